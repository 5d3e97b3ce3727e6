"""A rank imports bitsandbytes only where one of its configs quantizes with it: peft imports it
whenever it is installed, a second of every rank's start, and on a GPU its CUDA kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")

PROBE = """
import sys
from autofit.trials.worker import _skip_unused_bitsandbytes
_skip_unused_bitsandbytes(["--spec", sys.argv[1], "--out", "x"])
import peft.helpers
from peft.import_utils import is_bnb_available
print("bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is not None,
      is_bnb_available(), peft.helpers.bnb is not None)
"""


@pytest.mark.parametrize(
    ("backend", "loaded"), [("torchao", "False False False"), ("bitsandbytes", "True True True")]
)
@pytest.mark.timeout(120)
def test_a_rank_loads_bitsandbytes_only_for_a_config_that_uses_it(
    tmp_path: Path, backend: str, loaded: str
) -> None:
    spec = tmp_path / "spec.json"
    configs = [{"lora_rank": 8}, {"lora_rank": 8, "quant": "nf4", "quant_backend": backend}]
    spec.write_text(json.dumps({"configs": configs}))
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(spec)], capture_output=True, text=True, timeout=110
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == loaded
