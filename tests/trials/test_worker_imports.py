"""A rank imports bitsandbytes and torchao only where one of its configs uses them: peft imports
bitsandbytes and transformers imports torchao whenever they are installed, about 1 s and 0.27 s of
every rank's start on the suite's machine, and on a GPU their CUDA kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.trials.worker import _unused_libraries

pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")

# what a rank imports, after the worker's skip: peft's helpers (which try bitsandbytes) and
# transformers' quantizers (which import torchao where it is found), then whether each library
# is loaded and whether peft and transformers think it is installed
PROBE = """
import sys
from autofit.trials.worker import _skip_unused_libraries
_skip_unused_libraries(["--spec", sys.argv[1], "--out", "x"])
import peft.helpers
import transformers.quantizers.auto
from peft.import_utils import is_bnb_available
from transformers.utils import is_torchao_available
def loaded(name):
    return name in sys.modules and sys.modules[name] is not None
print(loaded("bitsandbytes"), is_bnb_available(), peft.helpers.bnb is not None,
      loaded("torchao"), is_torchao_available())
"""

LORA = {"lora_rank": 8}


def _spec(tmp_path: Path, second: dict[str, object]) -> Path:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"configs": [LORA, second]}))
    return spec


@pytest.mark.parametrize(
    ("second", "loaded"),
    [
        ({**LORA, "quant": "nf4", "quant_backend": "torchao"}, "False False False True True"),
        ({**LORA, "quant": "nf4", "quant_backend": "bitsandbytes"}, "True True True False False"),
        ({"lora_rank": 16, "micro_batch": 2}, "False False False False False"),
    ],
    ids=["torchao-nf4", "bitsandbytes-nf4", "bf16"],
)
@pytest.mark.timeout(120)
def test_a_rank_loads_an_optional_library_only_for_a_config_that_uses_it(
    tmp_path: Path, second: dict[str, object], loaded: str
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(_spec(tmp_path, second))],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == loaded


@pytest.mark.parametrize(
    "second",
    [
        {**LORA, "quant": "int8"},
        {**LORA, "optimizer": "adamw8bit"},
        {**LORA, "optimizer": "adamw4bit"},
        {**LORA, "offload": "optimizer"},
    ],  # fmt: skip
    ids=["int8", "adamw8bit", "adamw4bit", "offloaded-optimizer"],
)
def test_a_rank_keeps_torchao_for_each_of_its_other_uses(
    tmp_path: Path, second: dict[str, object]
) -> None:
    # torchao's int8 weights (`builder/quantize.py`), its low-bit AdamWs (`torchao.optim`) and its
    # CPUOffloadOptimizer (`builder/optim.py`): the rank must be able to import it
    assert _unused_libraries(["--spec", str(_spec(tmp_path, second))]) == ["bitsandbytes"]
