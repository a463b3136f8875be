"""The AM wire protocol (messages) and its client."""

from __future__ import annotations

from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from lightning_elan.protocol.messages import MAX_MESSAGE_BYTES, ProtocolError

__all__ = ["MAX_MESSAGE_BYTES", "AMClient", "AMError", "AMUnavailable", "ProtocolError"]
