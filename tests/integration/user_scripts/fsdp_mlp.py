"""A float64 MLP of a few Linear blocks trained with Adam, under ``strategy="elan"`` or ``"elan_fsdp"`` (issue 24).

python fsdp_mlp.py OUT [--strategy elan|elan_fsdp] [--shard-blocks] [--epochs N] [--kill-step S [--kill-rank R]...
    [--kill-at start|forward|backward|optimizer|reshard]] [--reshard-kill-rank R] [--configure-model] [--net-in-step]
    [--evaluate] [--hsdp K] [--own-units] [--dimension-names]

Every process appends the samples it trained to ``OUT/trained-<pid>.jsonl`` (one line per batch: epoch, step, the
dataset indices, without a rank's weight-0 stand-in sample, and the device mesh's shape). ``ModelCheckpoint`` saves
every 3 steps into ``OUT/checkpoints``. ``--configure-model``: the network is built in ``configure_model``, which writes
``OUT/built-<pid>.json`` (whether it was built on the meta device). ``--own-units``: ``configure_model`` makes the units
itself, as under Lightning's ``ModelParallelStrategy``: ``fully_shard(block, mesh=self.device_mesh)`` for each block and
``reshard_after_forward=False`` for the last Linear (idempotent: not again once they are units), recording the mesh's
size there in ``OUT/units-<pid>.json``; each trained batch's record lists the module's units (``FSDPModule`` instances,
by name). ``--dimension-names``: the same units made as Lightning's 2-D parallelism example makes them, through
``self.device_mesh["data_parallel"]`` and ``["tensor_parallel"]``, sharding only over a data-parallel dimension of more
than one (the sizes recorded in ``OUT/units-<pid>.json``); with ``--checkpoint-activations always`` each block is
wrapped by ``checkpoint_wrapper`` first (``when-sharded``: only when it is sharded, as that example does).
``--joiner-width W``: a joiner (``ELAN_ROLE=joiner``) builds its network ``W`` wide, as a host configured otherwise than
the members' would. ``--shard-columns``: the blocks are sharded with a ``shard_placement_fn`` on their parameters' last
dimension; ``--compile BACKEND``: each sharded block is compiled (``block.compile(backend=...)``). ``--step-sleep S``:
each batch waits S seconds as it starts (a joiner started by ``elan worker`` has time to join). ``--net-in-step``:
``training_step`` calls the network itself (``self.net(x)``, as most modules do) instead of ``self(x)``. At the end
every member gathers the full state (parameters and Adam's states, by parameter name) and rank 0 writes
``OUT/final.pt``. Each member's live reshards are logged (``resharded live``). ``--kill-step S``: rank 1 (or each
``--kill-rank``) SIGKILLs itself in the batch of step S: as it starts (``--kill-at start``), in the forward (a forward
pre-hook of the second block), in the backward (a gradient hook on that block's output: the later units' reduce-scatters
are under way) or in the optimizer step (a step post-hook of its optimizer: the step was committed and its own update
applied, its mirror not advanced; the batch's samples are recorded first, as the step stands) or, ``--kill-at reshard``,
in the live reshard of the first adjustment after step S (at its ``RESHARD_KILL_AT``-th transfer: some rows have moved).
Only processes of the generation that first reaches the kill die (``OUT/killed`` says which; several victims die once
all of them are at the kill point, ``OUT/at-kill-<rank>``, or after 60 s), so a survivor that takes a killed rank, or a
replacement, does not kill itself in the redo. ``--reshard-kill-rank R``: rank R (as step S starts) also SIGKILLs itself
in the reshard of the recovery from that first death, at its ``RESHARD_KILL_AT``-th transfer
(``OUT/killed-in-recovery``).

``--evaluate``: after ``fit`` the members run ``trainer.validate``, ``trainer.test`` and ``trainer.predict`` over the
dataset in order (their steps call the network as ``training_step`` does); rank 0 writes the logged ``val_mse`` and
``test_mse`` to ``OUT/evaluation.json`` and every member its predictions to ``OUT/predicted-<pid>.pt``. ``--hsdp K``:
``ElanFSDPStrategy(hsdp_group_size=K)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401
from lightning_elan.strategy.fsdp import ElanFSDPStrategy

SAMPLES, FEATURES, WIDTH = 96, 6, 16
OUT = "."  # set from the command line
CHECKPOINT_ACTIVATIONS = None  # --checkpoint-activations
JOINER_WIDTH = None  # --joiner-width
SHARD_COLUMNS = False  # --shard-columns
COMPILE = None  # --compile BACKEND
STEP_SLEEP_S = 0.0  # --step-sleep
RESHARD_KILL_AT = 3
"""``--kill-at reshard``: the transfer (all-to-all round of ``replication.reshard.carry``) a process dies in."""


def _mesh_shape(trainer) -> list[int] | None:
    """The shape of the device mesh the batch was trained on (``elan_fsdp``; None under ``elan``)."""
    mesh = getattr(trainer.strategy, "device_mesh", None) if trainer.strategy.strategy_name == "elan_fsdp" else None
    return list(mesh.shape) if mesh is not None else None


def _units(trainer) -> list[str]:
    """The names of the LightningModule's FSDP2 units ("" is the module itself)."""
    return sorted(name for name, module in trainer.lightning_module.named_modules() if isinstance(module, FSDPModule))


class Indexed(Dataset):
    """Sample ``i``: its index, a fixed random input and a target."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return index, self.x[index], self.y[index]


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def network() -> nn.Sequential:
    width = JOINER_WIDTH if JOINER_WIDTH and os.environ.get("ELAN_ROLE") == "joiner" else WIDTH
    return nn.Sequential(nn.Linear(FEATURES, width), Block(width), Block(width), Block(width),
                         nn.Linear(width, 1)).double()


def parallelize(net: nn.Sequential, device_mesh) -> nn.Sequential:
    """The shape of Lightning's 2-D parallelism example for ``ModelParallelStrategy``: the mesh sliced by its dimension
    names, tensor parallelism over a ``tensor_parallel`` dimension of more than one, the blocks sharded over a
    ``data_parallel`` dimension of more than one (this model has no tensor-parallel plan)."""
    dp_mesh, tp_mesh = device_mesh["data_parallel"], device_mesh["tensor_parallel"]
    (Path(OUT) / f"units-{os.getpid()}.json").write_text(json.dumps({"mesh_size": dp_mesh.size(),
                                                                     "tensor_parallel": tp_mesh.size()}))
    if tp_mesh.size() > 1:
        raise RuntimeError("this model has no tensor-parallel plan")
    sharded = dp_mesh.size() > 1
    if CHECKPOINT_ACTIVATIONS == "always" or (CHECKPOINT_ACTIVATIONS == "when-sharded" and sharded):
        for index in range(1, 4):
            if not isinstance(net[index], CheckpointWrapper):
                net[index] = checkpoint_wrapper(net[index])
    if sharded and not isinstance(net[4], FSDPModule):
        columns = {"shard_placement_fn": lambda parameter: Shard(parameter.ndim - 1)} if SHARD_COLUMNS else {}
        for block in net[1:4]:
            fully_shard(block, mesh=dp_mesh, **columns)
            if COMPILE:
                block.compile(backend=COMPILE)
        fully_shard(net[4], mesh=dp_mesh, reshard_after_forward=False)
    return net


class MLP(pl.LightningModule):
    """``in_configure_model``: the network is built in ``configure_model`` (on a joiner: on the meta device)."""

    def __init__(self, in_configure_model: bool = False, net_in_step: bool = False, own_units: bool = False,
                 by_dimension_names: bool = False) -> None:
        super().__init__()
        self.net = None if in_configure_model else network()
        self.net_in_step = net_in_step
        self.own_units = own_units
        self.by_dimension_names = by_dimension_names

    def configure_model(self) -> None:
        if self.net is None:
            self.net = network()
            built = {"meta": all(parameter.is_meta for parameter in self.net.parameters())}
            (Path(OUT) / f"built-{os.getpid()}.json").write_text(json.dumps(built))  # a joiner's: meta
        if self.by_dimension_names:
            self.net = parallelize(self.net, self.device_mesh)
        elif self.own_units and not isinstance(self.net[4], FSDPModule):
            for block in self.net[1:4]:
                fully_shard(block, mesh=self.device_mesh)
            fully_shard(self.net[4], mesh=self.device_mesh, reshard_after_forward=False)
            (Path(OUT) / f"units-{os.getpid()}.json").write_text(json.dumps({"mesh_size": self.device_mesh.size()}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return nn.functional.mse_loss(self._predict(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def _predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) if self.net_in_step else self(x)

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val_mse", nn.functional.mse_loss(self._predict(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("test_mse", nn.functional.mse_loss(self._predict(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        index, x, _ = batch
        return index, self._predict(x)


class RecordTrained(Callback):
    """One line per trained batch: the samples this process trained (a stand-in sample of weight 0 left out); the
    kills of ``--kill-step``."""

    def __init__(self, out: Path, kill_step: int | None, kill_ranks: list[int], kill_at: str,
                 reshard_kill_rank: int | None = None) -> None:
        self.out = out
        self.path = out / f"trained-{os.getpid()}.jsonl"
        self.kill_step, self.kill_ranks, self.kill_at = kill_step, kill_ranks, kill_at
        self.reshard_kill_rank = reshard_kill_rank
        self.hooks: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = batch
        time.sleep(STEP_SLEEP_S)
        if trainer.global_step == self.kill_step and trainer.global_rank == self.reshard_kill_rank and \
                not (self.out / "killed-in-recovery").exists():
            _die_in_a_reshard(self.out / "killed-in-recovery", lambda: (self.out / "killed").exists())
        if not self._kills_here(trainer) or self.kill_at == "reshard":
            return
        if self.kill_at == "start":
            self._die(trainer)
        elif self.kill_at == "forward":
            self.hooks.append(pl_module.net[2].register_forward_pre_hook(lambda *_: self._die(trainer)))
        elif self.kill_at == "backward":
            def die_in_backward(_module, _inputs, output):
                output.register_hook(lambda _grad: self._die(trainer))  # returns None: the output stays

            self.hooks.append(pl_module.net[2].register_forward_hook(die_in_backward))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.kill_at == "optimizer" and self._kills_here(trainer):
            torch_optimizer = getattr(optimizer, "_optimizer", optimizer)
            self.hooks.append(torch_optimizer.register_step_post_hook(lambda *_: self._die_after_update(trainer)))

    def _die_after_update(self, trainer):
        self._record(trainer, self.batch)  # committed and applied here: the step stands with this member's samples
        self._die(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self._record(trainer, batch)
        if self.kill_at == "reshard" and self._kills_here(trainer):  # the batch boundary's adjustment follows
            marker, generation = self.out / "killed", str(trainer.strategy.generation)
            _die_in_a_reshard(marker, lambda: not marker.exists() or marker.read_text() == generation, generation)

    def _record(self, trainer, batch) -> None:
        samples = [] if trainer.strategy.sample_weight == 0 else batch[0].tolist()
        with self.path.open("a") as file:
            file.write(json.dumps({"epoch": trainer.current_epoch, "step": trainer.global_step,
                                   "samples": samples, "mesh": _mesh_shape(trainer), "units": _units(trainer)}) + "\n")

    def _kills_here(self, trainer) -> bool:
        if trainer.global_step != self.kill_step or trainer.global_rank not in self.kill_ranks:
            return False
        marker = self.out / "killed"
        generation = str(trainer.strategy.generation)
        return not marker.exists() or marker.read_text() == generation

    def _die(self, trainer) -> None:
        """SIGKILL this process; with several victims, once all of them are at their kill point (else the first death
        could release another from a collective before it gets there, and it would live)."""
        generation = str(trainer.strategy.generation)
        (self.out / f"at-kill-{trainer.global_rank}").write_text(generation)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                (self.out / f"at-kill-{rank}").exists() for rank in self.kill_ranks):
            time.sleep(0.01)
        (self.out / "killed").write_text(generation)
        os.kill(os.getpid(), signal.SIGKILL)


def _die_in_a_reshard(marker: Path, armed, text: str = "") -> None:
    """SIGKILL this process at its ``RESHARD_KILL_AT``-th transfer of a live reshard while ``armed()`` (writing
    ``marker`` first)."""
    from lightning_elan.replication import reshard

    exchange, calls = reshard.exchange, [0]

    def exchange_or_die(*args, **kwargs):
        if armed():
            calls[0] += 1
            if calls[0] == RESHARD_KILL_AT:
                marker.write_text(text)
                os.kill(os.getpid(), signal.SIGKILL)
        return exchange(*args, **kwargs)

    reshard.exchange = exchange_or_die


def full_state(trainer: pl.Trainer, model: MLP) -> dict[str, torch.Tensor]:
    """Parameters and Adam's states by parameter name, whole (a collective under elan_fsdp)."""
    optimizer = trainer.optimizers[0]
    if isinstance(trainer.strategy, ElanFSDPStrategy):
        parameters = trainer.strategy.lightning_module_state_dict()
        optimizer_state = trainer.strategy.optimizer_state(optimizer).get("state", {})  # rank 0 holds it
    else:
        parameters = model.state_dict()
        optimizer_state = {name: optimizer.state[p] for name, p in model.named_parameters()}
    state = {name: value.detach().clone() for name, value in parameters.items()}
    for name, values in optimizer_state.items():
        state.update({f"adam/{name}/{key}": torch.as_tensor(value).clone() for key, value in values.items()})
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="elan_fsdp")
    parser.add_argument("--shard-blocks", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, action="append", default=None)
    parser.add_argument("--kill-at", choices=["start", "forward", "backward", "optimizer", "reshard"], default="start")
    parser.add_argument("--reshard-kill-rank", type=int, default=None)
    parser.add_argument("--configure-model", action="store_true")
    parser.add_argument("--net-in-step", action="store_true")
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--hsdp", type=int, default=None, help="ElanFSDPStrategy(hsdp_group_size=...)")
    parser.add_argument("--own-units", action="store_true", help="configure_model calls fully_shard itself")
    parser.add_argument("--checkpoint-activations", choices=["always", "when-sharded"], default=None,
                        help="with --dimension-names: each block wrapped by checkpoint_wrapper (when-sharded: only "
                             "over a data-parallel dimension of more than one, as Lightning's example does)")
    parser.add_argument("--joiner-width", type=int, default=None,
                        help="a joiner (ELAN_ROLE=joiner) builds its network this wide: a host configured otherwise")
    parser.add_argument("--compile", default=None, help="with --dimension-names: each sharded block compiled so")
    parser.add_argument("--shard-columns", action="store_true",
                        help="with --dimension-names: the blocks' parameters sharded on their last dimension")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each batch waits as it starts")
    parser.add_argument("--dimension-names", action="store_true",
                        help="--own-units through device_mesh['data_parallel'] and ['tensor_parallel']")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global OUT, CHECKPOINT_ACTIVATIONS, JOINER_WIDTH, SHARD_COLUMNS, COMPILE, STEP_SLEEP_S
    OUT, CHECKPOINT_ACTIVATIONS, JOINER_WIDTH = str(args.out), args.checkpoint_activations, args.joiner_width
    SHARD_COLUMNS, COMPILE, STEP_SLEEP_S = args.shard_columns, args.compile, args.step_sleep
    reshards = logging.getLogger("lightning_elan.elastic.live_reshard")  # one line per member and live reshard
    reshards.setLevel(logging.INFO)
    reshards.addHandler(logging.StreamHandler())
    pl.seed_everything(1)
    strategy = args.strategy
    if args.shard_blocks or args.hsdp:
        strategy = ElanFSDPStrategy(shard_modules={Block} if args.shard_blocks else None, hsdp_group_size=args.hsdp)
    model = MLP(in_configure_model=args.configure_model, net_in_step=args.net_in_step, own_units=args.own_units,
                by_dimension_names=args.dimension_names)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=args.epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RecordTrained(args.out, args.kill_step, args.kill_rank or [1], args.kill_at, args.reshard_kill_rank),
                   ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=3, save_top_k=-1,
                                   filename="{step}")],
    )
    trainer.fit(model, DataLoader(Indexed(), batch_size=6, shuffle=True))
    if trainer.strategy.has_left:
        return
    state = full_state(trainer, model)
    if trainer.is_global_zero:
        torch.save(state, args.out / "final.pt")
    if args.evaluate:
        evaluate(trainer, model, args.out)


def evaluate(trainer: pl.Trainer, model: MLP, out: Path) -> None:
    """Validate, test and predict over the whole dataset in order; write what they logged and predicted."""
    loader = DataLoader(Indexed(), batch_size=6)
    validated = trainer.validate(model, loader, verbose=False)
    tested = trainer.test(model, loader, verbose=False)
    predicted = trainer.predict(model, loader)
    indices = torch.cat([index for index, _ in predicted])
    outputs = torch.cat([output for _, output in predicted])
    torch.save({"indices": indices, "outputs": outputs}, out / f"predicted-{os.getpid()}.pt")
    if trainer.is_global_zero:
        (out / "evaluation.json").write_text(json.dumps({**validated[0], **tested[0]}))


if __name__ == "__main__":
    main()
