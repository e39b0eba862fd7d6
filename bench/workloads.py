"""The benchmark's three workloads: model, loss and batches, random-initialised and synthetic.

Nothing is downloaded; the data lives in memory: ``ddptrain.data.SyntheticSpeech``, shaped by
examples/finetune_hf_model.py's ``SYNTHETIC`` corpora.

* ``wav2vec2``: Wav2Vec2ForCTC, wav2vec2-large-lv60 layout (315M), raw 16 kHz audio with
  lognormal durations (median 7 s, clipped 1-20 s), CNN front end frozen.
* ``whisper``: WhisperForConditionalGeneration, Whisper-large-v3 layout (1.54B, 128 mel bins,
  30 s windows), lognormal transcript lengths (median 60 tokens).
* ``conformer``: the examples' Conformer-CTC at bench size (d_model 512, 17 layers, 110M;
  80-bin fbank, the wav2vec2 durations).

Preset ``tiny`` gives small models of the same code for CPU dry runs. wav2vec2 and Whisper need
``transformers`` (a benchmark dependency, never one of ddptrain's).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..", "examples", "models"))
                if p not in sys.path]

import finetune_hf_model as fhm  # noqa: E402

import ddptrain  # noqa: E402
from flops import Flops  # noqa: E402
from measure import Interleave  # noqa: E402

SR = 16000
WORKLOADS = ("wav2vec2", "whisper", "conformer")
CONFORMER_SIZES = {"large": dict(d_model=512, num_heads=8, ffn_dim=2048, num_layers=17, vocab_size=256,
                                 subsampling_channels=512),
                   "tiny": dict(d_model=32, num_heads=2, ffn_dim=64, num_layers=2)}


def hf_cfg(workload: str, preset: str, exp: dict) -> fhm.HFConfig:
    """The example's HF model/data settings for an experiment (batch, attention kernel)."""
    h = fhm.HFConfig(model="whisper" if workload == "whisper" else "wav2vec2", preset=preset)
    h.batch_size = int(exp.get("batch", 8))
    h.attn_implementation = exp.get("attn", "sdpa")
    return h


def build(workload: str, preset: str, exp: dict, dev):
    """(model on ``dev``, loss_fn, Flops) for a workload; the model is initialised on the device."""
    torch.manual_seed(0)
    with torch.device(dev):
        if workload == "conformer":
            from conformer_ctc import ConformerCTC, ConformerCTCConfig

            model = ConformerCTC(ConformerCTCConfig(**CONFORMER_SIZES[preset]))
            loss = conformer_loss
        else:
            model = fhm.build_model(hf_cfg(workload, preset, exp))
            loss = fhm.loss_for(model)
    model.to(dev)  # a few HF parameters (torch.Tensor(...) legacy constructors) ignore the default device
    return model, loss, Flops(workload, model)


def conformer_loss(model, batch):
    """CTC loss summed over the batch, normalised per target token (the ddptrain contract)."""
    log_probs, out_lens = model(batch["features"], batch["feature_lens"])
    loss = F.ctc_loss(log_probs.float().transpose(0, 1), batch["tokens"], out_lens, batch["token_lens"],
                      blank=0, reduction="sum", zero_infinity=True)
    return loss, batch["token_lens"].sum()


class StatsCollate:
    """Adds ``stats`` (host floats: real/padded audio seconds, samples, tokens, FLOPs) to each batch,
    computed in the DataLoader worker from the padded shapes, so measuring needs no host sync.

    Args:
        inner: the collate function to wrap.
        kind: the workload.
        flops: its :class:`Flops`.
        drop: keys to remove after counting (helper keys a peer's model must not receive).
    """

    def __init__(self, inner, kind: str, flops: Flops, drop: tuple = ()):
        self.inner, self.kind, self.flops, self.drop = inner, kind, flops, drop

    def __call__(self, examples):
        b = self.inner(examples)
        s = {"n": 0, "audio_s": 0.0, "padded_s": 0.0, "tokens": 0, "flops": 0.0}
        if self.kind == "wav2vec2":
            n, t = b["audio"].shape
            s.update(n=n, audio_s=float(b["audio_lens"].sum()) / SR, padded_s=n * t / SR, flops=self.flops.wav2vec2(n, t))
        elif self.kind == "whisper":
            n, L = b["tokens"].shape
            s.update(n=n, audio_s=30.0 * n, padded_s=30.0 * n, flops=self.flops.whisper(n, L))
        else:
            n, t = b["features"].shape[:2]
            s.update(n=n, audio_s=float(b["feature_lens"].sum()) / 100, padded_s=n * t / 100,
                     flops=self.flops.conformer(n, t))
        if "token_lens" in b:
            s["tokens"] = int(b["token_lens"].sum())
        b["stats"] = s
        for k in self.drop:
            b.pop(k, None)
        return b


def make_loader(workload: str, preset: str, exp: dict, model, flops: Flops, rank: int, ws: int, data_cfg=None):
    """The DataLoader ddptrain and the bare loop train on: ``DurationBucketSampler`` batches of the
    synthetic corpus for ``rank`` of ``ws``, each carrying its ``stats``.

    ``exp["as_world"] = N`` on one process returns the batches of all ``N`` ranks (``Interleave``).
    """
    if exp.get("as_world", 1) > 1 and ws == 1:
        n = exp["as_world"]
        one = dict(exp, as_world=1)
        return Interleave([make_loader(workload, preset, one, model, flops, r, n, data_cfg) for r in range(n)])
    data_cfg = data_cfg or ddptrain.load_config(None, [f"data.max_duration={exp.get('budget', 400)}",
                                                       f"data.num_workers={exp.get('workers', 4)}"]).data
    wrap = lambda c: StatsCollate(c, workload, flops)  # noqa: E731
    h = hf_cfg(workload, preset, exp)
    if workload == "conformer":
        from ddptrain.data import DurationBucketSampler, SpeechCollator, make_loader

        # the wav2vec2 corpus as 80-bin fbank frames (100 a second); targets must be below the
        # model's vocabulary: CPU ctc_loss does not check, and an out-of-range target writes
        # outside its buffers
        speech = fhm.SYNTHETIC["wav2vec2"].dataset(data_cfg.seed, (1, model.cfg.vocab_size), num_mel_bins=80)
        sampler = DurationBucketSampler.from_config(speech.durations, data_cfg, True, world_size=ws, rank=rank)
        return make_loader(speech, sampler, wrap(SpeechCollator(mode="features", num_mel_bins=80, pad_to_multiple=1)),
                           data_cfg)
    return fhm.build_synthetic_loader(h, data_cfg, ws, rank, getattr(model, "config", None), collate_wrapper=wrap)
