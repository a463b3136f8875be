"""Elastic data loading by serial position."""

from lightning_elan.data.loader import ElasticDataLoader
from lightning_elan.data.sampler import DataPosition, ElasticBatchSampler, ElasticSampler, EpochOrder

__all__ = ["DataPosition", "ElasticBatchSampler", "ElasticDataLoader", "ElasticSampler", "EpochOrder"]
