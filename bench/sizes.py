"""Model sizes of the benchmark (pure: the harness reads them without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

IN_FEATURES = 256
CLASSES = 10


@dataclass(frozen=True)
class ModelSize:
    """An MLP: ``depth`` hidden layers of ``width`` units."""

    name: str
    width: int
    depth: int

    def parameters(self) -> int:
        hidden = IN_FEATURES * self.width + self.width
        hidden += (self.depth - 1) * (self.width * self.width + self.width)
        return hidden + self.width * CLASSES + CLASSES


MODEL_SIZES: dict[str, ModelSize] = {
    size.name: size
    for size in (
        ModelSize("tiny", 64, 2),
        ModelSize("1m", 576, 4),
        ModelSize("11m", 1664, 5),
        ModelSize("25m", 2048, 7),
        ModelSize("100m", 4096, 7),
    )
}
