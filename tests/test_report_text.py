"""What `autofit.report` prints, held to text written by hand from the inputs (issue 9, point 11).

Each expected string below is computed by hand from published figures or from the numbers put in,
never captured from the function's own output.
"""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from autofit.config import Config
from autofit.estimate import estimate
from autofit.hardware import resolve_hardware
from autofit.report import estimate_report, trial_report
from autofit.trials.result import TrialResult
from tests.conftest import LLAMA_7B, MiB


def rendered(print_to) -> list[str]:  # type: ignore[no-untyped-def]
    console = Console(record=True, width=120)
    print_to(console)
    return console.export_text().splitlines()


def row(lines: list[str], label: str) -> str:
    """The size cell of the table row whose first cell starts with `label`."""
    for line in lines:
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 2 and cells[1].startswith(label):
            return cells[2]
    raise AssertionError(f"no row {label!r} in:\n" + "\n".join(lines))


def test_trial_report_prints_the_measured_numbers():
    # llama-debug (vocabulary 1024) before any learning: the loss of a uniform guess, ln 1024.
    result = TrialResult(
        status="ok",
        config=Config(lora_rank=8).to_dict(),
        model="llama-debug",
        device="cpu",
        nprocs=2,
        sharding="fsdp2",
        peak_bytes=21 * MiB,
        peak_allocated_bytes=20 * MiB + 512 * 1024,
        build_peak_bytes=3 * MiB // 2,
        tokens_per_s=2 * 4 * 512 / 0.32,  # 2 ranks x micro-batch 4 x 512 tokens in 0.32 s
        step_time_s=0.32,
        losses=[6.931471805599453, 6.5],
    )
    lines = rendered(lambda c: trial_report(c, result))
    assert lines == [
        "trial ok: llama-debug on 2 x cpu, FSDP2",
        "  peak 21.0 MiB reserved (20.5 MiB allocated) per CPU process; build peak 1.5 MiB",
        "  12,800 tokens/s for all 2 CPU processes together (6,400 per CPU process); step 0.320 s",
        "  losses: 6.9315, 6.5000",
    ]


def test_a_compiled_trial_prints_its_compile_apart_and_old_records_read_none():
    result = TrialResult(
        status="ok",
        config=Config(lora_rank=8, compile=True).to_dict(),
        model="llama-debug",
        device="cpu",
        nprocs=2,
        sharding="fsdp2",
        peak_bytes=21 * MiB,
        peak_allocated_bytes=21 * MiB,
        build_peak_bytes=2 * MiB,
        tokens_per_s=1000.0,
        step_time_s=0.256,
        losses=[6.9, 6.8],
        compile_s=18.3,
        graphs=2,
        graph_breaks=0,
        recompiles=0,
    )
    lines = rendered(lambda c: trial_report(c, result))
    assert lines[3] == (
        "  compiled: 2 graph(s), 0 graph break(s), 18.3 s compiling (not in the step time)"
    )
    new = ("compile_s", "graphs", "graph_breaks", "recompiles")
    read = TrialResult.from_dict({k: v for k, v in result.to_dict().items() if k not in new})
    assert (read.compile_s, read.graphs, read.graph_breaks, read.recompiles) == (None,) * 4


def test_an_oom_trial_prints_its_message_and_no_numbers():
    result = TrialResult(
        status="oom",
        config={},
        model="llama-7b",
        nprocs=1,
        sharding="none",
        message="CUDA out of memory. Tried to allocate 2.00 GiB.",
    )
    lines = rendered(lambda c: trial_report(c, result))
    assert lines == [
        "trial oom: llama-7b on 1 x cuda, the plain module (no sharding)",
        "  CUDA out of memory. Tried to allocate 2.00 GiB.",
    ]


def test_estimate_report_for_llama_7b_qlora_on_two_rtx_3090s():
    hw = resolve_hardware("2xrtx3090")
    config = Config(quant="nf4", lora_rank=16, micro_batch=1, grad_accum=4, checkpointing="full")
    lines = rendered(lambda c: estimate_report(c, LLAMA_7B, hw, estimate(LLAMA_7B, hw, config)))

    # Llama-2-7B has 6,738,415,616 parameters (Touvron et al. 2023; the HF checkpoint).
    assert lines[0] == (
        "llama-7b (6.74B params) on 2x NVIDIA GeForce RTX 3090 (pcie)  "
        "nf4 r16 mb1x4 wrap=layer ckpt=full, seq_len 2048"
    )
    assert lines[1] == "held as FSDP2"
    # LoRA r=16 on q,k,v,o (4096 -> 4096, 4096 -> 4096 for k/v: no GQA in Llama-2-7B) and on
    # gate, up, down (4096 <-> 11008): 32 layers x 16 x (4 x 8192 + 3 x 15104) = 39,976,960
    # trainable parameters (what peft's `print_trainable_parameters` reports for this model).
    # FSDP2 over 2 GPUs: fp32 masters 4 B x 39,976,960 / 2 = 79,953,920 B = 76.25 MiB (printed
    # to one decimal, half to even: 76.2); AdamW's two fp32 moments 8 B x 39,976,960 / 2 =
    # 159,907,840 B = 152.5 MiB.
    assert row(lines, "trainable weights") == "76.2 MiB"
    assert row(lines, "optimizer state") == "152.5 MiB"
    # An RTX 3090 has 24 GB of GDDR6X: 24 x 2^30 bytes.
    assert row(lines, "GPU capacity") == "24.0 GiB"

    # The verdict line restates the table and the step: reserved peak + CUDA context of capacity,
    # and tokens/s = 1 x 4 x 2 GPUs x 2048 tokens = 16,384 tokens per step over the step time.
    verdict = next(line for line in lines if line.startswith(("fits:", "does not fit:")))
    text = " ".join(" ".join(lines[lines.index(verdict) :]).split())  # rich wraps at 120
    m = re.search(r"step (\d+\.\d{3}) s .*~([\d,]+) tokens/s for all 2 GPUs together", text)
    assert m, text
    tokens_per_s = int(m.group(2).replace(",", ""))
    assert tokens_per_s == pytest.approx(16_384 / float(m.group(1)), abs=1)


def test_a_skipped_fused_loss_says_what_to_install(tmp_path):
    """Without Liger, `loss: fused` is skipped on a CUDA plan with the install command, printed
    as written (rich would read `[liger]` as markup and drop it)."""
    import autofit
    from autofit.report import plan_report
    from autofit.rules import liger_installed

    if liger_installed():
        pytest.skip("liger-kernel is installed here")
    space = tmp_path / "space.yaml"
    space.write_text("seq_len: 256\nknobs:\n  micro_batch: [1]\n  loss: [standard, fused]\n")
    plan = autofit.plan("llama-debug", gpus="1xrtx4090", space=space, trials=0)
    text = "\n".join(rendered(lambda console: plan_report(console, plan)))
    assert "1  loss=fused needs Liger: pip install 'autofit[liger]'" in text
    assert plan.best is not None and plan.best.config.loss == "standard"


@pytest.mark.parametrize(
    ("quant", "rank", "cell"),
    [("none", 0, "full"), ("none", 16, "lora r16"), ("int8", 8, "int8 r8"), ("nf4", 64, "nf4 r64")],
)
def test_the_ranked_tables_base_cell_names_the_fine_tune(quant, rank, cell):
    # the ranked table's `base` column: a full fine-tune, or LoRA of a rank on a bf16, int8 or
    # nf4 base, as the config's label starts (`nf4 r64 mb8x4 ...`)
    from autofit.report.ranked import KNOB_COLUMNS

    (base,) = (c for c in KNOB_COLUMNS if c.header == "base")
    config = Config(quant=quant, lora_rank=rank)
    assert base.cell(config) == cell and config.short().startswith(f"{cell} mb1x1")
