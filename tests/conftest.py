"""Shared test fixtures (kept small: each one says why it exists)."""

from __future__ import annotations

import gc
import os
import signal
import threading

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def frozen_import_heap():
    """One intra-op thread, and the heap that imports made (all test modules are imported before
    the first test) frozen out of the garbage collector's reach, for the whole run.

    Threads: as torchrun sets them (``OMP_NUM_THREADS=1``; the Trainer and every subprocess
    respect it): the tests' models are tiny, and on 2 shared cores a second OpenMP thread only
    spins at every parallel region. A test that checks the thread budget unsets it itself.

    The Trainer runs a full ``gc.collect()`` when its fit starts and at every epoch end,
    evaluation and save (StepPacedGC); with torch, transformers and torchaudio imported that
    walks ~340k objects (~0.3 s idle, 1.7 s on a busy 2-core machine), and a tiny test run of a
    few steps makes several: the collections were a large share of many tests' time.
    ``gc.freeze()`` moves what exists now out of the collector's reach; the same collections
    still run, over the objects the tests make. Undone at the end of the run.
    """
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        if "OMP_NUM_THREADS" not in os.environ:
            mp.setenv("OMP_NUM_THREADS", "1")
            torch.set_num_threads(1)
        gc.collect()
        gc.freeze()
        yield
        gc.unfreeze()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread_frozen_heap():
    """One intra-op thread, for modules that train tiny models (the heap: ``frozen_import_heap``).

    On CI's few shared cores, 2 OpenMP threads made a tiny GLM-ASR step ~8x slower than 1 (they
    spin at every parallel region); the Trainer respects ``OMP_NUM_THREADS``. Undone at the end
    of the module.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)


_MAIN_PID = os.getpid()


def _end_session(signum, frame):
    if os.getpid() != _MAIN_PID:  # a forked child (a DataLoader worker): the default, it just ends
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    pytest.exit(f"stopped by signal {signal.Signals(signum).name}", returncode=128 + signum)


def pytest_configure(config):
    """SIGTERM ends the whole run with its summary (``timeout 30m make test`` stops).

    A Trainer fitting inside a test takes SIGTERM over as a preemption (save, SystemExit), which
    pytest records as that test's failure before it goes on with the next: the run ignored
    ``timeout``. With a handler of its own here, the Trainer hands the signal back when its
    ``fit()`` ends (ddptrain/process.py), and the run stops there.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _end_session)
