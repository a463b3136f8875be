"""The simulator's one exception type: bad input or a violated invariant, with a message for the user."""

from __future__ import annotations


class SimulationError(Exception):
    """Raised for unreadable inputs (trace, cluster spec, cost file, policy name) and for broken invariants."""
