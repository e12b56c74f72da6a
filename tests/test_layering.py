"""The layers, read from the code: every import (module level and inside functions, ``import x``,
``from x import y``, relative imports, ``importlib.import_module("x")``) points down

    train → eval → envs, policies → learn2draft

— the engine (``learn2draft``) imports nothing from policies / envs / train / eval, nor wandb,
gymnasium or stable-baselines3; ``policies`` imports no envs / train / eval; ``envs`` no train / eval;
``eval`` no train — and no two files of the project import each other, directly or in a longer circle.

:data:`PENDING` lists the violations that other branches of the redesign (issue 15) are removing;
each must still occur, so the list cannot go stale, and it is emptied once they are merged.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("learn2draft", "policies", "envs", "eval", "train")

#: Top-level modules each layer must not import.
FORBIDDEN = {
    "learn2draft": frozenset({"policies", "envs", "train", "eval", "wandb", "gymnasium", "stable_baselines3"}),
    "policies": frozenset({"envs", "train", "eval"}),
    "envs": frozenset({"policies", "train", "eval"}),  # siblings: both stand on the engine alone
    "eval": frozenset({"train"}),
    "train": frozenset(),
}

#: Known violations, each still checked to occur (importer file, imported module) or circle (frozenset of files):
#: none since the redesign of issue 15 landed; keep it empty.
PENDING: set = set()


# ----------------------------------------------------------------------------- reading imports
def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_file(module: str) -> str | None:
    """The file (relative to the repository, POSIX) that defines ``module``, if it is one of ours."""
    base = ROOT.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if module.split(".")[0] in PACKAGES and f.is_file():
            return f.relative_to(ROOT).as_posix()
    return None


def _is_import_call(node: ast.Call) -> bool:
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in ("import_module", "__import__")


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """Every module ``source`` (the text of module ``module``) imports, anywhere in the file, with its
    line: ``import a.b`` → ``a.b``; ``from a import b`` → ``a.b`` when that is one of the project's
    modules, else ``a``; relative imports resolved against ``module``'s package; a literal
    ``importlib.import_module("a.b")`` / ``__import__("a.b")`` → ``a.b``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]  # [] beyond the top
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub if _project_file(sub) else base, node.lineno))
        elif (isinstance(node, ast.Call) and _is_import_call(node) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.args[0].value, node.lineno))
    return found


@functools.cache
def _project_imports() -> dict[str, list[tuple[str, int]]]:
    """File (relative, POSIX) → the modules it imports, for every .py file of the five packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            out[rel] = imports_of(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")
    return out


def layer_violations(imports: dict[str, list[tuple[str, int]]]) -> dict[tuple[str, str], list[int]]:
    """(importer file, imported module) → lines, for every import that points up or sideways."""
    bad: dict[tuple[str, str], list[int]] = {}
    for rel, mods in imports.items():
        forbidden = FORBIDDEN[rel.split("/")[0]]
        for mod, line in mods:
            if mod.split(".")[0] in forbidden:
                bad.setdefault((rel, mod), []).append(line)
    return bad


def import_cycles(imports: dict[str, list[tuple[str, int]]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one file of the file-level import graph."""
    graph = {rel: sorted({f for m, _ in mods if (f := _project_file(m)) and f != rel}) for rel, mods in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred files, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


# ----------------------------------------------------------------------------- tests
def test_the_import_reader_sees_function_level_relative_and_dynamic_imports():
    src = (
        "import os\n"
        "def f():\n"
        "    from train.training import run\n"
        "    import importlib\n"
        "    return importlib.import_module('eval.runner'), __import__('wandb')\n"
        "class C:\n"
        "    def g(self):\n"
        "        from . import model, nothing_here\n"
        "        from ..envs import tree\n"
    )
    got = {m for m, _ in imports_of(src, "learn2draft.drafters.base")}
    assert {"os", "train.training", "importlib", "eval.runner", "wandb", "learn2draft.drafters.model",
            "learn2draft.drafters"} <= got  # ``nothing_here`` is a name of the package, not a module
    assert "learn2draft.envs" in got  # ``..envs`` from learn2draft.drafters resolves inside learn2draft
    assert "learn2draft.sampling" in {m for m, _ in imports_of("from . import sampling\n", "learn2draft.tree")}
    bad = layer_violations({"learn2draft/drafters/base.py": imports_of(src, "learn2draft.drafters.base")})
    assert {m for _, m in bad} == {"train.training", "eval.runner", "wandb"}


def test_the_cycle_finder_reports_circles_of_any_length():
    imports = {"a/x.py": [("learn2draft.models", 1)], "learn2draft/models.py": [("learn2draft.tree", 1)],
               "learn2draft/tree.py": [("learn2draft.models", 3)], "learn2draft/names.py": []}
    assert import_cycles(imports) == [frozenset({"learn2draft/models.py", "learn2draft/tree.py"})]
    three = {"learn2draft/models.py": [("learn2draft.tree", 1)], "learn2draft/tree.py": [("learn2draft.names", 1)],
             "learn2draft/names.py": [("learn2draft.models", 1)]}
    assert import_cycles(three) == [frozenset(three)]


def test_every_import_points_down_the_layers():
    bad = layer_violations(_project_imports())
    pending = {e for e in PENDING if isinstance(e, tuple)}
    stale = sorted(pending - set(bad))
    assert not stale, f"PENDING lists imports that no longer occur (remove them from PENDING): {stale}"
    new = {k: v for k, v in bad.items() if k not in pending}
    assert not new, "imports that point up the layers (train → eval → envs, policies → learn2draft):\n" + "\n".join(
        f"  {f}:{','.join(map(str, lines))} imports {m}" for (f, m), lines in sorted(new.items()))


def test_no_two_files_import_each_other():
    cycles = import_cycles(_project_imports())
    pending = {e for e in PENDING if isinstance(e, frozenset)}
    stale = [sorted(c) for c in pending if c not in cycles]
    assert not stale, f"PENDING lists import circles that no longer occur (remove them from PENDING): {stale}"
    new = [sorted(c) for c in cycles if c not in pending]
    assert not new, "files that import each other, directly or in a circle: " + "; ".join(" ↔ ".join(c) for c in new)


def test_importing_every_engine_module_loads_no_rl_code():
    """Import each module of the learn2draft package in a fresh interpreter: none of the layers above,
    nor wandb / gymnasium / stable-baselines3, may end up in sys.modules."""
    forbidden = sorted(FORBIDDEN["learn2draft"])
    code = (
        "import importlib, pkgutil, sys\n"
        "import learn2draft\n"
        "names = [m.name for m in pkgutil.walk_packages(learn2draft.__path__, 'learn2draft.')]\n"
        "for n in names:\n"
        "    importlib.import_module(n)\n"
        f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({forbidden!r}))\n"
        "print(len(names), bad)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    count, bad = r.stdout.strip().split(" ", 1)
    assert int(count) >= 15, r.stdout  # the walk really visited the engine's modules
    assert bad == "[]", f"importing the engine's modules loaded {bad}"


if __name__ == "__main__":  # print the current violations and circles
    sys.exit(pytest.main([__file__, "-q"]))
