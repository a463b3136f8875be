"""An ordinary Hugging Face Accelerate training loop used by the integration tests (run through `elan run`, or with
``--plain`` as a plain ``Accelerator`` DDP run started like torchrun).

It records, per worker (``OUT/record-<worker>.json``): the dataset indices it trained on per epoch, a bitwise digest
of parameters, optimizer state and LR at every optimizer step it took part in, the LR used and global batch per
step, and, on the worker that ends as the main process, the final model and optimizer state (``OUT/final.pt``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.tracking import GeneralTracker
from hold_point import HoldPoint  # a sibling module (this script's folder is first on sys.path)
from torch.utils.data import DataLoader, Dataset


class IndexedDataset(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
        self.y = (self.x @ torch.linspace(-1, 1, 8, dtype=torch.float64)).unsqueeze(1) + 0.1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return index, self.x[index], self.y[index]


class EMA:
    """An exponential moving average of the parameters: extra state a joiner must receive."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    def update(self, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.shadow = {name: tensor.clone() for name, tensor in state["shadow"].items()}


class JsonLinesTracker(GeneralTracker):
    """A user's own tracker: one JSON line per ``log`` call, tagged with the process that wrote it."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict) -> None:
        self._write({"config": values})

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self._write({"step": step, **values})

    def _write(self, line: dict) -> None:
        with open(self.path, "a") as file:
            file.write(json.dumps({"worker": os.environ.get("ELAN_WORKER_ID", "w0"), **line}) + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="a plain Accelerator (the static reference run)")
    parser.add_argument("--scaling", default="strong")
    parser.add_argument("--ramp-steps", type=int, default=4)
    parser.add_argument("--coordinate-every", type=int, default=None)
    parser.add_argument("--wait-for-joiners", action="store_true")
    parser.add_argument("--save-at", type=int, default=None, help="save_state after this optimizer step")
    parser.add_argument("--stop-after-save", action="store_true")
    parser.add_argument("--load", type=Path, default=None, help="load_state from this folder before training")
    parser.add_argument("--tracker", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--kill-at", default=None,
                        help="WORKER:STEP:PHASE — that worker SIGKILLs itself at that optimizer step: 'backward' (in "
                             "the backward of the step's last micro-batch: the others wait in the all-reduce), "
                             "'accumulating' (in the backward of a micro-batch that does not all-reduce) or "
                             "'optimizer' (right after the step was applied)")
    parser.add_argument("--hold-at", default=None,
                        help="WORKER:STEP:PHASE — at that optimizer step's last micro-batch the members hold in PHASE "
                             "while the test SIGKILLs WORKER (hold_point.py)")
    parser.add_argument("--sigterm-at", default=None, help="WORKER:STEP — that worker gets SIGTERM after that step's "
                        "backward (a preemption notice: it should leave the job at the next batch boundary)")
    return parser.parse_args()


class KillPoint:
    """``--kill-at``: a real SIGKILL of this process at a chosen step and phase."""

    def __init__(self, text: str | None) -> None:
        worker, step, phase = (text or "::").split(":")
        self.worker, self.step, self.phase = worker, int(step or -1), phase

    def due(self, worker: str, step: int, phase: str) -> bool:
        return (worker, step, phase) == (self.worker, self.step, self.phase)

    @staticmethod
    def now(*_: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    tracker = [JsonLinesTracker(args.out / "tracker.jsonl")] if args.tracker else None
    # with shuffle=True, plain Accelerate visits a reproducible order with a seedable sampler: the same as the elastic
    # loader's for the same data_seed
    loading = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11) if args.shuffle else None
    common = {"gradient_accumulation_steps": args.accumulation, "mixed_precision": "no", "cpu": True,
              "log_with": tracker, "dataloader_config": loading}
    if args.plain:
        return Accelerator(**common)
    from lightning_elan.accelerate import ElasticAccelerator, ElasticPlugin

    plugin = ElasticPlugin(scaling=args.scaling, lr_ramp_steps=args.ramp_steps,
                           coordinate_every=args.coordinate_every)
    return ElasticAccelerator(elastic_plugin=plugin, **common)


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: EMA) -> str:
    sha = hashlib.sha256()
    for tensor in model.state_dict().values():
        sha.update(tensor.detach().cpu().numpy().tobytes())
    for state in optimizer.state.values():
        for key in sorted(state):
            sha.update(state[key].detach().cpu().numpy().tobytes())
    for tensor in ema.shadow.values():
        sha.update(tensor.numpy().tobytes())
    sha.update(repr([group["lr"] for group in optimizer.param_groups]).encode())
    return sha.hexdigest()


def wait_for_joiners_due_at(step: int, failed: Callable[[], bool], timeout_s: float = 240.0) -> None:
    """Hold the main process until every queued request due at ``step`` has its new workers ready; not once a member
    of its generation died (a replacement is queued then: the recovery must not wait for it)."""
    from lightning_elan.protocol.client import AMClient

    deadline = time.monotonic() + timeout_s
    with AMClient(os.environ["ELAN_AM_ADDRESS"], os.environ["ELAN_JOB"]) as client:
        while True:
            due = [request for request in client.status()["pending"] if (request.get("at_step") or 0) <= step]
            if failed() or all(state == "ready" for request in due for state in request["worker_status"].values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"joiners of {due} not ready after {timeout_s} s")
            time.sleep(0.1)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(7)
    accelerator = make_accelerator(args)
    worker = os.environ.get("ELAN_WORKER_ID", f"plain{accelerator.process_index}")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    ema = EMA(model)
    used_lr: list[float] = []  # the LR each optimizer step applied (an elastic LR ramp scales it during the step)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used_lr.append(opt.param_groups[0]["lr"]))
    elastic = not args.plain
    accelerator.register_for_checkpointing(ema)  # save_state/load_state carry it
    if elastic:
        accelerator.register_for_elastic_state(ema)  # joiners receive it (checkpointed objects are replicated too)
    train = DataLoader(IndexedDataset(args.samples), batch_size=args.batch_size, shuffle=args.shuffle,
                       num_workers=args.num_workers, persistent_workers=args.num_workers > 0)
    model, optimizer, train, scheduler = accelerator.prepare(model, optimizer, train, scheduler)
    if args.tracker:
        accelerator.init_trackers("probe", config={"samples": args.samples})
    if args.load is not None:
        accelerator.load_state(str(args.load))

    kill = KillPoint(args.kill_at)
    hold_point = HoldPoint.parse(args.out, args.hold_at)

    def hold(phase: str) -> None:
        """``--hold-at``: hold at that step's last micro-batch while the test SIGKILLs the victim."""
        if not (elastic and accelerator.sync_gradients and hold_point.due(phase, step)):
            return
        if phase == "allreduce" and worker != hold_point.worker:
            hold_point.mark(worker)  # go on into the all-reduce and wait there
            return
        hold_point.hold(worker, lambda: accelerator.engine.peer_failed)

    optimizer.optimizer.register_step_pre_hook(lambda *_: hold("optimizer"))  # every member committed the step
    term = KillPoint(f"{args.sigterm_at}:term" if args.sigterm_at else None)
    batches_log = open(args.out / f"batches-{worker}.jsonl", "a")  # flushed per batch: a killed worker keeps them
    consumed: dict[int, list[int]] = {}
    digests, steps = [], []
    epochs = accelerator.epochs(args.epochs) if elastic else range(args.epochs)
    step = 0
    for epoch in epochs:
        for index, x, y in train:
            step = accelerator.optimizer_steps if elastic else step
            weight = accelerator.sample_weight if elastic else 1.0
            if weight > 0:
                consumed.setdefault(epoch, []).extend(index.tolist())
            if elastic:  # every batch trained, with where it was cut from: a redone batch shows up again
                position = accelerator.data_position
                line = {"epoch": position.epoch, "position": position.position, "generation": accelerator.generation,
                        "indices": index.tolist() if weight > 0 else []}
                batches_log.write(json.dumps(line) + "\n")
                batches_log.flush()
            if args.wait_for_joiners and elastic and accelerator.is_main_process:
                wait_for_joiners_due_at(step + 1, lambda: accelerator.engine.peer_failed)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                phase = "backward" if accelerator.sync_gradients else "accumulating"
                if kill.due(worker, step, phase):
                    model.module[0].weight.register_hook(kill.now)  # dies in the middle of the backward pass
                hold("forward")  # the loss is computed, the backward is next
                for point in ("backward", "allreduce"):  # mid-backward, before any all-reduce of this worker
                    if elastic and accelerator.sync_gradients and hold_point.due(point, step):
                        model.module[0].weight.register_hook(lambda grad, point=point: hold(point))
                accelerator.backward(loss)
                hold("vote")  # the gradients are all-reduced, the commit vote (in optimizer.step) is next
                if term.due(worker, step, "term") and accelerator.sync_gradients:
                    os.kill(os.getpid(), signal.SIGTERM)
                if accelerator.sync_gradients:
                    digests.append([step, accelerator.num_processes, accelerator.process_index,
                                    digest(accelerator.unwrap_model(model), optimizer, ema)])
                optimizer.step()
                if accelerator.sync_gradients and kill.due(worker, step, "optimizer"):
                    kill.now()
                if accelerator.sync_gradients:
                    gathered = accelerator.gather(loss.detach()[None])  # one value per process of the live world
                    lr = used_lr[-1] if used_lr else None  # none yet: the job's first step was discarded
                    steps.append([step, epoch, accelerator.num_processes,
                                  accelerator.data_position.global_batch if elastic else None, lr, gathered.numel()])
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:  # discarded: redone later
                ema.update(accelerator.unwrap_model(model))
                step += 0 if elastic else 1
                accelerator.log({"loss": loss.item(), "world": accelerator.num_processes}, step=step)
            if args.save_at is not None and accelerator.sync_gradients and \
                    (accelerator.optimizer_steps + 1 if elastic else step) == args.save_at:
                accelerator.save_state(str(args.out / "checkpoint"))
                if args.stop_after_save:
                    break
            hold("batch_end")  # the step is applied; the next batch boundary follows
        if args.stop_after_save and args.save_at is not None and (args.out / "checkpoint").exists():
            break

    left = accelerator.has_left if elastic else False
    record = {"worker": worker, "left": left, "rank": accelerator.process_index,
              "world_size": accelerator.num_processes, "consumed": consumed, "digests": digests, "steps": steps,
              "optimizer_steps": accelerator.optimizer_steps if elastic else step}
    (args.out / f"record-{worker}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    if not left and accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        final = {f"model.{k}": v.cpu() for k, v in unwrapped.state_dict().items()}
        for name, value in ema.shadow.items():
            final[f"ema.{name}"] = value.cpu()
        for i, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    final[f"optimizer.{i}.{key}"] = value.cpu()
        torch.save(final, args.out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
