"""The shape of the package: data flows one way (docs/architecture.md), and plain data does not
import torch. Both are read from the code itself: the import statements (ast) and `sys.modules` of
a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import autofit

ROOT = Path(autofit.__file__).parent

# Lowest first. A unit may import units of its own layer or of layers below, never above; the
# public API (`autofit/__init__.py`) and the CLI sit on top. docs/architecture.md draws the same.
LAYERS: list[set[str]] = [
    {
        "_version",
        "errors",
        "units",
        "checks",
        "interrupt",
        "files",
        "quiet",
        "values",
    },  # facts, helpers
    {
        "config",
        "settings",
        "models",
        "hardware",
        "space",
        "space_file",
        "request",
        "recipe",
        "layout",
        "structure",
        "data",
        "rules",
    },  # in
    {"builder"},  # the torch builder: the model as trials and `apply` set it up, its traces
    {"arch"},  # a model's structure and layer traces, read with the builder and kept on disk
    {"estimate"},  # napkin memory and time: arithmetic over `arch`'s structure and traces
    {"trials", "export"},  # trial processes; export reads a plan's fields
    {"calibration"},  # the napkin corrected by measured trials; this machine's stored calibration
    {"plan"},  # candidates, pruning, ranking, the plan and its sentences
    {"search"},  # the Optuna study: estimate -> trials -> plan, reported as events
    {"report"},  # what people read (tables, the search's events shown live, picture, run folder)
    {"", "arguments", "cli", "__main__"},  # the public API (its arguments) and the CLI
]
# the worker's entry too: it must guard itself before torch takes seconds to import
TORCH_FREE = (
    "autofit", "autofit.search", "autofit.plan", "autofit.report", "autofit.trials",
    "autofit.trials.worker", "autofit.trials.launcher", "autofit.cli", "autofit.export",
    "autofit.arch", "autofit.estimate", "autofit.calibration", "autofit.calibration.store",
    "autofit.data.read", "autofit.data.source",
)  # fmt: skip


def unit(module: str) -> str:
    """`autofit.search.driver` -> 'search'; `autofit` -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def is_unit(name: str) -> bool:
    return (ROOT / name / "__init__.py").is_file() or (ROOT / f"{name}.py").is_file()


def typing_only_nodes(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (annotations only: no import at run time)."""
    return {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }


def imports() -> dict[str, set[tuple[str, str]]]:
    """unit -> {(imported unit, where)}, counting imports inside functions too, not the ones
    under `if TYPE_CHECKING:` (annotations only)."""
    found: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        typing_only = typing_only_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "autofit":
                # `from autofit import recipe` imports the unit `recipe`; `from autofit import
                # plan` in the CLI imports the public API, which is the top layer
                names = [f"autofit.{a.name}" if is_unit(a.name) else "autofit" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name == "autofit" or name.startswith("autofit."):
                    src, dst = unit(module.replace(".__init__", "")), unit(name)
                    if src != dst:
                        found[src].add((dst, f"{path.relative_to(ROOT.parent)}:{node.lineno}"))
    return found


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"autofit.{name} has no layer: add it to LAYERS and docs/architecture.md")


def test_no_module_reaches_up_a_layer():
    wrong = [
        f"{where}: autofit.{src or '__init__'} (layer {layer_of(src)}) imports autofit.{dst} "
        f"(layer {layer_of(dst)})"
        for src, targets in imports().items()
        for dst, where in sorted(targets)
        if layer_of(dst) > layer_of(src)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_units():
    """Units of one layer may import each other, but never both ways round, through any chain,
    imports inside functions included (a hidden cycle is a cycle)."""
    graph = {src: {dst for dst, _ in targets} for src, targets in imports().items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            unit_ = todo.pop()
            if unit_ == goal:
                return True
            if unit_ not in seen:
                seen.add(unit_)
                todo.extend(graph.get(unit_, ()))
        return False

    cycles = sorted(
        f"autofit.{src or '__init__'} -> autofit.{dst} -> ... -> autofit.{src or '__init__'}"
        for src, targets in graph.items()
        for dst in targets
        if reaches(dst, src)
    )
    assert not cycles, "\n".join(cycles)


def module_imports() -> dict[str, set[str]]:
    """module -> the autofit modules it imports (a package's `__init__` as the package's name),
    imports inside functions included, not the ones under `if TYPE_CHECKING:`; `from P import
    name` counts the module `P.name` where there is one, else `P`."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = typing_only_nodes(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names]  # fmt: skip
            else:
                continue
            for name in names:
                target = known(name) if name.startswith("autofit") else None
                if target is not None and target != module:
                    found[module].add(target)
    return found


def test_no_import_cycle_between_modules():
    """No module reaches itself through any chain of imports, inside a package or across, at any
    depth, imports inside functions included (a function-level import hides a cycle, it does not
    remove it): the strongly connected components of the module graph are single modules."""
    graph = module_imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_every_unit_has_a_layer():
    units = {p.stem for p in ROOT.glob("*.py")} | {
        p.parent.name for p in ROOT.glob("*/__init__.py")
    }
    for name in units - {"__init__"}:
        layer_of(name)


def test_plain_modules_do_not_import_torch():
    """Data types, the search, the plan and the CLI load without torch (it costs seconds); only the
    builder and the trial worker import it."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in TORCH_FREE)
        + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_trial_is_the_public_function_and_trials_the_package():
    import autofit.trials

    assert callable(autofit.trial) and autofit.trial.__module__ == "autofit"
    assert autofit.trials.run_trial.__module__ == "autofit.trials.launcher"
    assert type(sys.modules["autofit.trials"]).__name__ == "module"  # no class swap


def test_every_test_folder_is_collected(pytestconfig) -> None:  # type: ignore[no-untyped-def]
    """pytest's default `norecursedirs` skips any folder named `build` (the builder's tests,
    then under tests/build, went uncollected for a release). Every folder under tests/ with tests
    must be one pytest walks into."""
    import fnmatch

    skipped = pytestconfig.getini("norecursedirs")
    root = Path(__file__).resolve().parents[1]
    for folder in (root / "tests").rglob("*"):
        if folder.is_dir() and any(folder.glob("test_*.py")):
            assert not any(fnmatch.fnmatch(folder.name, p) for p in skipped), folder


MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_a_reader_can_hold():
    """Every function in the package (methods and nested functions too), docstring and
    signature included, is at most `MAX_FUNCTION_LINES` lines: a longer one is split into steps
    a reader can name, as `autofit.plan` and `run_trials` are."""
    long = sorted(
        (node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT.parent)}:{node.lineno}",
         node.name)
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    )  # fmt: skip
    assert not long, "\n".join(f"{where} {name}: {n} lines" for n, where, name in reversed(long))


def test_a_layout_is_resolved_in_one_module():
    """`autofit.layout` alone makes a `Layout` (`Layout(...)`, `Layout.of(...)`); every other
    module takes it from `layout_of`, so the builder, the trials, the exports and the estimator
    read one resolution of a config's layout instead of building their own from some of its
    knobs. Read from the code's syntax tree."""
    made = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "Layout") or (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and f.value.id == "Layout"
            ):
                made.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not made, "take the layout from layout_of:\n" + "\n".join(made)


def _knob_words() -> dict[str, tuple[str, ...]]:
    """Each knob's and word setting's words (`train_embeddings`' too, whose third form is
    `tokens:N`)."""
    from autofit.config import DECLARED
    from autofit.settings import WORD_SETTINGS
    from autofit.values import TrainEmbeddings, values

    words = {
        n: d.choices for n, d in DECLARED.items() if d.choices and isinstance(d.choices[0], str)
    }
    words.update({n: values(w.enum) for n, w in WORD_SETTINGS.items()})
    words["train_embeddings"] = values(TrainEmbeddings)
    return words


def _outside_the_declarations() -> list[Path]:
    """Every module of `autofit/` but the two that declare the words (`values`, `config`)."""
    return [p for p in sorted(ROOT.rglob("*.py"))
            if not (p.parent == ROOT and p.name in ("values.py", "config.py"))]  # fmt: skip


def test_no_module_compares_a_knob_with_its_word():
    """A knob's or a word setting's values are compared as `autofit.values` members
    (`cfg.offload == Offload.PARAMS`), never as the words (`== "params"`): the words live in
    their declaration only, so renaming or adding one is one edit and `grep` finds every reader.
    Read from the code: any `<...>knob ==/!=/in "word"` where the word is one of that knob's."""
    import re

    words = _knob_words()
    names = "|".join(sorted(words, key=len, reverse=True))
    lhs = rf'(?:\b(?P<a>{names})\b|\[\s*"(?P<b>{names})"\s*\]|\.get\(\s*"(?P<c>{names})"[^)]*\))'
    compare = re.compile(lhs + r'\s*(?:==|!=|(?:not\s+)?in)\s*[(\[{]?\s*"(?P<w>[^"]+)"')
    found = []
    for path in _outside_the_declarations():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in compare.finditer(line):
                knob = m.group("a") or m.group("b") or m.group("c")
                if m.group("w") in words[knob]:
                    found.append(f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}")
    assert not found, "compare with autofit.values members:\n" + "\n".join(found)


def test_no_module_writes_a_knob_word_as_a_value():
    """Nor is a knob's word written as a value it is given: a keyword (`cfg.replace(loss=
    "standard")`), a parameter's or a field's default (`offload: str = "none"`) or a mapping's
    entry (`{"wrap": "layer"}`) names an `autofit.values` member. Read from the code's syntax
    tree."""
    words = _knob_words()

    def word_of(name: object, value: ast.AST | None) -> bool:
        if isinstance(value, ast.IfExp):  # `"bf16-mixed" if autocast else "bf16"`
            return word_of(name, value.body) or word_of(name, value.orelse)
        return (
            isinstance(value, ast.Constant)
            and isinstance(name, str)
            and value.value in words.get(name, ())
        )

    found = []
    for path in _outside_the_declarations():
        for node in ast.walk(ast.parse(path.read_text())):
            pairs: list[tuple[object, ast.AST | None]] = []
            if isinstance(node, ast.keyword):
                pairs = [(node.arg, node.value)]
            elif isinstance(node, ast.Dict):
                pairs = [(k.value, v) for k, v in zip(node.keys, node.values, strict=True)
                         if isinstance(k, ast.Constant)]  # fmt: skip
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                pairs = [(node.target.id, node.value)]  # a field's default
            elif isinstance(node, ast.arguments):
                named = [*node.posonlyargs, *node.args][::-1]  # the last ones have defaults
                pairs = [(a.arg, d) for a, d in zip(named, node.defaults[::-1], strict=False)]
                kw = zip(node.kwonlyargs, node.kw_defaults, strict=True)
                pairs += [(a.arg, d) for a, d in kw]
            for name, value in pairs:
                if word_of(name, value):
                    found.append(f"{path.relative_to(ROOT.parent)}:{value.lineno}: {name}=...")
    assert not found, "write autofit.values members:\n" + "\n".join(found)
