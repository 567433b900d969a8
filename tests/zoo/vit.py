"""Vision transformers whose sequence (CLS + patches) tp does not divide: 17 tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, workload

CLASSES, IMAGE, PATCH = 10, 16, 4          # 16 patches + CLS = 17 tokens


class Block(torch.nn.Module):
    def __init__(self, c: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
        self.qkv, self.proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
        self.fc1, self.fc2 = torch.nn.Linear(c, 2 * c), torch.nn.Linear(2 * c, c)

    def forward(self, x):                                           # [B, T, C]
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(torch.nn.Module):
    def __init__(self, c: int = HIDDEN, layers: int = 2):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, c, PATCH, stride=PATCH)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, c) * 0.02)
        self.pos = torch.nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, c) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(c)
        self.head = torch.nn.Linear(c, CLASSES)

    def forward(self, images):                                      # [B, 3, H, W]
        x = self.patch(images).flatten(2).transpose(1, 2)           # [B, 16, C]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos   # [B, 17, C]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])                        # [B, classes] from CLS


def vit17(seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 5)
    images = torch.randn(4, 3, IMAGE, IMAGE, generator=g)
    labels = torch.randint(0, CLASSES, (4,), generator=g)
    return workload(TinyViT().train(), (images,), labels, F.cross_entropy)


def hf_vit17(seed: int = 0):
    """transformers' ViTForImageClassification, 16x16 images in 4x4 patches: 17 tokens."""
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    image_size=IMAGE, patch_size=PATCH, num_labels=CLASSES, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="eager")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = ViTForImageClassification(cfg)

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values).logits
    model = Logits().train()
    g = torch.Generator().manual_seed(seed + 5)
    images = torch.randn(4, 3, IMAGE, IMAGE, generator=g)
    labels = torch.randint(0, CLASSES, (4,), generator=g)
    return workload(model, (images,), labels, F.cross_entropy)


FACTORIES = {"vit17": vit17, "hf_vit17": hf_vit17}


def gpt_seq7(seed: int = 0):
    """examples/gpt.py on 7 tokens: under sp the vocab-parallel embedding reduce-scatters a
    sequence tp=2 does not divide (the padded path of the embedding, not of a projection)."""
    from tests.parity import load_workload
    return load_workload("gpt", n_layer=2, n_embd=HIDDEN, n_head=4, seq=7, batch=4, seed=seed)


FACTORIES["gpt_seq7"] = gpt_seq7
