"""Measure this GPU's two ceilings: dense bf16 matmul rate and device-to-device copy bandwidth, on
random data, timed with CUDA events (median of repeats). Prints one ``CALIB`` JSON line;
``gpu_session.py`` runs it before a plan, so MFU can be read against what this GPU really reaches."""

import json
import statistics

import torch


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main():
    n = 8192
    x, y = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    t = timed(lambda: x @ y)
    src = torch.randn(2**30 // 2, device="cuda")  # 2 GiB fp32
    dst = torch.empty_like(src)
    tc = timed(lambda: dst.copy_(src), reps=10)
    print("CALIB " + json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "bf16_matmul_tflops": 2 * n**3 / t / 1e12,
                                 "d2d_copy_gbps": 2 * src.numel() * 4 / tc / 1e9}), flush=True)


if __name__ == "__main__":
    main()
