"""Cluster size: the Tiresias cluster-spec format, or a plain GPU count."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.trace import read_csv_rows

SPEC_FIELDS = ("num_switch", "num_node_p_switch", "num_gpu_p_node", "num_cpu_p_node", "mem_p_node")
MAX_GPUS = 1_000_000  # the engine keeps one owner slot per GPU; far beyond any trace's cluster


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs only are simulated: placement on nodes and switches is not modelled (see docs/simulate.md)."""

    num_switch: int = 1
    num_node_p_switch: int = 1
    num_gpu_p_node: int = 1

    @property
    def total_gpus(self) -> int:
        return self.num_switch * self.num_node_p_switch * self.num_gpu_p_node

    def describe(self) -> str:
        return f"{self.total_gpus} GPUs ({self.num_switch}×{self.num_node_p_switch} nodes × {self.num_gpu_p_node})"


def gpus(count: int) -> ClusterSpec:
    """A cluster of ``count`` GPUs."""
    if count < 1:
        raise SimulationError(f"a cluster needs at least one GPU, not {count}")
    return _checked(ClusterSpec(1, 1, count))


def _checked(spec: ClusterSpec) -> ClusterSpec:
    if spec.total_gpus < 1:
        raise SimulationError("a cluster needs at least one GPU")
    if spec.total_gpus > MAX_GPUS:
        raise SimulationError(f"a cluster of {spec.total_gpus:,} GPUs is more than this simulator takes ({MAX_GPUS:,})")
    return spec


def read_cluster_spec(path: str | Path) -> ClusterSpec:
    path = Path(path)
    if not path.is_file():
        raise SimulationError(f"cluster spec not found: {path} (--cluster takes a Tiresias cluster-spec CSV, a GPU "
                              "count or NODESxGPUS)")
    rows = [row for row in read_csv_rows(path, "cluster spec") if any(row)]
    if len(rows) != 2 or tuple(cell.strip() for cell in rows[0]) != SPEC_FIELDS:
        raise SimulationError(f"{path}: expected the header {','.join(SPEC_FIELDS)} and one line")
    try:
        values = [int(cell) for cell in rows[1]]
    except ValueError:
        raise SimulationError(f"{path}:2: malformed line {','.join(rows[1])!r}") from None
    if len(values) != len(SPEC_FIELDS) or min(values[:3]) < 1:
        raise SimulationError(f"{path}:2: need {len(SPEC_FIELDS)} fields and positive counts")
    return _checked(ClusterSpec(values[0], values[1], values[2]))


def parse_cluster(text: str) -> ClusterSpec:
    """``--cluster``: a Tiresias spec file, a GPU count (``40``) or nodes×GPUs (``16x4``)."""
    if text.isdecimal():
        return gpus(int(text))
    nodes, sep, per_node = text.lower().partition("x")
    if sep and nodes.isdecimal() and per_node.isdecimal():
        spec = ClusterSpec(1, int(nodes), int(per_node))
        if spec.total_gpus < 1:
            raise SimulationError(f"a cluster needs at least one GPU: {text!r}")
        return _checked(spec)
    return read_cluster_spec(text)
