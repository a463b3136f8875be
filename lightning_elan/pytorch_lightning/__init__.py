"""``lightning_elan`` for the classic ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

    import pytorch_lightning as pl
    from lightning_elan.pytorch_lightning import ElanStrategy, HybridScaling, ProgressiveLinearLR

    pl.Trainer(strategy="elan", callbacks=[HybridScaling(), ProgressiveLinearLR()])

The submodules (``lightning_elan.pytorch_lightning.strategy.strategy``, ``….callbacks.hybrid``, ``….compat``) are the
modules of ``lightning_elan`` with their imports mapped to ``pytorch_lightning``/``lightning_fabric`` by the import
hook in :mod:`lightning_elan._classic`: one source, two class trees.
"""

from __future__ import annotations

from lightning_elan import _classic

_classic.install()

from lightning_elan.pytorch_lightning.callbacks import HybridScaling, ProgressiveLinearLR  # noqa: E402
from lightning_elan.pytorch_lightning.strategy.environment import ElanEnvironment  # noqa: E402
from lightning_elan.pytorch_lightning.strategy.strategy import ElanStrategy  # noqa: E402

__all__ = ["ElanEnvironment", "ElanStrategy", "HybridScaling", "ProgressiveLinearLR"]
