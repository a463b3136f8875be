"""The elastic engine: the membership protocol of one worker, with no training framework in it.

Front-ends (the Lightning strategy, the Accelerate accelerator) implement :class:`FrontEnd` and drive an
:class:`ElasticWorker`; its process group is an :class:`ElasticProcessGroup` that is reconfigured, never re-created.
"""

from __future__ import annotations

from lightning_elan.elastic.frontend import FrontEnd, ScalingParticipant
from lightning_elan.elastic.process_group import ElasticProcessGroup
from lightning_elan.elastic.worker import ElasticWorker, NotAMember

__all__ = ["ElasticProcessGroup", "ElasticWorker", "FrontEnd", "NotAMember", "ScalingParticipant"]
