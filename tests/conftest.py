"""Shared fixtures: a fake `pynvml` injected at autofit's one NVML boundary.

`autofit.hardware.nvml._pynvml()` does `import pynvml`; putting a module object in
`sys.modules["pynvml"]` replaces NVML for the whole process without touching any other code.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import types
from dataclasses import dataclass, field

import pytest

from autofit.hardware import resolve_hardware
from autofit.models import PRESETS
from autofit.plan import plan_estimates
from autofit.request import PlanRequest
from autofit.space_file import load_space

# Model structures and layer traces are cached between runs (`autofit.arch.cache_dir`): the
# suite keeps its own, shared by its subprocesses, and leaves nothing in the user's cache.
# pytest-xdist's workers are handed an 80x24 terminal (COLUMNS, LINES) that a run in one process
# does not have: the CLI's output width must not depend on how the suite is run.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)
# Each of the run's workers has a core of its own: torch's intra-op threads (one per core by
# default) would make each worker and each trial it starts spin for the other's core. Memory is
# counted per tensor storage, which threads do not change; the trials' speed is not asserted.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
# The run's workers (pytest-xdist) inherit the folder the first conftest made, so each
# architecture is traced once per run; the process that made it removes it.
_SHARED = "AUTOFIT_TEST_CACHE"
if _SHARED not in os.environ:
    os.environ[_SHARED] = tempfile.mkdtemp(prefix="autofit-test-cache-")
    atexit.register(shutil.rmtree, os.environ[_SHARED], ignore_errors=True)
_CACHE = os.environ[_SHARED]
os.environ["AUTOFIT_CACHE_DIR"] = _CACHE
# Each worker's trials take turns among themselves (`autofit.trials.devlock`), not with the other
# worker's nor with a planner the user runs beside the suite (the run's own lock folder): a CPU
# trial's measured memory does not depend on the load, and the workers' start-ups overlap.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ["AUTOFIT_LOCK_DIR"] = os.path.join(_CACHE, f"locks-{_WORKER}")
# this machine's calibration too (each test gets its own below; fixtures wider than a test share
# this one)
os.environ["AUTOFIT_CALIBRATION_DIR"] = os.path.join(_CACHE, "calibration")


@pytest.fixture(autouse=True)
def _own_calibration_store(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test (and the processes it starts) has its own per-machine calibration store: a plan
    of one test must not start from the calibration another test's trials stored."""
    monkeypatch.setenv("AUTOFIT_CALIBRATION_DIR", str(tmp_path_factory.mktemp("calibration")))


MiB = 1024**2
GiB = 1024**3
LLAMA_7B = PRESETS["llama-7b"]


@pytest.fixture(scope="session")
def qlora_plan():  # type: ignore[no-untyped-def]
    """llama-7b QLoRA (the `qlora` space) on two RTX 3090s, from estimates: no trial."""
    return plan_estimates(
        PlanRequest.of(
            LLAMA_7B,
            resolve_hardware("2xrtx3090"),
            load_space("qlora"),
            seq_len=2048,
            global_batch=32,
        )
    )


class NVMLError(Exception):
    """Stand-in for `pynvml.NVMLError`."""


class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801 - pynvml's own spelling
    def __str__(self) -> str:
        return "Driver Not Loaded"


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "Not Supported"


@dataclass
class FakeGPU:
    name: str | bytes
    total: int
    free: int
    cc: tuple[int, int]
    gen: int
    width: int
    nvlinks: int  # active NVLink links; querying link >= this raises NotSupported


@dataclass
class FakeNVML:
    gpus: list[FakeGPU]
    nvlink_pairs: set[frozenset[int]] = field(default_factory=set)
    fail_init: bool = False
    driver: str = "580.159.04"  # the H200 machine's (bench/data/gpu-check/README.md)

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("pynvml")
        mod.NVMLError = NVMLError
        mod.NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
        mod.NVMLError_NotSupported = NVMLError_NotSupported
        mod.NVML_NVLINK_MAX_LINKS = 18
        mod.NVML_FEATURE_ENABLED = 1
        mod.NVML_P2P_CAPS_INDEX_NVLINK = 3
        mod.NVML_P2P_STATUS_OK = 0
        mod.NVML_P2P_STATUS_NOT_SUPPORTED = 5
        gpus, pairs, fail, driver = self.gpus, self.nvlink_pairs, self.fail_init, self.driver

        def init() -> None:
            if fail:
                raise NVMLError_DriverNotLoaded()

        def link_state(handle: int, link: int) -> int:
            if link >= gpus[handle].nvlinks:
                raise NVMLError_NotSupported()
            return 1

        def p2p(a: int, b: int, caps: int) -> int:
            assert caps == 3, "autofit must ask for the NVLink P2P capability"
            return 0 if frozenset((a, b)) in pairs else 5

        mod.nvmlInit = init
        mod.nvmlShutdown = lambda: None
        mod.nvmlSystemGetDriverVersion = lambda: driver
        mod.nvmlDeviceGetCount = lambda: len(gpus)
        mod.nvmlDeviceGetHandleByIndex = lambda i: i
        mod.nvmlDeviceGetName = lambda h: gpus[h].name
        mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
            total=gpus[h].total, free=gpus[h].free, used=gpus[h].total - gpus[h].free
        )
        mod.nvmlDeviceGetCudaComputeCapability = lambda h: gpus[h].cc
        mod.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: gpus[h].gen
        mod.nvmlDeviceGetMaxPcieLinkWidth = lambda h: gpus[h].width
        mod.nvmlDeviceGetNvLinkState = link_state
        mod.nvmlDeviceGetP2PStatus = p2p
        return mod


def four_gpu_box() -> FakeNVML:
    """GPUs 0-1: H100 SXM joined by NVLink (18 links each); 2: an RTX 3090 on PCIe gen4 x16;
    3: a Tesla T4 (Turing, no bf16) on PCIe gen3 x8. Only the 0-1 pair talks over NVLink."""
    return FakeNVML(
        gpus=[
            FakeGPU(b"NVIDIA H100 80GB HBM3", 81559 * MiB, 80000 * MiB, (9, 0), 5, 16, 18),
            FakeGPU("NVIDIA H100 80GB HBM3", 81559 * MiB, 81000 * MiB, (9, 0), 5, 16, 18),
            FakeGPU("NVIDIA GeForce RTX 3090", 24576 * MiB, 24000 * MiB, (8, 6), 4, 16, 0),
            FakeGPU("Tesla T4", 15360 * MiB, 15000 * MiB, (7, 5), 3, 8, 0),
        ],
        nvlink_pairs={frozenset((0, 1))},
    )


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    """Four fake GPUs (see `four_gpu_box`) behind the real `autofit.hardware.nvml` code."""
    box = four_gpu_box()
    monkeypatch.setitem(sys.modules, "pynvml", box.module())
    return box


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    """NVML present but the driver is not: `nvmlInit` raises an NVMLError subclass."""
    box = FakeNVML(gpus=[], fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", box.module())
    return box
