"""Tests for ddptrain/activation_offload.py: offloaded saved tensors give the plain gradients, bit for
bit, and really leave the compute device between the forward and the backward.

Everything runs on CPU (the offloader's CPU path: the same code with plain copies instead of side
stream copies); bench/check_activation_offload.py checks the CUDA path on a GPU. Dropout is on and
models train, so a slip in what comes back (or in recompute's RNG replay) changes a gradient.
"""

from __future__ import annotations

import copy
import json
import warnings
import weakref

import pytest
import torch
from torch import nn

import ddptrain
from ddptrain import activation_offload
from ddptrain.activation_offload import ActivationOffload, HostPool, _Saved, apply_offload
from ddptrain.config import ConfigError, RecomputeConfig
from ddptrain.recompute import _Handle, apply_recompute

from test_recompute import TinyTransformer, _assert_same, _grads

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tiny models: one thread is fastest

CPU = torch.device("cpu")
MODES = {"recompute": True, "saved": False}  # offload what recompute keeps / everything saved inside


def _offloaded(model: nn.Module, recompute: bool, **kw) -> ActivationOffload:
    cfg = RecomputeConfig(enabled=recompute, module_classes=["Block"], offload="cpu", **kw)
    if recompute:
        apply_recompute(model, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "on a CPU device ... saves nothing"
        return apply_offload(model, cfg, CPU, min_bytes=0)


def _batch(seed: int = 0, b: int = 3, t: int = 9):
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, t, 8, generator=gen)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[1, t - 3:] = True  # padding: a second (bool) input of every block
    return feats, mask


# ----------------------------------------------------------------------------- (1) exact gradients


@pytest.mark.parametrize("mode", MODES)
def test_grads_and_loss_equal_plain_bitwise(mode):
    torch.manual_seed(0)
    plain = TinyTransformer().train()
    ours = copy.deepcopy(plain)
    offload = _offloaded(ours, MODES[mode])
    feats, mask = _batch()
    losses = {}

    def loss_fn(name):
        def f(m):
            loss = m(feats, mask).pow(2).sum()
            losses[name] = loss.detach()
            return loss
        return f

    want = _grads(plain, loss_fn("plain"))
    got = _grads(ours, loss_fn("ours"))
    assert torch.equal(losses["plain"], losses["ours"])
    _assert_same(want, got)  # every parameter's gradient, and the RNG stream afterwards
    assert offload.stats["offloaded"] > 0 and offload.pool.live_bytes == 0
    if mode == "recompute":  # and recompute without offload is the same again
        plain_recompute = copy.deepcopy(plain)
        apply_recompute(plain_recompute, RecomputeConfig(enabled=True, module_classes=["Block"]))
        _assert_same(want, _grads(plain_recompute, loss_fn("recompute")))


def test_autocast_and_every_k():
    torch.manual_seed(0)
    plain = TinyTransformer().train()
    ours = copy.deepcopy(plain)
    offload = _offloaded(ours, False, every_k=2)
    feats, mask = _batch()

    def loss_fn(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(feats, mask)
        return out.float().pow(2).sum()

    _assert_same(_grads(plain, loss_fn), _grads(ours, loss_fn))
    # autocast's bf16 casts of the weights are weights: they stay
    assert offload.stats["kept_weight"] > 0 and offload.stats["prefetched"] == 1  # 2 regions: layers 0, 2


# ----------------------------------------------------------------------------- (2) where tensors are


class _Outside:
    """What the test's own (outer) hook packs: a tensor saved outside every selected module."""

    def __init__(self, t):
        self.t = t


def _saved_items(root) -> list:
    """Every packed saved-tensor object held by the autograd graph below ``root`` (structurally:
    the graph's nodes and their raw SavedTensors; a recompute region's kept inputs, reached
    through the frame its handles unpack with)."""
    seen, stack, out = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_raw_saved_"):
                raw = getattr(node, name)
                for st in raw if isinstance(raw, (list, tuple)) else [raw]:
                    data = st.data
                    if data is None:  # not needed for this backward (an input that needs no grad): not saved
                        continue
                    out.append(data)
                    if isinstance(data, _Handle):  # recompute: the frame keeps the region's inputs
                        saver = st.unpack_hook.__self__.saver.grad_fn
                        out += [s.data for s in saver._raw_saved_tensors]
        stack += [fn for fn, _ in node.next_functions]
    return out


@pytest.mark.parametrize("mode", MODES)
def test_saved_tensors_of_selected_modules_wait_on_the_host(mode):
    torch.manual_seed(0)
    model = TinyTransformer().train()
    offload = _offloaded(model, MODES[mode])
    input_bytes = []  # of every block's tensor inputs (its hidden state and the padding mask)
    for block in model.layers:
        block.register_forward_pre_hook(lambda m, args, kw: input_bytes.extend(
            t.numel() * t.element_size() for t in [*args, *kw.values()] if isinstance(t, torch.Tensor)),
            with_kwargs=True)
    feats, mask = _batch()
    with torch.autograd.graph.saved_tensors_hooks(_Outside, lambda o: o.t):
        loss = model(feats, mask).pow(2).sum()
    items = _saved_items(loss.grad_fn)
    ours = [i for i in items if isinstance(i, _Saved)]
    # kept on the device: by the offloader, or Python numbers (autograd saves those without hooks)
    left = [i for i in items if isinstance(i, torch.Tensor) and i.dim() > 0]
    other = [type(i).__name__ for i in items if not isinstance(i, (_Saved, _Outside, _Handle, torch.Tensor))]
    assert ours and not other, other
    assert all(activation_offload._is_weight(t) for t in left), "an activation stayed on the device"
    assert all(s.device is None for s in ours), "brought back before the backward"
    chunks = {c.data.untyped_storage().data_ptr() for c in offload.pool._chunks}
    assert all(s.copy.host.untyped_storage().data_ptr() in chunks for s in ours), "not in the pool"
    assert offload.pool.live_bytes >= offload.stats["offloaded_bytes"] > 0
    if mode == "recompute":  # exactly the blocks' inputs went to host (the mask once: shared), nothing else
        mask_bytes = mask.numel()
        assert offload.stats["offloaded_bytes"] == sum(input_bytes) - 3 * mask_bytes
        assert offload.stats["shared"] == 3 and not left
    else:  # everything saved inside the blocks: much more than their inputs
        assert offload.stats["offloaded_bytes"] > 5 * sum(input_bytes)
    del items, ours, left
    loss.backward()
    assert offload.pool.live_bytes == 0, "host blocks not given back after the backward"
    assert offload.stats["prefetched"] == 3  # regions 2, 1, 0 came back while the next one ran


def test_block_inputs_are_freed_on_the_device_between_forward_and_backward():
    """With recompute, the device copy of each block's input is dead after the forward (only the
    host copy is left); without offload recompute keeps them alive."""

    def alive_inputs(model):
        refs = []
        hooks = [b.register_forward_pre_hook(lambda m, args: refs.append(weakref.ref(args[0])))
                 for b in model.layers]
        loss = model(feats).pow(2).sum()
        for h in hooks:
            h.remove()
        n = sum(r() is not None for r in refs)
        loss.backward()
        return n

    torch.manual_seed(0)
    feats = torch.randn(2, 7, 8)
    kept = TinyTransformer().train()
    moved = copy.deepcopy(kept)
    apply_recompute(kept, RecomputeConfig(enabled=True, module_classes=["Block"]))
    _offloaded(moved, True)
    assert alive_inputs(kept) == 4
    assert alive_inputs(moved) == 0


# ----------------------------------------------------------------------------- the mechanism


class _SaveBoth(torch.autograd.Function):
    """y = a * b, saving both: what comes back in backward is checked by the test."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        _SaveBoth.seen = (a, b)
        return g * b, g * a


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "expanded", "gapped", "offset"])
def test_strided_tensors_come_back_with_their_values_and_strides(layout):
    base = torch.randn(4, 6, 5)
    b = {"contiguous": base, "permuted": base.permute(2, 0, 1), "expanded": base[:, :1].expand(4, 6, 5),
         "gapped": base[:, ::2], "offset": base[1:]}[layout]
    a = torch.randn(b.shape, requires_grad=True)
    offload = ActivationOffload(CPU, min_bytes=0)
    with offload.region():
        y = _SaveBoth.apply(a, b)
    # bytes of b's copy: its memory from first to last element, or its elements if that has gaps
    b_bytes = {"contiguous": 480, "permuted": 480, "expanded": 95 * 4, "gapped": 60 * 4, "offset": 360}[layout]
    assert offload.stats["offloaded_bytes"] == a.numel() * 4 + b_bytes
    y.sum().backward()
    got = _SaveBoth.seen[1]
    assert torch.equal(got, b) and got.data_ptr() != b.data_ptr()
    if layout != "gapped":  # dense and overlapping views keep their strides (same kernels in backward)
        assert got.stride() == b.stride()
    assert offload.stats["offloaded"] == 2


def test_small_tensors_parameters_and_views_stay():
    w = nn.Parameter(torch.randn(32, 32))
    x = torch.randn(64, 32, requires_grad=True)
    offload = ActivationOffload(CPU, min_bytes=64 * 32 * 4)  # x is exactly that big, x[:1] is not
    with offload.region():
        y = (x @ w.t()).sum() + (x[:1] * 2).sin().sum()
    assert offload.stats["kept_weight"] >= 1 and offload.stats["kept_small"] >= 1
    assert offload.stats["offloaded"] == 1  # x (saved by the matmul)
    y.backward()
    torch.testing.assert_close(w.grad, x.detach().sum(0).expand(32, 32))


def test_a_tensor_saved_twice_is_copied_once_and_inplace_changes_are_reported():
    x = torch.randn(16, 16, requires_grad=True)
    offload = ActivationOffload(CPU, min_bytes=0)
    with offload.region():
        h = x.tanh()
        y = (h.sin() + h.cos() + h.exp()).sum()  # h saved by tanh (its output), sin and cos; exp its output
    assert offload.stats["offloaded"] == 2
    y.backward()
    torch.testing.assert_close(x.grad, ((h.cos() - h.sin() + h.exp()) * (1 - h ** 2)).detach())

    with offload.region():
        h = x * 2
        z = h.sin().sum()
    h.add_(1)  # plain autograd refuses this at the backward; the host copy would be stale
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_retain_graph_backward_twice():
    torch.manual_seed(0)
    plain = TinyTransformer().train()
    ours = copy.deepcopy(plain)
    _offloaded(ours, False)
    feats, mask = _batch()
    grads = []
    for m in (plain, ours):
        torch.manual_seed(0)
        loss = m(feats, mask).pow(2).sum()
        loss.backward(retain_graph=True)
        if m is ours:  # the retained graph still holds its saves; their device copies are gone
            saves = [s for s in _saved_items(loss.grad_fn) if isinstance(s, _Saved)]
            assert saves and all(s.device is None for s in saves), "a device copy outlived its unpack"
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    _assert_same(*grads)


def test_pool_reuses_its_chunks_step_after_step():
    pool = HostPool(pin=False, chunk_bytes=4096)
    blocks = [pool.take(1000) for _ in range(3)]  # 1024 each: one chunk of 4096
    assert pool.held_bytes == 4096 and pool.live_bytes == 3072
    big = pool.take(5000)  # a chunk of its own (8192: a power of two)
    assert pool.held_bytes == 4096 + 8192
    for b in reversed(blocks + [big]):
        pool.give(b)
    assert pool.live_bytes == 0
    again = [pool.take(1000) for _ in range(3)] + [pool.take(5000)]
    assert pool.held_bytes == 4096 + 8192, "a second step allocated new memory"
    assert {b.offset for b in again[:3]} == {0, 1024, 2048}
    for b in again:
        pool.give(b)
    pool.release()
    assert pool.held_bytes == 0


def test_steps_reuse_the_host_memory():
    torch.manual_seed(0)
    model = TinyTransformer().train()
    offload = _offloaded(model, False)
    for step in range(3):
        model(*_batch(step)).pow(2).sum().backward()
        if step == 0:
            held = offload.pool.held_bytes
    assert offload.pool.held_bytes == held and offload.pool.bytes_in == 3 * offload.pool.peak_live_bytes


# ----------------------------------------------------------------------------- (3) refused set-ups


@pytest.mark.parametrize("overrides, match", [
    (["recompute.offload=cpu"], "recompute.offload=cpu needs recompute.module_classes"),
    (["recompute.offload=cpu", "recompute.module_classes=[Block]", "compile.enabled=true"],
     "needs a regional compile"),
    (["recompute.offload=disk", "recompute.module_classes=[Block]"], "recompute.offload='disk' is not one of"),
    (["recompute.offload=cpu", "recompute.module_classes=[Block]", "lora.enabled=true", "lora.targets=[x]",
      "lora.base_offload=cpu"], "with recompute.offload=cpu needs recompute.enabled=true"),  # streamed_base's rule
])
def test_config_refuses(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ddptrain.load_config(None, overrides)


def test_config_accepts():
    cfg = ddptrain.load_config(None, ["recompute.offload=true", "recompute.name_globs=[layers.*]",
                                      "compile.enabled=true", "compile.module_classes=[Block]"])
    assert cfg.recompute.offload == "cpu"
    assert ddptrain.load_config(None, []).recompute.offload == "none"


def test_apply_refuses_and_warns():
    model = TinyTransformer()
    assert apply_offload(model, RecomputeConfig(module_classes=["Block"]), CPU) is None  # offload: none
    with pytest.raises(ValueError, match="apply_recompute"):  # recompute.enabled, but not applied
        apply_offload(model, RecomputeConfig(enabled=True, module_classes=["Block"], offload="cpu"), CPU)
    with pytest.raises(ValueError, match="no module matched"):
        apply_offload(model, RecomputeConfig(module_classes=["Conformer"], offload="cpu"), CPU)
    with pytest.warns(RuntimeWarning, match="saves nothing"):
        off = apply_offload(model, RecomputeConfig(module_classes=["Block"], offload="cpu"), CPU)
    off.remove()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


# ----------------------------------------------------------------------------- (4) accumulation, Trainer


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["sequential", "both_forwards_first"])
def test_two_micro_batches_accumulate_like_plain(mode, order):
    torch.manual_seed(0)
    plain = TinyTransformer().train()
    ours = copy.deepcopy(plain)
    offload = _offloaded(ours, MODES[mode])
    batches = [_batch(1, b=3, t=9), _batch(2, b=2, t=5)]  # other shapes: other blocks of the pool

    def accumulate(m):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        if order == "sequential":
            for feats, mask in batches:
                m(feats, mask).pow(2).sum().backward()
        else:  # two graphs alive at once, then one backward through both
            sum(m(feats, mask).pow(2).sum() for feats, mask in batches).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()} | {"rng": torch.get_rng_state()}

    _assert_same(accumulate(plain), accumulate(ours))
    assert offload.pool.live_bytes == 0


class SeqModel(nn.Module):
    """TinyTransformer on the Trainer's dict batches."""

    def __init__(self):
        super().__init__()
        self.net = TinyTransformer()

    def forward(self, x, mask):
        return self.net(x, mask)


def seq_loss(model, batch):
    out = model(batch["x"], batch["mask"])
    keep = ~batch["mask"]
    return (out.float().pow(2).sum(-1) * keep).sum(), keep.sum()


@pytest.mark.parametrize("mode", MODES)
def test_trainer_end_to_end(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(activation_offload, "MIN_BYTES", 0)  # the tiny model's tensors go too
    data = [dict(zip(("x", "mask"), _batch(i, b=2 + i % 2, t=5 + i))) for i in range(6)]
    runs = {}
    for offload in ("none", "cpu"):
        torch.manual_seed(0)
        model = SeqModel()
        out = tmp_path / offload
        cfg = ddptrain.load_config(None, [
            f"trainer.output_dir={out}", "logging.progress_bar=false", "logging.log_every=1",
            "logging.tensorboard=false", "trainer.max_steps=3", "trainer.grad_accum_steps=2",
            "checkpoint.save_at_end=false", f"recompute.enabled={MODES[mode]}",
            "recompute.module_classes=[Block]", f"recompute.offload={offload}"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            trainer = ddptrain.Trainer(model, seq_loss, cfg, data)
        trainer.fit()
        trainer.close()
        losses = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")
                  if json.loads(line)["split"] == "train"]
        runs[offload] = (losses, {k: v.clone() for k, v in model.state_dict().items()}, trainer.activation_offload)
    assert runs["none"][2] is None
    offload = runs["cpu"][2]
    assert offload.stats["offloaded"] > 0 and offload.pool.live_bytes == 0
    assert len(runs["cpu"][0]) == 3 and runs["cpu"][0] == runs["none"][0]
    for k, v in runs["none"][1].items():
        assert torch.equal(v, runs["cpu"][1][k]), k


@pytest.mark.filterwarnings("ignore:recompute.offload=cpu on a CPU device")
def test_recompute_offload_composes_with_the_streamed_base(tmp_path, monkeypatch):
    """lora.base_offload's saved-tensor hooks are entered first (outside ours): with recompute the
    blocks' kept inputs reach ours and go to host, the weights still stream, all bitwise."""
    from test_streamed_base import OFFLOAD as BASE_OFFLOAD, RECOMPUTE, train

    monkeypatch.setattr(activation_offload, "MIN_BYTES", 0)
    want, want_state, _, _ = train(tmp_path / "streamed", *RECOMPUTE, *BASE_OFFLOAD, steps=4)
    got, state, trainer, seen = train(tmp_path / "both", *RECOMPUTE, *BASE_OFFLOAD, "recompute.offload=cpu", steps=4)
    assert torch.equal(torch.stack(got.train), torch.stack(want.train))
    assert all(torch.equal(v, state[k]) for k, v in want_state.items())
    assert trainer.activation_offload.stats["offloaded"] > 0 and seen  # inputs to host, weights from the ring
