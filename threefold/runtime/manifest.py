"""`Manifest`: what the runtime needs to assemble any rank of a compiled model, as one value.

The compiler writes it (codegen/artifact.py `build_manifest`), `manifest.json` stores its
JSON form, and `parallelize`, `threefold run` and `threefold check` all hand the same
value to `runtime/assemble.assemble_rank`. Reading JSON is also where a manifest is
checked: structure, safe paths, and consistency (mesh and schedule against the plan,
chunks against the mesh, one module and shard per tp rank), so a bad or tampered manifest
is a one-line PlanError before anything it names is touched.

The plan is stored as its values (`plan_values`, read once here into a runtime/run_plan.RunPlan:
the runtime never imports the front end's Plan) and its text for readers; the mesh and the
schedule are the plan's (the JSON repeats them for readers, and a disagreement is an error).
Keys a newer writer adds are kept in `extra` and written back unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field

from threefold import placement as placements
from threefold.errors import PlanError
from threefold.placement import Placement
from threefold.runtime.mesh import Mesh, chunk_layout, stage_of
from threefold.runtime.run_plan import InputSplit, RunPlan
from threefold.runtime.shard import ShardSpec

MANIFEST = "manifest.json"
FORMAT = 6                         # 6: each input's placement on the mesh (was seq_dims); 5: the plan's values; 4: the mesh as named axes; 3: one module per chunk, shared by its tp ranks
MAX_RANKS = 1 << 16                # a mesh beyond this is a corrupt manifest, not a job
MAX_SCHEDULE_ACTIONS = 300_000     # pp*v*m*3: ~60 us each to build and verify, so a few seconds at most


@dataclass(frozen=True)
class TensorSpec:
    """One tensor crossing a chunk boundary (or a model input): its name in the graph,
    local (per rank) shape, dtype name, and placement: `placement` is the tensor-parallel
    one (typed, threefold/placement.py; the JSON holds its text, parsed once here) and
    `other_axes` the placements on the other mesh axes that split it (e.g. cp)."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: Placement = placements.R
    other_axes: tuple[tuple[str, Placement], ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)

    @property
    def on_mesh(self) -> placements.OnMesh:
        """The placement on every mesh axis (tp included)."""
        return placements.OnMesh(self.other_axes).with_axis("tp", self.placement)

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
               "placement": str(self.placement)}
        if self.other_axes:
            out["axes"] = {a: str(p) for a, p in self.other_axes}
        return out

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        other = tuple((str(a), placements.parse(p)) for a, p in (d.get("axes") or {}).items())
        return cls(str(d.get("name", "")), tuple(int(s) for s in d["shape"]), str(d["dtype"]),
                   placements.parse(d.get("placement")), other)


@dataclass(frozen=True)
class ChunkEntry:
    """One pipeline chunk: its generated module (shared by every tp rank), its weight shard
    per tp rank, what crosses its boundaries and which parameters it shares with others."""
    index: int
    stage: int
    cls: str                                   # the ChunkModule subclass in `module`
    module: str                                # relative path of the generated source
    weights: dict[int, str]                    # tp rank -> relative path of its shard ({} = none)
    inputs: tuple[TensorSpec, ...]             # boundary tensors received, in order
    user_inputs: tuple[int, ...]               # batch entries read directly
    outputs: tuple[TensorSpec, ...]            # boundary tensors sent on (last chunk: the loss)
    releasable: tuple[bool, ...]               # per output: no op of the chunk reads it
    params: tuple[str, ...]
    shared_params: dict[str, tuple[int, ...]]  # tied FQN -> every chunk holding it
    hash: str = ""                             # the module's content hash (its header)
    # zero>=2: parameter units (name, FQNs), unit 0 kept whole for the chunk's window
    # (passes/shard_units.py); () otherwise
    units: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # per tp rank: forward FLOPs and the backward's (B, W) split (passes/cost.py)
    flops: tuple[int, int, int] = (0, 0, 0)

    def to_json(self) -> dict:
        return {"index": self.index, "stage": self.stage, "class": self.cls, "module": self.module,
                "weights": {str(r): w for r, w in sorted(self.weights.items())},
                "inputs": [s.to_json() for s in self.inputs], "user_inputs": list(self.user_inputs),
                "outputs": [s.to_json() for s in self.outputs], "releasable": list(self.releasable),
                "params": list(self.params),
                "shared_params": {k: list(v) for k, v in self.shared_params.items()},
                "hash": self.hash, "units": [[n, list(ps)] for n, ps in self.units],
                "flops": list(self.flops)}

    @classmethod
    def from_json(cls, d: dict) -> "ChunkEntry":
        return cls(index=d["index"], stage=d["stage"], cls=d["class"], module=d["module"],
                   weights={int(r): w for r, w in (d.get("weights") or {}).items()},
                   inputs=tuple(TensorSpec.from_json(s) for s in d.get("inputs", [])),
                   user_inputs=tuple(d.get("user_inputs", [])),
                   outputs=tuple(TensorSpec.from_json(s) for s in d.get("outputs", [])),
                   releasable=tuple(bool(x) for x in d.get("releasable", [])),
                   params=tuple(d.get("params", [])),
                   shared_params={k: tuple(v) for k, v in (d.get("shared_params") or {}).items()},
                   hash=d.get("hash", ""),
                   units=tuple((str(n), tuple(ps)) for n, ps in d.get("units", [])),
                   flops=tuple(int(x) for x in d.get("flops", (0, 0, 0))))


@dataclass(frozen=True)
class LossForm:
    """How microbatch and dp partial losses combine (compiler's passes/loss_form.py):
    `denominator` is "graph" (the last chunk's loss_denominator method), "const" (`value`
    per microbatch) or "one" (a sum-reduced loss)."""
    mode: str = "whole"
    denominator: str = "const"
    value: float = 1
    detail: dict = field(default_factory=dict)   # reduction, op: for inspect and messages

    def to_json(self) -> dict:
        den = {"kind": self.denominator}
        if self.denominator == "const":
            den["value"] = self.value
        return {**self.detail, "mode": self.mode, "denominator": den}

    @classmethod
    def from_json(cls, d: dict | None) -> "LossForm":
        if not d:
            return cls()
        den = d.get("denominator") or {"kind": "const", "value": 1}
        detail = {k: v for k, v in d.items() if k not in ("mode", "denominator")}
        return cls(d.get("mode", "exact"), den["kind"], den.get("value", 1), detail)


@dataclass(frozen=True)
class Manifest:
    plan: RunPlan                               # the plan's values (RunPlan.of(a front-end Plan))
    chunks: tuple[ChunkEntry, ...]
    has_loss: bool
    num_model_inputs: int
    model: str = ""
    inputs: tuple[TensorSpec, ...] = ()         # user inputs (model inputs, then target), each on the mesh
    outputs: tuple[dict, ...] = ()              # the graph's outputs: {"shape", "dtype"}
    ties: dict = field(default_factory=dict)    # canonical FQN -> every FQN of it
    tp_grad_sync: tuple[str, ...] = ()          # params whose grads are summed over tp (sp)
    shards: dict[str, ShardSpec] = field(default_factory=dict)
    state_shapes: dict[str, tuple[list[int], str]] = field(default_factory=dict)  # full shapes
    local_shapes: dict[str, list[int]] = field(default_factory=dict)  # per tp rank, every param
    param_roles: dict[str, str] = field(default_factory=dict)   # FQN -> threefold/roles.py role
    model_flops: int = 0                        # forward + backward of one step (compiler/model_flops.py)
    loss: LossForm = field(default_factory=LossForm)
    batch_dims: list | None = None              # per user input: its batch dim (None: whole); for readers:
                                                # a step cuts inputs by `input_splits` (their placements)
    output_batch_dims: list | None = None       # per model output: its batch dim
    output_tree: dict | None = None             # the model's return structure (runtime/output_tree.py)
    frozen: tuple[str, ...] = ()
    # expert parameters (passes/experts.py): FQN -> number of experts along dim 0; under ep=N
    # each rank keeps E/N of them and their gradients are reduced over the edp ranks
    experts: dict[str, int] = field(default_factory=dict)
    # parameters of experts held as separate modules (passes/module_experts.py): FQN ->
    # [expert, experts]; under ep=N only the expert's ep rank keeps it, gradients over edp
    expert_modules: dict[str, list[int]] = field(default_factory=dict)
    # each parameter's placement on the mesh where it is not replicated (passes/mesh_axes.py):
    # what the runtime's readers ask through `param_on_mesh` / `sharded_over` (tp's cut
    # itself is `shards`; ep: the expert weights, S(0); zero=3: dp_shard rows, S(0))
    param_placements: dict[str, placements.OnMesh] = field(default_factory=dict)
    # custom ops the generated code calls: "ns::name" -> {"module", "sha256"} of the Python
    # module that registers it, imported by the loader (runtime/op_modules.py)
    op_modules: dict[str, dict] = field(default_factory=dict)
    # with a loss: why pm(x) cannot return the model's outputs ('' = it can: the last
    # chunk's `model_outputs` method computes them; codegen/model_outputs.py)
    model_outputs_missing: str = ""
    # cp: the sequence length it was compiled for (a length 2*cp does not divide is padded by the
    # cut, runtime/cp_ops.pad_to_blocks, and the code leaves the padding out; another length
    # could pad to the same blocks and train wrong): a step checks it
    seq_length: int | None = None
    notes: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)   # relative path -> sha256
    threefold_version: str = ""
    torch_version: str = ""
    extra: dict = field(default_factory=dict)   # keys this reader does not know, kept as is

    def __post_init__(self):
        # the compiler hands its Plan: the runtime keeps only its values
        object.__setattr__(self, "plan", RunPlan.of(self.plan))

    # -- facts derived from the plan (one place) -----------------------------------------
    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    @property
    def takes_target(self) -> bool:
        """Does a step's batch end with a target (a loss_fn's)? A model that returns its own
        loss (threefold/model_loss.py) has the loss without one: its inputs are the model's."""
        return self.has_loss and (not self.inputs or len(self.inputs) > self.num_model_inputs)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @functools.cached_property
    def input_splits(self) -> tuple[InputSplit, ...]:
        """How a step cuts each user input (batch order), read once from their placements."""
        return tuple(InputSplit.of(s.on_mesh) for s in self.inputs)

    @property
    def scatter_gather(self) -> bool:
        return bool(self.plan.scatter_gather and self.plan.tp > 1)

    @property
    def has_weights(self) -> bool:
        return bool(self.chunks) and bool(self.chunks[0].weights)

    def local_chunks(self, stage: int) -> list[int]:
        """The chunks pipeline stage `stage` holds."""
        return [c.index for c in self.chunks if c.stage == stage]

    def param_on_mesh(self, fqn: str) -> placements.OnMesh:
        """A parameter's placement on every mesh axis (replicated where the manifest has none)."""
        return self.param_placements.get(fqn) or placements.OnMesh()

    def sharded_over(self, axis: str) -> frozenset:
        """The parameters `axis` shards (ep: the expert weights, each rank holding its experts)."""
        return frozenset(f for f, on in self.param_placements.items() if on.dim(axis) is not None)

    def expert_weights(self) -> frozenset:
        """The parameters only some ep ranks hold (their gradients reduce over edp): the stacked
        experts ep splits (placed ep S(0)) and experts held as separate modules, each whole on
        its rank (passes/module_experts.py)."""
        return self.sharded_over("ep") | frozenset(self.expert_modules)

    def replace(self, **changes) -> "Manifest":
        return dataclasses.replace(self, **changes)

    # -- the JSON form by key: for readers written against the dict manifest (checkpoints,
    # tests); new code reads the typed attributes above.
    @functools.cached_property
    def _json(self) -> dict:
        return self.to_json()

    def __getitem__(self, key: str):
        return self._json[key]

    def get(self, key: str, default=None):
        return self._json.get(key, default)

    # -- JSON ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        plan = self.plan
        out = {
            "format": FORMAT,
            "threefold_version": self.threefold_version,
            "torch_version": self.torch_version,
            "model": self.model,
            "plan": str(plan),
            "plan_values": plan.to_json(),
            "mesh": self.mesh.to_json(),    # optional axes (ep, cp) only when > 1
            "num_chunks": len(self.chunks),
            "has_loss": self.has_loss,
            "num_model_inputs": self.num_model_inputs,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [dict(o) for o in self.outputs],
            "ties": self.ties,
            "tp_grad_sync": list(self.tp_grad_sync),
            "shards": {fqn: s.to_json() for fqn, s in self.shards.items()},
            "state_shapes": {k: [list(v[0]), v[1]] for k, v in self.state_shapes.items()},
            "local_shapes": {k: list(v) for k, v in self.local_shapes.items()},
            "param_roles": dict(self.param_roles),
            "model_flops": self.model_flops,
            "scatter_gather": self.scatter_gather,
            "schedule": {"kind": plan.schedule, "microbatches": plan.microbatches,
                         "interleave": plan.interleave},
            "chunks": [c.to_json() for c in self.chunks],
            "files": dict(self.files),
            "notes": list(self.notes),
            "loss": self.loss.to_json(),
            "batch_dims": self.batch_dims,
            "output_batch_dims": self.output_batch_dims,
            "output_tree": self.output_tree,
            "frozen": list(self.frozen),
            "experts": dict(self.experts),
            "expert_modules": {k: list(v) for k, v in self.expert_modules.items()},
            "param_placements": {fqn: str(on) for fqn, on in self.param_placements.items()},
            "op_modules": {k: dict(v) for k, v in self.op_modules.items()},
            "model_outputs_missing": self.model_outputs_missing,
        }
        if self.seq_length is not None:
            out["seq_length"] = self.seq_length
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, m, root: str = "<manifest>") -> "Manifest":
        """Check a manifest's JSON form (see `check_manifest`) and build the value."""
        check_manifest(root, m)
        plan = RunPlan.from_json(m.get("plan_values"), m.get("plan"), f"artifact {root!r}: {MANIFEST}")
        _check_against_plan(root, m, plan)
        known = {f.name for f in dataclasses.fields(cls)} | {"format", "mesh", "num_chunks", "plan_values",
                                                              "scatter_gather", "schedule"}
        try:
            return cls(
                plan=plan,
                chunks=tuple(ChunkEntry.from_json(c) for c in m["chunks"]),
                has_loss=bool(m.get("has_loss")),
                num_model_inputs=int(m.get("num_model_inputs", 0)),
                model=m.get("model", ""),
                inputs=tuple(TensorSpec.from_json(s) for s in m.get("inputs", [])),
                outputs=tuple(dict(o) for o in m.get("outputs", [])),
                ties=dict(m.get("ties") or {}),
                tp_grad_sync=tuple(m.get("tp_grad_sync", [])),
                shards={fqn: ShardSpec.from_json(d) for fqn, d in (m.get("shards") or {}).items()},
                state_shapes={k: (list(v[0]), v[1]) for k, v in (m.get("state_shapes") or {}).items()},
                local_shapes={k: [int(x) for x in v] for k, v in (m.get("local_shapes") or {}).items()},
                param_roles={str(k): str(v) for k, v in (m.get("param_roles") or {}).items()},
                model_flops=int(m.get("model_flops") or 0),
                loss=LossForm.from_json(m.get("loss")),
                batch_dims=m.get("batch_dims"),
                output_batch_dims=m.get("output_batch_dims"),
                output_tree=m.get("output_tree"),
                frozen=tuple(m.get("frozen", [])),
                experts={str(k): int(v) for k, v in (m.get("experts") or {}).items()},
                expert_modules={str(k): [int(x) for x in v] for k, v in (m.get("expert_modules") or {}).items()},
                param_placements={str(k): placements.parse_on_mesh(str(v))
                                  for k, v in (m.get("param_placements") or {}).items()},
                op_modules={str(k): {"module": str(v["module"]), "sha256": str(v["sha256"])}
                            for k, v in (m.get("op_modules") or {}).items()},
                model_outputs_missing=m.get("model_outputs_missing", _OLD_OUTPUTS if m.get("has_loss") else ""),
                seq_length=int(m["seq_length"]) if m.get("seq_length") is not None else None,
                notes=tuple(m.get("notes", [])),
                files=dict(m["files"]),
                threefold_version=m.get("threefold_version", ""),
                torch_version=m.get("torch_version", ""),
                extra={k: v for k, v in m.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"artifact {root!r}: {MANIFEST} is inconsistent: a field is missing or "
                            f"malformed ({type(exc).__name__}: {exc}); recompile the artifact") from None

    @classmethod
    def loads(cls, text: str, root: str = "<manifest>") -> "Manifest":
        try:
            data = json.loads(text)
        except RecursionError:
            raise PlanError(f"artifact {root!r}: {MANIFEST} nests too deeply to be a manifest; recompile the "
                            "artifact") from None
        except ValueError as exc:
            raise PlanError(f"artifact {root!r}: {MANIFEST} is not valid JSON ({exc}); recompile the artifact") from None
        return cls.from_json(data, root)


_OLD_OUTPUTS = "the artifact was compiled before forward-only outputs existed; recompile it"


# -- validation (before anything a manifest names is touched) --------------------------------

def safe_path(root: str, rel) -> str:
    """root/rel, refusing anything that leaves root (absolute, '..', links pointing out)."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise PlanError(f"artifact {root!r}: file entry {rel!r} in {MANIFEST} is not a relative path")
    parts = rel.replace("\\", "/").split("/")
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts or (len(rel) > 1 and rel[1] == ":"):
        raise PlanError(f"artifact {root!r}: {rel} in {MANIFEST} points outside the artifact directory")
    real_root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(real_root, rel))
    if os.path.commonpath([real_root, path]) != real_root:
        raise PlanError(f"artifact {root!r}: {rel} leads outside the artifact directory (symbolic link?)")
    return path


def _is_count(v, low: int = 1, high: int = MAX_RANKS) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _bad(root: str, what: str):
    raise PlanError(f"artifact {root!r}: {MANIFEST} is inconsistent: {what}; recompile the artifact")


def check_manifest(root: str, m) -> None:
    """Structure and consistency of a manifest's JSON form, and that every path it names
    stays inside `root` (runtime/loader.safe_path)."""
    if not isinstance(m, dict):
        _bad(root, "it is not a JSON object")
    if m.get("format") != FORMAT:
        raise PlanError(f"{root!r}: artifact format {m.get('format')!r} is not supported (expected {FORMAT}; "
                        "older formats had no per-input placements, plan values, weight hashes or one module per tp rank): recompile it with `threefold compile`")
    mesh, chunks, files = m.get("mesh"), m.get("chunks"), m.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) and len(v) == 64 for v in files.values()):
        _bad(root, "'files' must map each file to its sha256")
    for rel in files:
        safe_path(root, rel)
    if (not isinstance(mesh, list) or not mesh or not all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and _is_count(a[1]) for a in mesh)
            or len({a[0] for a in mesh}) != len(mesh)):
        _bad(root, f"mesh {mesh!r} must list its axes as [name, positive size] pairs, each name once")
    if math.prod(a[1] for a in mesh) > MAX_RANKS:
        _bad(root, f"mesh {mesh} asks for more than {MAX_RANKS} ranks")
    mesh = {name: size for name, size in mesh}
    mesh.setdefault("pp", 1)
    mesh.setdefault("tp", 1)
    sched = m.get("schedule")
    if (not isinstance(sched, dict) or not _is_count(sched.get("microbatches"), 1, 1 << 20)
            or not _is_count(sched.get("interleave"), 1, 1024) or not isinstance(sched.get("kind"), str)):
        _bad(root, f"schedule {sched!r} needs kind, microbatches and interleave")
    actions = mesh["pp"] * sched["interleave"] * sched["microbatches"] * 3    # F, B, W at most
    if actions > MAX_SCHEDULE_ACTIONS:
        _bad(root, f"schedule with pp={mesh['pp']}, v={sched['interleave']}, m={sched['microbatches']} has "
             f"about {actions} actions, more than the {MAX_SCHEDULE_ACTIONS} a run builds in seconds")
    if not isinstance(chunks, list) or len(chunks) != mesh["pp"] * sched["interleave"] or m.get("num_chunks") != len(chunks):
        _bad(root, f"{len(chunks) if isinstance(chunks, list) else chunks!r} chunks for pp={mesh['pp']} "
             f"v={sched['interleave']} (num_chunks {m.get('num_chunks')!r})")
    tp_ranks = {str(r) for r in range(mesh["tp"])}
    with_weights = None
    for i, c in enumerate(chunks):
        stage = stage_of(i, mesh["pp"], chunk_layout(sched["kind"]))
        if not isinstance(c, dict) or c.get("index") != i or c.get("stage") != stage:
            _bad(root, f"chunk {i} must have index {i} and stage {stage}")
        if not isinstance(c.get("class"), str) or not c["class"].isidentifier():
            _bad(root, f"chunk {i} class {c.get('class')!r} is not a name")
        weights = c.get("weights", {})
        if not isinstance(weights, dict) or (weights and set(weights) != tp_ranks):
            _bad(root, f"chunk {i} weights must name one file per tp rank 0..{mesh['tp'] - 1}")
        if not c.get("module"):
            _bad(root, f"chunk {i} has no module")
        for key, rel in [("module", c["module"])] + [("weights", w) for w in weights.values()]:
            safe_path(root, rel)
            if rel not in files:
                _bad(root, f"chunk {i} {key} file {rel!r} has no sha256 in 'files'")
        has = bool(c.get("weights"))
        if with_weights is not None and has != with_weights:
            _bad(root, "some chunks have weights and others do not")
        with_weights = has
    _check_boundaries(root, chunks)


BOUNDARY_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool")  # runtime/boundary.py
MAX_DIM = 1 << 40


def _boundary(root: str, i: int, side: str, specs) -> list[tuple]:
    """(shape, dtype, placement) of each tensor on one side of chunk i, each checked."""
    if not isinstance(specs, list):
        _bad(root, f"chunk {i} {side} must be a list of tensors")
    out = []
    for j, d in enumerate(specs):
        shape = d.get("shape") if isinstance(d, dict) else None
        if (not isinstance(shape, list) or len(shape) > 16
                or not all(_is_count(n, 0, MAX_DIM) for n in shape) or math.prod(shape) > MAX_DIM):
            _bad(root, f"chunk {i} {side}[{j}] shape {shape!r} is not a list of sizes")
        if d.get("dtype") not in BOUNDARY_DTYPES:
            _bad(root, f"chunk {i} {side}[{j}] dtype {d.get('dtype')!r} is not one of {', '.join(BOUNDARY_DTYPES)}")
        out.append((tuple(shape), d["dtype"], d.get("placement"), json.dumps(d.get("axes"), sort_keys=True)))
    return out


def _check_boundaries(root: str, chunks: list) -> None:
    """What chunk i sends is what chunk i+1 receives (shapes, dtypes, placements): a tampered
    side would otherwise meet its peer's buffer inside gloo, which aborts the process."""
    prev = None
    for i, c in enumerate(chunks):
        ins = _boundary(root, i, "inputs", c.get("inputs", []))
        outs = _boundary(root, i, "outputs", c.get("outputs", []))
        if prev is not None and ins != prev:
            _bad(root, f"chunk {i} receives {[x[:2] for x in ins]} but chunk {i - 1} sends {[x[:2] for x in prev]}")
        prev = outs


def _check_against_plan(root: str, m: dict, plan: RunPlan) -> None:
    """The JSON's mesh and schedule are the plan's (one fact: the plan)."""
    mesh = plan.mesh.to_json()
    if m["mesh"] != mesh:
        _bad(root, f"mesh {m['mesh']} is not plan {plan}'s {mesh}")
    sched = {"kind": plan.schedule, "microbatches": plan.microbatches, "interleave": plan.interleave}
    if {k: m["schedule"].get(k) for k in sched} != sched:
        _bad(root, f"schedule {m['schedule']} is not plan {plan}'s {sched}")
