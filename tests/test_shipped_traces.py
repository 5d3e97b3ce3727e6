"""The traces shipped in the package (`autofit/arch/shipped/`, made by `bench/ship_traces.py`):
one preset's traced again now must give the very numbers shipped, every preset has its file made
with this environment's versions, a file is read under releases that trace alike with those
(`TRACED_ALIKE`: the README's main job under the GPU machine's torch reads it, cold, without
torch) and not under others (a release that changes a traced shape traces anew)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autofit.arch import TRACE_VERSION, shipped, traced_entry
from autofit.arch.shipped import made_with, read_shipped, shipped_path
from autofit.models import PRESETS
from tests.benches import load_bench

BENCH = Path(__file__).resolve().parent.parent / "bench" / "ship_traces.py"


def _ship_traces():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("ship_traces", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SHIP = _ship_traces()


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_ships_every_key_a_shipped_space_asks_for(name):
    data = SHIP.read(shipped_path(PRESETS[name]))
    acts, events = SHIP.shipped_keys()
    assert data["made_with"] == made_with(TRACE_VERSION), (
        f"{name}'s shipped traces were made with other versions: run bench/ship_traces.py"
    )
    assert set(data["activations"]) == {k.text() for k in acts}
    if PRESETS[name].experts:  # HF's grouped-mm experts refuse fp32 (full fine-tune) weights
        events = [k for k in events if k.lora_rank or not k.autocast]
    assert set(data["events"]) == {k.text() for k in events}
    assert set(data["ops"]) == {k.text() for k in SHIP.shipped_ops_keys()}


def test_a_fresh_trace_of_a_small_preset_gives_the_shipped_numbers():
    """llama-debug's structure and a key of each kind (rank 0 and LoRA, each checkpointing,
    autocast, the chunked loss), traced now, against the file shipped; the whole entry is
    `python bench/ship_traces.py --check llama-debug`."""
    spec = PRESETS["llama-debug"]
    acts, _ = SHIP.shipped_keys()
    picked = [k for k in acts if k.lora_rank in (0, 16)]
    chosen = [k for k in picked if (k.policy, k.autocast, k.loss) in {
        ("none", False, "standard"), ("full", True, "chunked"), ("selective", False, "chunked"),
    }]  # fmt: skip
    fresh = traced_entry(spec, chosen, chosen)
    shipped = SHIP.read(shipped_path(spec))
    assert fresh["structure"] == shipped["structure"]
    for section in ("activations", "events"):
        assert fresh[section], section
        for key, value in fresh[section].items():
            assert shipped[section][key] == value, (section, key)


@pytest.mark.parametrize(
    "name", ["llama-7b", "qwen2.5-7b", "qwen3-8b", "gemma-2-2b", "phi-3-mini", "mixtral-8x7b"]
)
def test_the_shipped_structure_of_each_family_is_the_meta_models(name):
    """What `autofit models` and every preset's estimate read (Qwen2's biases, Qwen3's q/k norms,
    Gemma's norms and tied head, Phi-3's fused projections, Mixtral's router and experts),
    against the meta model read now."""
    from autofit.builder.structure import read_structure

    spec = PRESETS[name]
    assert SHIP.read(shipped_path(spec))["structure"] == read_structure(spec).to_dict()


def test_a_remade_entry_reuses_every_stored_trace_an_empty_one_too():
    """`bench/ship_traces.py` without `--fresh` traces only the keys its file lacks: remade from
    llama-debug's shipped file it is that file, and a trace stored empty is a stored trace,
    reused as it is (it was read as missing, then looked up among the fresh ones: KeyError)."""
    spec = PRESETS["llama-debug"]
    shipped = SHIP.read(shipped_path(spec))
    assert SHIP.entry(spec, shipped) == shipped
    first = next(iter(shipped["activations"]))
    emptied = {**shipped, "activations": {**shipped["activations"], first: {}}}
    assert SHIP.entry(spec, emptied)["activations"] == emptied["activations"]


def test_entries_made_with_other_versions_are_not_read():
    spec = PRESETS["llama-7b"]
    assert read_shipped(spec, TRACE_VERSION)["structure"]["layers"] == 32
    assert read_shipped(spec, TRACE_VERSION + 1) == {}


def test_a_presets_count_is_read_without_torch(tmp_path):
    """`autofit models` and a preset's plan read the shipped structure: torch is not imported.
    Llama-2-7B's count is the README's (and its model card's)."""
    code = (
        "import sys; from autofit.arch import structure_of; from autofit.models import PRESETS;"
        "print(structure_of(PRESETS['llama-7b']).n_params, 'torch' in sys.modules)"
    )
    env = {"AUTOFIT_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.split() == ["6738415616", "False"], done.stderr


COLD_START = load_bench("cold_start")


def _installed(monkeypatch, **versions):  # type: ignore[no-untyped-def]
    found = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "peft": "0.21.2", **versions}
    monkeypatch.setattr(shipped, "installed_versions", lambda: found)


STAMP = {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2", "trace_version": 8}


@pytest.mark.parametrize(
    ("versions", "alike"),
    [
        ({}, True),
        ({"torch": "2.13.1+cu130"}, True),  # a patch release, another build
        ({"torch": "2.11.0+cu130", "transformers": "5.23.0"}, True),  # a group of each
        ({"torch": "2.12.0"}, False),  # never traced: no group has it
        ({"transformers": "5.17.0"}, False),  # traced: other step logs, Gemma 2's activations
        ({"transformers": "5.21.0"}, True),
        ({"transformers": "5.20.0"}, False),  # traced: Gemma 2's activations differ
        ({"peft": "0.21.0"}, False),
        ({"peft": None}, False),
    ],
)
def test_an_entry_is_read_where_the_releases_trace_alike(monkeypatch, versions, alike):
    _installed(monkeypatch, **versions)
    assert shipped.traces_alike(STAMP, 8) is alike
    assert shipped.traces_alike(STAMP, 9) is False


def test_every_alike_group_holds_the_releases_the_shipped_files_were_made_with():
    """A group that left out the shipping release would serve nothing; the claim of each group
    is the check's (`bench/ship_traces.py --check` under its releases: docs/architecture.md)."""
    stamp = SHIP.read(shipped_path(PRESETS["llama-debug"]))["made_with"]
    for dist, groups in shipped.TRACED_ALIKE.items():
        for group in groups:
            assert any(stamp[dist].startswith(prefix + ".") for prefix in group), (dist, group)


def _faked(tmp_path, fake, *args):  # type: ignore[no-untyped-def]
    env = {**os.environ, "AUTOFIT_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("AUTOFIT_VERBOSE", None)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *COLD_START.faked(["-m", "autofit", *args], fake)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)  # fmt: skip
    return done, time.perf_counter() - started


@pytest.mark.slow
def test_the_readme_main_job_reads_the_shipped_traces_under_the_gpu_machines_torch(tmp_path):
    """torch 2.11 (the H200 machine's, issue 33) and transformers 5.23 trace alike with the
    releases the files were made with: the README's main job, cold, traces nothing and imports
    no torch (its time, about 3 s on the 2-core machine: `bench/cold_start.py --fake ...`)."""
    fake = {"torch": "2.11.0+cu130", "transformers": "5.23.0"}
    done, took = _faked(tmp_path, fake, "plan", "--model", "llama-7b", "--gpus", "2xrtx3090",
                        "--no-trials")  # fmt: skip
    print(f"cold, faked {fake}: {took:.2f} s")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["torch not imported"], done.stderr
    assert "Winner" in done.stdout


GPU_MACHINE = {"torch": "2.11.0+cu130", "transformers": "5.17.0"}
"""What the lent GPU machine has installed (`../shared/gpu/README.md`; its rows'
`bench/data/gpu-check/`): transformers 5.17 traces other step logs than the pinned 5.24."""


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_ships_a_variant_for_the_gpu_machines_transformers(name):
    """Each preset's `transformers-5.17` file holds every key a shipped space asks for, made
    with transformers 5.17 and this file's trace format, and is the one read there."""
    spec = PRESETS[name]
    data = SHIP.read(shipped_path(spec, "transformers-5.17"))
    acts, events = SHIP.shipped_keys()
    assert data["made_with"]["transformers"] == "5.17.0"
    assert data["made_with"]["trace_version"] == TRACE_VERSION
    assert set(data["activations"]) == {k.text() for k in acts}
    if spec.experts:  # as the pinned releases' files
        events = [k for k in events if k.lora_rank or not k.autocast]
    assert set(data["events"]) == {k.text() for k in events}
    assert set(data["ops"]) == {k.text() for k in SHIP.shipped_ops_keys()}


def test_the_gpu_machines_releases_read_the_variant_and_the_pinned_ones_the_main_file(
    monkeypatch,
):
    spec = PRESETS["llama-7b"]
    variant = SHIP.read(shipped_path(spec, "transformers-5.17"))
    main = SHIP.read(shipped_path(spec))
    assert variant["events"] != main["events"]  # the step logs differ (rotary temporaries)
    _installed(monkeypatch, **GPU_MACHINE)
    assert read_shipped(spec, TRACE_VERSION)["events"] == variant["events"]
    _installed(monkeypatch)
    assert read_shipped(spec, TRACE_VERSION)["events"] == main["events"]


@pytest.mark.slow
def test_the_readme_main_job_reads_the_variant_under_the_gpu_machines_releases(tmp_path):
    """torch 2.11 and transformers 5.17, the H200 machine's (issue 33: a cold plan there traced
    llama-7b's layer at real width, 19-29 s): the README's main job, cold, reads the
    `transformers-5.17` file, traces nothing and imports no torch."""
    done, took = _faked(tmp_path, GPU_MACHINE, "plan", "--model", "llama-7b", "--gpus",
                        "2xrtx3090", "--no-trials")  # fmt: skip
    print(f"cold, faked {GPU_MACHINE}: {took:.2f} s")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["torch not imported"], done.stderr
    assert "Winner" in done.stdout


@pytest.mark.slow
def test_a_release_that_changes_a_traced_shape_traces_anew(tmp_path):
    """transformers 5.20 (found to trace Gemma 2's activations otherwise than 5.24, and shipped
    in no variant) reads no shipped entry: a shipped preset's estimate traces, and says so."""
    done, _ = _faked(tmp_path, {"transformers": "5.20.0"}, "estimate", "--model", "llama-debug",
                     "--gpus", "1", "--device", "cpu")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("Tracing llama-debug's decoder layer"), lines
    assert lines[-1] == "torch imported"


def test_a_presets_step_time_reads_the_shipped_op_counts_without_torch(tmp_path):
    """A preset's estimate reads its op counts (the host's term of the step time) from the
    shipped file: no count is made, torch is not imported."""
    code = (
        "import sys; from autofit.estimate import estimate; from autofit.config import Config;"
        "from autofit.hardware import resolve_hardware; from autofit.models import PRESETS;"
        "e = estimate(PRESETS['llama-7b'], resolve_hardware('1xh200'),"
        " Config(quant='nf4', lora_rank=64, checkpointing='full', wrap='none'));"
        "print(e.time_breakdown['host'] > 0, 'torch' in sys.modules)"
    )
    env = {"AUTOFIT_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.split() == ["True", "False"], done.stderr
