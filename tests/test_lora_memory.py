"""What LoRA + recompute keep alive, measured on CPU by counting live tensor storages.

The case: GLM-4.1V-9B LoRA on one H200 peaked at 87.5 GiB under ddptrain against 36.4 GiB under
HF Trainer + peft (BENCHMARKS.md). The decoder's ``use_cache`` defaults to True in training, so
every recomputed decoder layer wrote its keys/values into the DynamicCache a second time in
backward; the cache then held each recomputed layer's autograd graph, and through it every tensor
the recomputation had captured, to the end of the backward: all 40 layers' activations at once,
recompute undone. Measured here at 1/8 width and 1/8 sequence (bench_9b's model at the real
depth): backward peak 1,103 MiB before, 88 MiB after, i.e. ~67 GiB -> ~5.5 GiB at full size.

The fixes: recompute hands the recomputed graph empty slots instead of the tensors (state that
keeps the graph no longer keeps activations) and warns about a KV cache in a recomputed region;
bench_9b calls the model with ``use_cache=False``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ddptrain
from ddptrain.config import RecomputeConfig
from ddptrain.lora import apply_lora
from ddptrain.recompute import apply_recompute

pytest.importorskip("transformers")
from transformers import Glm4vTextConfig  # noqa: E402
from transformers.models.glm4v.modeling_glm4v import Glm4vTextModel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_9b  # noqa: E402

TARGETS = ["*layers.*.self_attn.[qkvo]_proj", "*layers.*.mlp.*_proj"]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the CPU tensor storages created inside the context and still alive.

    Storages that exist before (``ignore``: parameters, inputs, their gradients) are not counted;
    a view of a counted storage is not counted again. A storage leaves the count when it is freed
    (a finalizer on its Python object, which torch keeps for as long as the storage lives).
    """

    def __init__(self, ignore=()):
        super().__init__()
        self.live = self.peak = 0
        self._seen = {t.untyped_storage().data_ptr() for t in ignore if isinstance(t, torch.Tensor)}

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n and key not in self._seen:
                    self._seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, key, n)
        return out


def _decoder(layers: int, d: int = 64) -> Glm4vTextModel:
    """A GLM-4.1V text decoder at a tiny width, LoRA r=4 on attention + MLP, every layer recomputed."""
    cfg = Glm4vTextConfig(hidden_size=d, intermediate_size=3 * d, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=32, max_position_embeddings=512,
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                               mrope_section=[1, 1, 2]))
    torch.manual_seed(0)
    model = Glm4vTextModel(cfg).train()
    apply_lora(model, TARGETS, rank=4)
    with torch.no_grad():  # non-zero adapters: the gradients below then flow through both LoRA factors
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.1)
    wrapped = apply_recompute(model, RecomputeConfig(enabled=True, module_classes=["Glm4vTextDecoderLayer"]))
    assert len(wrapped) == layers
    return model


def _backward_peak(model, x, use_cache: bool) -> int:
    """Bytes of new storages alive at the peak of one backward (after a forward with ``use_cache``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the KV-cache warning, tested on its own below
        loss = model(inputs_embeds=x, use_cache=use_cache).last_hidden_state.float().square().sum()
    with LiveBytes(ignore=[*model.parameters(), x]) as live:
        loss.backward()
    return live.peak


def test_a_kv_cache_does_not_keep_recomputed_activations_alive():
    """Backward memory of 8 recomputed LoRA layers is one layer's recomputation plus the layer inputs,
    with or without a DynamicCache (``use_cache=True``) passed through the layers. Before the fix
    the cache kept every layer's recomputation: 6.7x the no-cache peak here, growing with depth."""
    model = _decoder(8)
    x = torch.randn(1, 256, 64)
    plain = _backward_peak(model, x, use_cache=False)
    cached = _backward_peak(model, x, use_cache=True)
    # what the cache itself keeps by design: per layer the keys and values of the forward and of the
    # recomputation (2 x 256 positions), 2 heads x 16 dims, fp32
    kv = 8 * 2 * (2 * 256) * 2 * 16 * 4
    assert cached - plain <= 1.1 * kv, (cached, plain, kv)


def test_recompute_backward_memory_grows_by_layer_inputs_only():
    """6 more recomputed LoRA layers cost ~6 layer inputs in backward, not 6 layers of activations
    (one layer's recomputation is ~25 inputs' worth here)."""
    x = torch.randn(1, 256, 64)
    two, eight = (_backward_peak(_decoder(n), x, use_cache=True) for n in (2, 8))
    per_layer, layer_input = (eight - two) / 6, x.numel() * x.element_size()
    assert per_layer <= 3 * layer_input, (two, eight, layer_input)


def test_gradients_under_a_kv_cache_equal_plain_backward():
    """The recomputed regions give the gradients of a run without recompute, cache or not."""
    x = torch.randn(1, 32, 64)

    def grads(model, use_cache):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            model(inputs_embeds=x, use_cache=use_cache).last_hidden_state.square().sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model = _decoder(3)
    got = grads(model, use_cache=True)
    from ddptrain.recompute import remove_recompute

    remove_recompute(model)
    want = grads(model, use_cache=False)
    assert sorted(got) == sorted(want) and len(got) == 3 * 6 * 2
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_kv_cache_in_a_recomputed_region_warns_once():
    import ddptrain.recompute as rc

    rc._warned_state.discard("Glm4vTextDecoderLayer")  # other tests here may have seen it warn
    model = _decoder(2)
    x = torch.randn(1, 8, 64)
    with pytest.warns(RuntimeWarning, match="Glm4vTextDecoderLayer .*DynamicCache.*use_cache=False") as seen:
        model(inputs_embeds=x, use_cache=True)
        model(inputs_embeds=x, use_cache=True)
    assert len([w for w in seen if "recompute:" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model(inputs_embeds=x, use_cache=False).last_hidden_state.sum().backward()  # no cache: silent


def test_the_recomputed_graph_holds_no_tensors():
    """A tensor of a recomputation that escaped into outside state (the cache's keys) cannot be
    backpropagated: its graph's saved tensors were handed to the real backward and let go."""
    model = _decoder(1)
    x = torch.randn(1, 8, 64)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model(inputs_embeds=x, cache=cache, use_cache=True).last_hidden_state.sum().backward()
    keys = cache.layers[0].keys  # forward's 8 keys + the recomputation's 8
    assert keys.shape[-2] == 16 and keys.grad_fn is not None
    with pytest.raises(RuntimeError, match="graph of a recomputation"):
        keys[..., 8:, :].sum().backward()


# ---- bench_9b: the GLM-4.1V LoRA step itself, at a tiny width and two depths


def _bench_step_peak(tmp_path, layers: int, monkeypatch) -> tuple[int, ddptrain.Trainer, dict]:
    preset = f"tiny{layers}"
    monkeypatch.setitem(bench_9b.TEXT, preset, dict(bench_9b.TEXT["tiny"], num_hidden_layers=layers))
    monkeypatch.setitem(bench_9b.VISION, preset, bench_9b.VISION["tiny"])
    monkeypatch.setitem(bench_9b.BATCH, preset, dict(seq=128, grid=8))
    job = dict(model="9b", peer="ddptrain", lora=True)
    cfg = ddptrain.load_config(None, [
        f"trainer.output_dir={tmp_path}/{preset}", "trainer.precision=bf16", "trainer.param_dtype=bf16",
        "trainer.max_steps=2", "checkpoint.save_at_end=false", "logging.tensorboard=false",
        "logging.progress_bar=false", "logging.log_every=100000", "recompute.enabled=true",
        "recompute.module_classes=[Glm4vTextDecoderLayer]", "lora.enabled=true",
        f"lora.targets={json.dumps(bench_9b.LORA_TARGETS)}", "lora.rank=16", "lora.alpha=32"])
    dev = torch.device("cpu")
    model = bench_9b.WithLoss(bench_9b.build(job, preset, dev))
    batch = bench_9b.make_batch(bench_9b.glm4v_config(preset), preset, dev, vision=True)
    trainer = ddptrain.Trainer(model, lambda m, b: m(**b), cfg, [batch] * 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "recompute:", RuntimeWarning)  # no KV cache reaches a recomputed layer
        trainer.train_step([batch])  # the optimizer state exists from here on
        keep = [*model.parameters(), *batch.values(), *(v for s in trainer.optimizer.state.values()
                                                        for v in s.values() if torch.is_tensor(v))]
        keep += [m for _, m in trainer.backend.master.pairs] if trainer.backend.master else []
        with LiveBytes(ignore=keep) as live:
            trainer.train_step([batch])
    return live.peak, trainer, batch


@pytest.mark.timeout(120)
def test_bench_9b_lora_step_memory_and_frozen_state(tmp_path, monkeypatch):
    """bench_9b's LoRA step: 4 more decoder layers cost little more than their inputs at the peak
    (before: their recomputed activations too), and the frozen base has no gradient, master or
    optimizer state."""
    import ddptrain.recompute as rc

    monkeypatch.setattr(rc, "_warned_state", set())  # the KV-cache warning (an error below) fires once per class
    two, trainer, _ = _bench_step_peak(tmp_path, 2, monkeypatch)
    trainer.close()
    six, trainer, batch = _bench_step_peak(tmp_path, 6, monkeypatch)
    hidden = batch["input_ids"].numel() * bench_9b.TEXT["tiny"]["hidden_size"] * 2  # one layer input, bf16
    assert (six - two) / 4 <= 4 * hidden, (two, six, hidden)

    model = trainer.module
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}
    assert all(p.grad is None and p.dtype == torch.bfloat16 for p in frozen)
    masters = [m for _, m in trainer.backend.master.pairs]
    assert len(masters) == len(trainable) == 2 * len(trainer.adapted) == 2 * 6 * 6
    optimised = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in optimised} == {id(m) for m in masters}
    state = sum(v.numel() for s in trainer.optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim())
    assert state == 2 * sum(p.numel() for p in trainable)  # Adam's two moments, adapters only
    trainer.close()
