"""Check flops.Flops (the analytic FLOPs behind the MFU numbers) against torch's
FlopCounterMode on one CPU training step of small models (matmul/conv/attention FLOPs counted
by the dispatcher). Run: python bench/check_flops.py (needs transformers)

Expected (torch 2.11, transformers 5.17 and 5.24): whisper ratio 1.003; wav2vec2 0.929, all of the
gap in the grouped positional convolution, whose backward FlopCounterMode counts as 5x its forward
(2x is right: input and weight gradients); matmul and attention terms agree.
"""

import os
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flops import Flops  # noqa: E402
from workloads import fhm  # noqa: E402


def measured(model, loss_fn, batch):
    with FlopCounterMode(display=False) as fc:
        loss, _ = loss_fn(model, batch)
        loss.backward()
    return fc.get_total_flops()


def main():
    torch.manual_seed(0)
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC, WhisperConfig, WhisperForConditionalGeneration

    w = Wav2Vec2ForCTC(Wav2Vec2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=512, conv_dim=(64,) * 7, num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=4, layerdrop=0.0, feat_extract_norm="layer",
                                      do_stable_layer_norm=True, conv_bias=True, mask_time_prob=0.0,
                                      attn_implementation="eager", vocab_size=32))
    w.freeze_feature_encoder()
    n = 3 * 16000 + 123
    batch = {"audio": torch.randn(2, n), "audio_lens": torch.tensor([n, n]),
             "tokens": torch.randint(1, 32, (2, 20)), "token_lens": torch.tensor([20, 20])}
    m, a = measured(w, fhm.CTCLoss(w.config), batch), Flops("wav2vec2", w).wav2vec2(2, n)
    print(f"wav2vec2: counted {m:.4g}  analytic {a:.4g}  ratio {a / m:.3f}")

    wh = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=1000, num_mel_bins=16, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, max_source_positions=1500,
        pad_token_id=0, decoder_start_token_id=1, attn_implementation="eager", use_cache=False))
    L = 40
    batch = {"features": torch.randn(2, 3000, 16), "tokens": torch.randint(2, 1000, (2, L)),
             "token_lens": torch.tensor([L, L])}
    m, a = measured(wh, fhm.Seq2SeqLoss(wh.config), batch), Flops("whisper", wh).whisper(2, L)
    print(f"whisper:  counted {m:.4g}  analytic {a:.4g}  ratio {a / m:.3f}")


if __name__ == "__main__":
    main()
