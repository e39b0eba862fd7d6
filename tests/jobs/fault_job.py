"""A small deterministic CPU training job with injectable faults, launched by torchrun in tests.

    torchrun --standalone --nproc_per_node=2 tests/jobs/fault_job.py OUT_DIR FAULT [key=value ...]

FAULT is ``none`` or ``KIND:RANK:STEP`` with KIND one of
  sigterm  - the rank sends itself SIGTERM before that step (preemption of one rank)
  sigkill  - the rank SIGKILLs itself before that step (a crash; torchrun may restart the job)
  raise    - the rank raises inside its loss function at that step (a bug / bad batch)
  sigstop  - the rank SIGSTOPs itself before that step (a frozen rank: the others' timeout names it)
  killsave - the rank SIGKILLs itself in the middle of writing the checkpoint of that step
  baddata  - the rank's DataLoader worker raises in __getitem__ (a corrupt file) once it has
             served about STEP batches (workers read ahead, so a step or two earlier)
A fault fires once per OUT_DIR (a marker file remembers it), so a restarted job runs clean. On
success rank 0 writes OUT_DIR/final.pt with the parameters.
"""

import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ddptrain
from ddptrain import weights

out_dir, fault = sys.argv[1], sys.argv[2]
kind, fault_rank, fault_step = (fault.split(":") + ["", "-1", "-1"])[:3] if fault != "none" else ("none", "-1", "-1")
fault_rank, fault_step = int(fault_rank), int(fault_step)
marker = os.path.join(out_dir, f"fault-fired-{kind}")

cfg = ddptrain.load_config(None, [f"trainer.output_dir={out_dir}", "trainer.max_steps=12", "optim.lr=0.05",
                                  "logging.progress_bar=false", "logging.log_every=1", "checkpoint.every_steps=2",
                                  "checkpoint.keep_last=2", "checkpoint.resume=auto", "dist.timeout_s=60",
                                  *sys.argv[3:]])
info = ddptrain.setup_distributed(cfg)


def should_fire(step: int) -> bool:
    return info.rank == fault_rank and step == fault_step and not os.path.exists(marker)


def fire() -> None:
    open(marker, "w").close()


class Frames(Dataset):
    served = 0  # items this (worker) process has produced

    def __len__(self):
        return 40

    def __getitem__(self, i):
        Frames.served += 1
        if kind == "baddata" and Frames.served > 4 * fault_step and should_fire(fault_step):
            fire()
            raise ValueError(f"injected corrupt item {i}")
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3 + i % 5, 4, generator=g)
        return {"x": x, "y": x.sum(-1), "id": f"utt{i:03d}"}


def collate(items):
    t = max(it["x"].shape[0] for it in items)
    x = torch.zeros(len(items), t, 4)
    y = torch.zeros(len(items), t)
    lens = torch.tensor([it["x"].shape[0] for it in items])
    for i, it in enumerate(items):
        x[i, : lens[i]], y[i, : lens[i]] = it["x"], it["y"]
    return {"x": x, "y": y, "lens": lens, "ids": [it["id"] for it in items]}


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
data = Frames()
loader = DataLoader(data, batch_size=4, collate_fn=collate, num_workers=1,
                    sampler=DistributedSampler(data, info.world_size, info.rank, seed=1))
trainer = None


def loss_fn(model, batch):
    step = trainer.step + 1
    if kind == "sigstop" and should_fire(step):
        fire()
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind in ("sigterm", "sigkill", "raise") and should_fire(step):
        fire()
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "raise":
            raise ValueError("injected failure")
    pred = model(batch["x"]).squeeze(-1)
    mask = torch.arange(batch["x"].shape[1])[None] < batch["lens"][:, None]
    return (((pred - batch["y"]) ** 2) * mask).sum(), mask.sum()


if kind == "killsave":
    real_save = weights.save_weights

    def dying_save(m, path, *args, **kwargs):
        real_save(m, path, *args, **kwargs)
        if should_fire(trainer.step):
            fire()
            os.kill(os.getpid(), signal.SIGKILL)  # the folder is half written: no marker, still .tmp-

    weights.save_weights = dying_save

trainer = ddptrain.Trainer(model, loss_fn, cfg, loader)
trainer.fit()
if info.rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, "final.pt"))
