"""The public API's arguments checked and turned into what the planner reads: knob and setting
keywords into a `Config`, the LoRA settings given, the space's trained embeddings, this planner's
node, and the search's run folder. Each check raises one paragraph (`autofit.errors`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.errors import AutofitError, ConfigError, HardwareError, ModelError
from autofit.values import TrainEmbeddings


def config_of(knobs: dict[str, Any], spec: Any, hw: Any) -> Config:
    """A `Config` from knob and setting keyword arguments (`LORA_SETTINGS`), its
    `train_embeddings` checked against `spec`'s vocabulary, its `shard` against `hw`'s nodes, its
    `launch` against `hw`'s GPUs, and no LoRA setting without LoRA."""
    from autofit.config import check_known
    from autofit.rules import (
        launch_unavailable,
        lora_settings_unused,
        rule_violation,
        shard_unavailable,
    )  # fmt: skip

    check_known(knobs)
    config = Config(**knobs)
    check_train_embeddings(config.train_embeddings, spec)
    problem = lora_settings_unused(config.settings(), [config.lora_rank])
    problem = problem or shard_unavailable(config.shard, hw.nodes)
    # `wrap: auto` as it runs on these GPUs (a rule of quant_backend reads the wrap)
    problem = problem or rule_violation(config.resolved(hw.n_gpus))
    unavailable = launch_unavailable(config.launch)
    problem = problem or (unavailable and unavailable + ".")
    if problem:
        raise ConfigError(problem)
    return config


def check_model_size(spec: Any) -> None:
    """Refuse a model no hardware autofit plans for could hold, before anything is estimated or
    traced: its weights alone, every parameter at the smallest storage a quantization offers
    (`quant`'s declared choices), sharded over `MAX_GPUS` GPUs of the preset with the most memory,
    are more than one of them holds with the host RAM a what-if node of it gives each GPU for
    offload. Its structure is read from a sample of its layers, so a million layers are quick."""
    from autofit.arch import structure_of
    from autofit.config import DECLARED
    from autofit.estimate.memory.widths import base_bytes_per_param
    from autofit.hardware import GPU_PRESETS, MAX_GPUS, preset_hardware
    from autofit.units import fmt_size

    widths = {q: base_bytes_per_param(q) for q in DECLARED["quant"].choices or ("none",)}
    quant = min(widths, key=widths.__getitem__)
    n_params = structure_of(spec).n_params
    per_gpu = n_params * widths[quant] / MAX_GPUS
    largest = max(GPU_PRESETS.values(), key=lambda p: p.memory_bytes)
    node = preset_hardware(1, largest.name)
    holds = node.capacity_bytes + node.host_ram_bytes
    if per_gpu <= holds:
        return
    raise ModelError(
        f"{spec.name} is too large for any hardware autofit plans for: its {n_params:,} "
        f"parameters ({spec.layers:,} decoder layers of width {spec.hidden:,}), even stored at "
        f"{widths[quant]:.2f} B each ({quant}, the smallest quantization) and sharded over "
        f"{MAX_GPUS:,} GPUs (the most a plan is for), need {fmt_size(per_gpu)} on each: more than "
        f"the GPU preset with the most memory, {largest.name}, holds ({fmt_size(holds)}: "
        f"{fmt_size(node.capacity_bytes)} on the GPU and {fmt_size(node.host_ram_bytes)} of host "
        "RAM for offload). Check num_hidden_layers, hidden_size and intermediate_size in its "
        "config."
    )


def check_train_embeddings(value: str, spec: Any) -> None:
    """`tokens:N` within the model's vocabulary: one paragraph before anything is estimated."""
    from autofit.settings import trained_tokens_error

    problem = trained_tokens_error(value, spec.vocab)
    if problem is not None:
        raise ConfigError(problem)


def check_launch_installed(launch: str) -> None:
    """A plan's `launch` whose library is installed here (`launch: trl`, TRL): one paragraph
    naming what to install otherwise, before anything is estimated."""
    from autofit.rules import launch_missing

    problem = launch_missing(launch)
    if problem:
        raise ConfigError(problem)


def check_space_embeddings(sp: Any, spec: Any) -> None:
    """A space's `train_embeddings` within the model's vocabulary, and with LoRA candidates to
    carry it (its full fine-tunes are skipped: they train the embeddings already)."""
    from autofit.rules import lora_settings_unused

    problem = lora_settings_unused(sp.settings, sp.knobs["lora_rank"])
    if problem:
        ranks = list(sp.knobs["lora_rank"])
        raise ConfigError(f"Space {sp.name!r} has only full fine-tunes (lora_rank: {ranks}): "
                          f"{problem}")  # fmt: skip
    value = sp.settings.get("train_embeddings", TrainEmbeddings.NONE)
    if value == TrainEmbeddings.NONE:
        return
    check_train_embeddings(value, spec)
    if not any(rank > 0 for rank in sp.knobs["lora_rank"]):
        raise ConfigError(
            f"train_embeddings={value} trains the input embeddings and LM head beside a frozen "
            f"LoRA base, but space {sp.name!r} has only full fine-tunes (lora_rank: "
            f"{list(sp.knobs['lora_rank'])}), which train them already. Give the space LoRA "
            "ranks (lora_rank: [16, 64]), or drop train_embeddings (none) for full fine-tunes."
        )


def node_rank_of(hw: Any, node_rank: int | None, storage: str | None) -> int:
    """This planner's node of `hw` for a search: `node_rank`, else the launch's environment;
    checked against the hardware's nodes, and several nodes need a shared study."""
    from autofit.hardware import launch_world

    world = launch_world()
    if world.nodes > 1 and world.nodes != hw.nodes:
        raise HardwareError(
            f"This planner runs in a launch of {world.nodes} nodes ({world.source}'s "
            f"environment), but the hardware planned for, {hw.describe()}, has {hw.nodes} "
            f"node(s). Give --gpus the launch's nodes (auto, or NxK... with N={world.nodes}), or "
            "run a one-node plan outside the multi-node launch."
        )
    if node_rank is not None and not 0 <= node_rank < hw.nodes:
        raise HardwareError(
            f"--node-rank {node_rank} is not a node of {hw.describe()}: give 0 to "
            f"{hw.nodes - 1} ({hw.nodes} node(s))."
        )
    if hw.nodes <= 1:
        return 0
    if storage is None:
        raise AutofitError(
            f"Trials on {hw.nodes} nodes run one `autofit plan` per node on one shared study, "
            "so each needs to reach the same storage: add --storage URL --study NAME, the same on "
            "every node (e.g. --storage postgresql://user:password@host/db --study my-plan; "
            "sqlite:///path/study.db when every node's planner runs on one host), or add "
            "--no-trials to plan from estimates alone."
        )
    rank = node_rank if node_rank is not None else world.node_rank if world.nodes > 1 else None
    if rank is None:
        raise AutofitError(
            f"Trials on {hw.nodes} nodes run one `autofit plan` per node, and this one does not "
            "know which node it is: no torchrun or SLURM launch of several nodes set it. Add "
            f"--node-rank N (0 on the node that chooses the trials, 1 to {hw.nodes - 1} on the "
            "others), or set AUTOFIT_NODE_RANK and AUTOFIT_NODES."
        )
    return rank


def lora_settings(**given: Any) -> dict[str, Any]:
    """The LoRA settings given (not None), checked: `ConfigError` names a bad one. Their raw
    values are kept, so an explicit "all-linear" still replaces a space's targets."""
    from autofit.settings import coerce_setting

    out = {name: value for name, value in given.items() if value is not None}
    for name, value in out.items():
        coerce_setting(name, value)
    return out


def run_folder(
    spec: Any,
    hw: Any,
    sp: Any,
    seq_len: int | None,
    global_batch: int | None,
    device: str,
    study: str | None,
    run_dir: str | Path | None,
    lengths: LengthHistogram | None = None,
) -> Path:
    """The search's run folder, checked writable: `run_dir`, or `autofit-runs/<study>` where the
    study name must be one plain folder name (a default name is made into one)."""
    from autofit.checks import check_dir_writable, check_study_name, default_run_dir

    if run_dir is not None:
        folder = Path(run_dir).expanduser()
        what, hint = f"--run-dir {run_dir}", "Pass --run-dir a folder you can write in."
    else:
        if study is not None:
            folder = default_run_dir(check_study_name(study))
        else:
            from autofit.search.study import default_study_name

            seq = seq_len or sp.seq_len
            name = default_study_name(spec, hw, sp, seq, global_batch, device, lengths=lengths)
            folder = default_run_dir(name)
        what = f"the run folder {folder}"
        hint = "Run autofit from a folder you can write in, or pass --run-dir a writable folder."
    check_dir_writable(folder, what, hint)
    return folder
