"""autofit: find the fastest LLM fine-tuning config that will not run out of GPU memory.

The public API is this module: `estimate`, `plan`, `trial`, `apply`, `load_plan` and the types
they return. Everything else is private and may change.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit._version import __version__
from autofit.arguments import (
    check_launch_installed,
    check_model_size,
    check_space_embeddings,
    config_of,
    lora_settings,
    node_rank_of,
    run_folder,
)
from autofit.checks import SEARCH_TIMEOUT_S, TRIAL_TIMEOUT_S, check_steps, check_trial_timeout
from autofit.config import KNOBS, Config
from autofit.data import LengthHistogram
from autofit.data.source import DataKeywords, data_keywords, data_lengths
from autofit.errors import AutofitError, ConfigError, HardwareError, ModelError, SpaceError
from autofit.estimate import Estimate
from autofit.plan import Candidate, Plan
from autofit.request import (
    DEFAULT_MARGIN,
    DEFAULT_TRIALS,
    PlanRequest,
    check_calibration,
    check_plan_numbers,
)
from autofit.rules import loss_unavailable
from autofit.values import Launch

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from autofit.builder import Applied
    from autofit.calibration.sweep import CalibrationRun
    from autofit.hardware import Hardware
    from autofit.models import ModelSpec
    from autofit.space import Space
    from autofit.trials import TrialResult

__all__ = [
    "KNOBS",
    "AutofitError",
    "Candidate",
    "Config",
    "ConfigError",
    "Estimate",
    "HardwareError",
    "ModelError",
    "Plan",
    "SpaceError",
    "__version__",
    "apply",
    "calibrate",
    "estimate",
    "load_plan",
    "plan",
    "trial",
]


def estimate(
    model: str | ModelSpec,
    gpus: str | Hardware = "auto",
    *,
    gpu_memory: str | int | None = None,
    device: str = "cuda",
    inter_node_bandwidth: str | float | None = None,
    foreach_intermediates: int | None = None,
    expandable_segments: bool = True,
    **knobs: Any,
) -> Estimate:
    """Napkin estimate of one config: `autofit.estimate("llama-7b", gpus="2xrtx3090",
    quant="nf4", lora_rank=64, micro_batch=8, seq_len=2048, checkpointing="full")`. Besides the
    knobs, the LoRA settings: `lora_targets=["q_proj", "v_proj"]` (default: every linear
    projection of the decoder blocks), `lora_dropout=0.05`, `lora_alpha=32`,
    `train_embeddings="full"` (or `"tokens:N"`: the last N token ids). Past one node
    (`gpus="4x8xh100-80gb"`), `inter_node_bandwidth="400Gb/s"` replaces the network's preset.
    `optimizer_impl="foreach"` (a setting: torch AdamW's default on CUDA, HF Trainer's
    `adamw_torch`, whose step holds a parameter-sized intermediate; `auto` is fused on a GPU).
    For a launch autofit did not set up: `foreach_intermediates=2` (torch 2.0's foreach step held
    two) and `expandable_segments=False` (the allocator's default mode; autofit sets
    `expandable_segments:True`). With the data (`dataset`, `tokenizer`, `text_field` or
    `lengths`, as `plan` takes them) the peak is the longest micro-batch's and tokens/s counts
    useful tokens (`autofit.estimate.estimate_many`). `model` and `gpus` may be a `ModelSpec`
    and a `Hardware` already resolved (`autofit.models.resolve_model`,
    `autofit.hardware.resolve_hardware`): they are taken as they are."""
    from autofit.estimate import estimate as _estimate
    from autofit.hardware import resolve_hardware
    from autofit.models import check_seq_len, resolve_model

    data = data_keywords("estimate", knobs, only=False)
    spec = resolve_model(model)
    check_model_size(spec)
    check_seq_len(spec, knobs.get("seq_len"))
    hw = resolve_hardware(
        gpus, device=device, gpu_memory=gpu_memory, inter_node_bandwidth=inter_node_bandwidth
    )
    config = config_of(knobs, spec, hw)
    hist = data_lengths(**data)  # last: it may take a while
    return _estimate(
        spec, hw, config, device=device, foreach_intermediates=foreach_intermediates,
        expandable_segments=expandable_segments, lengths=hist,
    )  # fmt: skip


def plan(
    model: str, gpus: str = "auto", *, seq_len: int | None = None,
    global_batch: int | None = None, space: str | Path = "default", trials: int = DEFAULT_TRIALS,
    timeout: float | None = SEARCH_TIMEOUT_S, trial_timeout: float | None = None, steps: int = 3,
    margin: float = DEFAULT_MARGIN, device: str = "cuda", gpu_memory: str | int | None = None,
    inter_node_bandwidth: str | float | None = None, storage: str | None = None,
    study: str | None = None, run_dir: str | Path | None = None, prune: bool = True,
    lora_alpha: int | None = None, lora_targets: str | Sequence[str] | None = None,
    lora_dropout: float | None = None, train_embeddings: str | None = None,
    optimizer_impl: str | None = None, quant_backend: str | None = None,
    bnb_4bit_use_double_quant: bool | None = None, bnb_4bit_quant_storage: str | None = None,
    launch: str | None = None, calibration: str = "auto", node_rank: int | None = None,
    console: Any = None, **data: Unpack[DataKeywords],
) -> Plan:  # fmt: skip
    """Find the fastest config that fits. `trials=0` plans from estimates alone (no GPU needed);
    otherwise an Optuna study runs real trials of the most promising candidates: the estimate's
    fastest that fits first, then the one expected to improve most on the best measured. Trials
    start for `timeout` seconds (default `SEARCH_TIMEOUT_S`, 15 min; None: no limit); each is
    held to `trial_timeout` seconds when given, else to a limit from its own estimate, and one
    whose measured step runs far past its estimate is stopped as `slow` (`autofit.trials.budget`).

    `lora_alpha`, `lora_targets` (module names, or "all-linear"), `lora_dropout` and
    `train_embeddings`
    ("none", "full", or "tokens:N": also train the input embeddings and LM head, all of them or
    the rows of the last N token ids) are the LoRA settings every candidate carries; given, they
    replace the space file's (None: the space's, whose default is every linear projection of the
    decoder blocks, no dropout and frozen embeddings). With `train_embeddings` set, the space's
    full fine-tunes (`lora_rank: 0`, which train the embeddings anyway) are skipped.
    `optimizer_impl` (`auto`, `fused`, `foreach`, `for-loop`) is how torch AdamW runs its step
    in every candidate (None: the space's, default `auto`: fused on a GPU); set, the space's
    torchao low-bit AdamW candidates are skipped. `quant_backend` ("torchao", "bitsandbytes"),
    `bnb_4bit_use_double_quant` and `bnb_4bit_quant_storage` store the NF4 candidates' base as
    that library does (bitsandbytes: `wrap: none` candidates only, the others skipped).
    `launch` (`autofit`, `trainer`, `trl`) is whose training loop every candidate runs (None:
    the space's, default `autofit`): `trainer` plans for an HF Trainer script (DDP on several
    GPUs; candidates Trainer cannot run are skipped with the reason), its trials run
    `Trainer.train()` and its trainer export is the arguments measured; `trl` likewise for
    TRL's `SFTTrainer` (packing for `batching: packed`; `pip install 'autofit[trl]'`).

    `calibration`: `auto` starts from this machine's stored calibration (if any), corrects the
    estimates with every trial, and stores the result for the next plan; `study` corrects them
    with this study's trials alone (nothing stored is read or written); `off` trusts the napkin
    alone (`autofit.calibration`).

    `gpus="4x8xh100-80gb"` plans for 4 nodes of 8 (the space's `shard: node` is HSDP there);
    `inter_node_bandwidth` ("400Gb/s", "50GB/s") replaces the preset network between them.
    Trials on several nodes (`--device cpu --gpus 2x1`, or `gpus="auto"` in a torchrun/SLURM
    launch of several nodes) run one planner per node on one shared study (`storage` and `study`,
    the same on every node); `node_rank` says which node this one is where the launch's
    environment does not (`autofit.hardware.launch_world`). Node 0 chooses and starts each trial,
    the others join it and return node 0's plan.

    `dataset` (a local JSON Lines, JSON, CSV or Parquet file, or a `datasets.save_to_disk`
    folder), counted with `tokenizer` (a local tokenizer.json or model folder; not needed for
    `input_ids`) in `text_field` (default: `input_ids`, `messages` or `text`), or `lengths` (a
    length file, or a `LengthHistogram`), gives the plan the data's sequence lengths
    (`autofit.data`, `Plan.request.lengths`); given, they replace the space file's `dataset:`.

    A run folder that cannot be written (a full disk) raises `autofit.errors.WriteError`, whose
    `.plan` is the plan all the same."""
    data = data_keywords("plan", data, only=True)
    _check_plan_flags(margin, trials, seq_len, global_batch, steps, timeout, node_rank, calibration)
    settings = lora_settings(
        lora_alpha=lora_alpha, lora_targets=lora_targets, lora_dropout=lora_dropout,
        train_embeddings=train_embeddings, optimizer_impl=optimizer_impl,
        quant_backend=quant_backend, bnb_4bit_use_double_quant=bnb_4bit_use_double_quant,
        bnb_4bit_quant_storage=bnb_4bit_quant_storage, launch=launch,
    )  # fmt: skip
    spec, hw = _plan_model_and_hardware(model, gpus, seq_len, device, gpu_memory,
                                        inter_node_bandwidth, calibration)  # fmt: skip
    sp = _plan_space(space, settings, spec)
    read_data = partial(data_lengths, base=sp.data, progress=console is not None, **data)
    given = _PlanInputs(spec, hw, sp, seq_len, global_batch, margin, device, calibration, read_data)
    if trials == 0:
        return _plan_estimates(given)
    return _search(given, gpus=gpus, prune=prune, trials=trials, timeout=timeout,
                   trial_timeout=trial_timeout, steps=steps, gpu_memory=gpu_memory,
                   storage=storage, study=study, run_dir=run_dir, node_rank=node_rank,
                   console=console)  # fmt: skip


def _check_plan_flags(
    margin: float, trials: int, seq_len: int | None, global_batch: int | None, steps: int,
    timeout: float | None, node_rank: int | None, calibration: str,
) -> None:  # fmt: skip
    """`plan`'s numbers, search flags and calibration mode, each checked on its own."""
    from autofit.checks import check_search_flags

    check_plan_numbers(margin, trials, seq_len, global_batch)
    check_steps(steps)
    check_search_flags(timeout, node_rank)
    check_calibration(calibration)


def _plan_model_and_hardware(
    model: str, gpus: str, seq_len: int | None, device: str, gpu_memory: str | int | None,
    inter_node_bandwidth: str | float | None, calibration: str,
) -> tuple[ModelSpec, Hardware]:  # fmt: skip
    """The model (checked, with `seq_len`) and the hardware, with the CUDA context this
    machine's trials measured where `calibration` is `auto`."""
    from autofit.hardware import resolve_hardware
    from autofit.models import check_seq_len, resolve_model

    spec = resolve_model(model)
    check_model_size(spec)
    check_seq_len(spec, seq_len)
    hw = resolve_hardware(
        gpus, device=device, gpu_memory=gpu_memory, inter_node_bandwidth=inter_node_bandwidth
    )
    if calibration == "auto":  # the CUDA context this machine's trials measured, if any
        from autofit.calibration.store import with_measured_context

        hw = with_measured_context(hw, device)
    return spec, hw


def _plan_space(space: str | Path, settings: dict[str, Any], spec: ModelSpec) -> Space:
    """The space, the LoRA settings given replacing its own, checked against the model."""
    from autofit.space_file import load_space

    sp = load_space(space)
    if settings:
        sp = sp.with_settings(**settings)
    check_space_embeddings(sp, spec)
    check_launch_installed(sp.settings.get("launch", Launch.AUTOFIT))
    return sp


@dataclass(frozen=True)
class _PlanInputs:
    """What `plan` has resolved and checked before it plans, for either way of planning: the
    model, the hardware, the space, the numbers given, and how to read the data's lengths (last
    of the checks: it may take a while)."""

    spec: ModelSpec
    hw: Hardware
    sp: Space
    seq_len: int | None
    global_batch: int | None
    margin: float
    device: str
    calibration: str
    read_data: Callable[[], LengthHistogram | None]

    def request(self, **more: Any) -> PlanRequest:
        """The plan's request, with `more` of `PlanRequest.of`'s keyword arguments."""
        return PlanRequest.of(
            self.spec, self.hw, self.sp, seq_len=self.seq_len, global_batch=self.global_batch,
            margin=self.margin, device=self.device, calibration=self.calibration, **more,
        )  # fmt: skip


def _plan_estimates(given: _PlanInputs) -> Plan:
    """The plan from estimates alone (`trials=0`)."""
    from autofit.plan import plan_estimates

    return plan_estimates(given.request(lengths=given.read_data()))


def _search(
    given: _PlanInputs, *, gpus: str, prune: bool, trials: int, timeout: float | None,
    trial_timeout: float | None, steps: int, gpu_memory: str | int | None, storage: str | None,
    study: str | None, run_dir: str | Path | None, node_rank: int | None, console: Any,
) -> Plan:  # fmt: skip
    """The plan of a search with trials, shown live on `console`; node 0 writes its run folder,
    the other nodes return the plan it stored."""
    from autofit.hardware import check_trial_hardware, trial_memory_cap
    from autofit.report.live import SearchDisplay
    from autofit.report.run_folder import check_earlier_plan, write_run_folder
    from autofit.search import search
    from autofit.search.study import default_storage

    spec, hw, device = given.spec, given.hw, given.device
    # everything a search needs is checked before its first trial: the hardware trials run on,
    # and the run folder it writes at the end
    check_trial_hardware(hw, device, gpus, per_node=True)
    rank = node_rank_of(hw, node_rank, storage)
    hist = given.read_data()
    folder = run_folder(spec, hw, given.sp, given.seq_len, given.global_batch, device, study,
                        run_dir, hist)  # fmt: skip
    check_earlier_plan(folder, storage or default_storage(folder))
    request = given.request(
        prune=prune, trials=trials, timeout=timeout, trial_timeout=trial_timeout, steps=steps,
        gpu_memory=trial_memory_cap(hw, device, gpu_memory), storage=storage, study=study,
        run_dir=folder, lengths=hist,
    )  # fmt: skip
    result = search(request, listener=SearchDisplay(console), node_rank=rank)
    if rank == 0:  # node 0 writes the run folder; the others return the plan it stored
        write_run_folder(result, folder)
    return result


def calibrate(
    gpus: str = "auto",
    *,
    device: str = "cuda",
    gpu_memory: str | int | None = None,
    steps: int = 3,
    trial_timeout: float = TRIAL_TIMEOUT_S,
    quick: bool = False,
    on_start: Any = None,
    on_trial: Any = None,
) -> CalibrationRun:
    """Calibrate this machine: a short sweep of real trials of small models (the knobs that tell
    each correction factor apart), fitted with what this machine stored before, and stored for
    every later plan here (`autofit.calibration`); `quick`: one model, the six most telling
    variants. `on_start(i, n, model, config)` and `on_trial(i, n, trial)` report progress."""
    from autofit.calibration.sweep import calibrate as run_sweep
    from autofit.hardware import check_trial_hardware, is_preset, resolve_hardware, trial_memory_cap

    check_steps(steps)
    check_trial_timeout(trial_timeout)
    if isinstance(gpus, str) and is_preset(gpus):
        raise HardwareError(
            f"--gpus {gpus} names what-if hardware (a preset), but a calibration measures this "
            "machine and is stored as its own: trials of a preset would run on whatever this "
            "machine has (on --device cpu, CPU processes) and every later plan here would start "
            "from them. Use --gpus auto (or N, or indices like 0,2) for this machine's GPUs, or "
            "--device cpu --gpus N to calibrate N processes on its CPU."
        )
    hw = resolve_hardware(gpus, device=device, gpu_memory=gpu_memory)
    check_trial_hardware(hw, device, gpus, command="calibrate")
    return run_sweep(
        hw, device, gpu_memory=trial_memory_cap(hw, device, gpu_memory), steps=steps,
        trial_timeout=trial_timeout, quick=quick, on_start=on_start, on_trial=on_trial,
    )  # fmt: skip


def trial(
    model: str,
    gpus: str = "auto",
    *,
    device: str = "cuda",
    gpu_memory: str | int | None = None,
    steps: int = 3,
    trial_timeout: float = TRIAL_TIMEOUT_S,
    timeout: float | None = None,
    **knobs: Any,
) -> TrialResult:
    """Run one real trial (a few training steps in fresh processes, the model held as `wrap` and
    the GPU count say: plain module, DDP or FSDP2) and measure it, killed after `trial_timeout`
    seconds (`timeout` is its old name, as `plan(timeout=)` is the whole search's). Keyword
    arguments: the knobs and the LoRA settings, as `estimate` takes them. With the data
    (`dataset`, `tokenizer`, `text_field` or `lengths`, as `plan` takes them) the micro-batches
    have the data's lengths (random tokens), the peak is measured on the longest one the data can
    produce, and tokens/s counts useful tokens."""
    if timeout is not None:
        warnings.warn(
            "autofit.trial(timeout=) is now trial_timeout= (plan's timeout is the search's)",
            DeprecationWarning,
            stacklevel=2,
        )
        trial_timeout = timeout
    from autofit.hardware import check_trial_hardware, resolve_hardware, trial_memory_cap
    from autofit.models import check_seq_len, resolve_model
    from autofit.trials import run_trial

    data = data_keywords("trial", knobs, only=False)
    check_steps(steps)
    check_trial_timeout(trial_timeout)
    spec = resolve_model(model)
    check_model_size(spec)
    check_seq_len(spec, knobs.get("seq_len"))
    hw = resolve_hardware(gpus, device=device, gpu_memory=gpu_memory)
    check_trial_hardware(hw, device, gpus, command="trial")
    cfg = config_of(knobs, spec, hw)
    if cfg.lora_targets is not None:
        from autofit.arch import structure_of

        structure_of(spec).targets(cfg.lora_targets)  # a name the model lacks: one paragraph
    why = loss_unavailable(cfg.loss, device)
    if why:
        raise ConfigError(
            f"This trial cannot run here: {why}. Allowed here: loss=standard or loss=chunked "
            "(the same fused linear cross-entropy in pure torch)."
        )
    hist = data_lengths(**data)  # last: it may take a while
    return run_trial(
        spec, cfg, nprocs=hw.n_gpus, device=device,
        gpu_memory=trial_memory_cap(hw, device, gpu_memory), steps=steps,
        timeout_s=trial_timeout, lengths=hist,
    )  # fmt: skip


def apply(model: torch.nn.Module, config: Config | dict[str, Any], **kwargs: Any) -> Applied:
    """Set your own model up as trials measured it: LoRA, checkpointing, quantization, then the
    plain module (one GPU), DDP or FSDP2 (inside an initialised process group of several ranks),
    and the optimizer. Returns `Applied`: `.model` to call, `.optimizer`, `.autocast()` and
    `.gradient_sync(last_micro_step)` for the training loop. Keyword arguments: `lr`, `device`.

    It changes `model` in place, as the trials did: peft wraps the adapted projections, the
    checkpointed and compiled layers are wrapped, quantized projections are replaced, FSDP2's
    `fully_shard` turns the units into sharded modules; and under `loss: chunked` or `fused`
    the causal LM's and its LM head's `forward` are replaced on those two objects (instance
    attributes, not their classes: other models of the same class are untouched), so that the
    model's forward returns the chunked loss without building the logits."""
    from autofit.builder import apply as _apply

    return _apply(model, Config.of(config, "autofit.apply(model, config)"), **kwargs)


def load_plan(path: str | Path) -> Any:
    """Read an `autofit`-format plan YAML written by `plan.export("autofit", path)`."""
    from autofit.export import load_plan as _load_plan

    return _load_plan(path)
