"""Tests for ddptrain/recompute.py: checkpointed gradients must equal plain ones, bit for bit.

Dropout is ON and models are in train mode throughout, so any slip in RNG replay shows up as a
different mask and a different gradient. torch.utils.checkpoint (non-reentrant) is the oracle.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import faulthandler
import gc
import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint
from torch import nn

from _saved_bytes import SavedBytes, saved_activation_bytes
from ddptrain.config import RecomputeConfig
from ddptrain.recompute import apply_recompute, checkpoint, remove_recompute


class Block(nn.Module):
    """Pre-norm transformer block with keyword-only options and tuple-or-dict outputs."""

    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.2):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(p)

    def forward(self, x, mask=None, *, scale: float = 1.0, return_dict: bool = False):
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=mask, need_weights=False)
        x = x + self.drop(a) * scale
        x = x + self.ff(self.norm2(x))
        return {"hidden": x, "attn": a} if return_dict else (x, a)


class TinyTransformer(nn.Module):
    def __init__(self, d: int = 16, n: int = 4):
        super().__init__()
        self.proj = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 5)

    def forward(self, feats, mask=None):
        x = self.proj(feats)
        for i, layer in enumerate(self.layers):  # keyword args, alternating tuple / dict outputs
            y = layer(x, mask=mask, scale=0.5, return_dict=bool(i % 2))
            x = y["hidden"] if isinstance(y, dict) else y[0]
        return self.out(x)


def _cfg(**kw) -> RecomputeConfig:
    return RecomputeConfig(enabled=True, **kw)


def _grads(model: nn.Module, loss_fn, seed: int = 0, inputs=()) -> dict[str, torch.Tensor]:
    """Gradients of loss_fn(model) under a fixed seed (same dropout masks for every variant)."""
    model.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    torch.manual_seed(seed)
    loss_fn(model).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads.update({f"input{i}": t.grad.clone() for i, t in enumerate(inputs)})
    grads["rng_after"] = torch.get_rng_state()  # recomputation must not move the outer RNG
    if torch.cuda.is_available():  # (torch.compile may initialise CUDA between two calls)
        grads["cuda_rng_after"] = torch.cuda.get_rng_state()
    return grads


def _assert_same(a: dict, b: dict, exact: bool = True) -> None:
    assert a.keys() == b.keys() and len(a) > 1
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), (  # the message is only built on failure
                f"{k} differs by {(a[k].double() - b[k].double()).abs().max()}")
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def _torch_checkpointed(model: nn.Module, names: list[str]) -> nn.Module:
    """The oracle: the same layers wrapped with torch.utils.checkpoint(use_reentrant=False)."""
    oracle = copy.deepcopy(model)
    remove_recompute(oracle)
    for name in names:
        m = oracle.get_submodule(name)
        m.forward = functools.partial(torch.utils.checkpoint.checkpoint, type(m).forward.__get__(m),
                                      use_reentrant=False)
    return oracle


def _conformer(num_layers: int = 4):
    from torchaudio.models import Conformer

    torch.manual_seed(0)
    model = Conformer(input_dim=32, num_heads=4, ffn_dim=64, num_layers=num_layers,
                      depthwise_conv_kernel_size=7, dropout=0.1)
    x = torch.randn(3, 50, 32, requires_grad=True)
    lengths = torch.tensor([50, 40, 30])
    w = torch.randn(3, 50, 32)
    return model.train(), x, lengths, (lambda m: (m(x, lengths)[0] * w).sum())


def test_conformer_grads_equal_plain_and_torch_checkpoint():
    plain, x, _, loss_fn = _conformer()
    ours = copy.deepcopy(plain)
    names = apply_recompute(ours, _cfg(module_classes=["ConformerLayer"]))
    assert names == [f"conformer_layers.{i}" for i in range(4)]
    oracle = _torch_checkpointed(ours, names)
    want = _grads(plain, loss_fn, inputs=[x])
    _assert_same(want, _grads(ours, loss_fn, inputs=[x]))
    _assert_same(want, _grads(oracle, loss_fn, inputs=[x]))


def test_torchaudio_wav2vec2_encoder_layers_by_glob():
    from torchaudio.models import wav2vec2_model

    torch.manual_seed(0)
    plain = wav2vec2_model(
        extractor_mode="group_norm", extractor_conv_layer_config=[(8, 10, 5), (8, 3, 2)],
        extractor_conv_bias=False, encoder_embed_dim=16, encoder_projection_dropout=0.1,
        encoder_pos_conv_kernel=8, encoder_pos_conv_groups=2, encoder_num_layers=3,
        encoder_num_heads=2, encoder_attention_dropout=0.1, encoder_ff_interm_features=32,
        encoder_ff_interm_dropout=0.1, encoder_dropout=0.1, encoder_layer_norm_first=True,
        encoder_layer_drop=0.0, aux_num_out=6).train()
    ours = copy.deepcopy(plain)
    names = apply_recompute(ours, _cfg(name_globs=["encoder.transformer.layers.*"]))
    assert names == [f"encoder.transformer.layers.{i}" for i in range(3)]
    wave, lengths = torch.randn(2, 800), torch.tensor([800, 600])
    loss_fn = lambda m: m(wave, lengths)[0].log_softmax(-1)[..., 1:].sum()  # noqa: E731
    _assert_same(_grads(plain, loss_fn), _grads(ours, loss_fn))


def test_kwargs_non_grad_inputs_and_output_structures():
    torch.manual_seed(0)
    block = Block().train()
    x = torch.randn(2, 7, 16)  # does not require grad: only the parameters do
    mask = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    kw = dict(mask=mask, scale=0.5, return_dict=True)
    want = _grads(block, lambda b: b(x, **kw)["hidden"].sum())
    _assert_same(want, _grads(block, lambda b: checkpoint(b, x, **kw)["hidden"].sum()))
    model = TinyTransformer().train()
    feats = torch.randn(2, 7, 8, requires_grad=True)
    want = _grads(model, lambda m: m(feats, mask).pow(2).sum(), inputs=[feats])
    apply_recompute(model, _cfg(module_classes=["Block"]))
    _assert_same(want, _grads(model, lambda m: m(feats, mask).pow(2).sum(), inputs=[feats]))


def test_bf16_autocast_is_replayed_exactly():
    torch.manual_seed(0)
    plain = TinyTransformer().train()
    ours = copy.deepcopy(plain)
    apply_recompute(ours, _cfg(module_classes=["Block"]))
    feats = torch.randn(2, 9, 8)

    def loss_fn(m):  # backward runs outside autocast, as in a real loop: recompute must re-enter it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(feats).float().pow(2).sum()

    _assert_same(_grads(plain, loss_fn), _grads(ours, loss_fn))


def test_torch_compile_runs_checkpointed_layers_eagerly():
    torch.manual_seed(0)
    plain = TinyTransformer().train()
    ours = copy.deepcopy(plain)
    apply_recompute(ours, _cfg(module_classes=["Block"]))
    compiled = torch.compile(ours, backend="aot_eager")  # dynamo + AOT autograd, no codegen
    feats = torch.randn(2, 7, 8)
    want = _grads(plain, lambda m: m(feats).pow(2).sum())
    got = _grads(compiled, lambda m: m(feats).pow(2).sum())
    _assert_same(want, {k.replace("_orig_mod.", ""): v for k, v in got.items()}, exact=False)


def test_inputs_saved_or_returned_as_is():
    x = torch.randn(5, requires_grad=True)
    same, sq = checkpoint(lambda a, b: (a, a * a * b), x, b=torch.full((5,), 3.0))  # saves x itself
    assert same is x
    (same.sum() + sq.sum()).backward()
    torch.testing.assert_close(x.grad, 1 + 6 * x.detach())


def test_nested_checkpoints():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh())
    outer = lambda a: checkpoint(inner, a.sin()).exp() * inner(a)  # noqa: E731
    x = torch.randn(4, 8, requires_grad=True)
    want = _grads(inner, lambda m: outer(x).sum(), inputs=[x])
    _assert_same(want, _grads(inner, lambda m: checkpoint(outer, x).sum(), inputs=[x]))


def test_retain_graph_recomputes_and_second_backward_errors():
    calls = []

    def fn(a):
        calls.append("start")
        out = a.sin().exp()  # exp saves its output: the last saved tensor
        calls.append("end")  # never reached when recomputing: it stops once all are captured
        return out * 2

    x = torch.randn(4, requires_grad=True)
    loss = checkpoint(fn, x).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()  # a fresh recomputation: the first backward consumed its recomputed tensors
    assert calls == ["start", "end", "start", "start"]
    torch.testing.assert_close(x.grad, 2 * first)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_inplace_change_of_input_and_diverging_recompute_raise():
    x = torch.randn(4, requires_grad=True).clone()
    y = checkpoint(torch.sin, x)
    x.add_(1)  # recomputing from the changed x would give silently wrong gradients
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    flag = {"extra": True}
    x = torch.randn(4, requires_grad=True)
    z = checkpoint(lambda a: a.sin().exp() if flag["extra"] else a.sin(), x)
    flag["extra"] = False
    with pytest.raises(RuntimeError, match="saved 1 tensors for backward but the original saved 2"):
        z.sum().backward()


class CountingLinear(nn.Linear):
    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize("mode, expected_calls", [("train", 2), ("eval", 1), ("no_grad", 1)])
def test_wrapper_is_a_plain_call_in_eval_and_no_grad(mode, expected_calls):
    model = nn.Sequential(CountingLinear(4, 4), nn.Tanh(), CountingLinear(4, 1))
    model.train(mode != "eval")
    assert apply_recompute(model, _cfg(module_classes=["CountingLinear"])) == ["0", "2"]
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
        y = model(x)
    if y.requires_grad:
        y.sum().backward()
    assert [model[0].calls, model[2].calls] == [expected_calls] * 2


def test_saved_bytes_drop_to_layer_inputs():
    model, x, lengths, _ = _conformer(num_layers=4)
    layer_inputs: dict[int, int] = {}  # storage -> bytes of every tensor argument of every layer

    def record(module, args, kwargs):
        for t in [*args, *kwargs.values()]:
            if isinstance(t, torch.Tensor):
                layer_inputs[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True)
             for layer in model.conformer_layers]
    params = list(model.parameters())
    measure = lambda: saved_activation_bytes(lambda: model(x, lengths), ignore=params)  # noqa: E731
    plain = measure()
    apply_recompute(model, _cfg(module_classes=["ConformerLayer"], every_k=2))
    half = measure()
    remove_recompute(model)
    apply_recompute(model, _cfg(module_classes=["ConformerLayer"]))
    layer_inputs.clear()
    full = measure()
    for h in hooks:
        h.remove()
    expected = sum(layer_inputs.values())  # 4 hidden states (B*T*D fp32) + the padding mask
    print(f"\nsaved for backward: plain {plain} B, every 2nd layer {half} B, all layers {full} B "
          f"({plain / full:.1f}x less; layer inputs {expected} B)")
    assert expected <= full <= 1.05 * expected, "only the layer inputs should stay saved"
    assert full < half < plain
    assert half < 0.6 * plain + expected  # half the layers' activations are gone


def test_selection_every_k_nesting_and_state_dict():
    model = TinyTransformer(n=4)
    keys = list(model.state_dict())
    # "layers*" matches the ModuleList (no forward: skipped) and everything inside each layer
    # (nested in an already matched layer: skipped): only the 4 layers remain.
    assert apply_recompute(model, _cfg(name_globs=["layers*"])) == [f"layers.{i}" for i in range(4)]
    assert list(model.state_dict()) == keys
    clone = copy.deepcopy(model)
    assert clone.layers[0].forward.module is clone.layers[0]  # the copy recomputes itself
    TinyTransformer(n=4).load_state_dict(model.state_dict())  # strict: loads into un-wrapped
    with pytest.raises(ValueError, match="already"):
        apply_recompute(model, _cfg(module_classes=["Block"]))
    assert remove_recompute(model) == [f"layers.{i}" for i in range(4)]
    assert all("forward" not in m.__dict__ for m in model.modules())
    half = apply_recompute(model, _cfg(module_classes=["Block"], every_k=2))
    assert half == ["layers.0", "layers.2"]
    remove_recompute(model)
    # Classes and globs combine; registration order is kept; attn.out_proj is another class.
    ff = lambda i: [f"layers.{i}.ff.0", f"layers.{i}.ff.3"]  # noqa: E731
    assert apply_recompute(model, _cfg(module_classes=["Linear"], name_globs=["layers.1"])) == [
        "proj", *ff(0), "layers.1", *ff(2), *ff(3), "out"]


def test_bad_configs_raise():
    model = TinyTransformer()
    assert apply_recompute(model, RecomputeConfig(enabled=False, module_classes=["Block"])) == []
    with pytest.raises(ValueError, match=r"ConformerLayer.*encoder\.layers\.\*"):
        apply_recompute(model, _cfg(module_classes=["ConformerLayer"],
                                    name_globs=["encoder.layers.*"]))
    with pytest.raises(ValueError, match="every_k"):
        apply_recompute(model, _cfg(module_classes=["Block"], every_k=0))
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_saved_bytes_counts_each_storage_once():
    x = torch.randn(256, requires_grad=True)
    with SavedBytes() as counter:
        y = x.sin() * x.view(16, 16).flatten()  # x saved twice: as itself and as a view
    assert counter.nbytes == 2 * x.numel() * 4  # x once + the sin output; y.grad_fn keeps it alive
    del y


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_and_fp16_autocast_are_replayed():
    torch.manual_seed(0)
    plain = TinyTransformer(d=64).cuda().train()
    ours = copy.deepcopy(plain)
    apply_recompute(ours, _cfg(module_classes=["Block"]))
    feats = torch.randn(4, 33, 8, device="cuda")

    def loss_fn(m):
        with torch.autocast("cuda", dtype=torch.float16):
            return m(feats).float().pow(2).sum()

    want, got = _grads(plain, loss_fn), _grads(ours, loss_fn)
    assert "cuda_rng_after" in want
    _assert_same(want, got)


# ---- DDP: 2 gloo ranks, no_sync accumulation, checkpointed vs plain --------------------------


def _ddp_grads(rank: int, model: nn.Module, batches: list[torch.Tensor]) -> dict:
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    for step, feats in enumerate(batches):  # accumulate the micro-batches, sync on the last
        with contextlib.nullcontext() if step == len(batches) - 1 else ddp.no_sync():
            torch.manual_seed(100 * rank + step)  # same dropout masks for both models
            ddp(feats).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _ddp_worker(rank: int, world: int, port: int) -> None:
    faulthandler.dump_traceback_later(80, exit=True)  # a stuck rank prints where, then exits
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)  # a dead peer becomes an error, not a hang
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        torch.manual_seed(0)
        base = TinyTransformer().train()
        recomputed = copy.deepcopy(base)
        apply_recompute(recomputed, _cfg(module_classes=["Block"]))
        gen = torch.Generator().manual_seed(rank)
        batches = [torch.randn(2, 6, 8, generator=gen) for _ in range(3)]
        plain, ours = _ddp_grads(rank, base, batches), _ddp_grads(rank, recomputed, batches)
        _assert_same(plain, ours)
        flat = torch.cat([g.flatten() for g in ours.values()])
        other = flat.clone()
        dist.broadcast(other, src=0)
        assert torch.equal(flat, other), "ranks hold different gradients after the all-reduce"
        gc.collect()  # free the DDP reducers while the process group and the peer still exist
        dist.barrier()
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.timeout(120)
def test_ddp_no_sync_accumulation_matches_plain():
    # The parent hosts the rendezvous store (port 0: the OS picks a free one, no races).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.start_processes(_ddp_worker, args=(2, store.port), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 100
    while not ctx.join(timeout=1):  # raises if a rank failed (and terminates the other rank)
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("DDP ranks hung")


# ---- transformers (skipped without it) --------------------------------------------------------


def test_transformers_whisper_and_wav2vec2_layers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    whisper = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=64, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=16, max_target_positions=32, dropout=0.1,
        attention_dropout=0.1, activation_dropout=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, use_cache=False)).train()
    w2v = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, hidden_dropout=0.1,
        activation_dropout=0.1, attention_dropout=0.1, feat_proj_dropout=0.1, layerdrop=0.0,
        mask_time_prob=0.0, ctc_zero_infinity=True, pad_token_id=0)).train()
    feats, tokens = torch.randn(2, 8, 32), torch.randint(3, 64, (2, 6))
    wave, labels = torch.randn(2, 800), torch.randint(1, 12, (2, 10))
    cases = [(whisper, ["WhisperEncoderLayer", "WhisperDecoderLayer"], 4,
              lambda m: m(input_features=feats, labels=tokens).loss),
             (w2v, ["Wav2Vec2EncoderLayer", "Wav2Vec2EncoderLayerStableLayerNorm"], 2,
              lambda m: m(wave, labels=labels).loss)]
    for plain, classes, n, loss_fn in cases:
        ours = copy.deepcopy(plain)
        assert len(apply_recompute(ours, _cfg(module_classes=classes))) == n
        _assert_same(_grads(plain, loss_fn), _grads(ours, loss_fn))
        params = [*plain.parameters(), *ours.parameters()]  # weights exist either way
        assert (saved_activation_bytes(lambda: loss_fn(ours), params)
                < saved_activation_bytes(lambda: loss_fn(plain), params))


class NormBlock(nn.Module):
    """A block with every kind of running-statistics norm (the Conformer conv module has a BatchNorm1d)."""

    def __init__(self, c: int = 6):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm1d(c)
        self.cma = nn.BatchNorm1d(c, momentum=None)  # cumulative average: reads num_batches_tracked
        self.inorm = nn.InstanceNorm1d(c, affine=True, track_running_stats=True)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.inorm(self.cma(self.bn(self.conv(x))).relu()))


class NormNet(nn.Module):
    def __init__(self, c: int = 6, n: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(NormBlock(c) for _ in range(n))
        self.head = nn.Conv1d(c, 3, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train_norm_net(model: nn.Module, steps: int = 3) -> dict:
    """SGD steps on fixed batches; then the state (weights and running statistics) and eval outputs."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 6, 9, generator=gen) for _ in range(steps)]
    torch.manual_seed(0)
    model.train()
    for x in batches:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = {"eval_out": model(batches[0] * 2 + 1)}
    out.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.parametrize("how", ["recompute", "recompute+offload", "recompute+compile", "checkpoint(forward)",
                                 "checkpoint(lambda)"])
def test_running_statistics_are_updated_once_per_step(how):
    """Recomputation in backward must not update BatchNorm/InstanceNorm running statistics again."""
    torch.manual_seed(0)
    plain = NormNet()
    want = _train_norm_net(copy.deepcopy(plain))
    assert int(want["blocks.0.bn.num_batches_tracked"]) == 3
    ours = copy.deepcopy(plain)
    cfg = _cfg(module_classes=["NormBlock"])
    if how == "recompute+compile":
        from ddptrain.compile import apply_compile
        from ddptrain.config import CompileConfig
        apply_compile(ours, CompileConfig(enabled=True, module_classes=["NormBlock"], backend="aot_eager"))
    if how == "checkpoint(forward)":  # the public function, given a bound forward
        for block in ours.blocks:
            block.forward = functools.partial(checkpoint, type(block).forward.__get__(block))
    elif how == "checkpoint(lambda)":  # ... or a function that calls the modules
        blocks, head = list(ours.blocks), ours.head
        ours.forward = lambda x: head(checkpoint(lambda y: blocks[1](blocks[0](y)), x))
    else:
        apply_recompute(ours, cfg)
    if how == "recompute+offload":
        from ddptrain.activation_offload import apply_offload
        with pytest.warns(RuntimeWarning, match="CPU device"):
            apply_offload(ours, _cfg(module_classes=["NormBlock"], offload="cpu"), torch.device("cpu"), min_bytes=0)
    got = _train_norm_net(ours)
    _assert_same(want, got)
