"""The package's imports run one way: no cycle among its modules, counting imports inside functions, and no module
importing one of a higher layer. A module's layer is its folder under tiered_ops/ (the modules at the top are the base
every layer reads; the package's __init__ and __main__ sit above all). Built from the source with ``ast``, so an
import hidden in a function body counts like any other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import builtin_ops

PKG = Path(__file__).resolve().parents[1] / "tiered_ops"

# The layers, lowest first: a module may import only its own layer or lower ones. "" is the package's top-level
# modules (envs, registry, buckets, ...); every other layer is the folder of that name.
LAYERS: tuple[str, ...] = ("", "ops", "tiers", "store", "measure", "decide", "runtime", "models", "sweep", "analysis",
                           "cli")
FACE = ("__init__", "__main__")  # the public functions and ``python -m tiered_ops``: above every layer
# Lower layers a layer must not import even so: the analysis reads stored results and never measures; the call path
# reads the decision table and asks the tuner on a miss, never measures or reads the store itself.
NEVER: dict[str, tuple[str, ...]] = {"analysis": ("measure", "sweep"), "runtime": ("measure", "store")}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _layer(mod: str) -> int | None:
    if mod in FACE:
        return len(LAYERS)
    parts = mod.split(".")
    if parts[0] in LAYERS:
        return LAYERS.index(parts[0])
    return 0 if len(parts) == 1 and (PKG / f"{mod}.py").is_file() else None


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its body)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        if mod == "__init__":
            here = []
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                    base = base + (node.module.split(".") if node.module else [])
                elif node.module and node.module.split(".")[0] == "tiered_ops":
                    base = node.module.split(".")[1:]
                else:
                    continue
                for a in node.names:
                    sub = ".".join(base + [a.name])
                    targets.append(sub if sub in mods else ".".join(base) or "__init__")
            elif isinstance(node, ast.Import):
                targets += [".".join(a.name.split(".")[1:]) or "__init__" for a in node.names
                            if a.name.split(".")[0] == "tiered_ops"]
            for t in targets:
                if t in mods and t != mod:
                    edges[mod].add(t)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    cycle = _cycle(_edges(_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer_and_imports_no_higher_one():
    mods = _modules()
    unplaced = sorted(m for m in mods if _layer(m) is None)
    assert not unplaced, f"modules in a folder that is no layer of tests/test_imports.py LAYERS: {unplaced}"
    upward = sorted(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})" for m, ts in _edges(mods).items()
                    for t in ts if _layer(t) > _layer(m))
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def test_the_analysis_and_the_call_path_never_import_the_layers_they_must_not():
    edges = _edges(_modules())
    found = sorted(f"{m} imports {t}" for m, ts in edges.items() for t in ts
                   if t.split(".")[0] in NEVER.get(m.split(".")[0], ()))
    assert not found, "\n".join(found)


def test_a_layer_is_a_folder_and_an_upward_import_fails(tmp_path, monkeypatch):
    """The checker itself: a module of a lower folder importing a higher folder's module is reported."""
    for folder in ("store", "decide"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "envs.py").write_text("")
    (tmp_path / "decide" / "policy.py").write_text("from .. import envs\nfrom ..store import db\n")
    (tmp_path / "store" / "db.py").write_text("def f():\n    from ..decide.policy import x\n    return x\n")
    monkeypatch.setattr(f"{__name__}.PKG", tmp_path)
    mods = _modules()
    assert [_layer(m) for m in ("envs", "store.db", "decide.policy")] == [0, 3, 5]
    up = [(m, t) for m, ts in _edges(mods).items() for t in ts if _layer(t) > _layer(m)]
    assert up == [("store.db", "decide.policy")]


def test_the_graph_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The checker itself: a lazy import inside a function closes a cycle it must report."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    monkeypatch.setattr(f"{__name__}.PKG", tmp_path)
    assert _cycle(_edges(_modules())) in (["a", "b", "a"], ["b", "a", "b"])


@pytest.mark.parametrize("words", [r"[Ii]ssue [0-9]", r"[Ss]ession [0-9]"])
def test_the_product_names_no_issue_or_session(words):
    import re

    root = PKG.parent
    files = [p for d in ("tiered_ops", "triton_src", "cuda_src") for p in (root / d).rglob("*")]
    hits = [f"{p.relative_to(root)}:{i}" for p in files
            if p.is_file() and p.suffix in (".py", ".cu", ".cuh", ".h", ".cpp")
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(words, line)]
    assert not hits, f"{words} in the product: {hits}"


def test_every_op_has_its_test_file_and_its_float64_truth():
    """Tests take their ops from the registry; what an op adds for them is its test file and its truth."""

    tests = Path(__file__).resolve().parent
    missing = [f"{s.name}: {f}" for s in builtin_ops() for f in (f"test_{s.name}.py", f"truths/{s.name}.py")
               if not (tests / f).is_file()]
    assert not missing, f"ops without their test data: {missing}"
