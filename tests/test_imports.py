"""ddptrain's import graph: every module imports the others at top level, and the graph is acyclic;
the recipes' and benchmarks' graph (examples/, bench/) is acyclic too, their late imports counted.

Why: an import inside a function hides a cycle instead of breaking it (``checkpoint -> loading
-> checkpoint`` worked only while one side imported late), and a cycle makes the order of
imports matter: a module imported first from the other side finds its partner half-initialised.
The fix is to move the shared piece to the module it belongs to (weights.py above checkpoint.py,
preflight.py), not to import later.

Read from the source (ast), nothing is imported: an ``import`` inside a function or method is
function-level; one inside ``if TYPE_CHECKING:`` is never executed and is left out.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ddptrain"

# Function-level imports between ddptrain modules still allowed, as (importer, imported). Each
# must still exist (a stale entry fails, so the list only shrinks), and the cycle check below
# counts them as top-level edges: none of them may hide a cycle.
ALLOWED_LAZY: set[tuple[str, str]] = set()  # function-level imports between ddptrain modules: none


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _targets(module: str, node: ast.AST) -> list[str]:
    """The ddptrain modules an import statement loads (``from ddptrain import dist``: the
    module ddptrain.dist; ``from ddptrain import Trainer``: the package ddptrain)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package
            package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name not in MODULES and "." in name:  # import ddptrain.x.y where y is not a module
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != module and name not in out:
            out.append(name)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def module_imports(module: str, tree: ast.AST) -> tuple[set, list[tuple[str, int]]]:
    """``(top-level targets, [(function-level target, line)])`` of one module's syntax tree."""
    top: set = set()
    lazy: list[tuple[str, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(module, child)
                if in_function:
                    lazy.extend((t, child.lineno) for t in targets)
                else:
                    top.update(targets)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:  # the else branch runs
                    visit(other, in_function)
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return top, lazy


def import_graph() -> tuple[dict[str, set], dict[str, list[tuple[str, int]]]]:
    """``(top-level edges, function-level imports)`` of every ddptrain module."""
    top, lazy = {}, {}
    for module, path in MODULES.items():
        top[module], lazy[module] = module_imports(module, ast.parse(path.read_text(), str(path)))
    return top, lazy


def find_cycle(edges: dict[str, set]) -> list[str]:
    """One cycle of the graph (``[a, b, ..., a]``), or [] (depth-first search, colours)."""
    colour, stack = {m: 0 for m in edges}, []  # 0 new, 1 on the stack, 2 done

    def dfs(m: str) -> list[str]:
        colour[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if colour[n] == 1:
                return stack[stack.index(n):] + [n]
            if colour[n] == 0:
                found = dfs(n)
                if found:
                    return found
        stack.pop()
        colour[m] = 2
        return []

    for m in sorted(edges):
        if colour[m] == 0:
            found = dfs(m)
            if found:
                return found
    return []


def test_no_function_level_imports_between_ddptrain_modules():
    _, lazy = import_graph()
    found = {(m, t) for m, hits in lazy.items() for t, _ in hits}
    new = sorted(f"{MODULES[m].relative_to(ROOT)}:{line}: imports {t} inside a function" for m, hits in lazy.items()
                 for t, line in hits if (m, t) not in ALLOWED_LAZY)
    assert not new, ("function-level imports between ddptrain modules hide cycles; import at the top (moving a "
                     "shared piece to the module it belongs to if that makes a cycle):\n" + "\n".join(new))
    stale = sorted(ALLOWED_LAZY - found)
    assert not stale, f"ALLOWED_LAZY entries with no such import any more (remove them): {stale}"


def test_the_import_graph_is_acyclic():
    top, _ = import_graph()
    with_allowed = {m: top[m] | {t for a, t in ALLOWED_LAZY if a == m} for m in top}
    cycle = find_cycle(top)
    assert not cycle, "top-level import cycle: " + " -> ".join(cycle)
    cycle = find_cycle(with_allowed)
    assert not cycle, "an allowed function-level import would make a cycle at the top: " + " -> ".join(cycle)


def test_the_graph_check_finds_what_it_is_for():
    """The walker on a fixture: a function-level import is seen (in a method too), a
    TYPE_CHECKING one is left out, ``from ddptrain import name`` is the package; a cycle is found."""
    src = ("from typing import TYPE_CHECKING\nfrom ddptrain import dist, Trainer\nif TYPE_CHECKING:\n"
           "    from ddptrain.config import Config\n"
           "def f():\n    from ddptrain.checkpoint import load\n"
           "class C:\n    def g(self):\n        import ddptrain.lora.x\n")
    top, lazy = module_imports("ddptrain.resume", ast.parse(src))
    assert top == {"ddptrain.dist", "ddptrain"}
    assert lazy == [("ddptrain.checkpoint", 6), ("ddptrain.lora", 9)]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


# ------------------------------------------------------------------ examples/ and bench/

SCRIPT_DIRS = (ROOT / "examples", ROOT / "bench")  # on sys.path when their files run (sys.path.insert)


def _script_modules() -> dict[str, pathlib.Path]:
    """The importable names of the recipes, their models and the benchmarks (``finetune_tts``,
    ``models.glmasr``, ``bench_glmasr``, ``multi.glmasr``)."""
    out = {}
    for folder in SCRIPT_DIRS:
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            assert name not in out, f"{path} and {out.get(name)} are both importable as {name}"
            out[name] = path
    return out


def script_graph() -> dict[str, set]:
    """Every import between those files, function-level ones included: a recipe or benchmark may
    import a heavy optional dependency late, but an import between two of them inside a function
    still hides a cycle (finetune_tts -> prepare_tts -> finetune_tts did)."""
    modules = _script_modules()
    edges = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            found |= {n for n in names if n in modules and n != name}
        edges[name] = found
    return edges


def test_the_examples_and_bench_import_graph_is_acyclic_counting_late_imports():
    edges = script_graph()
    assert "finetune_tts" in edges["prepare_tts"] and "models.voxcpm_tts" in edges["finetune_tts"]
    assert "tts_cache" in edges["finetune_tts"] and "prepare_tts" not in edges["finetune_tts"]  # the cache, not the command
    assert {"finetune_glmasr", "models.glmasr"} <= edges["bench_glmasr"]  # late imports are edges too
    cycle = find_cycle(edges)
    assert not cycle, "import cycle among examples/ and bench/: " + " -> ".join(cycle)


def test_python_m_ddptrain_tune_runs_once():
    # the package no longer imports tune (the Trainer imports preflight), so runpy does not find
    # it imported already and run a second copy of it (its RuntimeWarning)
    run = subprocess.run([sys.executable, "-m", "ddptrain.tune", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "--recipe" in run.stdout, run.stderr[-2000:]
    assert "found in sys.modules" not in run.stderr


def test_public_api_is_unchanged():
    import ddptrain
    from ddptrain import checkpoint, lora, tune, weights

    for name in ddptrain.__all__:
        assert hasattr(ddptrain, name), name
    assert ddptrain.CheckpointError is checkpoint.CheckpointError
    for name in ("find_latest", "list_complete", "run_id_of", "COMPLETE"):
        assert hasattr(checkpoint, name), name
    for name in ("weights_file", "weights_info", "resolve_base", "export_merged"):
        assert hasattr(weights, name), name
    for name in ("load_weights", "save_weights", "empty_weights", "load_pretrained"):
        assert getattr(ddptrain, name) is getattr(weights, name), name
    # one home per name (issue 29 item 5): no module re-exports the weights functions
    for name in weights.__all__:
        assert not hasattr(checkpoint, name) and not hasattr(lora, name), name
    for gone in ("checkpoint_files.py", "loading.py"):
        assert not (PACKAGE / gone).exists(), gone
    for name in tune.__all__:
        assert hasattr(tune, name), name
    for name in ("find_max_duration", "main", "load_recipe", "preflight", "before_fit", "PreflightError", "is_oom"):
        assert name in tune.__all__, name
