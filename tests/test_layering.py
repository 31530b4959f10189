"""The floors of the house (ARCHITECTURE.md §6), checked over the source with `ast`: an upper floor may import a
lower one, never the reverse; no two rooms (package folders and top-level modules) import each other, directly or
round a longer circle; and no two files import each other. Imports inside functions and under TYPE_CHECKING
count: a loop hidden in a function body is still a loop. Nothing is imported, so the test takes a fraction of a
second.

A module `deepinfer.a.b` belongs to the folder `a`; the top-level modules (`api.py`, `embedded.py`, ...) are placed
on a floor by name below. `from X import y` is an edge to the module X.y when that is a module, else to X; the
package `__init__` that Python runs on the way to a submodule is not counted as an edge (every package that
re-exports its rooms would otherwise be a circle with each of them).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom. A name is a package folder of deepinfer/ or a top-level module (without .py).
FLOORS = [
    # entry points: the CLI, the Python API, DeepInfer-compatible entry points, HTTP serving
    {"deepinfer", "__main__", "cli", "api", "streaming", "sampling_params", "entrypoints", "serving"},
    {"frontend"},  # input and output processors, the sync and asyncio loops
    # the engine: clients (in-process, subprocess, data-parallel), EngineCore and its DP lockstep core, the core
    # process, scheduler, cache manager, model runner
    {"engine"},
    {"pipeline"},  # settings -> StepProgram: loads the model and the sampler for the engine
    {"embedded"},  # builds the embedded checkpoints from the model's own tables (pipeline.build materializes them)
    {"models"},  # the model, its cache types, loading, synthetic models and the tiny architecture they share
    {"distributed"},  # process groups, placement, EPLB, expert- and context-parallel math
    # sampling, config, and the plain output types (outputs.py imports nothing of ours)
    {"sampling", "config", "outputs", "assets"},
    {"kernels"},
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}

# Known violations (none left): each entry must still exist (a fixed one fails the test until it is deleted
# here), so the lists can only shrink.
ALLOWED_UPWARD: set[tuple[str, str]] = set()
ALLOWED_FILE_CYCLES: set[frozenset[str]] = set()


def _sources() -> dict[str, Path]:
    """module name -> file, for deepinfer/ and the kernels (top-level kernels/, importable as deepinfer.kernels)."""
    found = {}
    for base, prefix in ((ROOT / "deepinfer", ("deepinfer",)), (ROOT / "kernels", ("deepinfer", "kernels"))):
        for f in base.rglob("*.py"):
            parts = f.relative_to(base).with_suffix("").parts
            if parts[0] in ("kernels", "conf", "recipes") and base.name == "deepinfer":
                continue  # deepinfer/kernels, conf, recipes: links to the top-level folders (package data)
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join(prefix + parts)] = f
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The deepinfer modules `name` imports anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        else:
            continue
        for t in targets:
            while t not in modules and "." in t:
                t = t.rpartition(".")[0]
            if t in modules and t != name:
                out.add(t)
    return out


def _room(module: str) -> str:
    """The folder (or top-level module) a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _sources()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def test_every_room_has_a_floor(graph):
    unplaced = sorted({_room(m) for m in graph} - set(FLOOR))
    assert not unplaced, f"place these in FLOORS (tests/test_layering.py, ARCHITECTURE.md §6): {unplaced}"


def test_no_import_goes_up_a_floor(graph):
    upward = {(a, b) for a, targets in graph.items() for b in targets
              if FLOOR.get(_room(b), -1) < FLOOR.get(_room(a), -1)}
    new = sorted(upward - ALLOWED_UPWARD)
    assert not new, "imports from a lower floor into a higher one:\n" + "\n".join(
        f"  {a} ({_room(a)}) imports {b} ({_room(b)})" for a, b in new)
    assert not ALLOWED_UPWARD - upward, f"fixed: remove from ALLOWED_UPWARD: {sorted(ALLOWED_UPWARD - upward)}"


def test_no_two_rooms_import_each_other(graph):
    """Rooms are the package folders and the top-level modules: rooms on one floor may import each other one way
    only (embedded.py once imported models/ and was imported back)."""
    rooms = defaultdict(set)
    for a, targets in graph.items():
        rooms[_room(a)] |= {_room(b) for b in targets if _room(b) != _room(a)}
    loops = _cycles(dict(rooms))
    assert not loops, "rooms that import each other (directly or round a circle): " + "; ".join(
        " <-> ".join(sorted(c)) for c in loops)


def test_no_two_files_import_each_other(graph):
    cycles = set(_cycles(graph))
    new = cycles - ALLOWED_FILE_CYCLES
    assert not new, "import circles between files:\n" + "\n".join(f"  {sorted(c)}" for c in new)
    fixed = ALLOWED_FILE_CYCLES - cycles
    assert not fixed, f"fixed: remove from ALLOWED_FILE_CYCLES: {[sorted(c) for c in fixed]}"


def test_the_checker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The checker itself: an import inside a function body and a relative import are edges like any other."""
    pkg = tmp_path / "deepinfer" / "models"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from deepinfer.engine import core\n")
    (pkg / "b.py").write_text("from .a import f\nfrom . import c\n")
    (pkg / "c.py").write_text("X = 1\n")
    modules = {"deepinfer.models": pkg / "__init__.py", "deepinfer.models.a": pkg / "a.py",
               "deepinfer.models.b": pkg / "b.py", "deepinfer.models.c": pkg / "c.py",
               "deepinfer.engine.core": tmp_path / "core.py"}
    assert _imports("deepinfer.models.a", pkg / "a.py", modules) == {"deepinfer.engine.core"}
    assert _imports("deepinfer.models.b", pkg / "b.py", modules) == {"deepinfer.models.a", "deepinfer.models.c"}
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [frozenset({"x", "y", "z"})]
