"""Run a function in N local processes (gloo, CPU) with a hard timeout.

Why not plain ``mp.spawn``: its ``join()`` waits forever if one rank hangs in a collective. Here
a hang becomes a test failure after ``timeout`` seconds, and a failure on one rank terminates
every rank at once (``ProcessContext.join`` does that when a process dies with an error).

Ranks start from a fork server that imported torch and ddptrain once per test session: a
spawned rank imported them itself, ~5 s of CPU each, which two ranks on a 2-core machine paid
at every job of the suite's ~70 (a 2-rank job: ~15 s to start on a busy machine, ~1 s forked).
Each rank still gets a fresh process with the test process's environment of the moment.
"""

from __future__ import annotations

import os
import socket
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_method() -> str:
    """forkserver with torch and ddptrain preloaded where there is one (Linux, macOS), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(["torch", "torch.distributed", "ddptrain", "ddptrain.trainer"])  # before the server starts
    return "forkserver"


def _entry(rank: int, fn, world_size: int, port: int, args: tuple, env: dict) -> None:
    os.environ.clear()  # the server's environment is the one it started with: take the test's now
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)
    import gc
    import sys

    import torch.distributed as dist

    fn(rank, world_size, *args)  # an exception propagates: spawn reports it and ends the other ranks
    # Clean exit. gloo's teardown can abort ("terminate called without an active exception") when
    # one rank destroys its process group while a peer's DDP reducer or pending work still holds
    # it: drop the objects, agree with a barrier, destroy, then leave without interpreter teardown.
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 90.0) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes; raise on error or timeout.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    """
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args, dict(os.environ)), nprocs=world_size,
                             join=False, start_method=_start_method())
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world_size}-rank job did not finish within {timeout}s (hang?)")
