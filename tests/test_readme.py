"""The README and docs/ stay true: docs/config.md is the config reference the code generates,
docs/layout.md lists every ddptrain module with its docstring's first sentence, the README
links both and its two commands exist in the Makefile and in CI."""

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def generate():
    spec = importlib.util.spec_from_file_location("docs_generate", os.path.join(ROOT, "docs", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_current():
    from ddptrain.config import reference_markdown

    current = generate().section(read("docs/config.md"), "config-reference")
    assert current is not None, "docs/config.md lost its config reference markers"
    assert current == reference_markdown(), "docs/config.md is stale: run `python docs/generate.py`"


def test_layout_lists_every_module():
    gen = generate()
    layout = gen.section(read("docs/layout.md"), "layout")
    assert layout is not None, "docs/layout.md lost its layout markers"
    listed = set(re.findall(r"^\| `([^`]+\.py)` \|", layout, re.M))
    modules = set(gen.module_paths())
    assert "ddptrain/trainer.py" in modules and "ddptrain/data/sampler.py" in modules
    assert not modules - listed, f"docs/layout.md misses {sorted(modules - listed)}: run `python docs/generate.py`"
    assert not listed - modules, f"docs/layout.md lists removed modules {sorted(listed - modules)}"
    assert layout == gen.layout_markdown(), "docs/layout.md is stale: run `python docs/generate.py`"


def test_layout_summary_is_the_docstrings_first_sentence():
    gen = generate()
    assert gen.summary("ddptrain/trainer.py") == "The Trainer: one DDP training loop you can read top to bottom"
    assert gen.summary("ddptrain/data/sampler.py").startswith("DurationBucketSampler: batches by a budget")


def test_readme_links_the_docs():
    readme = read("README.md")
    for doc in ("docs/config.md", "docs/layout.md", "docs/design.md", "BENCHMARKS.md"):
        assert f"]({doc}" in readme, f"README does not link {doc}"
        assert os.path.exists(os.path.join(ROOT, doc))
    assert len(readme.splitlines()) <= 250, "README is a newcomer's path: 250 lines at most"


def test_benchmarks_is_one_current_table_per_question():
    benchmarks = read("BENCHMARKS.md")
    assert len(benchmarks.splitlines()) <= 400, "BENCHMARKS.md: 400 lines at most (the journal: bench/NOTES.md)"
    for heading in ("## (a) Against peers on one GPU", "## (b) Scaling", "## (c) Memory and ZeRO", "## (d) Recompute",
                    "## (e) Data pipeline", "### On a 24 GB card: GLM-ASR-Nano-2512", "### On a 24 GB card: a 9B LoRA"):
        assert heading in benchmarks, f"BENCHMARKS.md lost its section {heading!r}"


def slug(heading):
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_lead_to_headings_that_exist():
    readme = read("README.md")
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", readme):
        target = target or "README.md"
        headings = {slug(line.lstrip("#")) for line in read(target).splitlines() if line.startswith("#")}
        assert anchor in headings, f"README links {target}#{anchor}, a heading {target} does not have"


def test_modules_cite_the_design_in_the_repo():
    for folder, _, files in os.walk(os.path.join(ROOT, "ddptrain")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    text = f.read()
                assert "DESIGN.md" not in text, f"{name} cites a DESIGN.md not in the repo: docs/design.md"


def test_readme_commands_exist():
    readme, makefile, ci = read("README.md"), read("Makefile"), read(".ci/run")
    for target in ("demo", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M)
    assert re.search(r"^make test$", ci, re.M)


def test_make_test_shows_progress_and_the_slowest_tests():
    """issue 49 item 15: `make test` printed only dots for tens of minutes, with no duration."""
    import subprocess

    out = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    pytest_line = next(line for line in out.splitlines() if " -m pytest " in line)
    assert re.search(r"(^| )(-v|--verbose|-rA)( |$)", pytest_line) and "--durations=" in pytest_line, pytest_line
    assert re.search(r"timed in CI|about \d+ min", read("README.md").split("make test", 1)[1][:400])
