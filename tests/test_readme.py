"""The README stays true: its config reference is the one the code generates, and its two
commands exist in the Makefile and in CI."""

import os
import re

from ddptrain.config import reference_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_config_reference_is_current():
    readme = read("README.md")
    m = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", readme, re.S)
    assert m, "README lost its config reference markers"
    assert m.group(1) == reference_markdown(), "README config reference is stale: run `python -m ddptrain.config`"


def test_readme_commands_exist():
    readme, makefile, ci = read("README.md"), read("Makefile"), read(".ci/run")
    for target in ("demo", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M)
    assert re.search(r"^make test$", ci, re.M)
