"""Memory caps and peaks: the CUDA allocator on GPUs, a dispatch-level tensor tracker on CPU.

On CUDA the cap is `torch.cuda.set_per_process_memory_fraction`, so the caching allocator raises a
real `torch.OutOfMemoryError` past `gpu_memory`. On CPU there is no device allocator to ask, so
`TensorTracker` (a `TorchDispatchMode`, the technique of torch's `MemTracker`) counts the bytes of
every live tensor storage created while it is active and raises `torch.OutOfMemoryError` when the
count passes the cap. Storages are released through weak references, and FSDP2's
`UntypedStorage.resize_` (which allocates and frees all-gather buffers outside the dispatcher) is
patched while tracking, as `MemTracker` does.

Compiled layers (`compile: true`) run under the tracker too: it ignores compilation itself
(`ignore_compile_internals`: dynamo turns the mode off while it traces and compiles, and on again
for the compiled code, which a mode that does not say so keeps from compiling at all), and
inductor's CPU buffers, which its generated code allocates outside the dispatcher
(`torch._C._dynamo.guards._empty_strided_cpu`), are allocated through it while tracking, so the
compiled code's own memory plan is what is counted.
"""

from __future__ import annotations

import contextlib
import resource
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(t: type) -> bool:
    """A tensor type whose ops reach this mode as they are: a plain tensor or parameter, or a
    subclass with no dispatch of its own (bitsandbytes' `Params4bit`, whose storage is a plain
    tensor's); DTensor, NF4Tensor and Int8Tensor desugar first."""
    return t in _PLAIN or t.__torch_dispatch__ is torch.Tensor.__torch_dispatch__


class TensorTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes (current and peak); raises OOM past `cap_bytes`."""

    # Compiled, checkpointed layers run random ops through higher-order operators
    # (`run_and_save_rng_state`): they come here as ops do, and what they return is counted.
    supports_higher_order_operators = True

    def __init__(self, cap_bytes: int | None = None) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [weakref, nbytes]
        # id(storage) -> weakref: storages on the host, not counted even when an op views them
        self._host: dict[int, Any] = {}
        self._orig_resize = torch.UntypedStorage.resize_

    # ----- bookkeeping ----------------------------------------------------------------------
    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def _grow(self, delta: int) -> None:
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
        if delta > 0 and self.cap_bytes is not None and self.current > self.cap_bytes:
            raise torch.OutOfMemoryError(
                f"CPU trial out of memory: live tensors need {self.current} bytes, over the "
                f"capacity of {self.cap_bytes} bytes (--gpu-memory)."
            )

    def track_storage(self, st: torch.UntypedStorage) -> None:
        if st.device.type == "meta":
            return
        key = id(st)
        if key in self._host:
            return
        entry = self._live.get(key)
        nbytes = st.nbytes()
        if entry is None:
            ref = weakref.ref(st, lambda _ref, key=key: self._forget(key))
            self._live[key] = [ref, nbytes]
            self._grow(nbytes)
        elif entry[1] != nbytes:
            old, entry[1] = entry[1], nbytes
            self._grow(nbytes - old)

    def track(self, tensors: Any) -> None:
        """Count the storages of `tensors` (any pytree; subclasses are flattened to their data)."""
        for t in tree_leaves(tensors):
            for plain in _plain_tensors(t):
                self.track_storage(plain.untyped_storage())

    def untrack(self, tensors: Any) -> None:
        """Stop counting the storages of `tensors`, now and when a later op returns a view of
        them (host-resident ones, e.g. offloaded params, which an all-gather reads through
        views), until they are freed."""
        host = self._host
        for t in tree_leaves(tensors):
            for plain in _plain_tensors(t):
                st = plain.untyped_storage()
                key = id(st)
                self._forget(key)
                if key not in host:
                    host[key] = weakref.ref(st, lambda _ref, key=key: host.pop(key, None))

    def reset_peak(self) -> None:
        self.peak = self.current

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compilation is not the run: off while dynamo and inductor compile, on again for the
        compiled code (torch's `TorchDispatchMode` protocol)."""
        return True

    # ----- the mode -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Let subclasses (DTensor, NF4Tensor, Int8Tensor) desugar first; their inner ops on plain
        # tensors come back here. Fake and functional tensors hold no memory: DTensor's sharding
        # propagation, and a compile that runs while the mode is on (DDP's graph splitter,
        # `torch._dynamo.backends.distributed`), go on to the modes below this one.
        if any(issubclass(t, (FakeTensor, FunctionalTensor)) for t in types):
            return func(*args, **(kwargs or {}))
        if not all(_plain(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _plain(type(t)):
                self.track_storage(t.untyped_storage())
        return out

    def __enter__(self) -> TensorTracker:
        tracker = self
        orig = self._orig_resize

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            result = orig(st, size)
            tracker.track_storage(st)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        _guards._empty_strided_cpu = _dispatched_empty_strided_cpu
        try:
            super().__enter__()
        except BaseException:  # the mode did not start: nothing stays patched
            self._unpatch()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._unpatch()

    def _unpatch(self) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        _guards._empty_strided_cpu = _EMPTY_STRIDED_CPU


# Inductor's generated CPU code binds this name when it is loaded (during the first, tracked
# step) and allocates every buffer with it, directly in C++: tracked, it goes through the
# dispatcher instead. A module loaded then keeps the dispatched version (same tensors, a little
# slower), which only trial processes ever load.
_guards = torch._C._dynamo.guards
_EMPTY_STRIDED_CPU = _guards._empty_strided_cpu


def _dispatched_empty_strided_cpu(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _plain_tensors(t: Any) -> Iterator[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        return
    if _plain(type(t)):
        yield t
        return
    if hasattr(t, "_local_tensor"):  # DTensor
        yield from _plain_tensors(t._local_tensor)
        return
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(t, name))


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Run without any dispatch mode (torchao's compiled optimizer step breaks under one)."""
    with _disable_current_modes():
        yield


def device_used_bytes(device: torch.device) -> int:
    """Memory in use on the whole device (`cudaMemGetInfo`: total minus free): the caching
    allocator's reservations plus the CUDA context, cuBLAS workspaces and NCCL buffers, which is
    what runs out."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def cap_cuda(gpu_memory: int | None, device: torch.device, outside: int = 0) -> int:
    """Make this GPU behave like a card of `gpu_memory` bytes; returns the capacity in force.

    Call after the process group (if any) is up. What a run holds outside PyTorch's caching
    allocator is taken off the cap, so the allocator may reserve only what a real card of that
    size would have left: the larger of what the device holds now (the CUDA context, NCCL's
    communicator) and `outside`, the estimate's figure for the whole run (the context grows as a
    step loads its kernels, after this is measured).
    """
    total = torch.cuda.get_device_properties(device).total_memory
    if gpu_memory is None or gpu_memory >= total:
        return total
    now = device_used_bytes(device) - torch.cuda.memory_reserved(device)
    limit = max(gpu_memory - max(now, outside), 0)
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return gpu_memory


def host_peak_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def all_reduce(t: torch.Tensor, op: Any) -> None:
    """`dist.all_reduce` over the launch's ranks (a trial's measurements: the fullest rank's
    peak, every rank's tokens, the slowest step); nothing to do with no group (one rank)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
