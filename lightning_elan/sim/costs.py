"""Adjustment pauses: how long a resized job makes no progress, interpolated by model size.

Tables come from ``data/adjust_costs.json`` (``elan``: this repository's measured pauses, ``restart``: the
stop-and-restart baseline measured by the same benchmark) or from a user JSON ``{"points": [{"parameters": N,
"scale_out": s, "scale_in": s, "migrate": s}, …]}``. Between measured sizes the pause is linear in the parameter
count; beyond the largest it extends the line through the two largest points (never below the largest point's value);
below the smallest it is the smallest point's value.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from lightning_elan.sim.errors import SimulationError

COSTS_FILE = Path(__file__).parent / "data" / "adjust_costs.json"
BUILTIN_COST_MODELS = ("elan", "restart", "none")


class AdjustmentKind(str, Enum):
    """The kind of a simulated resize, which prices its pause."""

    SCALE_OUT = "scale_out"
    SCALE_IN = "scale_in"
    MIGRATE = "migrate"


@dataclass(frozen=True)
class CostPoint:
    parameters: int
    scale_out: float
    scale_in: float
    migrate: float

    def pause(self, kind: AdjustmentKind) -> float:
        return getattr(self, kind.value)


@dataclass(frozen=True)
class CostTable:
    """Pause per adjustment kind as a function of model size; ``name`` says where it came from."""

    name: str
    points: tuple[CostPoint, ...]
    _cache: dict[tuple[AdjustmentKind, int], float] = field(default_factory=dict, repr=False, compare=False, hash=False)

    def pause_s(self, kind: AdjustmentKind, parameters: int) -> float:
        key = (kind, parameters)
        if key not in self._cache:
            self._cache[key] = self._interpolate(kind, parameters)
        return self._cache[key]

    def _interpolate(self, kind: AdjustmentKind, parameters: int) -> float:
        if not self.points:
            return 0.0
        sizes = [point.parameters for point in self.points]
        if parameters <= sizes[0] or len(self.points) == 1:
            return self.points[0].pause(kind) if parameters <= sizes[0] else self.points[-1].pause(kind)
        index = min(bisect.bisect_left(sizes, parameters), len(sizes) - 1)
        low, high = self.points[index - 1], self.points[index]
        slope = (high.pause(kind) - low.pause(kind)) / (high.parameters - low.parameters)
        value = low.pause(kind) + slope * (parameters - low.parameters)
        return max(value, self.points[-1].pause(kind)) if parameters > sizes[-1] else value


@dataclass(frozen=True)
class CostModel:
    """The pauses one simulation charges: resizes from ``adjust``, resumes after preemption from ``resume``."""

    name: str
    adjust: CostTable
    resume: CostTable

    def resize_pause_s(self, parameters: int, old_gpus: int, new_gpus: int) -> float:
        if new_gpus == old_gpus:
            return 0.0
        kind = AdjustmentKind.SCALE_OUT if new_gpus > old_gpus else AdjustmentKind.SCALE_IN
        return self.adjust.pause_s(kind, parameters)

    def resume_pause_s(self, parameters: int) -> float:
        return self.resume.pause_s(AdjustmentKind.SCALE_OUT, parameters)


def _table(name: str, raw: object) -> CostTable:
    try:
        points = sorted(
            (CostPoint(int(p["parameters"]), float(p["scale_out"]), float(p["scale_in"]), float(p["migrate"]))
             for p in raw["points"]),  # type: ignore[index]
            key=lambda point: point.parameters,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise SimulationError(f"{name}: a cost table needs points with parameters, scale_out, scale_in, migrate "
                              f"({error!r})") from None
    if not points or any(min(p.scale_out, p.scale_in, p.migrate) < 0 for p in points):
        raise SimulationError(f"{name}: a cost table needs at least one point and non-negative pauses")
    return CostTable(name, tuple(points))


def builtin_tables() -> dict[str, CostTable]:
    raw = json.loads(COSTS_FILE.read_text())
    return {name: _table(name, raw[name]) for name in ("elan", "restart")}


def load_cost_model(spec: str) -> CostModel:
    """``elan``, ``restart``, ``none`` (instantaneous adjustments), or a path to a JSON cost table."""
    tables = builtin_tables()
    if spec == "none":
        return CostModel("none", CostTable("none", ()), tables["restart"])
    if spec in tables:
        return CostModel(spec, tables[spec], tables["restart"])
    path = Path(spec)
    if not path.is_file():
        raise SimulationError(f"--adjust-cost: {spec!r} is neither {', '.join(BUILTIN_COST_MODELS)} nor a file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SimulationError(f"{path}: not JSON ({error})") from None
    return CostModel(path.name, _table(str(path), raw), tables["restart"])
