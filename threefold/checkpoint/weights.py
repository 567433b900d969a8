"""`parallelize(..., weights=PATH)`: each rank reads only its own slices of safetensors files.

PATH is a `.safetensors` file, a directory holding `model.safetensors`, or a Hugging Face
sharded directory (`model.safetensors.index.json` naming each tensor's file). A rank's
shard is cut straight from the file with safetensors' `get_slice`, piece by piece
(layout.py: the blocks of a fused projection, the real rows of a padded vocabulary), so
no rank reads another rank's rows or holds the full tensor.

A model's FQN is looked up as is, then without its leading components (a wrapper's
`model.` prefix, as in examples/hf.py), then under its tied aliases. A parameter the files
lack keeps the model's value if it has one; on the meta device it gets its module's own
initialiser, replayed on this rank's shard only (init_shard.py: recorded once on the meta
device, drawn row by row from generators seeded by FQN and row, so every rank, every run
and every plan gets the same values).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os

import torch

from threefold.checkpoint.init_shard import ShardInit
from threefold.checkpoint.layout import local_shape, pieces
from threefold.errors import PlanError
from threefold.runtime.shard import rank_shard

INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def empty_weights():
    """Build a model with its parameters on the meta device and its buffers real (what
    `weights=` expects: buffers computed in __init__, like causal masks, stay usable)."""
    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    torch.nn.Module.register_parameter = on_meta
    try:
        with _SkipMetaInit():
            yield
    finally:
        torch.nn.Module.register_parameter = register


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Initialisers on meta tensors do nothing but cost: torch routes `normal_` on meta
    through its Python references, which import torch._dynamo (~100 MB per rank). Their
    values are never read (the weights come from the file), so they are skipped."""
    SKIP = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_,
            torch.Tensor.exponential_, torch.Tensor.bernoulli_, torch.Tensor.random_,
            torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.geometric_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_place_init = func in self.SKIP or getattr(func, "__module__", None) == "torch.nn.init"
        target = args[0] if args else kwargs.get("tensor")     # nn.init passes it by keyword
        if in_place_init and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def traceable(model: torch.nn.Module):
    """Meta parameters swapped for uninitialised CPU tensors while tracing (tracing reads
    shapes only, so their pages are never touched), then put back."""
    swapped, stand_in = [], {}
    for mod in model.modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in stand_in:   # one stand-in per parameter: tied weights stay tied
                    stand_in[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                         requires_grad=p.requires_grad)
                mod._parameters[name] = stand_in[id(p)]
                swapped.append((mod, name, p))
    try:
        yield
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


class WeightSource:
    def __init__(self, path: str, model: torch.nn.Module, ties: dict | None = None):
        self.path = path
        self.model = model
        self.files = _tensor_files(path)           # key -> file
        self.aliases = {}
        for canonical, names in (ties or {}).items():
            self.aliases[canonical] = [n for n in names if n != canonical]

    def key_of(self, fqn: str) -> str | None:
        for name in [fqn] + self.aliases.get(fqn, []):
            parts = name.split(".")
            for i in range(len(parts)):
                key = ".".join(parts[i:])
                if key in self.files:
                    return key
        return None

    def check_shapes(self) -> None:
        """Every model parameter the files hold has the model's shape (read from the files'
        headers only); the first that differs is a PlanError. Parameters the files lack are
        fine: they get their module's initialiser."""
        # lazy: safetensors loads only when weight files are read or written
        from safetensors import safe_open
        by_file: dict[str, list[tuple[str, str, list[int]]]] = {}
        for fqn, p in self.model.named_parameters():
            key = self.key_of(fqn)
            if key is not None:
                by_file.setdefault(self.files[key], []).append((fqn, key, list(p.shape)))
        for file, entries in by_file.items():
            try:
                with safe_open(file, framework="pt") as f:
                    for fqn, key, shape in entries:
                        got = list(f.get_slice(key).get_shape())
                        if got != shape:
                            raise PlanError(f"weights {self.path}: {key} has shape {got}, the model's {fqn} is "
                                            f"{shape}: these weights are of another model")
            except PlanError:
                raise
            except Exception as exc:
                raise PlanError(f"weights {self.path}: {file} is not a readable safetensors file "
                                f"({type(exc).__name__}); the file is damaged") from None

    def local(self, fqn: str, spec, tp_rank: int, model_value: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `fqn` as a new CPU tensor (see fill)."""
        out = torch.empty(local_shape(spec, list(model_value.shape), tp_rank), dtype=model_value.dtype)
        return self.fill(out, fqn, spec, tp_rank, model_value)

    def fill(self, dest: torch.Tensor, fqn: str, spec, tp_rank: int, model_value: torch.Tensor) -> torch.Tensor:
        """Write this rank's shard of `fqn` into `dest` (e.g. the chunk module's own
        parameter, so the shard exists once): from the files, one piece at a time, else the
        model's value, else its module's init."""
        shape = list(model_value.shape)
        key = self.key_of(fqn)
        if key is None and model_value.is_meta:
            dim, parts = pieces(spec, shape, tp_rank)
            return self.initialiser.fill(dest, fqn, shape, dim, parts)
        if key is None:
            with torch.no_grad():
                dest.copy_(rank_shard(model_value, spec, tp_rank))
            return dest
        # lazy: safetensors loads only when weight files are read or written
        from safetensors import safe_open
        dim, parts = pieces(spec, shape, tp_rank)
        try:
            with safe_open(self.files[key], framework="pt") as f, torch.no_grad():
                sl = f.get_slice(key)
                if list(sl.get_shape()) != shape:
                    raise PlanError(f"weights {self.path}: {key} has shape {list(sl.get_shape())}, the model's "
                                    f"{fqn} is {shape}: these weights are of another model")
                if not shape:
                    dest.copy_(f.get_tensor(key))
                    return dest
                dest.zero_()    # padded vocabulary rows stay zero
                for p in parts:
                    _read_piece(sl, dest, dim, p)
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(f"weights {self.path}: reading {key} from {self.files[key]} failed "
                            f"({type(exc).__name__}: {str(exc)[:200]}); the file is damaged") from None
        return dest

    @functools.cached_property
    def initialiser(self) -> ShardInit:
        return ShardInit(self.model, self.path)


READ_BYTES = 8 * 2**20   # a piece is read in row blocks of about this size


def _read_piece(sl, dest: torch.Tensor, dim: int, p) -> None:
    """Copy one piece of a safetensors slice into `dest`, a block of rows at a time, so the
    transient copy is a few MB rather than the piece (a vocabulary shard is tens of MB)."""
    view = dest.narrow(dim, p.local, p.length)
    row_bytes = max(1, view[0].numel() * view.element_size()) if view.dim() else 1
    rows = max(1, READ_BYTES // row_bytes)
    for r in range(0, view.shape[0] if view.dim() else 1, rows):
        n = min(rows, view.shape[0] - r)
        index = [slice(None)] * max(dim + 1, 1)
        index[dim] = slice(p.start, p.start + p.length)
        if dim == 0:
            index[0] = slice(p.start + r, p.start + r + n)
        else:
            index[0] = slice(r, r + n)
        view.narrow(0, r, n).copy_(sl[tuple(index)])


def _tensor_files(path: str) -> dict[str, str]:
    from safetensors import safe_open   # lazy: safetensors loads only when weight files are read or written
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
                raise PlanError(f"weights {index} is not a safetensors index ({type(exc).__name__}): "
                                "it needs a 'weight_map'") from None
            files = {k: os.path.join(path, v) for k, v in weight_map.items()}
            missing = sorted({f for f in files.values() if not os.path.isfile(f)})
            if missing:
                raise PlanError(f"weights {path}: {os.path.basename(missing[0])} named by {INDEX} is missing")
            return files
        single = os.path.join(path, "model.safetensors")
        if not os.path.isfile(single):
            raise PlanError(f"weights {path} has neither {INDEX} nor model.safetensors: pass a .safetensors "
                            "file or a Hugging Face model directory")
        path = single
    if not os.path.isfile(path):
        raise PlanError(f"weights {path} does not exist: pass a .safetensors file or a directory")
    try:
        with safe_open(path, framework="pt") as f:
            return {k: path for k in f.keys()}
    except Exception as exc:
        raise PlanError(f"weights {path} is not a readable safetensors file ({type(exc).__name__})") from None
