"""Every ``python -m ddptrain.X`` tool is also a console command (setup.py ``console_scripts``):
one entry point per module with a ``__main__`` block, each naming a ``main(argv=None)`` that exists.

Read from setup.py's source (nothing is installed here), so a tool added without its command, a
renamed ``main`` or a command pointing at a removed module fails here rather than at
``pip install``."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

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


def test_the_dev_extra_holds_what_the_hf_trainer_needs_to_run():
    """issue 49 item 14: ``pip install -e '.[dev]'`` could not run the HF Trainer the HF peers and
    parity checks use: transformers 5.x refuses to build a Trainer without ``accelerate``."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    names = {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower() for r in extras["dev"]}
    assert {"transformers", "accelerate", "pytest", "pytest-timeout"} <= names, sorted(names)


@pytest.mark.parametrize("how", ["console", "module"])
def test_the_usage_line_names_the_command_as_it_was_run(how, capsys, monkeypatch):
    """issue 49 item 15: 7 of 8 ``ddptrain-* --help`` usage lines said ``python -m ...``."""
    for command, target in sorted(console_scripts().items()):
        module = target.split(":")[0]
        argv0 = f"/venv/bin/{command}" if how == "console" else f"/src/{module.replace('.', '/')}.py"
        monkeypatch.setattr("sys.argv", [argv0, "--help"])
        with pytest.raises(SystemExit):
            getattr(importlib.import_module(module), "main")(["--help"])
        usage = capsys.readouterr().out.split("\n", 1)[0]
        want = command if how == "console" else f"python -m {module}"
        assert usage.startswith(f"usage: {want} ") or usage == f"usage: {want}", (command, usage)
