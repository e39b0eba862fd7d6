"""The model-state memory estimator (ddptrain/memory.py): the formula, the model path against
real optimizer state (plain and ZeRO on 2 gloo ranks), and the CLI table."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import ddptrain
from _dist import run_ranks
from ddptrain.memory import estimate_model_state, main


def _cfg(*overrides):
    return ddptrain.load_config(None, list(overrides))


def _state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)  # the 0-d step counters are not state memory


class Net(nn.Module):
    """Tied embedding/output weights, a frozen front end, norms and biases (two param groups)."""

    def __init__(self):
        super().__init__()
        self.front = nn.Linear(7, 16)
        self.front.requires_grad_(False)
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16))
        self.out = nn.Linear(16, 50, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x, tok):
        return self.out(self.body(self.front(x) + self.emb(tok)))


def test_count_formula_plain_ddp_and_zero():
    n = 1_000_000
    one = estimate_model_state(n, _cfg(), world_size=1)
    assert (one["params"], one["grads"], one["optimizer"], one["ddp_buckets"]) == (4 * n, 4 * n, 8 * n, 0)
    assert one["total"] == 16 * n
    # ZeRO on one rank is not used by the Trainer: same as plain
    assert estimate_model_state(n, _cfg("optim.zero=true"), 1)["total"] == 16 * n
    z2 = estimate_model_state(n, _cfg("optim.zero=true"), 2)
    assert z2["optimizer"] == 4 * n and z2["total"] == 12 * n
    z8 = estimate_model_state(n, _cfg("optim.zero=true"), 8)
    assert z8["optimizer"] == n and z8["total"] == 9 * n
    # the published rule for Whisper-large-v3: 1.54e9 * 16 B = 24.64 GB plain, 18.48 GB ZeRO/2
    assert estimate_model_state(1.54e9, _cfg(), 2)["total"] == pytest.approx(24.64e9)
    assert estimate_model_state(1.54e9, _cfg("optim.zero=true"), 2)["total"] == pytest.approx(18.48e9)


def test_bucket_view_sgd_and_autocast_rules():
    n = 1000
    no_view = _cfg("dist.gradient_as_bucket_view=false")
    assert estimate_model_state(n, no_view, 2)["ddp_buckets"] == 4 * n
    assert estimate_model_state(n, no_view, 1)["ddp_buckets"] == 0  # no DDP on one rank
    assert estimate_model_state(n, _cfg("optim.name=sgd"), 1)["optimizer"] == 4 * n
    assert estimate_model_state(n, _cfg("optim.name=sgd", "optim.momentum=0.0"), 1)["optimizer"] == 0
    assert estimate_model_state(n, _cfg("trainer.precision=bf16"), 1)["autocast_weight_copies"] == 2 * n
    assert estimate_model_state(n, _cfg("trainer.precision=fp32"), 1)["autocast_weight_copies"] == 0
    with pytest.raises(ValueError):
        estimate_model_state(n, _cfg(), 0)
    with pytest.raises(ValueError):
        estimate_model_state(-1, _cfg(), 1)


def test_model_path_matches_real_adamw_state():
    torch.manual_seed(0)
    model = Net()
    est = estimate_model_state(model, _cfg(), 1)
    unique = {id(p): p for p in model.parameters()}.values()
    assert est["num_params"] == sum(p.numel() for p in unique)
    assert est["num_trainable"] == est["num_params"] - sum(p.numel() for p in model.front.parameters())
    assert est["params"] == 4 * est["num_params"]
    assert est["grads"] == 4 * est["num_trainable"]

    from ddptrain.optim import build_optimizer

    opt = build_optimizer(model, _cfg().optim, torch.device("cpu"))
    out = model(torch.randn(4, 7), torch.randint(0, 50, (4,)))
    out.square().sum().backward()
    opt.step()
    assert _state_bytes(opt) == est["optimizer"]
    grads = sum(p.grad.numel() * p.grad.element_size() for p in unique if p.grad is not None)
    assert grads == est["grads"]


def test_model_path_uses_real_dtypes():
    model = Net().to(torch.bfloat16)
    est = estimate_model_state(model, _cfg(), 1)
    assert est["params"] == 2 * est["num_params"]
    assert est["optimizer"] == 4 * est["num_trainable"]  # two bf16 moments


def _zero_state_worker(rank, world, out):
    torch.manual_seed(0)
    model = Net()
    cfg = _cfg("optim.zero=true", "trainer.device=cpu")
    ddptrain.setup_distributed(cfg)
    from ddptrain.optim import build_optimizer

    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    out_ = model(torch.randn(4, 7), torch.randint(0, 50, (4,)))
    out_.square().sum().backward()
    opt.step()
    local = torch.tensor([_state_bytes(opt.optim)])
    gathered = [torch.zeros_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local)
    if rank == 0:
        est = estimate_model_state(model, cfg, world)
        torch.save({"per_rank": [int(g) for g in gathered], "est": est}, os.path.join(out, "zero.pt"))


@pytest.mark.timeout(120)
def test_zero_estimate_is_the_most_loaded_rank(tmp_path):
    run_ranks(_zero_state_worker, 2, str(tmp_path))
    res = torch.load(tmp_path / "zero.pt", weights_only=False)
    per_rank, est = res["per_rank"], res["est"]
    assert sum(per_rank) == 8 * est["num_trainable"]  # every moment lives on exactly one rank
    assert max(per_rank) == est["optimizer"]
    assert est["optimizer"] < 8 * est["num_trainable"]


def test_cli_prints_table(capsys):
    assert main(["--params", "1.54e9", "--world-size", "2", "--zero"]) == 0
    text = capsys.readouterr().out
    assert "ZeRO" in text and "2 GPU(s)" in text
    total = next(line for line in text.splitlines() if line.startswith("total model state"))
    assert total.split()[3] == "18.48"  # GB column
    assert main(["--params", "315e6"]) == 0
    total = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("total model state"))
    assert total.split()[3] == "5.04"


def test_bf16_master_weights_rule_and_real_tensors():
    n = 1000
    bf = _cfg("trainer.precision=bf16", "trainer.param_dtype=bf16")
    one = estimate_model_state(n, bf, 1)
    assert (one["params"], one["grads"], one["masters"], one["optimizer"]) == (2 * n, 2 * n, 4 * n, 8 * n)
    assert one["total"] == 16 * n and one["autocast_weight_copies"] == 0 and one["master_grads"] == 4 * n
    z2 = estimate_model_state(n, _cfg("trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.zero=true"), 2)
    # ZeRO shards the masters with the Adam state: 4 + 12/N (sharded_masters.py)
    assert z2["optimizer"] == 4 * n and z2["masters"] == 2 * n and z2["master_grads"] == 2 * n
    assert z2["total"] == 10 * n
    z8 = estimate_model_state(8000, _cfg("trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.zero=true"), 8)
    assert z8["total"] == 8000 * (4 + 12 / 8)

    # against the tensors MasterWeights and the optimizer really hold
    from ddptrain.optim import build_optimizer
    from ddptrain.precision import MasterWeights

    torch.manual_seed(0)
    model = Net()
    est = estimate_model_state(model, bf, 1)
    master = MasterWeights(model)
    unique = list({id(p): p for p in model.parameters()}.values())
    assert sum(p.numel() * p.element_size() for p in unique) == est["params"]
    assert sum(m.numel() * m.element_size() for _, m in master.pairs) == est["masters"]
    opt = build_optimizer(model, bf.optim, torch.device("cpu"), master.to_master)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 7), torch.randint(0, 50, (4,))).float().square().sum().backward()
    assert sum(p.grad.numel() * p.grad.element_size() for p in unique if p.grad is not None) == est["grads"]
    master.load_grads(1.0)
    assert sum(m.grad.numel() * m.grad.element_size() for _, m in master.pairs) == est["master_grads"]
    opt.step()
    assert _state_bytes(opt) == est["optimizer"]


def test_frozen_parameters_cost_their_weights_only():
    n, lora = 1_000_000, 5_000
    bf = _cfg("trainer.precision=bf16", "trainer.param_dtype=bf16")
    est = estimate_model_state(n, bf, 1, trainable=lora)
    assert est["params"] == 2 * n and est["grads"] == 2 * lora
    assert est["masters"] == 4 * lora and est["optimizer"] == 8 * lora and est["total"] == 2 * n + 14 * lora
    with pytest.raises(ValueError, match="trainable"):
        estimate_model_state(n, bf, 1, trainable=2 * n)
    # the model path agrees: a LoRA-adapted model counted from its requires_grad flags
    from ddptrain.lora import apply_lora

    model = Net()
    apply_lora(model, ["body.*"], rank=2)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapters == 2 * (16 + 64) + 2 * (64 + 16)
    by_model = estimate_model_state(model, bf, 1)
    assert by_model["num_trainable"] == adapters and by_model["grads"] == 2 * adapters


def test_fits_table_marks_what_does_not_fit():
    from ddptrain.memory import fits_table

    text = fits_table(sizes=(10.29e9,), gpus=(1, 2), measured={(10.29e9, 1, "lora"): 31.0})
    full = next(line for line in text.splitlines() if "| full |" in line)
    lora = next(line for line in text.splitlines() if "| LoRA |" in line)
    assert full.split("|")[3].strip().endswith("(no)")  # 10B full fine-tune on one GPU: no
    assert not full.split("|")[4].strip().endswith("(no)")  # on 2 GPUs with sharded masters: yes
    assert "measured peak 31.0" in lora
    assert main(["--table"]) == 0


def _sharded_masters_worker(rank, world, out):
    """Real per-rank tensors of sharded masters (bf16 model, ZeRO) against the estimate."""
    torch.manual_seed(0)
    model = Net()
    cfg = _cfg("optim.zero=true", "trainer.device=cpu", "trainer.precision=bf16", "trainer.param_dtype=bf16")
    ddptrain.setup_distributed(cfg)
    from ddptrain.optim import build_optimizer
    from ddptrain.sharded_masters import ShardedMasterWeights

    master = ShardedMasterWeights(model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"), master)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 7), torch.randint(0, 50, (4,))).float().square().sum().backward()
    master.load_grads(1.0)
    unique = list({id(p): p for p in model.parameters()}.values())
    measured = torch.tensor([sum(p.numel() * p.element_size() for p in unique),
                             sum(p.grad.numel() * p.grad.element_size() for p in unique if p.grad is not None),
                             sum(m.numel() * m.element_size() for p, m in master.pairs if p is not m),
                             sum(m.grad.numel() * m.grad.element_size() for _, m in master.pairs)])
    opt.step()
    master.copy_to_model()
    measured = torch.cat([measured, torch.tensor([_state_bytes(opt)])])
    gathered = [torch.zeros_like(measured) for _ in range(world)]
    torch.distributed.all_gather(gathered, measured)
    if rank == 0:
        torch.save({"per_rank": [g.tolist() for g in gathered], "est": estimate_model_state(model, cfg, world)},
                   os.path.join(out, "sharded.pt"))


@pytest.mark.timeout(120)
def test_sharded_masters_estimate_against_real_tensors(tmp_path):
    run_ranks(_sharded_masters_worker, 2, str(tmp_path))
    res = torch.load(tmp_path / "sharded.pt", weights_only=False)
    per_rank, est = res["per_rank"], res["est"]
    params, grads, masters, master_grads, optimizer = zip(*per_rank)
    assert all(p == est["params"] for p in params) and all(g == est["grads"] for g in grads)
    assert sum(masters) == 4 * est["num_trainable"] and max(masters) == est["masters"] < 4 * est["num_trainable"]
    assert max(master_grads) == est["master_grads"] == max(masters)
    assert sum(optimizer) == 8 * est["num_trainable"] and max(optimizer) == est["optimizer"]
