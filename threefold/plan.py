"""`Plan`: how a model is split across ranks (tp, pp, dp with ZeRO/HSDP, cp, ep, and how each runs).

A plan is a small frozen value. `Plan.parse("tp=2,pp=4,m=8")` and `str(plan)` round-trip.
Everything that checks a plan against a *model* (heads divisible by tp, enough ops for
pp*v chunks) lives in the passes; here we only check what the plan alone can know.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import difflib
import functools

from threefold.errors import PlanError

# zb-h1 and zbv are zero-bubble schedules (Qi et al. 2401.10241; runtime/zero_bubble.py):
# each backward is split into B (input gradients) and W (weight gradients). zbv runs two
# chunks per stage in a V, so it implies v=2.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
LOSS_MODES = ("exact", "microbatch_mean", "eager")
BATCHNORM_MODES = ("exact", "local")
# Activation recomputation (passes/recompute.py): "full" keeps each transformer layer's input
# and recomputes the layer in backward; "selective" recomputes only the regions that hold many
# bytes for few FLOPs (the attention core); booleans are aliases (true = full, false = none).
RECOMPUTE_MODES = ("none", "selective", "full")
# Compute dtype (runtime/mixed_precision.py): parameters, gradients and optimizer state stay
# fp32 (the master weights); chunk forwards run under torch.autocast in bf16/fp16; fp16 adds
# dynamic loss scaling. ZeRO stage (runtime/zero.py, runtime/fsdp.py), over the dp_shard
# ranks (all of dp unless dp_shard says fewer: HSDP): 0 = every dp rank holds everything;
# 1 = the optimizer state and update sharded; 2 = gradients too (reduce-scattered as
# backward produces them); 3 = parameters too (FSDP: gathered per layer around its use).
DTYPES = ("fp32", "bf16", "fp16")
# How each rank runs its generated chunks (runtime/compiled.py): "none" = eager, op by op;
# "inductor" = each chunk's forward (and so its backward) through torch.compile/Inductor,
# with the runtime's collectives left eager between the compiled pieces.
COMPILE_MODES = ("none", "inductor")
ZERO_STAGES = (0, 1, 2, 3)

# Short keys accepted by Plan.parse and used by str(plan).
_ALIASES = {"m": "microbatches", "v": "interleave"}
_SHORT = {v: k for k, v in _ALIASES.items()}


@dataclass(frozen=True)
class Plan:
    tp: int = 1                 # tensor-parallel ranks (Megatron column/row splits)
    pp: int = 1                 # pipeline stages
    dp: int = 1                 # data-parallel replicas
    microbatches: int = 1       # microbatches per iteration (m)
    interleave: int = 1         # model chunks per pipeline stage (v); >1 needs schedule=interleaved
    schedule: str = "1f1b"      # gpipe | 1f1b | interleaved
    sp: bool = False            # sequence parallelism (Korthikanti et al. 2022); needs tp>1
    scatter_gather: bool = True # send 1/tp of each boundary tensor across stages (paper 4.1)
    fuse: bool | None = None    # fused Triton kernels; None = on when the model is on a GPU
    recompute: str = "none"     # none | selective | full (passes/recompute.py); True/False alias full/none
    split_points: tuple[str, ...] = field(default_factory=tuple)  # FQNs to start new chunks at
    # How microbatch/dp losses combine: "exact" (numerator and denominator derived from the
    # loss graph; a PlanError where the loss is not separable) or "microbatch_mean" (opt-in:
    # the mean of per-microbatch losses, Megatron's behaviour) or "eager" (loss_fn runs as
    # Python on the last stage, combined exactly where it is a mean or sum over rows; also
    # chosen by itself when torch.export cannot trace the loss: compiler/eager_loss.py).
    loss: str = "exact"
    # Training-mode BatchNorm with m*dp > 1: "exact" (a PlanError: statistics would be per
    # microbatch) or "local" (opt-in: statistics per microbatch and dp rank).
    batchnorm: str = "exact"
    strict: bool = False        # tp: an op with no sharded rule is a PlanError, not a gather/reduce fallback
    dtype: str = "fp32"         # fp32 | bf16 | fp16: compute dtype (master weights stay fp32)
    zero: int = 0               # 0..3: what is sharded over the dp_shard ranks (see ZERO_STAGES)
    # HSDP: ranks per shard group (dp_replicate = dp / dp_shard replicas of it); None = all of dp
    dp_shard: int | None = None
    # Expert parallelism (passes/experts.py, runtime/experts.py): each group of ep consecutive
    # dp ranks holds E/ep whole experts of every MoE layer and moves tokens to them with
    # all-to-all. ep ranks are dp ranks (Megatron's expert-data-parallel layout): ep divides dp,
    # and an expert's gradient is reduced over the dp/ep ranks that hold it.
    ep: int = 1
    # context parallelism: ranks that split every sequence (inputs, activations) along its
    # positions; attention runs as a ring over them (passes/context_parallel.py, runtime/cp_ops.py)
    cp: int = 1
    compile: str = "none"       # none | inductor: eager chunks, or torch.compile'd (runtime/compiled.py)

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "microbatches", "interleave", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan {name}={value!r} is invalid: it must be a positive integer")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"plan schedule={self.schedule!r} is unknown: use one of {', '.join(SCHEDULES)}")
        if self.schedule == "zbv":
            if self.interleave == 1:   # ZB-V always cuts two chunks per stage
                object.__setattr__(self, "interleave", 2)
            if self.interleave != 2:
                raise PlanError(f"plan v={self.interleave} with schedule=zbv is invalid: ZB-V runs exactly "
                                "two chunks per stage; set v=2 (or leave v out)")
            if self.pp == 1:
                raise PlanError("plan schedule=zbv needs pp>1: its V spreads two chunks over each of "
                                "several stages; set pp>1 or use schedule=zb-h1")
        elif self.interleave > 1 and self.schedule != "interleaved":
            raise PlanError(f"plan v={self.interleave} needs schedule=interleaved "
                            f"(got schedule={self.schedule}); add schedule=interleaved or set v=1")
        if self.interleave > 1 and self.pp == 1:
            raise PlanError(f"plan v={self.interleave} needs pp>1: interleaving spreads chunks over "
                            "pipeline stages; set pp>1 or v=1")
        if self.sp and self.tp == 1:
            raise PlanError("plan sp=true needs tp>1: sequence parallelism shards along the tensor-parallel group")
        if self.cp > 1 and self.sp:
            raise PlanError("plan cp>1 with sp=true is not supported yet: both shard the sequence; "
                            "drop sp=true (cp already splits every activation along the sequence)")
        if isinstance(self.recompute, bool):
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        for name, allowed in (("loss", LOSS_MODES), ("batchnorm", BATCHNORM_MODES),
                              ("recompute", RECOMPUTE_MODES), ("compile", COMPILE_MODES)):
            if getattr(self, name) not in allowed:
                raise PlanError(f"plan {name}={getattr(self, name)!r} is unknown: use one of {', '.join(allowed)}")
        if self.dtype not in DTYPES:
            raise PlanError(f"plan dtype={self.dtype!r} is unknown: use one of {', '.join(DTYPES)}")
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise PlanError(f"plan zero={self.zero!r} is unsupported: use zero=0, 1, 2 or 3 (what is "
                            "sharded over dp: 1 optimizer state, 2 also gradients, 3 also parameters)")
        if self.dp_shard is not None:
            d = self.dp_shard
            if not isinstance(d, int) or isinstance(d, bool) or d < 1 or self.dp % d:
                raise PlanError(f"plan dp_shard={d!r} is invalid: it must divide dp={self.dp} "
                                f"(dp_replicate = dp / dp_shard replicas of each shard group)")
            if self.zero == 0:    # even dp_shard=dp: a key that would change nothing is a mistake
                raise PlanError(f"plan dp_shard={d} needs zero>=1: it says over how many dp ranks ZeRO "
                                "shards; add zero=3 (HSDP) or drop dp_shard")
            if d == self.dp:   # the default spelled out: one form, so str() round-trips
                object.__setattr__(self, "dp_shard", None)
        if self.ep > 1:
            if self.dp % self.ep:
                raise PlanError(f"plan ep={self.ep} is invalid with dp={self.dp}: expert-parallel ranks are "
                                f"data-parallel ranks, so ep must divide dp; set dp to a multiple of {self.ep}")
            # HSDP under ep: dp_shard counts the ranks of one shard group including its ep
            # ranks (mesh: dp_shard axis = dp_shard / ep, dp_replicate = dp / dp_shard)
            if self.dp_shard is not None and self.dp_shard % self.ep:
                raise PlanError(f"plan dp_shard={self.dp_shard} is invalid with ep={self.ep}: a shard group "
                                "holds whole ep groups (ZeRO shards over dp_shard/ep ranks holding the same "
                                f"experts); set dp_shard to a multiple of {self.ep}")
        if isinstance(self.split_points, (list, str)):
            pts = (self.split_points,) if isinstance(self.split_points, str) else tuple(self.split_points)
            object.__setattr__(self, "split_points", pts)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def shard_degree(self) -> int:
        """Ranks ZeRO shards over (the dp_shard mesh axis): dp unless dp_shard says fewer."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def mesh(self):
        """The named mesh this plan runs on (runtime/mesh.py: one entry per axis)."""
        from threefold.runtime.mesh import Mesh   # lazy: start-up: runtime.mesh loads only on this path
        return Mesh.of_plan(self)

    @property
    def num_chunks(self) -> int:
        """Pipeline chunks the model is cut into: pp stages times v chunks per stage."""
        return self.pp * self.interleave

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    # ---- text form -------------------------------------------------------------
    @classmethod
    def parse(cls, text: "str | Plan | None") -> "Plan":
        """Parse 'tp=2,pp=4,dp=2,m=8,v=2,schedule=interleaved' (spaces allowed)."""
        if isinstance(text, Plan):
            return text
        if text is None or not str(text).strip():
            return cls()
        return cls(**cls.parse_fields(text))

    @classmethod
    def parse_fields(cls, text: str) -> dict:
        """The items of a plan text as {field name: value}, each key and value checked by the
        grammar but not the plan as a whole: a partial plan (the planner's --evaluate)."""
        kwargs: dict = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        text = str(text or "").strip()
        if not text:
            return kwargs
        seen: dict[str, str] = {}
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                raise PlanError(f"plan {text!r} is malformed: an empty item between commas; "
                                "write key=value items separated by single commas, e.g. 'tp=2,pp=4'")
            if "=" not in item:
                raise PlanError(f"plan item {item!r} is malformed: write key=value, e.g. 'tp=2,pp=4'")
            key, value = (part.strip() for part in item.split("=", 1))
            if not key or any(c.isspace() for c in key + value) or not value:
                raise PlanError(f"plan item {item!r} is malformed: write key=value items separated by "
                                "commas, e.g. 'tp=2,pp=4'")
            name = _ALIASES.get(key, key)
            if name not in fields:
                raise PlanError(unknown_key(key))
            if name in seen and name != "split_points":
                raise PlanError(f"plan key {key!r} is given twice ({seen[name]}, {item}): give each key once")
            seen[name] = item
            kwargs[name] = _parse_value(name, value, kwargs.get(name))
        return kwargs

    def __str__(self) -> str:
        parts = []
        default = type(self)()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == getattr(default, f.name) and f.name in ("split_points", "fuse", "recompute",
                                                                 "scatter_gather", "sp", "loss", "batchnorm",
                                                                 "strict", "dtype", "zero", "dp_shard", "ep", "cp",
                                                                 "compile"):
                continue
            key = _SHORT.get(f.name, f.name)
            if f.name == "split_points":
                parts.extend(f"split={p}" for p in value)
            elif isinstance(value, bool):
                parts.append(f"{key}={'true' if value else 'false'}")
            else:
                parts.append(f"{key}={value}")
        return ",".join(parts)


def unknown_key(key: str) -> str:
    """"plan key 'shedule' is unknown: did you mean 'schedule'? ..." (one line)."""
    known = sorted({f.name for f in dataclasses.fields(Plan)} | set(_ALIASES))
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"plan key {key!r} is unknown: {hint}known keys are {', '.join(known)}"


def _init_checked(init):
    """Plan(shedule=...) is a PlanError naming the key (with a suggestion), not a bare TypeError."""
    names = None

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        nonlocal names
        names = names or {f.name for f in dataclasses.fields(Plan)}
        for key in kwargs:
            if key not in names:
                raise PlanError(unknown_key(key))
        if len(args) > len(names):
            raise PlanError(f"Plan() takes at most {len(names)} positional values, got {len(args)}: "
                            "give them by name, e.g. Plan(tp=2, pp=4)")
        init(self, *args, **kwargs)
    return __init__


Plan.__init__ = _init_checked(Plan.__init__)

# Boolean plan values: these spellings (ASCII, any case), nothing else.
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _ascii_int(name: str, value: str) -> int:
    """ASCII digits only: int() would also take '２', '٢', '1_0' and '+1'."""
    if not (value.isascii() and value.isdigit()):
        raise PlanError(f"plan {name}={value!r} is invalid: it must be a positive integer in ASCII digits")
    return int(value)


def _parse_value(name: str, value: str, previous):
    if name == "split_points":
        # Several split points: repeat the key ('split=a,split=b') or join with '+'.
        return tuple(previous or ()) + tuple(v for v in value.split("+") if v)
    if name == "recompute":
        # true/false stay booleans here (the planner's Constraints read them); Plan maps them
        low = value.lower() if value.isascii() else value
        if low in TRUE_WORDS:
            return True
        if low in FALSE_WORDS:
            return False
        if low not in RECOMPUTE_MODES:
            raise PlanError(f"plan recompute={value!r} is invalid: use one of {', '.join(RECOMPUTE_MODES)} "
                            "(or true/false for full/none)")
        return low
    if name in ("sp", "scatter_gather", "fuse", "strict"):
        low = value.lower() if value.isascii() else value
        if low in TRUE_WORDS:
            return True
        if low in FALSE_WORDS:
            return False
        if name == "fuse" and low in ("auto", "none"):
            return None
        raise PlanError(f"plan {name}={value!r} is invalid: use true or false (also 1/0, yes/no, on/off)")
    if name in ("schedule", "loss", "batchnorm"):
        return value.lower() if value.isascii() else value    # an unknown word is refused by Plan
    if name == "compile":
        low = value.lower()
        if low not in COMPILE_MODES:
            raise PlanError(f"plan compile={value!r} is invalid: use compile=none (eager, the default) "
                            "or compile=inductor (torch.compile each chunk)")
        return low
    if name == "dtype":
        low = value.lower()
        low = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}.get(low, low)
        if low not in DTYPES:
            raise PlanError(f"plan dtype={value!r} is invalid: use one of {', '.join(DTYPES)}")
        return low
    if name == "zero":
        if value not in ("0", "1", "2", "3"):
            raise PlanError(f"plan zero={value!r} is invalid: use 0, 1, 2 or 3")
        return int(value)
    return _ascii_int(name, value)


_ALIASES["split"] = "split_points"
