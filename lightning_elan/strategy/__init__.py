"""The elastic strategy and its cluster environment."""

from lightning_elan.strategy.environment import ElanEnvironment
from lightning_elan.strategy.strategy import ElanStrategy

__all__ = ["ElanEnvironment", "ElanStrategy"]
