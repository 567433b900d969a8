"""Jobs for tests/test_cp_birth.py: ViTs whose sequence is born inside the model, under cp."""
from __future__ import annotations

import torch

from tests.cp_factory_models import parallel, reference


def vit_workload(arch: str) -> dict:
    """A zoo arch, or one of this file's workloads (per_patch, first_token)."""
    from tests.zoo import ZOO
    own = {"per_patch": per_patch_workload, "first_token": first_token_workload, "patch_mean": patch_mean_workload,
           "patch_mean17": lambda: patch_mean_workload((16, 16))}
    return own.get(arch, ZOO[arch] if arch in ZOO else None)()


def first_token_workload() -> dict:
    """An LM that adds its first token's embedding to every position (x + x[:, 0]): one global
    position read under cp (tests/cp_loop_models.FirstToken)."""
    from tests.cp_loop_models import FirstToken
    from tests.cp_shift_jobs import shift_workload
    w = shift_workload()
    torch.manual_seed(0)
    w["model"] = FirstToken()
    return w


def vit_parity(archs: list, plan: str, steps: int = 3) -> dict:
    """Run on every rank: each ViT under `plan`, (losses, grads) over `steps` SGD steps."""
    torch.set_num_threads(1)
    return {a: parallel(vit_workload(a), plan, steps) for a in archs}


def vit_reference(arch: str, steps: int = 3):
    torch.set_num_threads(1)
    return reference(vit_workload(arch), steps)


def vit_parity_or_error(archs: list, plan: str, steps: int = 3) -> dict:
    """vit_parity, with each arch's failure as its one-line text (to tell a refusal in a test)."""
    torch.set_num_threads(1)
    out = {}
    for a in archs:
        try:
            out[a] = parallel(vit_workload(a), plan, steps)
        except Exception as exc:
            out[a] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
    return out


def compare(got: list, ref, whole_only: bool = False) -> tuple:
    """(loss diff, grad diff, names compared) of each rank's run against one process; with
    `whole_only` (tp, pp) only the parameters a rank holds whole (tp shards and other stages'
    parameters left out)."""
    from tests.cp_factory_models import grad_diff
    from tests.parity import max_rel_diff
    out = []
    for losses, grads in got:
        ref_grads = ref[1]
        if whole_only:
            ref_grads = [{k: v for k, v in r.items() if k in g and g[k].shape == v.shape} for g, r in zip(grads, ref[1])]
            grads = [{k: g[k] for k in r} for g, r in zip(grads, ref_grads)]
        out.append((max_rel_diff(losses, ref[0]), grad_diff(grads, ref_grads), sorted(ref_grads[0])))
    return out


def per_patch_workload() -> dict:
    """A ViT scoring each of its 16 patch tokens against a target [B, 16] (a segmentation head):
    the target runs along a sequence only the model makes."""
    import torch.nn.functional as F
    from tests.zoo.vit16 import MeanViT
    torch.manual_seed(0)

    class PerPatch(MeanViT):
        def forward(self, images):
            x = self.patch(images).flatten(2).transpose(1, 2) + self.pos
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))                          # [B, 16, classes]
    g = torch.Generator().manual_seed(5)
    images, labels = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4, 16), generator=g)
    return {"model": PerPatch().train(), "inputs": (images,), "target": labels,
            "loss_fn": lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())}


def patch_mean_workload(image: tuple = (12, 20)) -> dict:
    """CLS + 15 patches pooled as the mean of the patch rows alone (x[:, 1:].mean(1), as
    Dinov2's and BEiT's classifiers do): a mean over a sequence shortened inside the model.
    `image` (16, 16): CLS + 16 patches, 17 tokens, padded under cp."""
    import torch.nn.functional as F
    from tests.zoo.vit16 import ClsViT
    torch.manual_seed(0)

    class PatchMean(ClsViT):
        def forward(self, images):
            x = self.patch(images).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x)[:, 1:].mean(dim=1))
    g = torch.Generator().manual_seed(5)
    return {"model": PatchMean(image=image).train(), "inputs": (torch.randn(4, 3, *image, generator=g),),
            "target": torch.randint(0, 10, (4,), generator=g), "loss_fn": F.cross_entropy}
