"""Which old member sends the training state to each joiner (pure)."""

from __future__ import annotations


def choose_sources(stayers: list[str], leavers: list[str], joiners: list[str]) -> dict[str, str]:
    """Map each joiner to a source worker: distinct stayers round-robin in order, leavers if there is no stayer.

    Spreading joiners over distinct sources lets their copies run concurrently. Raises ``ValueError`` when joiners
    need a source but there are neither stayers nor leavers, or when a joiner is listed twice.
    """
    if len(set(joiners)) != len(joiners):
        raise ValueError(f"joiners must be distinct, got {joiners}")
    if not joiners:
        return {}
    candidates = list(dict.fromkeys(stayers)) or list(dict.fromkeys(leavers))
    if not candidates:
        raise ValueError(f"no source for joiners {joiners}: there are no stayers and no leavers")
    return {joiner: candidates[index % len(candidates)] for index, joiner in enumerate(joiners)}
