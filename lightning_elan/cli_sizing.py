"""The options of ``elan profile`` and ``elan autoscale`` and the sizing options of ``elan run``/``elan am``, the
requests they make (``master/sizing.py`` serves them), and the wait for a profile's result; ``cli_status`` says them."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from lightning_elan.cli_types import fraction, job_name, non_negative_float, positive_float, positive_int, world_size
from lightning_elan.master.sizing import AUTOSCALE_POLICIES, SETTLE_MODES, STRAGGLER_MODES
from lightning_elan.protocol.contract import AutoscaleRequest, StatusReply, StragglersRequest

__all__ = ["add_autoscale", "add_profile", "add_sizing_options", "autoscale_request", "sizing_requests",
           "wait_for_profile"]

PROFILE_POLL_S = 1.0


def _utility_file(text: str) -> dict[str, Any]:
    """A utility function file (JSON, or YAML when PyYAML is installed), checked now."""
    from lightning_elan.sizing.autoscale import UtilityFunction

    try:
        return UtilityFunction.from_file(text).to_dict()
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"utility function {text!r}: {error}") from None


def add_profile(sub: Any, add_am_option: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    profile = sub.add_parser(
        "profile", help="measure a running job's throughput at each world size (EDL's profile)",
        description="Scale the running job through every world size in MIN..MAX, one worker at a time, measure "
                    "samples/s at each, then return it to its size (or settle on the best). No restart; every sample "
                    "still once per epoch. The result is in `elan status` and STATE_DIR/profile.json.",
    )
    profile.add_argument("--job", type=job_name, required=True, metavar="NAME")
    add_am_option(profile)
    profile.add_argument("--min", type=world_size, required=True, metavar="N", dest="min_size")
    profile.add_argument("--max", type=world_size, required=True, metavar="M", dest="max_size")
    profile.add_argument("--steps", type=positive_int, default=20, metavar="S",
                         help="steps measured at each size (default %(default)s)")
    profile.add_argument("--settle", choices=SETTLE_MODES, default="return",
                         help="after the profile: back to the job's size, or the best measured (default %(default)s)")
    profile.add_argument("--no-wait", action="store_true", help="return once the profile has started")
    profile.add_argument("--wait-timeout", type=non_negative_float, default=3600.0, metavar="SECONDS",
                         help="give up waiting for the result after this long (default %(default)g)")
    profile.add_argument("--timeout", type=positive_float, default=10.0, metavar="SECONDS",
                         help="one request to the AM (default %(default)g)")
    return profile


def add_autoscale(sub: Any, add_am_option: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    autoscale = sub.add_parser(
        "autoscale", help="let a running job size itself (Or et al.'s throughput or utility policy)",
        description="Switch a running job's autoscaler on (or off).",
    )
    autoscale.add_argument("--job", type=job_name, required=True, metavar="NAME")
    add_am_option(autoscale)
    autoscale.add_argument("--policy", choices=AUTOSCALE_POLICIES, required=True)
    autoscale.add_argument("--min-workers", type=world_size, default=None, metavar="N", help="default 1")
    autoscale.add_argument("--max-workers", type=world_size, default=None, metavar="M", help="default: none")
    _add_policy_options(autoscale, prefix="")
    autoscale.add_argument("--timeout", type=positive_float, default=10.0, metavar="SECONDS")
    return autoscale


def _add_policy_options(parser: argparse.ArgumentParser | Any, prefix: str) -> None:
    parser.add_argument(f"--{prefix}every", type=positive_int, default=None, metavar="N", dest="autoscale_every",
                        help="decide every N measured steps at a size (default 20)")
    parser.add_argument(f"--{prefix}step", type=world_size, default=None, metavar="K", dest="autoscale_step",
                        help="workers added per decision (default 1)")
    parser.add_argument(f"--{prefix}threshold", type=fraction, default=None, metavar="S",
                        dest="autoscale_threshold", help="throughput policy: least scaling efficiency (default 0.1)")
    parser.add_argument(f"--{prefix}cooldown", type=non_negative_float, default=None, metavar="SECONDS",
                        dest="autoscale_cooldown", help="least time between two decisions (default 0)")
    parser.add_argument("--price", type=non_negative_float, default=None, metavar="P",
                        help="utility policy: the price of one worker-second")
    parser.add_argument("--utility", type=_utility_file, default=None, metavar="FILE",
                        help="utility policy: the utility of the completion time (JSON or YAML, docs/autoscaling.md)")
    parser.add_argument("--scale-out-command", default=None, metavar="CMD",
                        help="how the AM asks the cluster for one more `elan worker` (a shell command, run once per "
                             "worker; e.g. 'sbatch worker.sh'); needed to grow a job of `elan worker`s")


def add_sizing_options(parser: argparse.ArgumentParser) -> None:
    """``--autoscale``/``--stragglers`` and their settings, on ``elan run`` and ``elan am``."""
    group = parser.add_argument_group("sizing (docs/autoscaling.md)")
    group.add_argument("--autoscale", choices=AUTOSCALE_POLICIES[:-1], default=None, metavar="POLICY",
                       help="size the job automatically: throughput or utility")
    group.add_argument("--autoscale-min", type=world_size, default=None, metavar="N")
    group.add_argument("--autoscale-max", type=world_size, default=None, metavar="M")
    _add_policy_options(group, prefix="autoscale-")
    group.add_argument("--stragglers", choices=STRAGGLER_MODES, default=None,
                       help="replace or remove a worker much slower than the others (default off: report only)")
    group.add_argument("--straggler-threshold", type=fraction, default=None, metavar="F",
                       help="a worker below F of the median compute throughput (EWMA) is slow (default 0.8)")
    group.add_argument("--straggler-window", type=positive_int, default=None, metavar="N",
                       help="... for N straggler rounds in a row (default 5); a round ends once every member has "
                            "sent its compute time, which each sends every second: about 1 s each")


def sizing_requests(args: argparse.Namespace,
                    parser: argparse.ArgumentParser) -> list[AutoscaleRequest | StragglersRequest]:
    """The ``autoscale``/``stragglers`` requests the options of ``elan run``/``elan am`` ask for."""
    requests: list[AutoscaleRequest | StragglersRequest] = []
    if args.stragglers or args.straggler_threshold is not None or args.straggler_window is not None:
        requests.append(StragglersRequest(args.stragglers or "off", args.straggler_threshold, args.straggler_window))
    if args.autoscale == "utility" and (args.price is None or args.utility is None):
        parser.error("--autoscale utility needs --price P and --utility FILE")
    if args.autoscale_min and args.autoscale_max and args.autoscale_min > args.autoscale_max:
        parser.error(f"--autoscale-min {args.autoscale_min} is more than --autoscale-max {args.autoscale_max}")
    if args.autoscale:
        requests.append(autoscale_request(args, args.autoscale, args.autoscale_min, args.autoscale_max))
    elif any(getattr(args, name) is not None for name in ("autoscale_min", "autoscale_max", "autoscale_every",
                                                          "autoscale_step", "autoscale_threshold", "price", "utility")):
        parser.error("the autoscaler's settings need --autoscale POLICY")
    elif args.scale_out_command:
        requests.append(AutoscaleRequest("off", scale_out_command=args.scale_out_command))
    return requests


def autoscale_request(args: argparse.Namespace, policy: str, low: int | None, high: int | None) -> AutoscaleRequest:
    return AutoscaleRequest(policy, every=args.autoscale_every, step=args.autoscale_step,
                            threshold=args.autoscale_threshold, min_workers=low, max_workers=high,
                            cooldown_s=args.autoscale_cooldown, price=args.price, utility=args.utility,
                            scale_out_command=args.scale_out_command)


def wait_for_profile(status: Callable[[], StatusReply], timeout_s: float) -> dict[str, Any]:
    """Poll the job's status until its profile has finished; returns the result (TimeoutError after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sizing = status().sizing or {}
        if sizing.get("profile") is None and sizing.get("profile_result"):
            return sizing["profile_result"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"the profile did not finish within {timeout_s:g} s (it goes on; see `elan status`)")
        time.sleep(PROFILE_POLL_S)
