"""tests/gpu: the on-GPU checks of bench/check_*.py as tests, skipped where there is no CUDA GPU.

Run on a GPU machine: ``python -m pytest tests/gpu`` (about 10 minutes on one H100). The scripts
stay in bench/ (bench/gpu_session.py and bench/NOTES.md call them); these tests run each at a
size that still shows what it checks and assert its verdict, so a GPU session gives pass/fail
instead of rows to read. The CPU paths of the same features are tested by the main suite.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu: the on-GPU checks of bench/check_*.py)")
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
