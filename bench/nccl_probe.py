"""All-reduce bandwidth between the GPUs of one host (what DDP's gradient sync can get).

    torchrun --nproc_per_node=2 bench/nccl_probe.py            # NCCL_DEBUG=INFO shows the transport

Prints, per message size, the time of one bf16 all-reduce and the "bus bandwidth" in NCCL's
convention (2 (n-1)/n x bytes / time), so it can be compared with the link's rating.
"""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    for mb in (1, 25, 100, 400, 1600):
        x = torch.ones(mb * (1 << 20) // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        reps = 10
        t = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / reps
        if rank == 0:
            busbw = 2 * (n - 1) / n * x.numel() * 2 / dt / 1e9
            print(f"NCCLPROBE {mb:5d} MB bf16 all-reduce: {dt * 1e3:8.3f} ms, bus bandwidth {busbw:7.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
