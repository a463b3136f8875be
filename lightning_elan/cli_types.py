"""The argument types of every ``elan`` command, one set: numbers, ports, job names, AM addresses.

Each parser raises ``ValueError`` with one line naming the problem; :func:`arg_type` turns it into argparse's
``elan <command>: error: argument --x: <message>`` with exit code 2. Numbers must be finite: ``inf`` and ``nan``
are refused everywhere (they cannot travel in the AM's JSON, and no timeout or price of the CLI means them).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from lightning_elan.launcher.schedule import parse_non_negative_int, parse_positive_int, parse_schedule
from lightning_elan.master import registry
from lightning_elan.protocol import addresses
from lightning_elan.protocol.contract import MAX_STANDBY, MAX_WORLD_SIZE

MAX_PORT = 65535


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Turn a parser raising ``ValueError`` into an argparse type whose message reaches the user."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _number(text: str) -> float | None:
    """``float(text)``, or None when ``text`` is no number (``nan`` counts as none)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else value


def _check_range(text: str, ok: Callable[[float], bool], what: str) -> float:
    """The number in ``text`` if it is finite and ``ok``; else ValueError ``must be <what>, got 'text'``."""
    value = _number(text)
    if value is None or not ok(value):
        raise ValueError(f"must be {what}, got {text!r}")
    if math.isinf(value):
        raise ValueError(f"must be a finite {what.removeprefix('a ')}, got {text!r}")
    return value


def parse_positive_float(text: str) -> float:
    """A finite number > 0 (timeouts, grace periods, factors)."""
    return _check_range(text, lambda value: value > 0, "a number > 0")


def parse_non_negative_float(text: str) -> float:
    """A finite number >= 0 (cool-downs, prices, waits that may be zero)."""
    return _check_range(text, lambda value: value >= 0, "a number >= 0")


def parse_fraction(text: str) -> float:
    """A number in [0, 1) (thresholds)."""
    return _check_range(text, lambda value: 0 <= value < 1, "a number in [0, 1)")


def parse_world_size(text: str) -> int:
    """A number of workers: an integer in 1..MAX_WORLD_SIZE."""
    stripped = text.strip()
    if not stripped.isdecimal() or not 1 <= int(stripped) <= MAX_WORLD_SIZE:
        raise ValueError(f"must be an integer in 1..{MAX_WORLD_SIZE}, got {text!r}")
    return int(stripped)


def parse_standby_count(text: str) -> int:
    """A number of standby workers: an integer in 0..MAX_STANDBY."""
    count = parse_non_negative_int(text)
    if count > MAX_STANDBY:
        raise ValueError(f"at most {MAX_STANDBY} standby workers, got {count}")
    return count


def parse_port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    stripped = text.strip()
    if not stripped.isdecimal() or int(stripped) > MAX_PORT:
        raise ValueError(f"must be a port number in 0..{MAX_PORT}, got {text!r}")
    return int(stripped)


def parse_job_name(text: str) -> str:
    """A job name the registry takes (letters, digits, ``_ . -``)."""
    return registry.check_job_name(text)


positive_int = arg_type(parse_positive_int)
non_negative_int = arg_type(parse_non_negative_int)
positive_float = arg_type(parse_positive_float)
non_negative_float = arg_type(parse_non_negative_float)
fraction = arg_type(parse_fraction)
world_size = arg_type(parse_world_size)
standby_count = arg_type(parse_standby_count)
port = arg_type(parse_port)
job_name = arg_type(parse_job_name)
schedule_type = arg_type(parse_schedule)
am_address_list = arg_type(addresses.am_address_list)
bind_address = arg_type(addresses.bind_address)
