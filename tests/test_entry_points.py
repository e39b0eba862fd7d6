"""Every ``python -m ddptrain.X`` tool is also a console command (setup.py ``console_scripts``):
one entry point per module with a ``__main__`` block, each naming a ``main(argv=None)`` that exists.

Read from setup.py's source (nothing is installed here), so a tool added without its command, a
renamed ``main`` or a command pointing at a removed module fails here rather than at
``pip install``."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def console_scripts() -> dict[str, str]:
    """``{command: "module:function"}`` of setup.py's ``entry_points``."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    entry_points = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    return dict(tuple(x.strip() for x in line.split("=")) for line in entry_points["console_scripts"])


def modules_with_main_blocks() -> set[str]:
    out = set()
    for path in (ROOT / "ddptrain").rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
            out.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return out


def test_every_python_m_tool_has_a_command_and_no_command_lacks_a_tool():
    targets = console_scripts()
    assert all(name.startswith("ddptrain-") for name in targets), sorted(targets)
    modules = {t.split(":")[0] for t in targets.values()}
    assert modules == modules_with_main_blocks(), "a python -m tool without a console command (or the reverse)"
    assert {"ddptrain-tune", "ddptrain-memory", "ddptrain-validate", "ddptrain-weights"} <= set(targets)


@pytest.mark.parametrize("command", sorted(console_scripts()))
def test_each_command_target_is_importable_and_callable(command, capsys):
    module, function = console_scripts()[command].split(":")
    main = getattr(importlib.import_module(module), function)
    assert callable(main)
    with pytest.raises(SystemExit) as e:  # its argv: --help prints the usage and exits 0
        main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out
