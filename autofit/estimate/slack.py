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

Under `offload: params` (FSDP2 `CPUOffloadPolicy`) the gradients go to the host: each unit's
reduce-scatter input (the compute stream's) lives until the next unit's reduce, its output (the
reduce-scatter stream's) is copied to the host and dropped, and no sharded gradient stays. On a
one-rank mesh FSDP2 all-gathers nothing: each parameter is copied from the host, cast, and copied
into its unsharded tensor on the compute stream, the embedding's and `[norm, head]`'s too
(`StepShape.host_params`).

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
    offload: bool = False  # FSDP2 `offload: params`: each unit's reduced gradients go to the host
    # `offload: params` on a one-rank mesh: each parameter of the embedding unit, of one layer
    # unit and of `[norm, head]`, as (bytes copied from the host, bytes gathered), module order
    host_params: tuple[tuple[tuple[int, int], ...], ...] = ()
    embedding_trained: bool = False  # the embedding unit is gathered and reduced in backward


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
    replay = _Replay(layer_events, shape)
    replay.persistent()
    for step in range(steps):
        replay.step(step)
    return replay.out


class _Replay:
    """A training step's allocation log, written in the order the step runs: the persistent
    weights, then per step the embedding, each layer's forward (FSDP2 gathering and resharding
    its unit), the head and the loss, each layer's backward in reverse (its unit's gradients
    reduced), the embedding's backward, and what the step's end frees and the optimizer keeps."""

    def __init__(self, layer_events: list[StepEvents], shape: StepShape) -> None:
        self.layer_events = layer_events
        self.shape = shape
        self.out: list[tuple[object, int]] = []
        self.alive: set[object] = set()
        self.plans: dict[int, _Plan] = {}
        self.gather_buffer: object | None = None
        self.held: dict[object, list[object]] = {}  # one-rank offload: a unit's unsharded params
        self.reduce_input: object | None = None  # offload: the last unit's reduce-scatter input

    # ----- the log ------------------------------------------------------------------------------
    def plan_of(self, i: int) -> _Plan:
        ev = self.layer_events[i]
        if id(ev) not in self.plans:
            self.plans[id(ev)] = _Plan(ev)
        return self.plans[id(ev)]

    def alloc(self, key: object, size: float) -> None:
        if key in self.alive or size <= 0:
            return
        self.alive.add(key)
        self.out.append((key, max(int(size), 1)))

    def free(self, key: object) -> None:
        if key in self.alive:
            self.alive.discard(key)
            self.out.append((key, 0))

    def sized(self, p: _Plan, sid: int, size: int) -> float:
        """A traced birth at this micro-batch: activations scale with it, fixed tensors not."""
        return size if sid in p.fixed else size * self.shape.micro_batch

    def outputs(self, step: int, i: int) -> list[object]:
        """Layer i's tensors the trace sees die at the head: its output."""
        p = self.plan_of(i)
        return [(step, i, sid) for sid, w in p.born.items()
                if w == _FWD and p.died.get(sid) == _MID]  # fmt: skip

    def free_input(self, step: int, i: int, sid: int) -> None:
        """Layer i's input dies: the embedding's output, or the previous layer's output."""
        if i == 0:
            self.free((("root", step), sid))
        else:
            for key in self.outputs(step, i - 1):
                self.free(key)

    # ----- FSDP2's units ------------------------------------------------------------------------
    def gather(self, step: int, where: str, i: int) -> None:
        if self.shape.host_params:
            self.copy_in((step, where, i), self.shape.host_params[1])
            return
        if not self.shape.gathered_per_layer:
            return
        if self.gather_buffer is not None:
            self.free(self.gather_buffer)
        self.gather_buffer = ("ag", step, where, i)
        self.alloc(self.gather_buffer, self.shape.gathered_per_layer)
        self.alloc(("unsharded", step, where, i), self.shape.gathered_per_layer)

    def copy_in(self, unit: object, params: tuple[tuple[int, int], ...]) -> None:
        """`offload: params` on a one-rank mesh (torch 2.11-2.13 `FSDPParamGroup.unshard` and
        `wait_for_unshard` at world_size 1, `FSDPParam.all_gather_inputs`): no all-gather and no
        buffer; per parameter, on the compute stream, its host copy (`.to(device)`), the cast of
        that to the compute dtype (a new tensor, the copy dropped), the previous parameter's
        input dropped, then the unsharded parameter (`all_gather_outputs[0]`) copied into."""
        held, last = self.held.setdefault(unit, []), None
        for j, (host, gathered) in enumerate(params):
            given = ("h2d", unit, j)
            self.alloc(given, host)
            if host != gathered:
                self.alloc(("cast", unit, j), gathered)
                self.free(given)
                given = ("cast", unit, j)
            if last is not None:
                self.free(last)
            held.append(("unsharded", unit, j))
            self.alloc(held[-1], gathered)
            last = given
        if last is not None:
            self.free(last)

    def release(self, unit: object) -> None:
        for key in self.held.pop(unit, ()):
            self.free(key)

    def reshard(self, step: int, where: str, i: int) -> None:
        if self.shape.host_params:
            if self.shape.reshard or where == "b":
                self.release((step, where, i))
                self.release((step, "f", i))
            return
        if self.shape.gathered_per_layer and (self.shape.reshard or where == "b"):
            self.free(("unsharded", step, where, i))
            if where == "b":
                self.free(("unsharded", step, "f", i))

    def reduce_grads(self, step: int, i: int) -> None:
        """FSDP2: layer i's unit's gradients reduced. The reduce-scatter input (in the reduce
        dtype, on its own stream) is kept until the next reduce-scatter is waited on; the
        unsharded gradients are freed, a shard of them kept."""
        p = self.plan_of(i)
        if self.shape.offload:
            self.reduce_to_host(("rs", step, i), p, (step, i))
            return
        if not (self.shape.gathered_per_layer and p.grads):
            return
        unit = sum(p.size.get(sid, 0) for sid in p.grads)
        self.alloc(("rs", step, i), unit * self.shape.reduce_ratio)
        self.free(("rs", step, i + 1))
        for sid in sorted(p.grads):
            key = (step, i, sid)
            if key in self.alive:
                self.free(key)
                self.alloc(("gshard", step, i, sid), p.size.get(sid, 0) * self.shape.grad_shard)

    def reduce_to_host(self, key: tuple[object, ...], p: _Plan, at: tuple[object, ...]) -> None:
        """`offload: params` (torch `foreach_reduce`, `FSDPParamGroup.post_backward`): the
        unit's gradients alive here (its own: plan `p`'s gradients, keyed under `at`) are copied
        into the reduce-scatter input, in the reduce dtype, on the compute stream, once the last
        unit's input is dropped (`reduce_scatter_state = None`), and kept until the next unit's
        reduce; the output, on the reduce-scatter stream, is copied to the host
        (`new_sharded_grad.to("cpu")`) and dropped: no gradient stays on the GPU."""
        live = [((*at, sid), p.size[sid]) for sid in sorted(p.grads) if (*at, sid) in self.alive]
        if not live:
            return
        unit = sum(size for _, size in live) * self.shape.reduce_ratio
        if self.reduce_input is not None:
            self.free(self.reduce_input)
        self.reduce_input = ("rs-input", *key[1:])
        self.alloc(self.reduce_input, unit)
        for k, _ in live:
            self.free(k)
        self.alloc(key, unit * self.shape.grad_shard)
        self.free(key)

    # ----- one step -----------------------------------------------------------------------------
    def persistent(self) -> None:
        for i in range(self.shape.layers):
            self.alloc(("w", i), self.shape.weights_per_layer)
        self.alloc(("w", "root"), self.shape.weights_outside)

    def step(self, step: int) -> None:
        n = self.shape.layers
        self.embedding(step)
        for i in range(n):
            self.forward(step, i)
        self.head(step)
        for i in reversed(range(n)):
            self.backward(step, i)
        self.embedding_backward(step)
        self.end(step)

    def embedding(self, step: int) -> None:
        first, root = self.plan_of(0), ("root", step)
        if self.shape.host_params:
            self.copy_in((step, "embedding", "f"), self.shape.host_params[0])
        for sid, size in first.windows[_PRE]:
            if size:
                self.alloc((root, sid), self.sized(first, sid, size))
            else:
                self.free((root, sid))
        if self.shape.reshard:
            self.release((step, "embedding", "f"))

    def forward(self, step: int, i: int) -> None:
        p = self.plan_of(i)
        self.gather(step, "f", i)
        for sid, size in p.windows[_FWD]:
            if size:
                self.alloc((step, i, sid), self.sized(p, sid, size))
            elif p.born.get(sid) == _FWD:
                self.free((step, i, sid))
            elif p.born.get(sid) == _PRE:
                self.free_input(step, i, sid)
        self.reshard(step, "f", i)

    def head(self, step: int) -> None:
        """The final norm, the head and the loss: the last layer's trace between its forward and
        its backward."""
        n, root = self.shape.layers, ("root", step)
        last = self.plan_of(n - 1)
        if self.shape.host_params:  # not resharded after forward: gathered until its backward
            self.copy_in((step, "head"), self.shape.host_params[2])
        for sid, size in last.windows[_MID]:
            if size:
                self.alloc((root, "mid", sid), self.sized(last, sid, size))
            elif last.born.get(sid) == _FWD:
                self.free((step, n - 1, sid))
            else:
                self.free((root, "mid", sid))
                self.free((root, sid))
        self.release((step, "head"))
        if self.shape.offload:
            self.reduce_to_host(("rs", step, "head"), last, (root, "mid"))

    def backward(self, step: int, i: int) -> None:
        p = self.plan_of(i)
        self.gather(step, "b", i)
        for sid, size in p.windows[_BWD]:
            if size:
                self.alloc((step, i, sid), self.sized(p, sid, size))
                continue
            born = p.born.get(sid)
            if born in (_FWD, _BWD):
                self.free((step, i, sid))
            elif born == _MID:  # the gradient flowing in: the head's, or layer i + 1's
                self.free_incoming_grad(step, i, sid)
            elif born == _PRE:  # the layer's input, kept for backward
                self.free_input(step, i, sid)
        self.reshard(step, "b", i)
        self.reduce_grads(step, i)

    def free_incoming_grad(self, step: int, i: int, sid: int) -> None:
        if i == self.shape.layers - 1:
            self.free((("root", step), "mid", sid))
            return
        passed = self.plan_of(i + 1)
        for psid, w in passed.born.items():
            if w == _BWD and passed.died.get(psid) == _POST:
                self.free((step, i + 1, psid))

    def embedding_backward(self, step: int) -> None:
        p0, root = self.plan_of(0), ("root", step)
        if self.shape.host_params and self.shape.embedding_trained:
            self.copy_in((step, "embedding", "b"), self.shape.host_params[0])
        for sid, size in p0.windows[_POST]:
            if size:
                self.alloc((root, "post", sid), self.sized(p0, sid, size))
            elif p0.born.get(sid) == _BWD:
                self.free((step, 0, sid))
            else:
                self.free((root, "post", sid))
                self.free((root, sid))
        self.release((step, "embedding", "b"))
        self.release((step, "embedding", "f"))
        if self.shape.offload:
            self.reduce_to_host(("rs", step, "embedding"), p0, (root, "post"))

    def end(self, step: int) -> None:
        """What the step leaves besides the gradients (the loss, leftovers) goes; after the first
        step the optimizer's states are born; `zero_grad(set_to_none=True)` frees the
        gradients."""
        n = self.shape.layers
        if self.gather_buffer is not None:
            self.free(self.gather_buffer)
            self.gather_buffer = None
        self.free(("rs", step, 0))
        if self.reduce_input is not None:
            self.free(self.reduce_input)
            self.reduce_input = None
        grads = {(step, i, sid) for i in range(n) for sid in self.plan_of(i).grads}
        grads |= {("gshard", step, i, sid) for i in range(n) for sid in self.plan_of(i).grads}
        # (in a fixed order: a set of keys holding text iterates differently in each process)
        for key in [k for k in sorted(self.alive, key=repr) if k not in grads and _transient(k)]:
            self.free(key)
        if step == 0:  # the optimizer's states, born in its first step
            for i in range(n):
                self.alloc(("opt", i), self.shape.opt_per_layer)
        for key in sorted(grads & self.alive, key=repr):
            self.free(key)


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
