"""A trial of `launch: trainer`: HF `Trainer.train()` runs the config's steps in the trial process.
(`launch: trl` runs TRL's `SFTTrainer`, a `Trainer`, through the same `run_trainer`: its set-up is
`autofit.trials.trl.sft_setup`.)

The model is the one a Trainer script loads (`autofit.builder.trainer.trainer_model`: from_config
with random weights, peft LoRA of the export's `lora` section), the `TrainingArguments` are the
trainer export's (`autofit.export.render.trainer_arguments` of this trial's plan document) with
the trial's own on top (`TRIAL_ARGUMENTS`: the steps, where it writes, nothing saved, logged to
disk or reported), and the data is one optimizer step's rows of random token ids of `seq_len`,
which `max_steps` cycles through (the model memorises them, as autofit's own trials do).

What it measures is what `autofit.trials.rank.run` measures, the same way: on CPU the peak of
the live tensor bytes (`TensorTracker`, under the trial's cap) from the model's build on, the
build's peak apart, over every step Trainer runs (the optimizer's state, which Trainer makes in
its first step, included); on CUDA the allocator's peaks. Step times are read by a
`TrainerCallback` from each step's begin to its end (the optimizer step, clipping and
`zero_grad` inside), the warm-up steps left out; a measured step past `slow_after_s` stops the
training there (`control.should_training_stop`) and the result is `slow`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from autofit.builder.batching import IGNORE_INDEX, drawn_micro_batches
from autofit.builder.trainer import TokenRows, make_trainer, trainer_model
from autofit.config import Config
from autofit.data import LengthHistogram
from autofit.export.render import trainer_arguments
from autofit.export.schema import lora_section
from autofit.layout import layout_of
from autofit.models import ModelSpec
from autofit.trials.budget import SLOW_FACTOR, SLOW_MIN_S, warmup_steps
from autofit.trials.memory import TensorTracker, all_reduce, device_used_bytes, host_peak_bytes

TRIAL_ARGUMENTS: dict[str, Any] = {
    "save_strategy": "no",
    "eval_strategy": "no",
    "logging_strategy": "steps",  # each step's loss in `state.log_history`, in memory only
    "logging_steps": 1,
    "report_to": "none",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
    "seed": 0,
}
"""The trial's own `TrainingArguments`, on top of the export's: the measurement, not the run."""


RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
"""What a one-rank trial's worker is started with (`launcher.ONE_RANK_ENV`, the ranks torchrun
would set) and `python train.py` is not: with `LOCAL_RANK` set, Accelerate's `PartialState`
takes the process for one rank of a distributed launch and joins a process group."""


@contextlib.contextmanager
def as_one_process() -> Iterator[None]:
    """The environment of a Trainer script run as `python train.py` while Trainer sets up: no
    launcher's rank variables (`RANK_ENV`), put back after."""
    saved = {k: os.environ.pop(k) for k in RANK_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def trial_document(spec: ModelSpec, config: Config, world: int, device: str) -> dict[str, Any]:
    """The part of a plan document (`autofit.export.schema.plan_document`) the trainer export
    reads, for this trial: its config, GPUs, device and model."""
    return {
        "config": config.resolved(world).to_dict(),
        "hardware": {"n_gpus": world, "nodes": 1, "gpus_per_node": world, "device": device},
        "model_spec": asdict(spec),
        "decoder_layer": spec.decoder_layer_class,
    }


def trial_arguments(
    spec: ModelSpec, config: Config, world: int, device: torch.device, steps: int, output_dir: str
) -> dict[str, Any]:
    """`TrainingArguments` of this trial: the trainer export's for `config` (exactly what
    `autofit export --format trainer` writes for its plan), `TRIAL_ARGUMENTS`, `steps` steps and
    `output_dir`; on CPU `use_cpu`."""
    args = trainer_arguments(trial_document(spec, config, world, device.type))
    args.update(TRIAL_ARGUMENTS, max_steps=steps, output_dir=output_dir)
    if device.type == "cpu":
        args["use_cpu"] = True
    return args


def step_rows(
    spec: ModelSpec, config: Config, lengths: dict[str, Any] | None = None, steps: int = 1,
    longest_step: int = 0, world: int = 1, rank: int = 0,
) -> tuple[list[torch.Tensor], list[int] | None]:  # fmt: skip
    """The rows Trainer trains on (every rank's), and this `rank`'s useful tokens in each step
    (None without the data's lengths). Without the lengths: one optimizer step's rows
    (`micro_batch` x `grad_accum` x `world`) of `seq_len` random token ids, the draw of
    `autofit.trials.rank.synthetic_batch`, which `max_steps` cycles through. With them: `steps`
    steps of rows at lengths drawn from the data as the config's `batching` lays them out
    (`drawn_micro_batches`, the longest micro-batch rank 0's first of step `longest_step`), in
    the order Trainer's sequential sampler batches them; Accelerate deals the micro-batches to
    the ranks in turn (`BatchSamplerShard`: rank r gets r, r + world, ...)."""
    if not lengths:
        gen = torch.Generator().manual_seed(1234)
        n = config.micro_batch * config.grad_accum * world
        return list(torch.randint(0, spec.vocab, (n, config.seq_len), generator=gen)), None
    per_step = config.grad_accum * world
    drawn = drawn_micro_batches(
        LengthHistogram.from_dict(lengths), config.batching, config.micro_batch, config.seq_len,
        spec.vocab, steps * per_step, seed=1234, longest_at=longest_step * per_step,
    )  # fmt: skip
    rows: list[torch.Tensor] = []
    for inputs, _ in drawn:
        kept = inputs["labels"] != IGNORE_INDEX
        if len(kept) != config.micro_batch:  # pragma: no cover - padded layouts are full
            raise ValueError("a drawn micro-batch has fewer rows than micro_batch")
        rows += [ids[k] for ids, k in zip(inputs["input_ids"], kept, strict=True)]
    mine = [n for i, (_, n) in enumerate(drawn) if i % world == rank]
    return rows, step_sums(mine, config.grad_accum)


def step_sums(per_micro_step: list[int], grad_accum: int) -> list[int]:
    """Each optimizer step's sum of `per_micro_step` (its `grad_accum` micro-steps in order)."""
    ga = grad_accum
    return [sum(per_micro_step[i : i + ga]) for i in range(0, len(per_micro_step), ga)]


class _Steps:
    """Times each step Trainer runs (begin to end) and stops the training once a measured step
    runs past `slow_after_s`; reports progress; on CUDA reads the whole device's use after each
    step (`device_peak`)."""

    def __init__(
        self, warmup: int, slow_after_s: float | None, progress: Any, device: torch.device,
        world: int = 1,
    ) -> None:  # fmt: skip
        from transformers import TrainerCallback

        self.warmup, self.limit, self.progress = warmup, slow_after_s, progress
        self.device_peak = 0
        self.times: list[float] = []
        self.slow = ""
        self._start = 0.0
        outer = self

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                step = len(outer.times)
                warm = step < outer.warmup
                outer.progress(
                    "warmup" if warm else "step", step + 1 - (0 if warm else outer.warmup)
                )
                outer._start = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    outer.device_peak = max(outer.device_peak, device_used_bytes(device))
                elapsed = time.perf_counter() - outer._start
                if world > 1:  # the slowest rank's: every rank stops at the same step
                    elapsed = _over_ranks([elapsed], device, dist.ReduceOp.MAX)[0]
                outer.times.append(elapsed)
                measured = len(outer.times) - outer.warmup
                if measured > 0 and outer.limit is not None and outer.times[-1] > outer.limit:
                    outer.slow = (
                        f"stopped as slow after {measured} measured step(s): a step took "
                        f"{outer.times[-1]:.2f} s, past {outer.limit:.2f} s ({SLOW_FACTOR:g}x its "
                        f"estimated step, at least {SLOW_MIN_S:g} s); its tokens/s are of the "
                        "steps it ran"
                    )
                    control.should_training_stop = True

        self.callback = Callback()


@dataclass
class Setup:
    """What a launch's trial needs to set its trainer up: the model, the trial's steps (warm-up
    first: the longest micro-batch is the first of step `warmup - 1`), the data's lengths, the
    export's `lora` section, the trainer's arguments and callbacks."""

    spec: ModelSpec
    config: Config
    layout: Any
    device: torch.device
    lengths: dict[str, Any] | None
    steps: int
    warmup: int
    lora: dict[str, Any] | None
    args: dict[str, Any]
    callbacks: list[Any]
    world: int = 1  # the launch's ranks: DDP replicas on several
    rank: int = 0


Made = tuple[Any, Callable[[], list[int] | None]]
"""A trainer ready to `train()`, and what gives each step's useful tokens after it ran (None
without the data's lengths: every position is a token)."""


def trainer_setup(setup: Setup) -> Made:
    """`launch: trainer`: HF `Trainer` on the model a Trainer script loads (peft LoRA wrapped by
    the script), padding one optimizer step's rows (`step_rows`) with `collate_rows`."""
    rows, useful = step_rows(setup.spec, setup.config, setup.lengths, setup.steps,
                             setup.warmup - 1, setup.world, setup.rank)  # fmt: skip
    model = trainer_model(setup.spec, setup.config, setup.layout, setup.lora, setup.device)
    model.train()
    trainer = make_trainer(model, setup.args, TokenRows(rows), setup.callbacks)
    return trainer, lambda: useful


def run_trainer(
    spec: dict[str, Any], config: Config, device: torch.device, capacity: int | None,
    world: int, progress: Any, slow_after_s: float | None = None,
    make: Callable[[Setup], Made] = trainer_setup,
) -> dict[str, Any]:  # fmt: skip
    """Build `config` as a Trainer script does (`make`: `trainer_setup`; for `launch: trl` an
    SFTTrainer script, `autofit.trials.trl.sft_setup`), run its `train()` for the trial's steps
    and return its result (the fields `autofit.trials.rank.run` returns). On one GPU the process
    is a script run as `python train.py` (no launcher's rank variables: `as_one_process`); on
    `world` ranks each is one of `torchrun`'s, which Accelerate joins as DDP replicas, and the
    result is the launch's: the peaks of its fullest rank, the hosts' memory and the useful
    tokens summed over the ranks."""
    progress("build")
    rank = dist.get_rank() if dist.is_initialized() else 0
    model_spec = ModelSpec(**spec["model"])
    lengths = spec.get("lengths")
    warmup = warmup_steps(config, spec["warmup"], data=bool(lengths))
    steps = warmup + spec["steps"]
    layout = layout_of(config, world, device=device.type)
    lora = lora_section(config, model_spec) if config.is_lora else None
    timer = _Steps(warmup, slow_after_s, progress, device, world)
    torch.manual_seed(0)
    tracker = TensorTracker(capacity) if device.type == "cpu" else None
    with (
        tempfile.TemporaryDirectory(prefix=f"autofit-{config.launch}-") as out_dir,
        tracker if tracker is not None else contextlib.nullcontext(),
        as_one_process() if world == 1 else contextlib.nullcontext(),
    ):
        args = trial_arguments(model_spec, config, world, device, steps, out_dir)
        if lengths:  # the drawn order: the longest micro-batch once the optimizer state exists
            args["train_sampling_strategy"] = "sequential"
        setup = Setup(model_spec, config, layout, device, lengths, steps, warmup, lora, args,
                      [timer.callback], world, rank)  # fmt: skip
        trainer, useful_of = make(setup)
        gc.collect()
        if tracker is not None:
            build_peak = tracker.peak
            tracker.reset_peak()
        else:
            build_peak = torch.cuda.max_memory_reserved(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        trainer.train()
        history = trainer.state.log_history
        useful = useful_of()
    peaks = _launch_peaks(tracker, build_peak, timer.device_peak, device)
    host = _over_ranks([host_peak_bytes()], device, dist.ReduceOp.SUM)[0]
    if useful is not None:
        useful = _over_ranks(useful, device, dist.ReduceOp.SUM)
    losses = [float(h["loss"]) for h in history if "loss" in h]
    measured = timer.times[warmup:] or timer.times
    step_time = statistics.median(measured)
    tokens_per_s = config.micro_batch * config.grad_accum * config.seq_len * world / step_time
    if useful is not None:  # useful tokens (padding excluded) of the measured steps
        ran = range(warmup, len(timer.times)) if timer.times[warmup:] else range(len(timer.times))
        tokens_per_s = sum(useful[i] for i in ran) / sum(measured)
    result: dict[str, Any] = (
        {"status": "slow", "message": timer.slow} if timer.slow else {"status": "ok"}
    )
    return {
        "compile_s": None, "graphs": None, "graph_breaks": None, "recompiles": None,
        **result,
        "sharding": str(layout.sharding),
        "process_group": dist.is_initialized(),
        "peak_bytes": int(peaks[0]),
        "peak_allocated_bytes": int(peaks[1]),
        "build_peak_bytes": int(peaks[2]),
        "device_peak_bytes": int(peaks[3]) or None,
        "host_peak_bytes": int(host),
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "losses": losses,
        "capacity_bytes": capacity,
    }  # fmt: skip


def _launch_peaks(
    tracker: TensorTracker | None, build_peak: int, device_peak: int, device: torch.device
) -> list[float]:
    """(reserved, allocated, build, device level) peaks of the launch's fullest rank: on CPU the
    tracked live bytes (no allocator, no device level), on CUDA the allocator's."""
    if tracker is not None:
        peaks = [tracker.peak, tracker.peak, build_peak, 0]
    else:
        peaks = [
            torch.cuda.max_memory_reserved(device),
            torch.cuda.max_memory_allocated(device),
            build_peak,
            device_peak,
        ]
    return _over_ranks(peaks, device, dist.ReduceOp.MAX)


def _over_ranks(values: list[Any], device: torch.device, op: Any) -> list[float]:
    """`values` (bytes, tokens, seconds) reduced by `op` over the launch's ranks, in float64 (as
    they are with no process group)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    all_reduce(t, op)
    return [float(v) for v in t.tolist()]
