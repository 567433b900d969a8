"""Triton lowering rules, one per fusible op: the forward expression and the gradients.

A rule sees one op of a region (`R`): its arguments as Triton expressions (value names,
or the constants themselves), and writes fp32 code on [BLOCK_M, BLOCK_N] tiles. Forward:
`fwd(r) -> (lines, expr)`; backward: `bwd(r, out, g) -> (lines, grads)` with one gradient
expression (or None) per argument, given the op's result `out` and its gradient `g`.
Backward kernels re-run the forward code first, so a rule may use the temporaries
(`v{j}_...`) its forward wrote. Names the tile code provides: rows, cols, cmask (cols < N),
offs (row * N + col), N, seed, i{d} (row index along leading dim d).

The table is keyed by the short names in passes/fusion_regions.py (ELEMENTWISE, ROW_OPS).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from threefold.passes.fusion_regions import Op

TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}
CM = "cmask[None, :]"     # the tile's valid columns, broadcast over rows


@dataclass
class R:
    """One op as a rule sees it."""
    op: Op
    j: int                  # op index: temporaries are named v{j}_*
    a: list                 # per argument: an expression (str) for values, else the constant
    is_val: list            # per argument: True when it is a tensor value
    dtypes: list            # per argument: dtype of a value, None for constants
    seed_offset: int = 0    # dropout: which of the region's dropouts this is
    row_index: str = "rows" # causal masks: the index along dim -2

    def t(self, name: str) -> str:
        return f"v{self.j}_{name}"

    def x(self, i: int) -> str:
        """Argument i as an expression (constants as float literals)."""
        return self.a[i] if self.is_val[i] else lit(self.a[i])


def store_cast(expr: str, dtype) -> str:
    """`expr` (fp32) converted for a store into a tensor of `dtype`."""
    if dtype == torch.bfloat16:
        return f"_round_bf16({expr}).to(tl.bfloat16)"
    return f"{expr}.to({TL_DTYPES[dtype]})"


def lit(c) -> str:
    if isinstance(c, bool):
        return "1.0" if c else "0.0"
    if isinstance(c, (int, float)):
        c = float(c)
        if math.isinf(c):
            return 'float("inf")' if c > 0 else 'float("-inf")'
        if math.isnan(c):
            return 'float("nan")'
        return repr(c)
    raise TypeError(f"no Triton literal for {c!r}")


FWD: dict = {}
BWD: dict = {}


def rule(*names):
    def deco(cls):
        for n in names:
            FWD[n], BWD[n] = cls.fwd, cls.bwd
        return cls
    return deco


def _alpha(r: R) -> float:
    return float(r.op.kw("alpha", 1))


def _scaled(expr: str, k: float) -> str:
    return expr if k == 1 else f"{expr} * {lit(k)}"


@rule("add")
class Add:
    fwd = staticmethod(lambda r: ([], f"{r.x(0)} + {_scaled(r.x(1), _alpha(r))}"))
    bwd = staticmethod(lambda r, out, g: ([], [g, _scaled(g, _alpha(r))]))


@rule("sub")
class Sub:
    fwd = staticmethod(lambda r: ([], f"{r.x(0)} - {_scaled(r.x(1), _alpha(r))}"))
    bwd = staticmethod(lambda r, out, g: ([], [g, _scaled(f"-{g}", _alpha(r))]))


@rule("rsub")
class RSub:  # rsub(self, other, alpha) = other - alpha * self
    fwd = staticmethod(lambda r: ([], f"{r.x(1)} - {_scaled(r.x(0), _alpha(r))}"))
    bwd = staticmethod(lambda r, out, g: ([], [_scaled(f"-{g}", _alpha(r)), g]))


@rule("mul")
class Mul:
    fwd = staticmethod(lambda r: ([], f"{r.x(0)} * {r.x(1)}"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} * {r.x(1)}", f"{g} * {r.x(0)}"]))


@rule("div")
class Div:
    fwd = staticmethod(lambda r: ([], f"{r.x(0)} / {r.x(1)}"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} / {r.x(1)}", f"-{g} * {out} / {r.x(1)}"]))


@rule("neg")
class Neg:
    fwd = staticmethod(lambda r: ([], f"-{r.x(0)}"))
    bwd = staticmethod(lambda r, out, g: ([], [f"-{g}"]))


@rule("clone")
class Clone:
    fwd = staticmethod(lambda r: ([], r.x(0)))
    bwd = staticmethod(lambda r, out, g: ([], [g]))


@rule("exp")
class Exp:
    fwd = staticmethod(lambda r: ([], f"tl.exp({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} * {out}"]))


@rule("log")
class Log:
    fwd = staticmethod(lambda r: ([], f"tl.log({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} / {r.x(0)}"]))


@rule("tanh")
class Tanh:
    fwd = staticmethod(lambda r: ([], f"_tanh({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} * (1.0 - {out} * {out})"]))


@rule("sigmoid")
class Sigmoid:
    fwd = staticmethod(lambda r: ([], f"tl.sigmoid({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} * {out} * (1.0 - {out})"]))


@rule("relu")
class Relu:
    fwd = staticmethod(lambda r: ([], f"tl.maximum({r.x(0)}, 0.0)"))
    bwd = staticmethod(lambda r, out, g: ([], [f"tl.where({out} > 0.0, {g}, 0.0)"]))


@rule("silu")
class Silu:
    fwd = staticmethod(lambda r: ([f"{r.t('s')} = tl.sigmoid({r.x(0)})"], f"{r.x(0)} * {r.t('s')}"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} * {r.t('s')} * (1.0 + {r.x(0)} * (1.0 - {r.t('s')}))"]))


class Gelu:  # PyTorch's formulas (aten/src/ATen/native/cpu/Activation.cpp)
    @staticmethod
    def fwd(r):
        x = r.x(0)
        if r.op.kw("approximate", "none") == "tanh":
            return ([f"{r.t('t')} = _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))"],
                    f"0.5 * {x} * (1.0 + {r.t('t')})")
        return [], f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))"

    @staticmethod
    def bwd(r, out, g):
        x = r.x(0)
        if r.op.kw("approximate", "none") == "tanh":
            t = r.t("t")
            return [], [f"{g} * (0.5 * (1.0 + {t}) + 0.5 * {x} * (1.0 - {t} * {t}) * 0.7978845608028654 * "
                        f"(1.0 + 0.134145 * {x} * {x}))"]
        return [], [f"{g} * (0.5 * (1.0 + tl.erf({x} * 0.7071067811865476)) + "
                    f"{x} * 0.3989422804014327 * tl.exp(-0.5 * {x} * {x}))"]


rule("gelu")(Gelu)


@rule("erf")
class Erf:
    fwd = staticmethod(lambda r: ([], f"tl.erf({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} * 1.1283791670955126 * tl.exp(-{r.x(0)} * {r.x(0)})"]))


@rule("sqrt")
class Sqrt:
    fwd = staticmethod(lambda r: ([], f"tl.sqrt_rn({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} * 0.5 / {out}"]))


@rule("rsqrt")
class Rsqrt:
    fwd = staticmethod(lambda r: ([], f"1.0 / tl.sqrt_rn({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"-0.5 * {g} * {out} * {out} * {out}"]))


@rule("reciprocal")
class Reciprocal:
    fwd = staticmethod(lambda r: ([], f"1.0 / {r.x(0)}"))
    bwd = staticmethod(lambda r, out, g: ([], [f"-{g} * {out} * {out}"]))


@rule("sin")
class Sin:
    fwd = staticmethod(lambda r: ([], f"tl.sin({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"{g} * tl.cos({r.x(0)})"]))


@rule("cos")
class Cos:
    fwd = staticmethod(lambda r: ([], f"tl.cos({r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"-{g} * tl.sin({r.x(0)})"]))


class Pow:  # only the exponents fusion_regions.POW_EXPONENTS admits
    FWD = {1: "{x}", 2: "{x} * {x}", 3: "{x} * {x} * {x}", 0.5: "tl.sqrt_rn({x})",
           -0.5: "1.0 / tl.sqrt_rn({x})", -1: "1.0 / {x}"}
    BWD = {1: "{g}", 2: "2.0 * {x} * {g}", 3: "3.0 * {x} * {x} * {g}", 0.5: "{g} * 0.5 / {out}",
           -0.5: "-0.5 * {g} * {out} * {out} * {out}", -1: "-{g} * {out} * {out}"}

    @staticmethod
    def fwd(r):
        return [], Pow.FWD[r.a[1]].format(x=r.x(0))

    @staticmethod
    def bwd(r, out, g):
        return [], [Pow.BWD[r.a[1]].format(x=r.x(0), g=g, out=out), None]


rule("pow")(Pow)


def dropout_active(op: Op) -> bool:
    return bool(op.args[2]) and float(op.args[1]) > 0


class Dropout:  # the mask comes from Philox(seed + k, flat index): backward recomputes it
    @staticmethod
    def fwd(r):
        if not dropout_active(r.op):
            return [], r.x(0)
        p = float(r.a[1])
        keep = f"{r.t('keep')} = tl.rand(seed + {r.seed_offset}, offs) >= {lit(p)}"
        return [keep], f"tl.where({r.t('keep')}, {r.x(0)} * {lit(1.0 / (1.0 - p))}, 0.0)"

    @staticmethod
    def bwd(r, out, g):
        if not dropout_active(r.op):
            return [], [g]
        return [], [f"tl.where({r.t('keep')}, {g} * {lit(1.0 / (1.0 - float(r.a[1])))}, 0.0)"]


rule("dropout")(Dropout)


@rule("masked_fill")
class MaskedFill:
    fwd = staticmethod(lambda r: ([], f"tl.where({r.a[1]}, {r.x(2)}, {r.x(0)})"))
    bwd = staticmethod(lambda r, out, g: ([], [f"tl.where({r.a[1]}, 0.0, {g})", None, None]))


@rule("where")
class Where:
    fwd = staticmethod(lambda r: ([], f"tl.where({r.a[0]}, {r.x(1)}, {r.x(2)})"))
    bwd = staticmethod(lambda r, out, g: ([], [None, f"tl.where({r.a[0]}, {g}, 0.0)",
                                               f"tl.where({r.a[0]}, 0.0, {g})"]))


@rule("not")
class Not:
    fwd = staticmethod(lambda r: ([], f"~{r.a[0]}"))
    bwd = staticmethod(lambda r, out, g: ([], [None]))


class Cast:  # compute stays fp32; a cast to 16 bits rounds, as eager does
    @staticmethod
    def fwd(r):
        x, src, dst = r.a[0], r.dtypes[0], r.op.dtype
        if src == torch.bool:
            return [], f"{x}.to(tl.float32)"
        if dst == torch.bfloat16:
            return [], f"_round_bf16({x})"
        if dst == torch.float16:
            return [], f"{x}.to(tl.float16).to(tl.float32)"
        return [], x

    @staticmethod
    def bwd(r, out, g):   # autograd casts the gradient back to the source dtype: round like it
        src = r.dtypes[0]
        grad = {torch.bool: None, torch.bfloat16: f"_round_bf16({g})",
                torch.float16: f"{g}.to(tl.float16).to(tl.float32)"}.get(src, g)
        return [], [grad] + [None] * (len(r.a) - 1)


rule("cast")(Cast)


# ---- row ops: need whole rows (BLOCK_N >= N) ---------------------------------------------
def _rsum(expr: str, masked: bool = True) -> str:
    return f"tl.sum({f'tl.where({CM}, {expr}, 0.0)' if masked else expr}, axis=1)[:, None]"


class Softmax:
    @staticmethod
    def fwd(r):
        z, e = r.t("z"), r.t("e")
        return [f'{z} = tl.where({CM}, {r.x(0)}, float("-inf"))',
                f"{e} = tl.exp({z} - tl.max({z}, axis=1)[:, None])"], f"{e} / tl.sum({e}, axis=1)[:, None]"

    @staticmethod
    def bwd(r, out, g):
        return [], [f"{out} * ({g} - {_rsum(g + ' * ' + out)})"] + [None] * (len(r.a) - 1)


rule("softmax")(Softmax)


class LayerNorm:  # layer_norm(x, normalized_shape, weight, bias, eps, cudnn_enable)
    @staticmethod
    def fwd(r):
        x, w, b = r.x(0), r.a[2], r.a[3]
        mean, xc, rstd, xhat = r.t("mean"), r.t("xc"), r.t("rstd"), r.t("xhat")
        lines = [f"{mean} = {_rsum(x)} / N",
                 f"{xc} = tl.where({CM}, {x} - {mean}, 0.0)",
                 f"{rstd} = 1.0 / tl.sqrt_rn({_rsum(xc + ' * ' + xc, False)} / N + {lit(r.a[4])})",
                 f"{xhat} = {xc} * {rstd}"]
        return lines, xhat + (f" * {w}" if w is not None else "") + (f" + {b}" if b is not None else "")

    @staticmethod
    def bwd(r, out, g):
        w = r.a[2]
        gx, c1, c2, rstd, xhat = r.t("gxhat"), r.t("c1"), r.t("c2"), r.t("rstd"), r.t("xhat")
        lines = [f"{gx} = {g} * {w}" if w is not None else f"{gx} = {g}",
                 f"{c1} = {_rsum(gx + ' * ' + xhat)} / N",
                 f"{c2} = {_rsum(gx)} / N"]
        grads = [f"{rstd} * ({gx} - {xhat} * {c1} - {c2})", None,
                 f"{g} * {xhat}" if w is not None else None, g if r.a[3] is not None else None, None, None]
        return lines, grads[:len(r.a)]


rule("layer_norm")(LayerNorm)


class RmsNorm:  # rms_norm(x, normalized_shape, weight=None, eps=None)
    @staticmethod
    def fwd(r):
        x, rstd, xhat = r.x(0), r.t("rstd"), r.t("xhat")
        eps = r.a[3] if len(r.a) > 3 and r.a[3] is not None else torch.finfo(r.op.dtype).eps
        w = r.a[2] if len(r.a) > 2 else None
        lines = [f"{rstd} = 1.0 / tl.sqrt_rn({_rsum(x + ' * ' + x)} / N + {lit(eps)})",
                 f"{xhat} = {x} * {rstd}"]
        return lines, xhat + (f" * {w}" if w is not None else "")

    @staticmethod
    def bwd(r, out, g):
        w = r.a[2] if len(r.a) > 2 else None
        gx, c, rstd, xhat = r.t("gxhat"), r.t("c"), r.t("rstd"), r.t("xhat")
        lines = [f"{gx} = {g} * {w}" if w is not None else f"{gx} = {g}",
                 f"{c} = {_rsum(gx + ' * ' + xhat)} / N"]
        grads = [f"{rstd} * ({gx} - {xhat} * {c})", None, f"{g} * {xhat}" if w is not None else None, None]
        return lines, grads[:len(r.a)]


rule("rms_norm")(RmsNorm)


class Mean:  # mean(x, [-1], keepdim=True): a [BLOCK_M, 1] value
    # Gradients of a value broadcast along the row are held per element, as if the value
    # were copied into every column (whatever consumed it wrote one term per column); the
    # row value's own gradient is their sum, so the backward sums g over the valid columns.
    fwd = staticmethod(lambda r: ([], f"{_rsum(r.x(0))} / N"))
    bwd = staticmethod(lambda r, out, g: (
        [], [f"{_rsum(f'tl.broadcast_to({g}, (BLOCK_M, BLOCK_N))')} / N"] + [None] * (len(r.a) - 1)))


rule("mean")(Mean)


def _rotate(x: str, lo: str, hi: str, sign_lo: str, sign_hi: str) -> list[str]:
    return [f"{lo}, {hi} = tl.split(tl.permute(tl.reshape(tl.broadcast_to({x}, (BLOCK_M, BLOCK_N)), "
            f"(BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))"], \
        f"tl.reshape(tl.permute(tl.join({sign_hi}{hi}, {sign_lo}{lo}), (0, 2, 1)), (BLOCK_M, BLOCK_N))"


class RotateHalf:  # cat(-x[..., h:], x[..., :h]); its transpose is -rotate_half
    @staticmethod
    def fwd(r):
        return _rotate(r.x(0), r.t("lo"), r.t("hi"), "", "-")

    @staticmethod
    def bwd(r, out, g):
        lines, expr = _rotate(g, r.t("glo"), r.t("ghi"), "-", "")
        return lines, [expr]


rule("rotate_half")(RotateHalf)


class Causal:  # causal_mask(like, form, diagonal, negate): True where the mask is set
    @staticmethod
    def fwd(r):
        form, diag, negate = r.a[1], int(r.a[2]), r.a[3]
        cmp = {("tril", False): "<=", ("tril", True): ">", ("triu", False): ">=", ("triu", True): "<"}
        return [f"{r.t('d')} = cols[None, :] - {r.row_index}[:, None]"], f"{r.t('d')} {cmp[form, negate]} {diag}"

    @staticmethod
    def bwd(r, out, g):
        return [], [None] * len(r.a)


rule("causal")(Causal)
