"""`Cluster`: the hardware the planner plans for, from a preset name or a TOML file.

A cluster is a handful of physical numbers per GPU: peak FLOP/s per dtype, HBM capacity
and bandwidth, GPUs per node, link bandwidths inside and across nodes, and the fraction
of peak a large GEMM sustains. Presets ship as `threefold/planner/clusters/<name>.toml`;
a user file has the same keys (see `REQUIRED` and `OPTIONAL`). Every problem with a file is a
`PlanError` naming the file, the key and the fix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources

from threefold.errors import PlanError

try:  # Python 3.11+
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None

# key -> what it means (used in error messages and `threefold plan --help`).
REQUIRED = {
    "gpus_per_node": "GPUs in one node (one NVLink/NVSwitch domain)",
    "hbm_bytes": "GPU memory per GPU, bytes",
    "hbm_bandwidth": "GPU memory bandwidth, bytes/s",
    "intra_node_bandwidth": "per-GPU one-direction bandwidth inside a node, bytes/s",
    "inter_node_bandwidth": "per-GPU one-direction bandwidth across nodes, bytes/s",
    "matmul_fraction": "fraction of peak FLOP/s a large GEMM sustains (0..1]",
    "peak_flops": "table of dense peak FLOP/s per dtype, e.g. [peak_flops] bf16 = 312e12",
}
OPTIONAL = {
    "kernel_launch_s": 5e-6,          # host cost of launching one kernel: a floor per op
    "intra_node_latency_s": 5e-6,     # per ring step inside a node
    "inter_node_latency_s": 10e-6,    # per ring step / message across nodes
    "reserved_bytes": 2 * 2**30,      # CUDA context, cuBLAS workspace, NCCL buffers
    "name": "",
    "description": "",
    "device": "",                     # the GPU, as the plan report names it ("H100 80GB SXM5")
    # The best whole-step efficiency measured for dense transformer training of this kind on
    # this device, as a fraction of its peak: no plan is predicted above it. Without one, the
    # paper's A100 figure (Narayanan et al., SC'21, Table 1: 163 of 312 TFLOP/s).
    "measured_best_fraction": 163 / 312,
    "measured_best_source": "",
}
PAPER_A100_SOURCE = "Narayanan et al. SC'21, Table 1: 163 of an A100's 312 TFLOP/s"


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    hbm_bytes: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    matmul_fraction: float
    peak_flops: dict = field(default_factory=dict)   # dtype -> FLOP/s
    kernel_launch_s: float = 5e-6
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    reserved_bytes: float = 2 * 2**30
    description: str = ""
    device: str = ""
    measured_best_fraction: float = 163 / 312
    measured_best_source: str = PAPER_A100_SOURCE

    @property
    def device_name(self) -> str:
        return self.device or self.name

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise PlanError(f"cluster {self.name!r} has no peak FLOP/s for dtype {dtype!r}: "
                            f"use one of {', '.join(sorted(self.peak_flops))} or add it under [peak_flops]")
        return float(self.peak_flops[dtype])

    @property
    def usable_bytes(self) -> float:
        """Memory a plan may fill: HBM less what the runtime itself keeps."""
        return self.hbm_bytes - self.reserved_bytes


def preset_names() -> list[str]:
    folder = resources.files("threefold.planner") / "clusters"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_cluster(name_or_path: str) -> Cluster:
    """A preset name (`a100-80gb`, `h100-80gb`, `h200`) or a path to a TOML file."""
    text = str(name_or_path)
    if text.endswith(".toml") or os.sep in text or os.path.exists(text):
        if not os.path.isfile(text):
            raise PlanError(f"cluster file {text!r} does not exist: give a TOML file path "
                            f"or a preset ({', '.join(preset_names())})")
        with open(text, "rb") as f:
            return cluster_from_toml(f.read(), source=text)
    if text not in preset_names():
        raise PlanError(f"cluster preset {text!r} is unknown: use one of {', '.join(preset_names())} "
                        "or a path to a TOML file")
    data = (resources.files("threefold.planner") / "clusters" / f"{text}.toml").read_bytes()
    return cluster_from_toml(data, source=f"preset {text}")


def cluster_from_toml(data: bytes | str, source: str = "cluster TOML") -> Cluster:
    if _toml is None:  # pragma: no cover
        raise PlanError("reading cluster TOML needs Python 3.11 (tomllib) or the tomli package: pip install tomli")
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    try:
        raw = _toml.loads(data)
    except _toml.TOMLDecodeError as exc:
        raise PlanError(f"{source} is not valid TOML ({exc}): fix the syntax") from None
    except RecursionError:
        raise PlanError(f"{source} nests too deeply to be a cluster description: use flat key = value lines") from None
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise PlanError(f"{source} is missing {', '.join(missing)}: add "
                        + "; ".join(f"{k} ({REQUIRED[k]})" for k in missing))
    unknown = sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise PlanError(f"{source} has unknown key(s) {', '.join(unknown)}: "
                        f"known keys are {', '.join(list(REQUIRED) + list(OPTIONAL))}")
    values = {k: raw.get(k, default) for k, default in OPTIONAL.items()}
    texts = ("name", "description", "device", "measured_best_source")
    for key in [k for k in REQUIRED if k != "peak_flops"] + [k for k in OPTIONAL if k not in texts]:
        value = raw.get(key, OPTIONAL.get(key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                value == 0 and key in REQUIRED):
            raise PlanError(f"{source}: {key} = {value!r} is invalid: it must be a positive number "
                            f"({REQUIRED.get(key, 'see OPTIONAL in threefold/planner/cluster.py')})")
        values[key] = value
    for key in ("matmul_fraction", "measured_best_fraction"):
        if not 0 < values[key] <= 1:
            raise PlanError(f"{source}: {key} = {values[key]} is invalid: it is a fraction of peak, in (0, 1]")
    if "measured_best_fraction" in raw and not raw.get("measured_best_source"):
        raise PlanError(f"{source}: measured_best_fraction needs measured_best_source: say who measured it "
                        "(the plan report cites it when a prediction is held there)")
    if int(values["gpus_per_node"]) != values["gpus_per_node"]:
        raise PlanError(f"{source}: gpus_per_node = {values['gpus_per_node']} is invalid: use a whole number")
    peaks = raw["peak_flops"]
    if not isinstance(peaks, dict) or not peaks or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in peaks.values()):
        raise PlanError(f"{source}: peak_flops must be a table of positive FLOP/s per dtype, "
                        "e.g. [peak_flops] then bf16 = 312e12")
    return Cluster(
        name=str(values["name"] or source), description=str(values["description"]),
        gpus_per_node=int(values["gpus_per_node"]), hbm_bytes=float(values["hbm_bytes"]),
        hbm_bandwidth=float(values["hbm_bandwidth"]),
        intra_node_bandwidth=float(values["intra_node_bandwidth"]),
        inter_node_bandwidth=float(values["inter_node_bandwidth"]),
        matmul_fraction=float(values["matmul_fraction"]),
        peak_flops={str(k): float(v) for k, v in peaks.items()},
        kernel_launch_s=float(values["kernel_launch_s"]),
        intra_node_latency_s=float(values["intra_node_latency_s"]),
        inter_node_latency_s=float(values["inter_node_latency_s"]),
        reserved_bytes=float(values["reserved_bytes"]),
        device=str(values["device"]), measured_best_fraction=float(values["measured_best_fraction"]),
        measured_best_source=str(values["measured_best_source"] or PAPER_A100_SOURCE),
    )
