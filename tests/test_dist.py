"""Tests for ddptrain/dist.py helpers that need a process group (2 gloo ranks)."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from torch import nn

from _dist import run_ranks
from ddptrain import dist


def _broadcast_worker(rank, world, out):
    dist.setup("gloo", 60.0, "cpu")
    torch.manual_seed(100 + rank)  # a different init on every rank
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3).to(torch.float64))
    model[1].running_mean.normal_()
    dist.broadcast_module(model)
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    dist.teardown()


@pytest.mark.timeout(120)
def test_broadcast_module_copies_rank0_params_and_buffers_of_every_dtype(tmp_path):
    run_ranks(_broadcast_worker, 2, str(tmp_path))
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    torch.manual_seed(100)
    want = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3).to(torch.float64))
    want[1].running_mean.normal_()
    for k, v in want.state_dict().items():
        assert torch.equal(a[k], v) and torch.equal(b[k], v), k


# ----------------------------------------------------------------------------- a rank that stops answering (issue 49 item 9)


def _stopping_worker(rank, world, out, how):
    """Rank 1 stops answering in its third step's loss_fn: frozen (SIGSTOP), or alive and busy
    (a sleep past the timeout). Rank 0 waits in the step's all-reduce until dist.timeout_s."""
    import signal
    import time

    import ddptrain
    from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches

    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    # what this rank prints to stderr, for the test (ranks start from a fork server: not the test's fds)
    sys.stderr = open(os.path.join(out, f"stderr{rank}.txt"), "w", buffering=1)
    holder = {}

    def loss(model, batch):
        if rank == 1 and holder["trainer"].step == 2:
            if how == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(60)
        return frame_loss(model, batch)

    torch.manual_seed(0)
    cfg = make_cfg(os.path.join(out, "run"), "trainer.max_steps=4", "dist.timeout_s=6", "checkpoint.save_at_end=false")
    holder["trainer"] = trainer = ddptrain.Trainer(FrameMLP(), loss, cfg, [mb[rank] for mb in micro_batches(4)])
    try:
        trainer.fit()
    except Exception as e:
        if rank == 0:
            with open(os.path.join(out, "error.txt"), "w") as f:
                f.write(f"{type(e).__name__}: {e}")
            with open(os.path.join(out, "pid1")) as f:
                os.kill(int(f.read()), signal.SIGKILL)  # the stopped rank ends with the job, as torchrun ends it
            os._exit(0)
        raise


@pytest.mark.timeout(150)  # ~30 s on an idle machine: start-up, 2 steps, dist.timeout_s=6
@pytest.mark.parametrize("how", ["sigstop", "sleep"])
def test_a_collective_timeout_names_the_rank_that_stopped_answering(tmp_path, how):
    """The healthy rank's error says which rank stopped answering and where it was, not only its own
    batch: a frozen rank's heartbeat is stale; a busy one's is fresh and says where it is busy.
    Half-way to the timeout the waiting rank already warns (NCCL's watchdog ends a process
    without a Python exception: the warning is then what names the silent rank)."""
    with pytest.raises(Exception, match="SIGKILL|signal"):  # rank 1 killed by rank 0, once its error was written
        run_ranks(_stopping_worker, 2, str(tmp_path), how, timeout=120)
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith("PeerTimeoutError: rank 0: a collective did not complete within dist.timeout_s=6"), error
    assert re.search(r"rank 0: \d+ s ago, after step 2, in .*forward_backward", error), error  # waiting in step 3
    if how == "sigstop":
        assert re.search(r"rank 1 \(last heartbeat \d+ s ago, after step [0-2], .*\) stopped answering", error), error
        assert "rank 0 (last heartbeat" not in error, error  # the healthy rank is not blamed
        warned = (tmp_path / "stderr0.txt").read_text()
        assert re.search(r"WARNING: rank 0: no step for \d+ s, and rank 1 \(last heartbeat", warned), warned
    else:
        assert "every rank still answers" in error, error
        assert re.search(r"rank 1: \d+ s ago, after step 2, in loss \(test_dist.py:\d+\)", error), error


def test_only_a_collective_timeout_or_a_lost_peer_is_explained_by_heartbeats():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                        "6000ms for recv operation to complete")
    wrapped = RuntimeError("rank 0, step 3, micro-batch 0: RuntimeError: Got the following error ...")
    wrapped.__cause__ = gloo
    assert dist.lost_peer(gloo) and dist.lost_peer(wrapped)
    assert dist.lost_peer(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"))
    nccl = torch.distributed.DistBackendError("NCCL error: remote process exited or there was a network error")
    assert dist.lost_peer(nccl)
    for other in (RuntimeError("DataLoader worker (pid 5) timed out after 300 seconds"), ValueError("timeout_s < 1"),
                  RuntimeError("CUDA out of memory")):
        assert not dist.lost_peer(other)
        assert dist.peer_timeout(other) is None


class _FakeStore:
    """The few TCPStore calls the heartbeat makes, over a dict shared by its clones."""

    def __init__(self, data=None):
        self.data = {} if data is None else data

    def clone(self):
        return _FakeStore(self.data)

    def set_timeout(self, timeout):
        pass

    def set(self, key, value):
        self.data[key] = value.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_the_heartbeats_name_a_stale_rank_and_leave_other_errors_alone():
    import time

    store = _FakeStore()
    beat = dist.Heartbeat(store, 0, 4, timeout_s=6)
    try:
        store.set("heartbeat/1", f"7 {time.time() - 60:.3f} loss (train.py:12)")  # frozen for a minute
        store.set("heartbeat/2", f"8 {time.time():.3f} all_reduce (distributed_c10d.py:1)")  # waits, alive
        timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv")
        error = str(beat.explain(timeout))
        assert "rank 1 (last heartbeat 60 s ago, after step 7, in loss (train.py:12))" in error, error
        assert "rank 3 (no heartbeat at all)" in error and "rank 2 (" not in error, error
        assert "stopped answering" in error and "rank 0: 0 s ago, outside fit()" in error, error
        store.set("heartbeat/1", f"7 {time.time():.3f} loss (train.py:12)")
        store.set("heartbeat/3", f"7 {time.time():.3f} loss (train.py:12)")
        assert "every rank still answers" in str(beat.explain(timeout))
        # a peer that crashed (its own error is the root cause) or an error of another kind: unchanged
        assert beat.explain(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")) is None
        assert beat.explain(ValueError("bad batch")) is None
    finally:
        beat.stop()
