"""What a trial reports: one JSON-safe record per real run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("ok", "slow", "oom", "timeout", "error")
"""`slow`: stopped after a measured step far past its estimate (`autofit.trials.budget`); its
numbers are of the steps it measured."""
MEASURED = ("ok", "slow")
"""The statuses of a run that measured its steps: a peak and a speed."""


@dataclass
class TrialResult:
    """Measured numbers of one trial (a few real training steps in fresh processes).

    A config that is not the first of its launch (`run_trials`) reports the peaks of its own
    build and steps, but its processes already hold what the earlier ones left to the process
    (the C allocator's freed pages, one-time caches): its `host_peak_bytes` may be higher, and
    its `build_peak_bytes` may differ (int8 LoRA under DDP on llama-debug built at 5.19 or
    5.78 MB, alone and in a launch alike, from run to run). `peak_bytes` was the same for that
    config, but 0.56 MiB lower for a later FSDP2 config on CPU: compare the peaks of configs
    that are each first in a launch, or all later.
    """

    status: str
    """One of `STATUSES`."""
    config: dict[str, Any]
    model: str
    device: str = "cuda"
    nprocs: int = 1
    sharding: str | None = None
    """How the model was held: `none` (the plain module on one GPU), `ddp` or `fsdp2`."""
    process_group: bool | None = None
    """Whether the trial's processes held a process group (NCCL's communicator on GPUs): on
    several ranks, and on one where the config's layout has one (`Layout.communicators`); None in
    records older than this field."""
    peak_bytes: int | None = None
    """The max over ranks of `torch.cuda.max_memory_reserved` on CUDA; on CPU the peak of live
    tensor storage counted by the dispatch-level tracker (`memory.TensorTracker`)."""
    build_peak_bytes: int | None = None
    """The same measure as `peak_bytes` while the model was built (before the first step)."""
    device_peak_bytes: int | None = None
    """On CUDA, the device-level use (`mem_get_info`: allocator plus CUDA context and NCCL
    buffers) seen after each step."""
    peak_allocated_bytes: int | None = None
    """The max over ranks of `torch.cuda.max_memory_allocated` (on CPU, `peak_bytes`)."""
    host_peak_bytes: int | None = None
    """The sum over ranks of each process's peak resident set (ru_maxrss)."""
    tokens_per_s: float | None = None  # the whole run's: every rank (`nprocs`) together
    step_time_s: float | None = None
    losses: list[float] = field(default_factory=list)
    message: str = ""
    wall_s: float = 0.0
    capacity_bytes: int | None = None
    oom_of: str | None = None
    """For an `oom`, what ran out: `gpu` (the device, or the capacity a CPU trial is held to) or
    `host` (RAM: a failed host or pinned allocation, or a worker killed by the kernel's OOM
    killer)."""
    # A compiled run (`compile: true`) reports the next four; they are None when the run was not
    # compiled, and in records older than the knob.
    compile_s: float | None = None
    """The seconds torch.compile spent (dynamo's own measure, the slowest rank's; not in
    `step_time_s` or `tokens_per_s`)."""
    graphs: int | None = None
    """Dynamo's count of the graphs it compiled."""
    graph_breaks: int | None = None
    """Dynamo's count of the breaks between them."""
    recompiles: int | None = None
    """Graphs compiled again during measured steps (0 in a sound run)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def measured(self) -> bool:
        """It ran measured steps (`ok`, or stopped as `slow` after some): a peak and a speed."""
        return self.status in MEASURED

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def update(self, report: dict[str, Any]) -> None:
        """Take what a trial's rank 0 reported (`autofit.trials.rank.run`'s dict): each key must
        be one of this result's fields, so a report and the result cannot drift apart unseen."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(report) - names)
        if unknown:
            raise ValueError(f"a trial reported fields TrialResult does not have: {unknown}")
        for key, value in report.items():
            setattr(self, key, value)


def config_result(out: Path, index: int) -> Path:
    """Where a launch's rank 0 writes the result of its `index`-th config (`OUT.<index>`)."""
    return out.with_name(f"{out.name}.{index}")
