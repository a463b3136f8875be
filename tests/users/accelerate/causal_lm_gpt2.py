"""Train a small GPT-2 language model from scratch with Hugging Face Accelerate, in the style of transformers'
``run_clm_no_trainer.py``. For elastic training ``ElasticAccelerator`` replaces ``Accelerator`` and epochs come from
``accelerator.epochs(n)``; launch with ``elan run --nproc 2 --job gpt2 -- python causal_lm_gpt2.py --output_dir OUT``.

The model is ``GPT2LMHeadModel`` built from a ``GPT2Config`` (nothing is downloaded), in float64 with dropout off. The
text is a synthetic token stream (each token a function of the previous one, with noise) cut into blocks of
``--block_size`` tokens, the labels the inputs, batched by ``transformers.default_data_collator``; the loss is the
next-token cross-entropy, computed from the logits in float64.
The loop: AdamW with a cosine schedule and warm-up from ``transformers.get_scheduler``, gradient clipping, perplexity
on held-out blocks with ``gather_for_metrics`` after every epoch, a JSON-lines tracker (``OUT/metrics.jsonl``),
``save_state`` every ``--checkpointing_steps`` optimizer steps (``OUT/step_<n>``), ``--resume_from_checkpoint`` as
``run_clm_no_trainer.py`` does it (``load_state``, then ``skip_first_batches`` to the saved step within its epoch), the
trained model saved with ``save_pretrained`` (``OUT/final``). ``--fsdp``: FSDP2 as Accelerate's FSDP guide sets it up
for a transformers model (``FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
transformer_cls_names_to_wrap=["GPT2Block"])``; GPT-2's ``lm_head.weight`` is tied to ``transformer.wte.weight``), the
model saved with ``state_dict=accelerator.get_state_dict(model)`` as that guide says.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from accelerate import FullyShardedDataParallelPlugin
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, IterableDataset
from training_utils import JsonLinesTracker, SampleLog, TrainingProgress
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

from lightning_elan.accelerate import ElasticAccelerator

VOCAB = 40


def token_blocks(num_blocks: int, block_size: int, seed: int) -> list[dict[str, Any]]:
    """A token stream cut into blocks, as ``group_texts`` of ``run_clm_no_trainer.py`` leaves it."""
    generator = torch.Generator().manual_seed(seed)
    stream = [int(torch.randint(VOCAB, (1,), generator=generator))]
    noise = torch.randint(3, (num_blocks * block_size,), generator=generator)
    for step in noise[1:].tolist():
        stream.append((3 * stream[-1] + 1 + step) % VOCAB)
    blocks = []
    for index in range(num_blocks):
        tokens = stream[index * block_size : (index + 1) * block_size]
        blocks.append({"idx": index, "input_ids": tokens, "attention_mask": [1] * block_size, "labels": tokens})
    return blocks


class StreamedBlocks(IterableDataset):
    """The blocks as a stream (what ``datasets`` gives with ``streaming=True``)."""

    def __init__(self, blocks: list[dict[str, Any]]) -> None:
        self.blocks = blocks

    def __iter__(self) -> Any:
        yield from self.blocks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--train_blocks", type=int, default=96)
    parser.add_argument("--eval_blocks", type=int, default=30)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_warmup_steps", type=int, default=3)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--checkpointing_steps", type=int, default=5)
    parser.add_argument("--resume_from_checkpoint", type=Path, default=None)
    parser.add_argument("--streaming", action="store_true", help="read the training blocks as a stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2, each GPT2Block a unit")
    return parser.parse_args()


def build_model(block_size: int) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=block_size, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in the logits' own precision (passing ``labels=`` to the model computes it in float32:
    transformers upcasts half-precision logits to float32, and casts float64 ones down to it)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction=reduction)


def evaluate(accelerator: ElasticAccelerator, model: torch.nn.Module, loader: DataLoader) -> dict[str, float]:
    """Perplexity over the held-out blocks (the mean of each block's mean token loss, gathered)."""
    model.eval()
    losses = []
    for batch in loader:
        batch.pop("idx")
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits
        losses.append(accelerator.gather_for_metrics(causal_lm_loss(logits, labels, reduction="none").mean(dim=1)))
    model.train()
    eval_loss = torch.cat(losses).mean().item()
    return {"eval_loss": eval_loss, "perplexity": math.exp(eval_loss), "eval_samples": sum(map(len, losses))}


def resume_point(checkpoint: Path, steps_per_epoch: int) -> tuple[int, int | None]:
    """``(starting_epoch, resume_step)`` from the checkpoint's name (``epoch_<n>`` or ``step_<n>``), as
    ``run_clm_no_trainer.py`` computes them."""
    name = checkpoint.name
    if name.startswith("epoch_"):
        return int(name.replace("epoch_", "")) + 1, None
    resume_step = int(name.replace("step_", ""))
    starting_epoch = resume_step // steps_per_epoch
    return starting_epoch, resume_step - starting_epoch * steps_per_epoch


def main() -> None:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    plugin = None
    if args.fsdp:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["GPT2Block"])
    accelerator = ElasticAccelerator(fsdp_plugin=plugin,
                                     log_with=[JsonLinesTracker(args.output_dir / "metrics.jsonl")])
    set_seed(args.seed)
    model = build_model(args.block_size)
    train_blocks = token_blocks(args.train_blocks, args.block_size, seed=1)
    train_data = StreamedBlocks(train_blocks) if args.streaming else train_blocks
    train_dataloader = DataLoader(train_data, shuffle=not args.streaming, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(token_blocks(args.eval_blocks, args.block_size, seed=2),
                                 collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    max_train_steps = args.num_train_epochs * -(-len(train_blocks) // args.per_device_train_batch_size)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=max_train_steps)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)  # before prepare(): a joiner receives it there
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accelerator.init_trackers("causal_lm_gpt2", config={key: str(value) for key, value in vars(args).items()})

    starting_epoch, resume_step = 0, None
    if args.resume_from_checkpoint is not None:
        accelerator.load_state(str(args.resume_from_checkpoint))
        starting_epoch, resume_step = resume_point(args.resume_from_checkpoint, len(train_dataloader))

    trained = SampleLog(args.output_dir)
    model.train()
    for epoch in accelerator.epochs(args.num_train_epochs):
        if args.resume_from_checkpoint is not None and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            trained.add(batch.pop("idx").tolist())
            labels = batch.pop("labels")
            with accelerator.accumulate(model):
                loss = causal_lm_loss(model(**batch).logits, labels)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.optimizer_step_was_skipped:  # a member of the job died: the step is trained again
                trained.step_skipped()
                continue
            trained.step_applied(epoch, progress.completed_steps, accelerator.process_index,
                                 accelerator.num_processes)
            accelerator.log({"train_loss": loss.item(), "lr": lr_scheduler.get_last_lr()[0],
                             "world_size": accelerator.num_processes}, step=progress.completed_steps)
            progress.completed_steps += 1
            if progress.completed_steps % args.checkpointing_steps == 0:
                accelerator.save_state(str(args.output_dir / f"step_{progress.completed_steps}"))
        metrics = evaluate(accelerator, model, eval_dataloader)
        accelerator.log({**metrics, "epoch": epoch}, step=progress.completed_steps)

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model) if args.fsdp else None  # every process gathers it
    accelerator.unwrap_model(model).save_pretrained(args.output_dir / "final", save_function=accelerator.save,
                                                    is_main_process=accelerator.is_main_process, state_dict=state_dict)
    accelerator.end_training()


if __name__ == "__main__":
    main()
