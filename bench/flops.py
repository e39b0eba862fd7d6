"""The benchmarks' FLOP model: the recipes' own (examples/models/train_flops.py), and the peak.

MFU = model FLOPs / (time x GPUs x ``PEAK_BF16``), with the FLOPs of the *padded* batch actually
computed and recomputation not counted. ``bench/check_flops.py`` checks the formulas against
torch's FlopCounterMode on small models.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ddptrain.throughput import dense_peak_tflops  # noqa: E402
from models.train_flops import Flops, GlmAsrFlops, VoxCpmFlops  # noqa: E402,F401

PEAK_BF16 = dense_peak_tflops("NVIDIA H200") * 1e12  # the GPU the rows were measured on (H100/H200 SXM)
