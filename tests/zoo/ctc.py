"""CTC speech models: the loss (aten._ctc_loss, data-dependent shapes) cannot be traced, so
the last stage computes it eagerly (compiler/eager_loss.py). Labels are padded with -1 and
have a different length per row, so the per-row mean (CTC's reduction="mean" divides each
row by its label length) is what the microbatch combination must keep."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, workload

CTC_VOCAB, SAMPLES, BATCH = 12, 64, 4


def ctc_loss(logits, labels):
    """logits [B, T, V] (V includes blank 0), labels [B, S] padded with -1."""
    log_probs = logits.log_softmax(-1).transpose(0, 1)                    # [T, B, V]
    frames = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.long)
    lengths = (labels >= 0).sum(-1)
    return F.ctc_loss(log_probs, labels.clamp(min=0), frames, lengths, blank=0, zero_infinity=True)


def ctc_batch(seed: int = 0, batch: int = BATCH):
    g = torch.Generator().manual_seed(seed + 3)
    audio = torch.randn(batch, SAMPLES, generator=g)
    labels = torch.randint(1, CTC_VOCAB, (batch, 5), generator=g)
    for row in range(batch):                   # 2..5 labels per row
        labels[row, 2 + row % 4:] = -1
    return audio, labels


class ConvCTC(torch.nn.Module):
    """A small conv front end (stride 4) and one pre-norm attention block, logits per frame."""

    def __init__(self, c: int = HIDDEN, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.conv = torch.nn.Conv1d(1, c, kernel_size=8, stride=4, padding=2)
        self.norm1, self.norm2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
        self.qkv, self.proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
        self.up, self.down = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)
        self.head = torch.nn.Linear(c, CTC_VOCAB)

    def forward(self, audio):                                   # [B, L]
        x = F.gelu(self.conv(audio.unsqueeze(1))).transpose(1, 2)   # [B, T, C]
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(x)                                     # [B, T, V]


def conv_ctc(seed: int = 0):
    torch.manual_seed(seed)
    audio, labels = ctc_batch(seed)
    return workload(ConvCTC().train(), (audio,), labels, ctc_loss)


class Wav2Vec2Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_values):
        return self.model(input_values=input_values).logits


def wav2vec2_ctc(seed: int = 0):
    """transformers' Wav2Vec2ForCTC from a tiny config: conv feature encoder (group norm),
    positional conv embedding (weight norm), post-norm encoder; no SpecAugment or layerdrop
    (they draw from numpy's random state)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    torch.manual_seed(seed)
    cfg = Wav2Vec2Config(vocab_size=CTC_VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, conv_dim=(16, 16), conv_kernel=(4, 2), conv_stride=(4, 2),
                         num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                         layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                         feat_proj_dropout=0.0, final_dropout=0.0, pad_token_id=0,
                         attn_implementation="eager")
    model = Wav2Vec2Logits(Wav2Vec2ForCTC(cfg)).train()
    audio, labels = ctc_batch(seed)
    return workload(model, (audio,), labels, ctc_loss)


FACTORIES = {"conv_ctc": conv_ctc, "wav2vec2_ctc": wav2vec2_ctc}
