"""The ``elan`` console script: ``elan run``, ``elan am``, ``elan worker``, ``elan scale``, ``elan status``.

Argument problems exit with code 2 and one ``elan <command>: error: …`` line (argparse style); so do
an unknown job and an AM that does not answer. An error reply from the AM exits with code 1 as
``elan: error: <message>``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_elan import cli_sizing
from lightning_elan.cli_client import DEFAULT_TIMEOUT_S, CLIError, call, connect, refuse_if_running, use_secret_file
from lightning_elan.cli_logging import configure_logging
from lightning_elan.cli_status import describe_profile_start, describe_scale_reply, format_profile, format_status
from lightning_elan.cli_types import (
    am_address_list,
    bind_address,
    job_name,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    schedule_type,
    standby_count,
    world_size,
)
from lightning_elan.launcher.schedule import ScheduleError, parse_action
from lightning_elan.master import registry
from lightning_elan.protocol.addresses import ADDRESS_FORMS
from lightning_elan.protocol.contract import (
    DEFAULT_COORDINATE_EVERY,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_REPORT_TIMEOUT_S,
    DEFAULT_TERM_GRACE_S,
    ENV_AM,
    ENV_IFACE,
    ENV_JOB,
    MAX_STANDBY,
    AutoscaleReply,
    ProfileReply,
    ProfileRequest,
    ScaleReply,
    StatusReply,
)
from lightning_elan.words import describe_autoscale

log = logging.getLogger("lightning_elan.cli")

DEFAULT_BIND = "tcp://127.0.0.1:0"
DEFAULT_AM_MAX_RESTARTS = 20  # the launcher's default (launcher.am_process), not imported to keep the CLI light


# ---------------------------------------------------------------------- parser


@dataclass
class Parsers:
    """The top-level parser and one sub-parser per command (each reports its own errors)."""

    main: argparse.ArgumentParser
    commands: dict[str, argparse.ArgumentParser]


def build_parser() -> Parsers:
    parser = argparse.ArgumentParser(prog="elan", description="Elastic PyTorch Lightning jobs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = {
        "run": _add_run(sub),
        "am": _add_am(sub),
        "worker": _add_worker(sub),
        "scale": _add_scale(sub),
        "status": _add_status(sub),
        "simulate": _add_simulate(sub),
        "profile": cli_sizing.add_profile(sub, _add_am_option),
        "autoscale": cli_sizing.add_autoscale(sub, _add_am_option),
    }
    for command in commands.values():
        command.add_argument(
            "--secret-file", type=Path, default=None, metavar="F",
            help="shared secret authenticating every message to and from the AM (default: $ELAN_SECRET_FILE)",
        )
    return Parsers(parser, commands)


def _add_run(sub: Any) -> argparse.ArgumentParser:
    run = sub.add_parser(
        "run",
        help="start an AM, a store and N workers of CMD",
        usage="elan run --nproc N --job NAME [options] -- CMD...",
        description="Start the AM, the TCPStore and N workers of CMD; start joiners when the AM asks.",
    )
    run.add_argument("--nproc", type=world_size, required=True, metavar="N", help="workers in generation 0")
    run.add_argument("--job", type=job_name, required=True, metavar="NAME")
    run.add_argument(
        "--coordinate-every", type=positive_int, default=None, metavar="K",
        help=f"coordination interval in steps (default {DEFAULT_COORDINATE_EVERY})",
    )
    run.add_argument(
        "--report-timeout", type=positive_float, default=DEFAULT_REPORT_TIMEOUT_S, metavar="SECONDS",
        help="a request fails if a new worker has not reported ready after this long (default %(default)g)",
    )
    run.add_argument(
        "--term-grace", type=positive_float, default=DEFAULT_TERM_GRACE_S, metavar="SECONDS",
        help="a worker that gets SIGTERM leaves the job at its next batch boundary; one that has not left this long "
        "after (or gets a second SIGTERM) kills itself, as a crashed worker (default %(default)g)",
    )
    run.add_argument(
        "--schedule",
        type=schedule_type,
        default=None,
        metavar="S",
        help='scale requests as STEP:ACTION=ARG[,…], e.g. "10:add=1,20:remove=rank:0,30:migrate=1,40:to=4"',
    )
    run.add_argument("--state-dir", type=Path, default=None, metavar="D", help="default: $ELAN_HOME/jobs/NAME")
    run.add_argument("--devices", choices=("cpu", "cuda"), default="cpu")
    run.add_argument(
        "--am-max-restarts", type=non_negative_int, default=DEFAULT_AM_MAX_RESTARTS, metavar="N",
        help="restart a dead AM process from its store at most N times, then fail the job (default %(default)s)",
    )
    run.add_argument(
        "--replace-failed", action="store_true",
        help="start a replacement for each worker that dies; it joins like any joiner (default: off)",
    )
    run.add_argument(
        "--min-workers", type=world_size, default=None, metavar="N",
        help="after a worker dies, wait for joiners while fewer than N workers are left (default 1)",
    )
    run.add_argument(
        "--join-timeout", type=positive_float, default=None, metavar="SECONDS",
        help=f"how long the job waits for joiners below --min-workers before it fails (default "
             f"{DEFAULT_JOIN_TIMEOUT_S:g})",
    )
    run.add_argument(
        "--standby", type=standby_count, default=0, metavar="K",
        help=f"keep K workers started and warmed up but not training (0–{MAX_STANDBY}); an `add` takes them first, "
             "so new capacity trains after one adjustment pause instead of a process start (default 0)",
    )
    run.add_argument(
        "--no-preload", dest="preload", action="store_false",
        help="start every worker as a fresh process; by default a `python script.py` or `python -m module` command's "
             "workers are forked from one process that imported torch/Lightning/Accelerate once (a joiner starts in "
             "about a second instead of after its imports; README: Preloaded workers)",
    )
    cli_sizing.add_sizing_options(run)
    return run


def _add_am(sub: Any) -> argparse.ArgumentParser:
    am = sub.add_parser("am", help="run an AM alone (foreground)")
    am.add_argument("--job", type=job_name, required=True, metavar="NAME")
    am.add_argument("--bind", type=bind_address, default=DEFAULT_BIND, metavar="ADDR",
                    help=f"where the AM listens: {ADDRESS_FORMS} (port 0: any free one; default {DEFAULT_BIND})")
    am.add_argument("--state-dir", type=Path, default=None, metavar="D", help="default: $ELAN_HOME/jobs/NAME")
    am.add_argument(
        "--store", default=None, metavar="URL",
        help="where the state lives: a file path (default D/state.json) or etcd://HOST:PORT[,HOST:PORT…]/PREFIX; with "
        "etcd, several `elan am` of one job may run: one leads, the others stand by and take over",
    )
    am.add_argument(
        "--lease-ttl", type=positive_float, default=None, metavar="SECONDS",
        help="etcd store: the leader's lease; a standby takes over this long after the leader died (default 5)",
    )
    am.add_argument(
        "--parent-pid", type=positive_int, default=None, metavar="PID",
        help="stop when this process is gone (elan run passes its own pid)",
    )
    _add_enrolment_options(am)
    cli_sizing.add_sizing_options(am)
    return am


def _add_enrolment_options(am: argparse.ArgumentParser) -> None:
    """``elan am --min-workers N``: a job of workers started by a scheduler (``elan worker``)."""
    group = am.add_argument_group("workers started by a scheduler (`elan worker`)")
    group.add_argument(
        "--min-workers", type=world_size, default=None, metavar="N",
        help="take `elan worker`s: the job starts once N have enrolled (and, after a worker dies, waits for joiners "
             "while fewer than N are left)",
    )
    group.add_argument("--max-workers", type=world_size, default=None, metavar="M",
                       help="at most M workers (default: --min-workers); more are refused")
    group.add_argument("--start-grace", type=non_negative_float, default=None, metavar="SECONDS",
                       help="once N have enrolled, wait this long for more (up to M) before the start (default 5)")
    group.add_argument("--coordinate-every", type=positive_int, default=None, metavar="K",
                       help=f"coordination interval in steps (default {DEFAULT_COORDINATE_EVERY})")
    group.add_argument("--join-timeout", type=positive_float, default=None, metavar="SECONDS",
                       help=f"how long the job waits for joiners below --min-workers before it fails (default "
                            f"{DEFAULT_JOIN_TIMEOUT_S:g})")
    group.add_argument("--heartbeat-timeout", type=positive_float, default=None, metavar="SECONDS",
                       help="once the job runs, a worker whose `elan worker` has not been heard from this long (its "
                            "host lost, paused or cut off) is taken for dead and the others recover at once (default "
                            "30, at least 15)")
    group.add_argument("--rdzv-port", type=port, default=0, metavar="P",
                       help="port of the job's rendezvous store (a TCPStore this AM serves; default: a free one)")


def _add_worker(sub: Any) -> argparse.ArgumentParser:
    worker = sub.add_parser(
        "worker",
        help="run one worker of a job whose AM takes enrolments (started by any scheduler)",
        usage="elan worker [--am HOST:PORT] [--job NAME] [options] -- CMD...",
        description="Enrol with the job's AM (`elan am --min-workers N`), then run CMD as a member of the first "
                    "generation or, once the job runs, as a joiner. SIGTERM makes CMD leave the job gracefully.",
    )
    worker.add_argument("--am", type=am_address_list, default=os.environ.get(ENV_AM), metavar="HOST:PORT",
                        help="the AM's address, or a comma list of a leader and its standbys (default: $ELAN_AM)")
    worker.add_argument("--job", type=job_name, default=os.environ.get(ENV_JOB), metavar="NAME",
                        help="default: $ELAN_JOB")
    worker.add_argument("--device-index", type=non_negative_int, default=_local_rank(), metavar="I",
                        help="the GPU of this worker (default: $LOCAL_RANK or $SLURM_LOCALID when set)")
    worker.add_argument("--iface", default=None, metavar="NAME",
                        help="the network interface the worker's collectives and state transfers use (sets "
                             "$ELAN_IFACE; default: the interface of the route to the AM)")
    worker.add_argument("--term-grace", type=positive_float, default=DEFAULT_TERM_GRACE_S, metavar="SECONDS",
                        help="after SIGTERM, how long the worker may take to leave (default %(default)g)")
    worker.add_argument("--enrol-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                        help="give up when no AM answers, or the job does not start, within this long "
                             "(default %(default)g)")
    return worker


def _local_rank() -> int | None:
    text = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID")
    return int(text) if text and text.isdigit() else None


def _add_scale(sub: Any) -> argparse.ArgumentParser:
    scale = sub.add_parser(
        "scale",
        help="ask a running job to grow, shrink or migrate",
        usage="elan scale --job NAME [--at-step S] {add K | remove K | remove rank:R[,R…] | migrate K | to N}",
    )
    scale.add_argument("--job", type=job_name, required=True, metavar="NAME")
    _add_am_option(scale)
    scale.add_argument("--at-step", type=non_negative_int, default=None, metavar="S", help="not before step S")
    scale.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS")
    scale.add_argument("action", metavar="ACTION", help="add, remove, migrate or to")
    scale.add_argument("arg", metavar="ARG", help="a count, a size (to) or rank:R[,R…] (remove)")
    return scale


def _add_status(sub: Any) -> argparse.ArgumentParser:
    status = sub.add_parser("status", help="show a running job")
    status.add_argument("--job", type=job_name, required=True, metavar="NAME")
    _add_am_option(status)
    status.add_argument("--json", action="store_true", help="print the AM's status reply as JSON")
    status.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS")
    return status


def _add_simulate(sub: Any) -> argparse.ArgumentParser:
    simulate = sub.add_parser("simulate", help="simulate a GPU cluster scheduling elastic jobs (docs/simulate.md)")
    simulate.add_argument("--trace", required=True, metavar="FILE",
                          help="Tiresias trace CSV, or saxena:{high,low,bursty}[:MINUTES] for the synthetic workload")
    simulate.add_argument("--cluster", required=True, metavar="SPEC",
                          help="Tiresias cluster-spec CSV, a GPU count (40) or NODESxGPUS (4x4)")
    simulate.add_argument("--policy", default="fifo,backfill,e-fifo,e-bf,tiresias,elastic-tiresias,dp,dp-fixed",
                          metavar="P[,P…]", help="policies to compare (default: all)")
    simulate.add_argument("--adjust-cost", default="elan", metavar="elan|restart|none|FILE[,…]",
                          help="adjustment pauses: measured elan, stop-and-restart, none, or a JSON table")
    simulate.add_argument("--out", type=Path, default=None, metavar="DIR", help="write simulate.{md,json,png} here")
    simulate.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    simulate.add_argument("--dp-interval", type=float, default=0.0, metavar="SECONDS",
                          help="run the dp allocators every Δ seconds instead of at every event")
    simulate.add_argument("--min-res-factor", type=float, default=0.5, help="min_res = ⌈factor · num_gpu⌉")
    simulate.add_argument("--max-res-factor", type=float, default=2.0, help="max_res = ⌈factor · num_gpu⌉")
    simulate.add_argument("--profiles", type=Path, default=None, metavar="FILE", help="model profile JSON")
    simulate.add_argument("--no-png", action="store_true", help="skip the PNG (and matplotlib)")
    return simulate


def _add_am_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--am", type=am_address_list, default=None, metavar="HOST:PORT",
                         help="the AM's address (comma list: leader and standbys); default: found through this "
                              "machine's job registry")


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """Split ``argv`` at the first ``--``: (elan's own arguments, the worker command or None)."""
    args = list(argv)
    if "--" not in args:
        return args, None
    index = args.index("--")
    return args[:index], args[index + 1 :]


# ---------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    own, command = split_command(sys.argv[1:] if argv is None else argv)
    parsers = build_parser()
    args = parsers.main.parse_args(own)
    args.worker_command = command
    configure_logging()
    handler = {"run": cmd_run, "am": cmd_am, "worker": cmd_worker, "scale": cmd_scale,
               "status": cmd_status, "simulate": cmd_simulate, "profile": cmd_profile,
               "autoscale": cmd_autoscale}[args.command]
    try:
        use_secret_file(args.secret_file)
        return handler(args, parsers.commands[args.command])
    except CLIError as exc:
        print(f"elan: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:  # `elan status | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def cmd_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_elan.sim import SimulationError
    from lightning_elan.sim.command import run_simulate

    try:
        return run_simulate(args)
    except SimulationError as error:
        raise CLIError(f"simulate: {error}", code=2) from None


# ---------------------------------------------------------------------- elan run


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = _worker_command(args, parser)
    refuse_if_running(args.job, parser)
    from lightning_elan.launcher.run import JobLauncher, LaunchConfig, LaunchError

    state_dir = args.state_dir or registry.default_state_dir(args.job)
    config = LaunchConfig(
        job=args.job,
        nproc=args.nproc,
        command=command,
        state_dir=state_dir,
        coordinate_every=args.coordinate_every or DEFAULT_COORDINATE_EVERY,
        report_timeout_s=args.report_timeout,
        term_grace_s=args.term_grace,
        schedule=list(args.schedule or []),
        devices=args.devices,
        am_max_restarts=args.am_max_restarts,
        replace_failed=args.replace_failed,
        min_workers=args.min_workers,
        join_timeout_s=args.join_timeout,
        standby=args.standby,
        sizing=cli_sizing.sizing_requests(args, parser),
        preload=args.preload,
    )
    if args.min_workers is not None and args.min_workers > args.nproc:
        parser.error(f"--min-workers {args.min_workers} is more than --nproc {args.nproc}")
    from lightning_elan.master.main import AMStartError, make_state_dir

    try:
        make_state_dir(state_dir)
    except AMStartError as error:
        raise CLIError(str(error), code=error.code) from None
    try:
        launcher = JobLauncher(config)
    except LaunchError as exc:
        parser.error(str(exc))
    return launcher.run()


def _worker_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    command = args.worker_command
    if not command:
        parser.error("missing worker command after `--` (e.g. elan run --nproc 2 --job demo -- python train.py)")
    program = command[0]
    if os.sep in program:
        if not os.access(program, os.X_OK):
            parser.error(f"worker command {program!r} is not an executable file")
    elif shutil.which(program) is None:
        parser.error(f"worker command {program!r} not found on PATH")
    return list(command)


# ---------------------------------------------------------------------- elan am


def cmd_am(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_elan.etcd import is_etcd_url, parse_etcd_url
    from lightning_elan.master.main import AMOptions, AMStartError, serve

    _reject_command(args, parser)
    enrolment = _enrolment(args, parser)
    sizing = cli_sizing.sizing_requests(args, parser)
    in_etcd = args.store is not None and is_etcd_url(args.store)
    if in_etcd:
        if sizing:
            parser.error("--autoscale, --stragglers and --scale-out-command need the file store for now; with etcd, "
                         "use `elan autoscale` once the job runs")
        try:
            parse_etcd_url(args.store)
        except ValueError as error:
            parser.error(str(error))
    else:
        if args.lease_ttl is not None:
            parser.error("--lease-ttl needs --store etcd://…")
        refuse_if_running(args.job, parser)
    options = AMOptions(job=args.job, state_dir=Path(args.state_dir or registry.default_state_dir(args.job)),
                        bind=args.bind, store=args.store, parent_pid=args.parent_pid, enrolment=enrolment,
                        coordinate_every=args.coordinate_every, join_timeout_s=args.join_timeout,
                        lease_ttl_s=args.lease_ttl, rdzv_port=args.rdzv_port, sizing=sizing)
    try:
        return serve(options)
    except AMStartError as error:
        raise CLIError(str(error), code=error.code) from None


def _enrolment(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The enrolment rule of ``--min-workers``/``--max-workers``, or None (the job's workers come from elan run)."""
    from lightning_elan.master.enrolment import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_START_GRACE_S, Enrolment

    enrolment_only = ("max_workers", "start_grace", "coordinate_every", "join_timeout", "heartbeat_timeout")
    if args.min_workers is None:
        given = [f"--{name.replace('_', '-')}" for name in enrolment_only if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --min-workers")
        return None
    maximum = args.max_workers or args.min_workers
    try:
        return Enrolment(args.min_workers, maximum, DEFAULT_START_GRACE_S if args.start_grace is None
                         else args.start_grace, heartbeat_timeout_s=args.heartbeat_timeout
                         or DEFAULT_HEARTBEAT_TIMEOUT_S)
    except ValueError as error:
        parser.error(str(error))


# ---------------------------------------------------------------------- elan worker


def _check_interface(name: str, parser: argparse.ArgumentParser) -> None:
    import socket

    known = sorted(interface for _index, interface in socket.if_nameindex())
    if name not in known:
        parser.error(f"--iface {name!r}: no such network interface here (have: {', '.join(known)})")


def cmd_worker(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_elan.launcher.enrolled import EXIT_NOT_ENROLLED, EnrolledWorker, NotEnrolled, WorkerConfig

    command = _worker_command(args, parser)
    if args.am is None:
        parser.error("the AM's address is needed: --am HOST:PORT (or $ELAN_AM)")
    if args.job is None:
        parser.error("the job's name is needed: --job NAME (or $ELAN_JOB)")
    if args.iface is not None:
        _check_interface(args.iface, parser)
        os.environ[ENV_IFACE] = args.iface  # inherited by the training command
    config = WorkerConfig(args.am, args.job, command, device_index=args.device_index, term_grace_s=args.term_grace,
                          enrol_timeout_s=args.enrol_timeout)
    try:
        returncode = EnrolledWorker(config).run()
        return 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128 + N, as a shell says
    except NotEnrolled as error:
        log.error("%s", error)
        return EXIT_NOT_ENROLLED
    except KeyboardInterrupt:  # Ctrl-C while enrolling (once the command runs, SIGINT makes it leave the job)
        log.error("interrupted before the command started: this worker did not join job %s", args.job)
        return 128 + signal.SIGINT


# ---------------------------------------------------------------------- elan scale / status


def cmd_scale(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _reject_command(args, parser)
    try:
        action = parse_action(args.action, args.arg, at_step=args.at_step)
    except ScheduleError as exc:
        parser.error(str(exc))
    client = connect(args.job, timeout_s=args.timeout, am=args.am)
    reply = ScaleReply.from_body(call(client, args.job, lambda: client.scale(**action.request_kwargs())))
    print(describe_scale_reply(action, reply))
    return 0


def cmd_profile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _reject_command(args, parser)
    if args.min_size > args.max_size:
        parser.error(f"--min {args.min_size} is more than --max {args.max_size}")
    request = ProfileRequest(args.min_size, args.max_size, args.steps, args.settle)
    client = connect(args.job, timeout_s=args.timeout, am=args.am)
    reply = ProfileReply.from_body(call(client, args.job, lambda: client.request(request.TYPE, request.to_body())))
    print(describe_profile_start(args.job, reply.profile, args.steps))
    if args.no_wait:
        return 0

    def status() -> StatusReply:
        poller = connect(args.job, timeout_s=args.timeout, am=args.am)
        return StatusReply.from_body(call(poller, args.job, poller.status))

    try:
        result = cli_sizing.wait_for_profile(status, args.wait_timeout)
    except TimeoutError as error:
        raise CLIError(str(error), code=1) from None
    print(format_profile(result))
    return 0


def cmd_autoscale(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _reject_command(args, parser)
    if args.min_workers and args.max_workers and args.min_workers > args.max_workers:
        parser.error(f"--min-workers {args.min_workers} is more than --max-workers {args.max_workers}")
    request = cli_sizing.autoscale_request(args, args.policy, args.min_workers, args.max_workers)
    client = connect(args.job, timeout_s=args.timeout, am=args.am)
    reply = AutoscaleReply.from_body(call(client, args.job, lambda: client.request(request.TYPE, request.to_body())))
    print(describe_autoscale(args.job, reply.autoscale, request.scale_out_command))
    return 0


def cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _reject_command(args, parser)
    client = connect(args.job, timeout_s=args.timeout, am=args.am)
    body = call(client, args.job, client.status)
    status = StatusReply.from_body(body)  # checked even for --json, which prints the reply as the AM sent it
    print(json.dumps(body, indent=2, sort_keys=True) if args.json else format_status(status))
    return 0


def _reject_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.worker_command is not None:
        parser.error("unexpected `--`: only `elan run` and `elan worker` take a worker command")


if __name__ == "__main__":
    sys.exit(main())
