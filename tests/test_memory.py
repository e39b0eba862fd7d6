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
    one = estimate_model_state(n, bf, 1, device="cpu")
    assert (one["params"], one["grads"], one["masters"], one["optimizer"]) == (2 * n, 2 * n, 4 * n, 8 * n)
    assert one["total"] == 16 * n and one["autocast_weight_copies"] == 0 and one["master_grads"] == 4 * n
    # on a GPU the fused update (optim.fused_update: auto) reads the bf16 gradients: no fp32 copies;
    # without it (off, or the unfused AdamW it does not stand for) they come back
    gpu = estimate_model_state(n, bf, 1)
    assert gpu["total"] == 16 * n and gpu["master_grads"] == 0
    for off in ("optim.fused_update=false", "optim.fused=false", "optim.name=adam"):
        assert estimate_model_state(n, _cfg("trainer.precision=bf16", "trainer.param_dtype=bf16", off),
                                    1)["master_grads"] == 4 * n, off
    assert estimate_model_state(n, _cfg("trainer.precision=bf16", "trainer.param_dtype=bf16",
                                        "optim.fused_update=true"), 1, device="cpu")["master_grads"] == 0
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
    est = estimate_model_state(model, bf, 1, device="cpu")
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
    from ddptrain.update.sharded import ShardedMasterWeights

    master = ShardedMasterWeights(model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"), master.to_master, local_only=True)
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


# ----------------------------------------------------------------------------- the memory tiers (issue 28)

from ddptrain.memory import (PRESETS, TIERS, _tier_config, cards_table, estimate_model_state as _est,  # noqa: E402
                             fits_table, measure_activations, stream_blocks)

_BF = ("trainer.precision=bf16", "trainer.param_dtype=bf16")
_CHUNK = f"optim.offload_chunk_mb={1000 * 2 / 2**20!r}"  # 1000 bf16 elements a chunk


def _tier(name):
    zero, shard_grads, offload = {"ddp": (False, False, False), "zero": (True, False, False),
                                  "shard_grads": (True, True, False), "offload": (True, True, True),
                                  "offload_full_grads": (True, False, True)}[name]
    cfg = _cfg(*_BF, _CHUNK, f"optim.zero={str(zero).lower()}", f"optim.offload={'cpu' if offload else 'none'}")
    cfg.optim.shard_grads = shard_grads  # set by hand: the estimate reads the key wherever ddptrain defines it
    return cfg


# GPU model state (at rest) of 8,000 trainable bf16 parameters, by hand: 16 B; 4 + 12/N;
# 2 + 2/N + 12/N; 2 + 2/N (offload with sharded grads); 2 + 2 (offload, whole grads); on one GPU
# with one micro-batch a step offload keeps 2 B (the gradients leave during the backward)
TIER_TOTALS = {
    "ddp": {1: 128_000, 2: 128_000, 4: 128_000, 8: 128_000},
    "zero": {1: 128_000, 2: 80_000, 4: 56_000, 8: 44_000},
    "shard_grads": {1: 128_000, 2: 72_000, 4: 44_000, 8: 30_000},
    "offload": {1: 16_000, 2: 24_000, 4: 20_000, 8: 18_000},
    "offload_full_grads": {1: 16_000, 2: 32_000, 4: 32_000, 8: 32_000},
}


def test_offload_on_one_gpu_with_accumulation_keeps_the_gradients():
    """With several micro-batches a step the earlier ones' gradients accumulate on the GPU."""
    cfg = _tier("offload")
    cfg.trainer.grad_accum_steps = 2
    assert _est(8000, cfg, 1)["total"] == 32_000


@pytest.mark.parametrize("tier", sorted(TIER_TOTALS))
@pytest.mark.parametrize("n_gpus", [1, 2, 4, 8])
def test_each_tier_by_count(tier, n_gpus):
    n = 8000
    est = _est(n, _tier(tier), n_gpus)
    assert est["total"] == TIER_TOTALS[tier][n_gpus]
    own = n // n_gpus if tier != "ddp" else n  # the rank's share of masters / Adam state
    if tier.startswith("offload"):
        assert est["masters"] == est["optimizer"] == est["master_grads"] == 0
        # host, per rank: 4 (master) + 8 (AdamW) + 2 (bf16 staging) per owned parameter + one fp32 chunk
        assert (est["host_masters"], est["host_optimizer"], est["host_grads"]) == (4 * own, 8 * own, 2 * own)
        assert est["host_scratch"] == 4 * min(own, 1000)
        assert est["host_total"] == 14 * own + 4 * min(own, 1000)
    else:
        assert est["host_total"] == 0
        sharded = n_gpus > 1 and tier != "ddp"  # the fused update (default on a GPU) takes unsharded masters only
        assert est["master_grads"] == (4 * own if sharded else 0)
        assert _est(n, _tier(tier), n_gpus, device="cpu")["master_grads"] == 4 * (own if sharded else n)


class Blocks(nn.Module):
    """Embedding 80, four 100-parameter blocks in a ModuleList, a 60-parameter head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 10)
        self.layers = nn.ModuleList([nn.Linear(10, 10, bias=False) for _ in range(4)])
        self.head = nn.Linear(10, 6, bias=False)

    def forward(self, tok):
        h = self.emb(tok)
        for layer in self.layers:
            h = layer(h).relu()
        return self.head(h)


def test_model_path_offload_partition_and_chunks():
    chunk = f"optim.offload_chunk_mb={150 * 2 / 2**20!r}"  # 150 elements
    cfg = _cfg(*_BF, "optim.zero=true", "optim.offload=cpu", chunk)
    # 2 ranks, whole tensors largest first: rank 0 {layer0, layer2, emb} = 280, rank 1 {layer1, layer3, head} = 260;
    # rank 0's chunks in model order: emb+layer0 = 180 (cut at >= 150), layer2 = 100
    est = _est(Blocks(), cfg, 2)
    assert (est["host_masters"], est["host_optimizer"], est["host_grads"], est["host_scratch"]) == (
        4 * 280, 8 * 280, 2 * 280, 4 * 180)
    assert est["params"] == 2 * 540 and est["grads"] == 2 * 540 and est["total"] == 4 * 540
    sg = _est(Blocks(), _tier("shard_grads"), 4)
    assert sg["grads"] == 2 * 180 and sg["masters"] == 4 * 180  # rank 0 of 4: layer0 + emb
    assert sg["total"] == 2 * 540 + 14 * 180
    # one rank: every tensor its own; chunks 180 | 200 | 160 -> the largest is 200
    one = _est(Blocks(), cfg, 1)
    assert one["host_total"] == 14 * 540 + 4 * 200


def test_model_path_offload_matches_offloaded_masters():
    offload = pytest.importorskip("ddptrain.update.host")
    torch.manual_seed(0)
    chunk_mb = 150 * 2 / 2**20
    est = _est(Blocks(), _cfg(*_BF, "optim.offload=cpu", f"optim.offload_chunk_mb={chunk_mb!r}"), 1)
    real = offload.OffloadedMasters(Blocks(), torch.bfloat16, chunk_mb)
    assert real.host_bytes() == est["host_total"]


def test_model_path_streamed_base():
    from ddptrain.lora import apply_lora

    model = Blocks()
    apply_lora(model, ["layers.*"], rank=2)  # 40 adapter parameters a block; emb and head frozen
    cfg = _cfg(*_BF)
    cfg.lora.base_offload, cfg.lora.stream_ahead = "cpu", 1  # as lora.enabled would have it (set by hand here)
    est = _est(model, cfg, 1)
    assert est["num_trainable"] == 160
    assert est["stream_ring"] == 2 * (2 * 100)  # (stream_ahead + 1) blocks of 100 bf16 weights
    assert est["params"] == 2 * 160 + 2 * (80 + 60)  # adapters + the frozen weights outside the blocks
    assert est["host_base"] == est["host_total"] == 2 * 400
    assert est["total"] == est["params"] + est["stream_ring"] + 2 * 160 + 4 * 160 + 8 * 160
    assert [len(list(b.parameters())) for b in stream_blocks(model)] == [3, 3, 3, 3]  # weight + lora_A/B
    assert stream_blocks(model, ["layers.1", "layers.3"]) == [model.layers[1], model.layers[3]]
    try:
        from ddptrain.streamed_base import find_blocks
    except ImportError:
        return
    assert [m for _, m in find_blocks(model)] == stream_blocks(model)


def test_streamed_base_by_count_needs_the_ring():
    cfg = _cfg(*_BF)
    cfg.lora.base_offload = "cpu"
    with pytest.raises(ValueError, match="stream_ring_bytes"):
        _est(1000, cfg, 1, trainable=10)
    est = _est(1000, cfg, 1, trainable=10, stream_ring_bytes=300, stream_resident=90)
    assert est["params"] == 2 * (10 + 90) and est["stream_ring"] == 300
    assert est["host_base"] == 2 * (1000 - 10 - 90) and est["total"] == 200 + 300 + 10 * 14


def _cell(text, label, col):
    row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return row.split("|")[col + 1].strip()


def test_cards_table_cells_of_a_preset(capsys):
    assert main(["--table", "--preset", "glm-asr-nano"]) == 0
    text = capsys.readouterr().out
    assert "state only" in text and "GLM-ASR-Nano-2512" in text
    # 2 GPUs, sharded masters: (4 + 12/2) x 2.14e9 = 21.4e9 B + 4/2 x 2.14e9 transient = 25.68e9 B = 23.9 GiB
    assert _cell(text, "+ sharded masters (optim.zero)", 2) == "23.9 (24+)"
    assert _cell(text, "DDP, bf16 weights + fp32 masters", 1) == "31.9 (48+)"  # 16 B x 2.14e9: the fused update
    # 8 GPUs with offload: (2 + 2/8) x 2.14e9 = 4.815e9 B = 4.5 GiB; host per rank
    # 14 x 2.675e8 + 4 x 2**27 (one 256 MB chunk of bf16 gradients, widened) = 4.282e9 B = 4.0 GiB, x 8 a node
    assert _cell(text, "+ optimizer offload (optim.offload: cpu)", 4) == "4.5 (16+)"
    assert _cell(text, "&nbsp;&nbsp;host GiB per rank / node", 4) == "4.0 / 31.9"
    assert "LoRA" not in text
    # an activation term moves cells to larger cards: 21.4e9 + 6 GiB = 25.9 GiB > 24
    text = cards_table(2.14e9, activations=6 * 2**30)
    assert _cell(text, "+ sharded masters (optim.zero)", 2) == "23.9 (48+)"
    assert "6.0 GiB of activations" in text


def test_cards_table_lora_preset_streamed():
    p = PRESETS["glm4v-9b-lora"]
    assert (p["params"], p["trainable"]) == (10_340_372_992, 47_595_520)  # bench_9b.py's measured counts
    cfg = _cfg(*_BF, "optim.zero=true")
    cfg.lora.base_offload = "cpu"
    ring = 2 * 2 * p["stream_block_params"]  # two bf16 decoder layers
    est = _est(p["params"], cfg, 1, p["trainable"], stream_ring_bytes=ring, stream_resident=p["stream_resident_params"])
    # one GPU: the adapters' masters are not sharded, so the fused update makes no fp32 gradients
    assert est["master_grads"] == 0
    assert est["total"] == ring + 2 * p["stream_resident_params"] + 16 * p["trainable"]
    assert est["host_base"] == 2 * (p["params"] - p["trainable"] - p["stream_resident_params"])
    text = cards_table(p["params"], p["trainable"], stream_block_bytes=ring / 2,
                       stream_resident=p["stream_resident_params"])
    got = (est["total"] + est["master_grads"]) / 2**30
    assert _cell(text, "LoRA, streamed base (lora.base_offload: cpu)", 1) == f"{got:.1f} (16+)"
    assert _cell(text, "&nbsp;&nbsp;host GiB per rank / node", 4) == \
        f"{est['host_base'] / 2**30:.1f} / {8 * est['host_base'] / 2**30:.1f}"
    assert "DDP, bf16" not in text and "LoRA, bf16 frozen base" in text


def _line(text, name):
    """The GB, GiB and B/param columns of a format_table row."""
    return next(line for line in text.splitlines() if line.startswith(name)).split()[-3:]


def test_cli_new_flags(capsys, tmp_path):
    # sharded grads + offload, 2 GPUs: (2 + 1) x 8e9 = 24 GB on the GPU; host 14 x 4e9 + 4 x 2**27 per rank
    assert main(["--params", "8e9", "--world-size", "2", "--param-dtype", "bf16", "--zero", "--shard-grads",
                 "--offload"]) == 0
    text = capsys.readouterr().out
    assert "sharded grads" in text and "optimizer offload" in text
    assert _line(text, "total model state")[0] == "24.00"
    assert _line(text, "host total per rank")[0] == f"{(56e9 + 4 * 2**27) / 1e9:.2f}"
    assert _line(text, "host total per node (2 ranks)")[0] == f"{2 * (56e9 + 4 * 2**27) / 1e9:.2f}"
    assert main(["--params", "8e9", "--world-size", "2", "--param-dtype", "bf16", "--offload",
                 "--offload-chunk-mb", "1024", "--local-world-size", "1"]) == 0
    text = capsys.readouterr().out
    assert _line(text, "host: fp32 gradient chunk")[1] == "2.00"  # 4 x 2**29 B = 2 GiB
    assert "per node" not in text
    # a streamed base: the ring by hand, the activations added to the peak
    assert main(["--params", "1e9", "--trainable", "1e6", "--param-dtype", "bf16", "--base-offload",
                 "--stream-ring-gb", "0.5", "--stream-ahead", "2", "--activations-gb", "3"]) == 0
    text = capsys.readouterr().out
    assert _line(text, "streamed base ring")[1] == "0.50" and _line(text, "+ activations (one step)")[1] == "3.00"
    assert _line(text, "host: frozen base (pinned)")[1] == f"{2 * 999e6 / 2**30:.2f}"
    assert _line(text, "peak per GPU")[0] == f"{(2e6 + 2**29 + 14e6 + 3 * 2**30) / 1e9:.2f}"
    assert main(["--preset", "glm4v-9b-lora", "--param-dtype", "bf16", "--base-offload"]) == 0
    assert _line(capsys.readouterr().out, "streamed base ring")[0] == f"{4 * 203_969_024 / 1e9:.2f}"
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--trainable", "1e6", "--base-offload"])  # no ring
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--offload"])  # offload needs bf16 weights
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "optim.zero=true"])  # an override without --config
    # a training YAML (a recipe's own sections left out) + overrides, flags on top
    yaml = tmp_path / "run.yaml"
    yaml.write_text("glmasr:\n  path: /nowhere\ntrainer:\n  precision: bf16\n  param_dtype: bf16\n"
                    "optim:\n  offload: cpu\n")
    assert main(["--config", str(yaml), "--params", "8e9", "--world-size", "2", "--shard-grads",
                 "optim.zero=true"]) == 0
    assert _line(capsys.readouterr().out, "total model state")[0] == "24.00"
    with pytest.raises(SystemExit):
        main(["--config", str(yaml), "--params", "8e9", "optim.offlaod=cpu"])  # the config's own error


def test_measure_activations_says_it_cannot_on_cpu():
    model = Blocks()
    with pytest.warns(UserWarning, match="CUDA"):
        got = measure_activations(model, lambda m, b: (m(b).float().sum(), b.numel()), torch.tensor([1, 2]))
    assert got is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_activations_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    x = torch.randn(2048, 1024)
    got = measure_activations(model, lambda m, b: (m(b).float().square().sum(), b.shape[0]), x)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert got["at_rest"] == pytest.approx(2 * weights, rel=0.01)  # the weights + the gradients the step made
    # at least the input, the bf16 hidden activations (pre- and post-GELU) and the fp32 output
    assert got["activations"] >= 2048 * 1024 * 4 + 2 * 2048 * 4096 * 2 + 2048 * 1024 * 4
    assert got["peak"] == got["at_rest"] + got["activations"]
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- the EMA (ema.enabled)


EMA_RUNS = {"replicated16": _BF, "zero": ("optim.zero=true",), "zero16": (*_BF, "optim.zero=true"),
            "offload16": (*_BF, "optim.zero=true", "optim.offload=cpu")}


def _net_loss(model, batch):
    return model(batch["x"], batch["tok"]).float().square().sum(), torch.tensor(4.0)


def _ema_worker(rank, world, out):
    """Each config's real EMA tensors on this rank (ddptrain/ema.py, built by the Trainer)."""
    ddptrain.setup_distributed(_cfg("trainer.device=cpu"))
    batch = {"x": torch.randn(4, 7, generator=torch.Generator().manual_seed(rank)), "tok": torch.arange(4)}
    got = {}
    for run, extra in EMA_RUNS.items():
        torch.manual_seed(0)
        cfg = _cfg(f"trainer.output_dir={out}/{run}", "trainer.device=cpu", "logging.progress_bar=false",
                   "ema.enabled=true", "checkpoint.save_at_end=false", *extra)
        trainer = ddptrain.Trainer(Net(), _net_loss, cfg, [batch])
        local = torch.tensor([sum(e.numel() * e.element_size() for e in trainer.ema.ema)])
        gathered = [torch.zeros_like(local) for _ in range(world)]
        torch.distributed.all_gather(gathered, local)
        got[run] = {"per_rank": [int(g) for g in gathered], "est": estimate_model_state(trainer.module, cfg, world)}
        trainer.close()
    if rank == 0:
        torch.save(got, os.path.join(out, "ema.pt"))


@pytest.mark.timeout(180)
def test_the_ema_estimate_is_the_real_ema_of_the_most_loaded_rank(tmp_path):
    """2 gloo ranks: replicated (bf16 masters) every rank holds 4 B per trainable parameter; sharded
    (fp32 ZeroRedundancyOptimizer, bf16 sharded masters, offload) each its partition; the estimate
    is the most loaded rank's, on the GPU, or on the host beside offload's masters."""
    run_ranks(_ema_worker, 2, str(tmp_path), timeout=150)
    got = torch.load(tmp_path / "ema.pt", weights_only=False)
    for run, r in got.items():
        est, per_rank = r["est"], r["per_rank"]
        where = "host_ema" if run == "offload16" else "ema"
        assert est[where] == max(per_rank) and est["host_ema" if where == "ema" else "ema"] == 0, run
        if run == "replicated16":
            assert per_rank == [4 * est["num_trainable"]] * 2
        else:
            assert sum(per_rank) == 4 * est["num_trainable"] and max(per_rank) < 4 * est["num_trainable"], run


@pytest.mark.parametrize("tier", sorted(TIER_TOTALS))
@pytest.mark.parametrize("n_gpus", [1, 2, 4])
@pytest.mark.parametrize("device", ["auto", "gpu", "cpu"])
def test_the_ema_adds_4_bytes_per_owned_parameter_where_ema_device_says(tier, n_gpus, device):
    """By count: an fp32 copy of the rank's share of the trainable parameters, on the GPU (auto
    without offload, gpu), or in host memory (cpu; auto under offload), where cpu with the
    weights on the GPU adds two pinned staging buffers; nothing else changes."""
    from ddptrain.ema import CHUNK_ELEMS

    n = 8000
    base = _est(n, _tier(tier), n_gpus)
    cfg = _tier(tier)
    cfg.ema.enabled, cfg.ema.device = True, device
    offload = tier.startswith("offload")
    if offload and device == "gpu":
        with pytest.raises(ValueError, match="ema.device=gpu with optim.offload=cpu"):
            _est(n, cfg, n_gpus)
        return
    est = _est(n, cfg, n_gpus)
    own = n // n_gpus if tier != "ddp" and (n_gpus > 1 or offload) else n
    host = device == "cpu" or (device == "auto" and offload)
    assert est["total"] - base["total"] == (0 if host else 4 * own)
    assert est["ema"] == (0 if host else 4 * own)
    staging = 2 * 4 * CHUNK_ELEMS if device == "cpu" and not offload else 0
    assert est["host_total"] - base["host_total"] == est["host_ema"] == (4 * own + staging if host else 0)
    assert {k: v for k, v in est.items() if "ema" not in k and "total" not in k} == \
        {k: v for k, v in base.items() if "ema" not in k and "total" not in k}


def test_cli_ema_flags(capsys):
    assert main(["--params", "1e9", "--world-size", "2", "--zero", "--param-dtype", "bf16", "--ema"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("EMA of the weights"))
    assert "+ EMA (auto)" in text and row.split()[-1] == "2.00"  # 4 B over 2 ranks per parameter
    assert main(["--params", "1e9", "--param-dtype", "bf16", "--ema", "--ema-device", "cpu"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert not any(line.startswith("EMA of the weights") for line in lines)
    assert any(line.startswith("host: EMA of the weights") for line in lines)
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--param-dtype", "bf16", "--offload", "--ema", "--ema-device", "gpu"])
    assert "--ema-device gpu with --offload" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["auto", "gpu", "cpu"])
def test_the_tables_add_the_estimators_ema_where_ema_device_puts_it(capsys, device):
    """--table with --ema: each cards_table cell grows by the estimator's EMA bytes on the GPU, or
    each host row by its host EMA (cpu; the offload row's whatever the device, as the config
    keeps it there); fits_table's cells likewise, its host EMA given per cell."""
    n, gib = 2.14e9, 2**30
    assert main(["--table", "--preset", "glm-asr-nano", "--ema", "--ema-device", device]) == 0
    text = capsys.readouterr().out
    assert f"fp32 EMA of the trainable weights (ema.device={device})" in text
    lines = text.splitlines()
    for k, (label, switches, _) in enumerate(TIERS[:4]):
        host_row = lines[lines.index(next(x for x in lines if x.startswith(f"| {label} |"))) + 1]
        for col, g in enumerate((1, 2, 4, 8), start=1):
            cfg = _tier_config(**switches)
            base = _est(n, cfg, g)
            cfg.ema.enabled, cfg.ema.device = True, "auto" if switches.get("offload") else device
            ema = _est(n, cfg, g)
            assert ema["ema"] + ema["host_ema"] > 0.5 * gib  # the EMA is there, on one side
            state = base["total"] + base["master_grads"] + ema["ema"]
            assert _cell(text, label, col).startswith(f"{state / gib:.1f} ("), (label, g)
            host = base["host_total"] + ema["host_ema"]
            if host:
                assert host_row.split("|")[col + 1].strip() == f"{host / gib:.1f} / {g * host / gib:.1f}", (label, g)
            else:
                assert not host_row.startswith("| &nbsp;&nbsp;host"), label
    text = fits_table(sizes=(7e9,), gpus=(1, 2), ema=True, ema_device=device)
    for mode, trainable in (("full", None), ("LoRA", 7e9 * 0.005)):
        for col, g in enumerate((1, 2), start=1):
            cfg = _tier_config(zero=g > 1)
            base = _est(7e9, cfg, g, trainable)
            cfg.ema.enabled, cfg.ema.device = True, device
            ema = _est(7e9, cfg, g, trainable)
            want = f"{(base['total'] + base['master_grads'] + ema['ema']) / gib:.1f}"
            if ema["host_ema"]:
                want += f", host {ema['host_ema'] / gib:.1f}"
            got = next(x for x in text.splitlines() if f"| {mode} |" in x).split("|")[col + 2].strip()
            assert got.replace(" (no)", "") == want, (mode, g)
