"""The caching allocator's slack at a step's peak: a training step's allocations replayed through
the model of PyTorch's CUDA caching allocator (`autofit.estimate.allocator`).

Reserved memory is more than allocated memory because the allocator keeps what it frees: a
tensor freed in a layer's forward leaves a hole that only a tensor that fits can reuse, the
optimizer's states, born after the first backward, land in the activations' freed space, and
segments grow in pages (2 MiB small, 20 MiB large with `expandable_segments:True`, which
autofit's trials and exports set). None of that is a fixed share of the allocated bytes, so the
slack is read from a replay of the step's own allocation sequence:

- the persistent state first: the weights (one block per layer and one for what lies outside
  the layers, at the napkin's bytes);
- two steps (the second is the steady state a run lives in: the first step's optimizer states
  and freed activations are in place), each a micro-step of `layers` decoder layers composed
  from the one-layer model's traced births and deaths (`autofit.arch.step_events_of`): the
  embedding's, each layer's forward, the head's and the loss's, each layer's backward in
  reverse, the embedding's backward; activations scale with the micro-batch, autocast's weight
  copies and parameters' gradients do not;
- FSDP2 gathers each layer unit before its forward and its backward (the all-gather output
  buffer, kept until the next all-gather, and the unsharded parameters, freed at reshard), and
  turns each unit's unsharded gradients into a sharded gradient after its backward;
- after the first backward the optimizer's states (one block per layer), and after each step
  the gradients are freed (`zero_grad(set_to_none=True)`).

Composing a layer's births and deaths: the one-layer model's layer takes its input from the
embedding and hands its output to the head, where a layer of the real model takes the previous
layer's output and hands its own to the next layer. So the output of layer i (a tensor the trace
sees die at the head) dies where layer i + 1's input (born before the layer, in the trace)
dies; and the gradient layer i + 1 hands to layer i dies where the head's gradient (born at the
head) dies in layer i's backward.

FSDP2's all-gather outputs and reduce-scatter inputs are allocated on streams of their own,
whose free blocks the compute stream never reuses (`STREAMS`): each stream has its allocator.

What is not modelled: `record_stream`'s delayed reuse, gradient accumulation's second micro-step
(the accumulated gradients are the first's), the loss's own fragmentation beyond the one-layer
trace, and NF4's dequantization transients.
"""

from __future__ import annotations

from dataclasses import dataclass

from autofit.estimate.allocator import CachingAllocator
from autofit.structure import StepEvents

_PRE, _FWD, _MID, _BWD, _POST = range(5)


@dataclass(frozen=True)
class StepShape:
    """What the replay needs besides the traced events, per GPU (bytes)."""

    layers: int
    micro_batch: int
    weights_per_layer: float  # persistent parameter bytes of one layer (sharded or not)
    weights_outside: float  # persistent parameter bytes outside the layers
    opt_per_layer: float  # optimizer state bytes of one layer (born after the first backward)
    gathered_per_layer: float = 0.0  # FSDP2: one layer unit's unsharded bf16 bytes (0: no FSDP2)
    grad_shard: float = 1.0  # FSDP2: the sharded share of a unit's gradients that stays
    reshard: bool = True
    reduce_ratio: float = 1.0  # FSDP2: reduce-scatter input bytes per traced gradient byte


@dataclass(frozen=True)
class Slack:
    """A replay's result: the slack (reserved less allocated at their peaks) and both peaks."""

    slack: int
    peak_reserved: int
    peak_allocated: int
    events: int


def _window(i: int, marks: tuple[int, int, int, int]) -> int:
    f, m, b, p = marks
    if i < f:
        return _PRE
    if i < m:
        return _FWD
    if i < b:
        return _MID
    if i < p:
        return _BWD
    return _POST


class _Plan:
    """The traced log sorted into windows, with each storage's windows of birth and death."""

    def __init__(self, ev: StepEvents) -> None:
        self.windows: list[list[tuple[int, int]]] = [[] for _ in range(5)]
        self.born: dict[int, int] = {}
        self.died: dict[int, int] = {}
        self.size: dict[int, int] = {}
        for i, (sid, size) in enumerate(ev.log):
            w = _window(i, ev.marks)
            self.windows[w].append((sid, size))
            if size:
                self.born[sid] = w
                self.size[sid] = size
            else:
                self.died[sid] = w
        self.fixed = ev.fixed
        self.grads = ev.grads


def step_events(
    layer_events: list[StepEvents], shape: StepShape, steps: int = 2
) -> list[tuple[object, int]]:
    """The (key, bytes) births and (key, 0) deaths of `steps` training steps: `layer_events[i]`
    is the one-layer model's trace for layer i (its checkpointing policy)."""
    out: list[tuple[object, int]] = []
    alive: set[object] = set()
    mb = shape.micro_batch
    plans: dict[int, _Plan] = {}

    def plan_of(i: int) -> _Plan:
        ev = layer_events[i]
        if id(ev) not in plans:
            plans[id(ev)] = _Plan(ev)
        return plans[id(ev)]

    def alloc(key: object, size: float) -> None:
        if key in alive or size <= 0:
            return
        alive.add(key)
        out.append((key, max(int(size), 1)))

    def free(key: object) -> None:
        if key in alive:
            alive.discard(key)
            out.append((key, 0))

    def sized(p: _Plan, sid: int, size: int) -> float:
        return size if sid in p.fixed else size * mb

    n = shape.layers
    for i in range(n):
        alloc(("w", i), shape.weights_per_layer)
    alloc(("w", "root"), shape.weights_outside)
    gather_buffer: object | None = None

    def gather(step: int, where: str, i: int) -> None:
        nonlocal gather_buffer
        if not shape.gathered_per_layer:
            return
        if gather_buffer is not None:
            free(gather_buffer)
        gather_buffer = ("ag", step, where, i)
        alloc(gather_buffer, shape.gathered_per_layer)
        alloc(("unsharded", step, where, i), shape.gathered_per_layer)

    def reshard(step: int, where: str, i: int) -> None:
        if shape.gathered_per_layer and (shape.reshard or where == "b"):
            free(("unsharded", step, where, i))
            if where == "b":
                free(("unsharded", step, "f", i))

    for step in range(steps):
        root = ("root", step)
        first = plan_of(0)
        for sid, size in first.windows[_PRE]:
            (alloc((root, sid), sized(first, sid, size)) if size else free((root, sid)))

        def outputs(i: int, step: int = step) -> list[object]:
            """Layer i's tensors the trace sees die at the head: its output."""
            p = plan_of(i)
            return [(step, i, sid) for sid, w in p.born.items()
                    if w == _FWD and p.died.get(sid) == _MID]  # fmt: skip

        for i in range(n):
            p = plan_of(i)
            gather(step, "f", i)
            for sid, size in p.windows[_FWD]:
                if size:
                    alloc((step, i, sid), sized(p, sid, size))
                elif p.born.get(sid) == _FWD:
                    free((step, i, sid))
                elif p.born.get(sid) == _PRE:  # the layer's input dies: the embedding's or ...
                    if i == 0:
                        free((root, sid))
                    else:  # ... the previous layer's output
                        for key in outputs(i - 1):
                            free(key)
            reshard(step, "f", i)
        last = plan_of(n - 1)
        for sid, size in last.windows[_MID]:
            if size:
                alloc((root, "mid", sid), sized(last, sid, size))
            elif last.born.get(sid) == _FWD:
                free((step, n - 1, sid))
            else:
                free((root, "mid", sid))
                free((root, sid))
        for i in reversed(range(n)):
            p = plan_of(i)
            gather(step, "b", i)
            for sid, size in p.windows[_BWD]:
                if size:
                    alloc((step, i, sid), sized(p, sid, size))
                    continue
                born = p.born.get(sid)
                if born in (_FWD, _BWD):
                    free((step, i, sid))
                elif born == _MID:  # the gradient flowing in: the head's, or layer i + 1's
                    if i == n - 1:
                        free((root, "mid", sid))
                    else:
                        passed = plan_of(i + 1)
                        for psid, w in passed.born.items():
                            if w == _BWD and passed.died.get(psid) == _POST:
                                free((step, i + 1, psid))
                elif born == _PRE:  # the layer's input, kept for backward
                    if i == 0:
                        free((root, sid))
                    else:
                        for key in outputs(i - 1):
                            free(key)
            reshard(step, "b", i)
            if shape.gathered_per_layer and p.grads:  # FSDP2: each unit's gradients reduced
                # the reduce-scatter input (in the reduce dtype, on its own stream), kept until
                # the next reduce-scatter is waited on; the unsharded gradients freed, a shard
                # of them kept
                unit = sum(p.size.get(sid, 0) for sid in p.grads)
                alloc(("rs", step, i), unit * shape.reduce_ratio)
                free(("rs", step, i + 1))
                for sid in sorted(p.grads):
                    key = (step, i, sid)
                    if key in alive:
                        free(key)
                        alloc(("gshard", step, i, sid), p.size.get(sid, 0) * shape.grad_shard)
        p0 = plan_of(0)
        for sid, size in p0.windows[_POST]:
            if size:
                alloc((root, "post", sid), sized(p0, sid, size))
            elif p0.born.get(sid) == _BWD:
                free((step, 0, sid))
            else:
                free((root, "post", sid))
                free((root, sid))
        if gather_buffer is not None:
            free(gather_buffer)
            gather_buffer = None
        free(("rs", step, 0))
        # what the step leaves besides the gradients (the loss, leftovers) goes
        grads = {(step, i, sid) for i in range(n) for sid in plan_of(i).grads}
        grads |= {("gshard", step, i, sid) for i in range(n) for sid in plan_of(i).grads}
        # (in a fixed order: a set of keys holding text iterates differently in each process)
        for key in [k for k in sorted(alive, key=repr) if k not in grads and _transient(k)]:
            free(key)
        if step == 0:  # the optimizer's states, born in its first step
            for i in range(n):
                alloc(("opt", i), shape.opt_per_layer)
        for key in sorted(grads & alive, key=repr):  # zero_grad(set_to_none=True)
            free(key)
    return out


def _transient(key: object) -> bool:
    """Keys that do not outlive a step: everything but the weights and the optimizer's states."""
    return not (isinstance(key, tuple) and key and key[0] in ("w", "opt"))


STREAMS = {"ag": 1, "rs": 2}
"""The streams FSDP2 allocates on besides the compute stream: its all-gathers' outputs on the
all-gather stream, its reduce-scatters' inputs on the reduce-scatter stream (torch
`_fsdp_param_group.py`: `all_gather_stream`, `reduce_scatter_stream`). The caching allocator
keeps free blocks per stream (`BlockPool` ordered by stream first, `get_free_block` takes only
the request's stream; an expandable segment per stream), so what those streams free is never
reused by the compute stream's tensors: their peaks add to the reserved bytes."""


def _stream(key: object) -> int:
    return STREAMS.get(key[0], 0) if isinstance(key, tuple) and key else 0


def replay_slack(
    layer_events: list[StepEvents], shape: StepShape, *, expandable_segments: bool = True
) -> Slack:
    """Replay two steps through the allocator model, one allocator per stream (`STREAMS`), by
    default with expandable segments (autofit's trials and exports set
    `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`): the peaks of the streams' totals."""
    events = step_events(layer_events, shape)
    allocators: dict[int, CachingAllocator] = {}
    handles: dict[object, tuple[CachingAllocator, int]] = {}
    peak_allocated = peak_reserved = 0
    for key, size in events:
        if size:
            stream = _stream(key)
            allocator = allocators.get(stream)
            if allocator is None:
                allocator = allocators[stream] = CachingAllocator(
                    expandable_segments=expandable_segments
                )
            handles[key] = (allocator, allocator.malloc(size))
        else:
            allocator, handle = handles.pop(key)
            allocator.free(handle)
            continue
        if len(allocators) == 1:
            peak_allocated = max(peak_allocated, allocator.allocated)
            peak_reserved = max(peak_reserved, allocator.reserved)
        else:
            peak_allocated = max(peak_allocated, sum(a.allocated for a in allocators.values()))
            peak_reserved = max(peak_reserved, sum(a.reserved for a in allocators.values()))
    return Slack(
        slack=max(peak_reserved - peak_allocated, 0),
        peak_reserved=peak_reserved,
        peak_allocated=peak_allocated,
        events=len(events),
    )
