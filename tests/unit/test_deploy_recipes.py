"""The Kubernetes recipe's command lines are ones `elan` accepts (its own parser, the same checks as on a cluster):
a typo in a flag, a bad address or job name fails here, not in a pod. (The manifest itself is only written: there is
no Kubernetes on the build machine; docs/deploy.md says so.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_elan.cli import build_parser, split_command
from lightning_elan.launcher.enrolled import am_addresses
from lightning_elan.master.registry import check_job_name

yaml = pytest.importorskip("yaml")
MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "elan-job.yaml"


def containers() -> dict[str, dict]:
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    return {doc["metadata"]["name"]: container for doc in documents if doc["kind"] == "Deployment"
            for container in doc["spec"]["template"]["spec"]["containers"]}


def parse(command: list[str]):
    assert command[0] == "elan"
    own, worker_command = split_command(command[1:])
    args = build_parser().main.parse_args(own)
    return args, worker_command


def test_the_am_command_parses_and_takes_enrolments() -> None:
    args, worker_command = parse(containers()["elan-am"]["command"])
    assert args.command == "am" and worker_command is None
    assert args.min_workers == 2 and args.max_workers == 8 and args.rdzv_port == 29401
    assert args.bind == "tcp://0.0.0.0:29400" and str(args.secret_file) == "/etc/elan/secret"


def test_the_worker_command_and_its_environment_are_valid() -> None:
    container = containers()["elan-worker"]
    args, worker_command = parse(container["command"])
    assert args.command == "worker" and worker_command == ["python", "/app/train.py"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert am_addresses(env["ELAN_AM"]) == "tcp://elan-am:29400"
    assert check_job_name(env["ELAN_JOB"]) == "lm"
    am = containers()["elan-am"]["command"]
    assert env["ELAN_JOB"] == am[am.index("--job") + 1], "the workers join the AM's job"
