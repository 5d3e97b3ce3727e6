"""The caching-allocator model against the real one: a recorded training step on a GPU, replayed.

A child process (a fresh allocator: nothing allocated or cached before recording starts, and
`PYTORCH_CUDA_ALLOC_CONF` set before torch starts) records two training steps of a small MLP with
fused AdamW under `torch.cuda.memory._record_memory_history()`, then hands its `_snapshot()` and
`memory_stats()` back; the test replays `events_from_snapshot` through `replay` with the
allocator's own setting (expandable when the trace has `segment_map` entries) and compares peaks.

Tolerances: the requested peak depends only on the request sizes and their order, so it must be
equal. The allocated peak (rounded block sizes, whole unsplit blocks) within 1%, the reserved peak
within 2% or one 20 MiB large segment, whichever is more: the model hands out segment addresses
in increasing order, the driver need not, and that decides ties between equal-sized free blocks.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.estimate.allocator import events_from_snapshot, replay

MiB = 1024**2


def _cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


_STEP = r"""
import pickle, sys
import torch
from torch import nn

torch.cuda.init()
torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None, stacks="python")
assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_reserved() == 0
torch.cuda.reset_peak_memory_stats()
torch.manual_seed(0)
with torch.device("cuda"):
    # widths giving small (biases), 1-10 MiB (3000 x 384 fp32 = 4.4 MiB) and larger blocks, and
    # sizes that are not multiples of 2 MiB (3000 x 2048 fp32 = 23.4 MiB)
    widths = [2048, 5120, 2048, 384, 2048, 2048]
    layers = [nn.LayerNorm(2048)]
    for n_in, n_out in zip(widths, widths[1:]):
        layers += [nn.Linear(n_in, n_out), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(2048, 1000))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(2):
        x = torch.randn(3000, 2048)
        loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del x, loss
torch.cuda.synchronize()
snapshot = torch.cuda.memory._snapshot()
stats = torch.cuda.memory_stats()
keys = ["allocated_bytes.all.peak", "reserved_bytes.all.peak", "requested_bytes.all.peak",
        "num_device_alloc"]
with open(sys.argv[1], "wb") as f:
    pickle.dump({
        "traces": snapshot["device_traces"],
        "stats": {k: stats[k] for k in keys},
        "backend": torch.cuda.get_allocator_backend(),
    }, f)
"""


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
def test_replaying_a_recorded_training_step_gives_the_allocators_peaks(
    expandable: bool, tmp_path: Path
) -> None:
    conf = f"expandable_segments:{expandable}"
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTORCH_ALLOC_CONF": conf}
    out = tmp_path / "step.pickle"
    done = subprocess.run([sys.executable, "-c", _STEP, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out, "rb") as f:
        data = pickle.load(f)
    if data["backend"] != "native":
        pytest.skip(f"the {data['backend']} allocator backend is not the caching allocator")
    # the allocator's own setting: it maps pages only with expandable segments (which need the
    # CUDA driver API; without it the setting is ignored)
    mapped = any(entry["action"] == "segment_map" for trace in data["traces"] for entry in trace)
    if expandable and not mapped:
        pytest.skip("expandable segments are not supported by this build or driver")
    events = events_from_snapshot({"device_traces": data["traces"]})
    assert len(events) > 100
    result = replay(events, expandable_segments=mapped)
    real = data["stats"]
    report = f"model {result}, torch {real}"
    assert result.peak_requested == real["requested_bytes.all.peak"], report
    assert result.peak_allocated == pytest.approx(real["allocated_bytes.all.peak"], rel=0.01), (
        report
    )
    reserved = real["reserved_bytes.all.peak"]
    assert abs(result.peak_reserved - reserved) <= max(0.02 * reserved, 20 * MiB), report
