"""Hugging Face Accelerate, elastic: ``ElasticAccelerator`` runs an ordinary Accelerate training loop as a member of an
elastic job (``elan run``), with the same application master, protocol, replication and scaling as the Lightning
strategy.

    accelerator = ElasticAccelerator(elastic_plugin=ElasticPlugin(coordinate_every=10))
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    for epoch in accelerator.epochs(num_epochs):
        for batch in train_dl:
            ...
"""

from __future__ import annotations

from lightning_elan._lazy import lazy_exports

__all__ = ["ElasticAccelerator", "ElasticPlugin"]

__getattr__, __dir__ = lazy_exports(__name__, {"ElasticAccelerator": "accelerator", "ElasticPlugin": "plugin"})
