"""``import ddptrain`` leaves torch._dynamo unimported (~2 s of a ~4.5 s import): recompute's
``torch.compiler.disable`` is applied at the first call, and still keeps compiled code out of the region."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

from ddptrain.recompute import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_ddptrain_does_not_import_dynamo():
    code = "import sys, ddptrain; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_import_ddptrain_loads_no_heavy_optional_module():
    """What ``import ddptrain`` adds to ``import torch`` stays small (README's costs table: ~0.05 s
    of ~1.5 s): audio, logging and model libraries load where a recipe or tool uses them."""
    heavy = ("torchaudio", "soundfile", "tensorboard", "torch.utils.tensorboard", "transformers", "sympy", "triton",
             "torch._dynamo", "torch._inductor", "torch.distributed.checkpoint", "matplotlib")
    code = f"import sys, ddptrain; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_first_checkpoint_call_under_compile_runs_the_region_eagerly():
    lin = nn.Linear(4, 4)
    compiling = []

    def region(x):
        compiling.append(torch.compiler.is_compiling())  # False in forward and in its recomputation
        return lin(x).tanh()

    x = torch.randn(3, 4, requires_grad=True)
    torch.compile(lambda a: checkpoint(region, a * 2).sum() * 3, backend="eager")(x).backward()
    want = torch.autograd.grad((lin(x.detach() * 2).tanh().sum() * 3), lin.weight)[0]
    assert compiling == [False, False]
    torch.testing.assert_close(lin.weight.grad, want)
    assert checkpoint.__name__ == "checkpoint" and "recompute the rest" in checkpoint.__doc__
