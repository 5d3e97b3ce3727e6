"""`launch: trainer` with bitsandbytes QLoRA: the model autofit builds for it
(`autofit.builder.trainer.trainer_model`: `from_config`, each decoder projection replaced by a
`Linear4bit` in place, `prepare_model_for_kbit_training`, peft LoRA) holds the same parameters
(class, dtype, shape, bytes and NF4 quant state) as a Trainer script's
`from_pretrained(path, quantization_config=BitsAndBytesConfig(...), dtype=torch.bfloat16)` of the
same model saved, put through the same `prepare_model_for_kbit_training` and peft LoRA; both on
CPU (bitsandbytes 0.50's CPU backend)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("bitsandbytes")

from autofit.builder.trainer import lora_config, trainer_model  # noqa: E402
from autofit.config import Config  # noqa: E402
from autofit.export.schema import lora_section  # noqa: E402
from autofit.layout import layout_of  # noqa: E402
from autofit.models import resolve_model  # noqa: E402


def _described(model: torch.nn.Module) -> dict[str, tuple[Any, ...]]:
    """Each parameter: its class, dtype, shape, bytes, whether it trains, and for an NF4 weight
    its quant state (block size, compute dtype, double quantization, absmax's dtype and size)."""
    out: dict[str, tuple[Any, ...]] = {}
    for name, p in model.named_parameters():
        qs = getattr(p, "quant_state", None)
        state: tuple[Any, ...] = ()
        if qs is not None:
            state = (qs.blocksize, qs.quant_type, qs.dtype, qs.nested, qs.absmax.dtype,
                     qs.absmax.numel(), qs.shape)  # fmt: skip
            if qs.nested:
                state += (qs.state2.absmax.numel(), qs.state2.blocksize, float(qs.offset) != 0)
        out[name] = (type(p).__name__, p.dtype, tuple(p.shape), p.numel() * p.element_size(),
                     p.requires_grad, state)  # fmt: skip
    return out


@pytest.mark.parametrize(("double_quant", "checkpointing"), [(False, "none"), (True, "full")])
def test_trainer_qlora_model_is_what_from_pretrained_with_bitsandbytes_loads(
    tmp_path, double_quant, checkpointing
) -> None:  # type: ignore[no-untyped-def]
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    spec = resolve_model("llama-debug")
    cfg = Config(lora_rank=8, quant="nf4", quant_backend="bitsandbytes", launch="trainer",
                 bnb_4bit_use_double_quant=double_quant, checkpointing=checkpointing)  # fmt: skip
    cpu = torch.device("cpu")
    lora = lora_section(cfg, spec)
    built = trainer_model(spec, cfg, layout_of(cfg, 1, device="cpu"), lora, cpu)

    hf_config = spec.to_hf_config()
    hf_config.use_cache = False
    AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=double_quant,
    )  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=bnb_config, dtype=torch.bfloat16, device_map={"": "cpu"}
    )
    loaded = prepare_model_for_kbit_training(
        loaded, use_gradient_checkpointing=checkpointing == "full"
    )
    loaded = get_peft_model(loaded, lora_config(lora), autocast_adapter_dtype=True)

    ours, theirs = _described(built), _described(loaded)
    assert ours == theirs
    # what prepare_model_for_kbit_training did: every non-NF4 base parameter (the embeddings,
    # the norms, the untied LM head) upcast to fp32 and frozen; the adapters fp32 and trained
    assert {d[1] for d in ours.values() if d[0] != "Params4bit"} == {torch.float32}
    assert all(d[4] == ("lora_" in n) for n, d in ours.items())
    base = built.get_base_model()
    assert base.is_loaded_in_4bit and base.is_gradient_checkpointing == (checkpointing == "full")


def test_trl_qlora_model_is_what_sfttrainer_loads_from_the_exports_arguments(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # launch: trl with bitsandbytes QLoRA: the model an SFT script hands SFTTrainer (loaded in
    # 4 bits, no prepare_model_for_kbit_training), wrapped by SFTTrainer's own peft, against
    # SFTTrainer loading a saved model itself from the trainer export's SFTConfig (its
    # model_init_kwargs' dtype and quantization_config dict) with the same peft_config
    pytest.importorskip("trl")
    from trl import SFTConfig, SFTTrainer

    from autofit.builder.trl import make_sft_trainer, offline_tokenizer, token_dataset
    from autofit.trials.trainer import trial_arguments

    spec = resolve_model("llama-debug")
    cfg = Config(lora_rank=8, quant="nf4", quant_backend="bitsandbytes", launch="trl",
                 precision="bf16", bnb_4bit_use_double_quant=True)  # fmt: skip
    cpu = torch.device("cpu")
    lora = lora_section(cfg, spec)
    args = trial_arguments(spec, cfg, 1, cpu, 1, str(tmp_path / "out"))
    data = token_dataset([[3, 4, 5, 6]] * 4)
    base = trainer_model(spec, cfg, layout_of(cfg, 1, device="cpu"), None, cpu)
    built = make_sft_trainer(base, args, data, lora, []).model

    hf_config = spec.to_hf_config()
    hf_config.use_cache = False
    from transformers import AutoModelForCausalLM

    path = tmp_path / "model"
    AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).save_pretrained(path)
    kwargs = args["model_init_kwargs"]
    assert kwargs["quantization_config"]["bnb_4bit_use_double_quant"] is True
    loaded = SFTTrainer(
        model=str(path), args=SFTConfig(**args), train_dataset=data,
        processing_class=offline_tokenizer(), peft_config=lora_config(lora),
    ).model  # fmt: skip

    ours, theirs = _described(built), _described(loaded)
    assert ours == theirs
    # SFTTrainer did not upcast anything (no prepare_model_for_kbit_training) and turned the
    # adapters of a quantized model to bf16: precision=bf16
    assert {d[1] for d in ours.values() if d[0] != "Params4bit"} == {torch.bfloat16}
    assert all(d[4] == ("lora_" in n) for n, d in ours.items())
