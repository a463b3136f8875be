"""The one set of argument types of every ``elan`` command (``cli_types``): counts are plain decimals, numbers are
finite (``inf`` and ``nan`` are refused with one line), and argparse reports each refusal as ``elan <command>: error:
argument --x: …`` with exit code 2."""

from __future__ import annotations

import pytest

from lightning_elan import cli_types
from lightning_elan.cli import main
from lightning_elan.protocol.contract import MAX_STANDBY, MAX_WORLD_SIZE

NUMBERS = [cli_types.parse_positive_float, cli_types.parse_non_negative_float, cli_types.parse_fraction]
COUNTS = [cli_types.parse_world_size, cli_types.parse_standby_count, cli_types.parse_port]


@pytest.mark.parametrize("parse", NUMBERS)
@pytest.mark.parametrize("text", ["inf", "-inf", "Infinity", "nan", "1e999", "x", ""])
def test_numbers_refuse_what_is_not_a_finite_number(parse: object, text: str) -> None:
    with pytest.raises(ValueError, match=f"must be .*, got {text!r}"):
        parse(text)  # type: ignore[operator]


@pytest.mark.parametrize("parse", COUNTS)
@pytest.mark.parametrize("text", ["inf", "nan", "1.5", "-1", "1e3", "two"])
def test_counts_take_plain_decimals_only(parse: object, text: str) -> None:
    with pytest.raises(ValueError, match=f"got {text!r}"):
        parse(text)  # type: ignore[operator]


def test_in_range_values_are_taken() -> None:
    assert cli_types.parse_positive_float("0.5") == 0.5
    assert cli_types.parse_non_negative_float("0") == 0.0
    assert cli_types.parse_fraction("0.8") == 0.8
    assert cli_types.parse_world_size(str(MAX_WORLD_SIZE)) == MAX_WORLD_SIZE
    assert cli_types.parse_standby_count(str(MAX_STANDBY)) == MAX_STANDBY
    assert cli_types.parse_port("0") == 0


def test_range_ends_are_refused() -> None:
    with pytest.raises(ValueError, match="must be a number > 0"):
        cli_types.parse_positive_float("0")
    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\)"):
        cli_types.parse_fraction("1")
    with pytest.raises(ValueError, match=f"at most {MAX_STANDBY} standby workers"):
        cli_types.parse_standby_count(str(MAX_STANDBY + 1))
    with pytest.raises(ValueError, match="must be a port number"):
        cli_types.parse_port("65536")


RUN = ["run", "--nproc", "1", "--job", "j"]


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "--nproc", "inf", "--job", "j", "--", "true"], "argument --nproc: must be an integer in 1.."),
    ([*RUN, "--standby", "inf", "--", "true"], "argument --standby: must be a non-negative integer, got 'inf'"),
    ([*RUN, "--coordinate-every", "inf", "--", "true"], "argument --coordinate-every: must be an integer >= 1"),
    ([*RUN, "--term-grace", "inf", "--", "true"], "argument --term-grace: must be a finite number > 0, got 'inf'"),
    ([*RUN, "--autoscale", "throughput", "--autoscale-threshold", "inf", "--", "true"],
     "argument --autoscale-threshold: must be a number in [0, 1), got 'inf'"),
    (["scale", "--job", "j", "--at-step", "inf", "add", "1"], "argument --at-step: must be a non-negative integer"),
    (["profile", "--job", "j", "--min", "1", "--max", "2", "--steps", "inf"], "argument --steps: must be an integer"),
    (["autoscale", "--job", "j", "--policy", "throughput", "--price", "inf"],
     "argument --price: must be a finite number >= 0, got 'inf'"),
])
def test_elan_refuses_inf_with_one_line_and_exit_2(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert message in errors[0]
