"""Regenerate the generated parts of docs/: the config reference and the module layout.

``python docs/generate.py`` rewrites the text between the markers of docs/config.md (from
``ddptrain.config.reference_markdown()``) and docs/layout.md (from the first sentence of each
ddptrain module's docstring); tests/test_readme.py checks both are current.
"""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ddptrain")


def module_paths():
    """Every module of the ddptrain package, as paths relative to the repository root, sorted."""
    paths = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        paths += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(paths, key=lambda p: (p.count(os.sep), p))


def summary(path):
    """The first sentence of a module's docstring, on one line (read without importing it).

    Raises:
        ValueError: the module has no docstring (every module must say what it is for).
    """
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    if not doc:
        raise ValueError(f"{path} has no module docstring: give it one line saying what it is for")
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?)\.(\s|$)", paragraph)  # the first sentence: a period, then a space or the end
    return (m.group(1) if m else paragraph).replace("|", "\\|")


def layout_markdown():
    """A Markdown table of every ddptrain module and the first sentence of its docstring."""
    rows = ["| module | what it is |", "| --- | --- |"]
    rows += [f"| `{p}` | {summary(p)} |" for p in module_paths()]
    return "\n".join(rows)


def config_markdown():
    """The config reference table (every key, default, accepted values, meaning)."""
    from ddptrain.config import reference_markdown

    return reference_markdown()


GENERATED = {  # file under docs/ -> (marker name, generator)
    "config.md": ("config-reference", config_markdown),
    "layout.md": ("layout", layout_markdown),
}


def section(text, marker):
    """The text between ``<!-- marker:start -->`` and ``<!-- marker:end -->``, or None."""
    m = re.search(rf"<!-- {marker}:start -->\n(.*?)\n?<!-- {marker}:end -->", text, re.S)
    return m.group(1) if m else None


def main():
    for name, (marker, make) in GENERATED.items():
        path = os.path.join(ROOT, "docs", name)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if section(text, marker) is None:
            raise SystemExit(f"{path} lost its <!-- {marker}:start/end --> markers")
        new = re.sub(rf"(<!-- {marker}:start -->\n).*?\n?(<!-- {marker}:end -->)",
                     lambda m: m.group(1) + make() + "\n" + m.group(2), text, count=1, flags=re.S)
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
