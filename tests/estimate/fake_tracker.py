"""FSDPMemTracker under FakeTensorMode: the peak bytes of rank 0 of autofit's own FSDP2 step.

torch's `FSDPMemTracker` runs the real FSDP2 training step of autofit's own builder under
`FakeTensorMode` with the `fake` process group (no memory is allocated, no rank exists but 0) and
reports the peak tensor memory of one rank by category. Its counts are the same bytes on every
run (no timing enters them), at any model size, in seconds for a model of a few layers.

Used by `bench/fake_yardstick.py` (7B-70B, docs/accuracy.md section 2) and by
`tests/estimate/test_against_tracker.py` (`tests/estimate/tracked.py`, the cases the suite holds).

Only FSDP2 configs (`wrap` layer, every-2, model): the tracker follows `fully_shard` units. The
model is laid out as the builder does it (torchtitan: embedding unit, layer units, `[norm, head]`
unit kept gathered after forward, root). What the tracker does not see: CUDA context and
caching-allocator slack (compare allocated bytes only), and quantized tensor subclasses it cannot
fake (torchao's NF4/int8 subclasses refuse fake tensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from autofit.models import ModelSpec, resolve_model


def peak_tracker_class() -> type:
    """`FSDPMemTracker` that keeps only the global peak, and where it happened.

    The stock tracker also updates a per-module peak on every dispatched op by walking all tracked
    modules (a `WeakIdKeyDictionary` whose look-ups call `hasattr` through every checkpoint
    wrapper): over half the run time at 70B. Only the global peak is compared here, so this
    override drops that walk and records instead the pass and the FSDP2 unit last entered (its
    pre-forward or pre-backward hook; the module tracker's `parents` go stale under activation
    checkpointing)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class PeakTracker(FSDPMemTracker):
        where = ""
        _unit = None

        def _entered(self, fsdp_mod: object, hook: Callable) -> Callable:
            def inner(*args: object, **kwargs: object) -> object:
                self._unit = fsdp_mod
                return hook(*args, **kwargs)

            return inner

        def _fsdp_state_pre_forward(self, fsdp_mod: object, orig: Callable) -> Callable:
            return self._entered(fsdp_mod, super()._fsdp_state_pre_forward(fsdp_mod, orig))

        def _fsdp_param_group_pre_backward(self, fsdp_mod: object, orig: Callable) -> Callable:
            hook = super()._fsdp_param_group_pre_backward(fsdp_mod, orig)
            return self._entered(fsdp_mod, hook)

        def _update_peak_stats(self, peak_state: object) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
                    self.where = self._place()

        def _place(self) -> str:
            if self._in_opt:
                return "optimizer step"
            unit = self._unit and self._mod_tracker.get_known_fqn(self._unit) or "?"
            unit = unit.split(".", 1)[1] if "." in unit else "root"
            unit = unit.replace("base_model.model.", "").replace("_checkpoint_wrapped_module.", "")
            pass_ = "backward" if self._mod_tracker.is_bw else "forward"
            return f"{pass_} (last unit entered: {unit})"

    return PeakTracker


@contextlib.contextmanager
def own_fake_mode_for_dtensor_metadata() -> Iterator[None]:
    """Make DTensor's sharding propagation run in a fake mode of its own.

    DTensor derives each op's output metadata by running it on global-shape tensors under
    `detect_fake_mode() or FakeTensorMode()`. Inside this script's FakeTensorMode it finds that
    mode, which is also the one the tracker entered under, so the tracker cannot tell those
    global-shape tensors from the step's own and counts them. It matters in the optimizer step,
    which runs on the sharded DTensor parameters: unsharded fp32 stand-ins of the parameters
    being updated (llama-3-8b, 128k vocabulary: +6.1 GiB of `OPT`, which was its whole recorded
    "peak", 21.07 GiB instead of 19.20). A separate fake mode is what DTensor uses outside a fake
    mode, and the tracker skips ops run in a fake mode other than its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    own = FakeTensorMode()
    detect = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: own
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


def trace(model: str | ModelSpec, world: int, knobs: dict) -> tuple:
    """Peak bytes of rank 0 by category for one config (traced under FakeTensorMode by
    FSDPMemTracker), where the peak happened, and the config's `Config` and `ModelSpec`.
    `knobs` are `Config` fields; seq_len is 2048 unless they say otherwise."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autofit.builder.apply import cast_base, cast_trainable, model_layout
    from autofit.builder.checkpoint import apply_checkpointing
    from autofit.builder.fsdp import apply_fsdp, fsdp_root, make_mesh
    from autofit.builder.lora import apply_lora
    from autofit.builder.model import build_meta_model, materialize, model_parts
    from autofit.builder.optim import build_optimizer
    from autofit.config import Config

    spec = resolve_model(model)
    cfg = Config(**{"seq_len": 2048, **knobs}).resolved(world)
    net = build_meta_model(spec)
    layout = model_layout(net, cfg, world, device_type="cpu")  # one node
    if not layout.fsdp:
        raise ValueError(f"wrap={cfg.wrap} on {world} GPU(s) is not FSDP2: nothing to track")
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = make_mesh("cpu", layout)  # made outside the fake mode
    # The builder's steps before sharding run on the meta device outside the fake mode (peft's
    # adapter moves cannot swap fake tensors); sharding and materialising run inside it, in the
    # builder's order (autofit/builder/apply.py `prepare`, unquantized: shard, then materialise).
    cast_base(net, layout)
    net = apply_lora(net, cfg.lora_rank, cfg.alpha, layout.adapted)
    cast_trainable(net, layout)
    apply_checkpointing(net, layout.checkpointed, layout.selective)
    parts = model_parts(net)
    with FakeTensorMode(allow_non_fake_inputs=True):
        apply_fsdp(net, parts, cfg, mesh, layout)
        materialize(net, torch.device("cpu"))
        opt = build_optimizer(net, cfg, layout.adamw, "cpu")
        root = fsdp_root(net)
        batch = torch.randint(0, spec.vocab, (cfg.micro_batch, cfg.seq_len))
        tracker = peak_tracker_class()(root, opt)
        tracker.track_inputs((batch,))
        with tracker, own_fake_mode_for_dtensor_metadata():
            for step in range(2):
                for micro in range(cfg.grad_accum):
                    root.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
                    loss = net(input_ids=batch, labels=batch, use_cache=False).loss
                    (loss / cfg.grad_accum).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step == 0:
                    tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")
    dist.destroy_process_group()
    per_dev = next(iter(snap.values()))
    measured = {str(k).split(".")[-1]: int(v) for k, v in per_dev.items()}
    return measured, tracker.where, cfg, spec
