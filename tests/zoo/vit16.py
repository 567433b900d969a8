"""Vision transformers of 16 tokens (a multiple of 2*cp for cp = 2, 4): their sequence is made
inside forward from pixels [B, 3, H, W] (compiler/seq_birth.py starts cp where it is born)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.zoo.common import HIDDEN, workload
from tests.zoo.vit import CLASSES, PATCH, Block


class MeanViT(torch.nn.Module):
    """16 patch tokens, no CLS, a learned position table added whole, mean-pooled."""

    def __init__(self, c: int = HIDDEN, layers: int = 2, image: int = 16):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, c, PATCH, stride=PATCH)
        self.pos = torch.nn.Parameter(torch.randn(1, (image // PATCH) ** 2, c) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(c)
        self.head = torch.nn.Linear(c, CLASSES)

    def forward(self, images):                                      # [B, 3, 16, 16]
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos   # [B, 16, C]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))                  # [B, classes]


class ClsViT(torch.nn.Module):
    """CLS + 15 patches (12 x 20 images) with a learned position table of 16 added whole."""

    def __init__(self, c: int = HIDDEN, layers: int = 2, image=(12, 20)):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, c, PATCH, stride=PATCH)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, c) * 0.02)
        self.pos = torch.nn.Parameter(torch.randn(1, (image[0] // PATCH) * (image[1] // PATCH) + 1, c) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(c)
        self.head = torch.nn.Linear(c, CLASSES)

    def forward(self, images):                                      # [B, 3, 12, 20]
        x = self.patch(images).flatten(2).transpose(1, 2)           # [B, 15, C]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos   # [B, 16, C]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])                        # [B, classes] from CLS


def _images(seed: int, h: int, w: int):
    g = torch.Generator().manual_seed(seed + 5)
    return torch.randn(4, 3, h, w, generator=g), torch.randint(0, CLASSES, (4,), generator=g)


def vit16_mean(seed: int = 0):
    torch.manual_seed(seed)
    images, labels = _images(seed, 16, 16)
    return workload(MeanViT().train(), (images,), labels, F.cross_entropy)


def vit16_cls(seed: int = 0):
    torch.manual_seed(seed)
    images, labels = _images(seed, 12, 20)
    return workload(ClsViT().train(), (images,), labels, F.cross_entropy)


def hf_vit16(seed: int = 0):
    """transformers' ViTForImageClassification, 12x20 images in 4x4 patches: 15 + CLS = 16 tokens."""
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    image_size=(12, 20), patch_size=PATCH, num_labels=CLASSES, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="eager")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = ViTForImageClassification(cfg)

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values).logits
    images, labels = _images(seed, 12, 20)
    return workload(Logits().train(), (images,), labels, F.cross_entropy)


def hf_deit16(seed: int = 0):
    """transformers' DeiTForImageClassification, 8x28 images in 4x4 patches: 14 + CLS + distillation = 16."""
    from transformers import DeiTConfig, DeiTForImageClassification
    torch.manual_seed(seed)
    cfg = DeiTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     image_size=(8, 28), patch_size=PATCH, num_labels=CLASSES, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="eager")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = DeiTForImageClassification(cfg)

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values).logits
    images, labels = _images(seed, 8, 28)
    return workload(Logits().train(), (images,), labels, F.cross_entropy)


def hf_dinov2_16(seed: int = 0):
    """transformers' Dinov2Model trained on its CLS row (pooler_output), 12x20 images in 4x4 patches
    (15 + CLS = 16): its position table of 10 (a 12x12 image) is interpolated bicubically in forward."""
    from transformers import Dinov2Config, Dinov2Model
    torch.manual_seed(seed)
    cfg = Dinov2Config(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=12,
                       patch_size=PATCH, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="eager")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.head = Dinov2Model(cfg), torch.nn.Linear(HIDDEN, CLASSES)

        def forward(self, pixel_values):
            return self.head(self.model(pixel_values=pixel_values).pooler_output)
    images, labels = _images(seed, 12, 20)
    return workload(Logits().train(), (images,), labels, F.cross_entropy)


FACTORIES = {"vit16_mean": vit16_mean, "vit16_cls": vit16_cls, "hf_vit16": hf_vit16, "hf_deit16": hf_deit16,
             "hf_dinov2_16": hf_dinov2_16}
