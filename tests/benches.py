"""The bench scripts as modules, for the tests that hold them to outside truth (bench/ is no
package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(stem: str) -> ModuleType:
    """`bench/<stem>.py` as the module `autofit_bench_<stem>`, registered in sys.modules before
    it runs, as its dataclasses need (and loaded once per process)."""
    name = f"autofit_bench_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
