"""Fine-tune a small BERT for sentence classification with Hugging Face Accelerate, in the style of transformers'
``run_glue_no_trainer.py``. For elastic training ``ElasticAccelerator`` replaces ``Accelerator`` and epochs come from
``accelerator.epochs(n)``; launch with ``elan run --nproc 2 --job bert -- python classify_bert.py --output_dir OUT``.

The model is built from a config (nothing is downloaded), in float64 with dropout off; the data are synthetic
"sentences" of token ids (label: does token 7 occur more often than token 9?) of 8 to 24 tokens, padded per batch by
the collate function. The loop: gradient accumulation, gradient clipping, AdamW with a linear schedule and warm-up
from ``transformers.get_scheduler``, evaluation with ``gather_for_metrics`` after every epoch, a JSON-lines tracker
(``OUT/metrics.jsonl``), ``save_state`` after every epoch (``OUT/epoch_<n>``; ``--resume_from_checkpoint`` continues
from one), the trained model saved with ``save_pretrained`` (``OUT/final``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from training_utils import JsonLinesTracker, SampleLog, TrainingProgress
from transformers import AutoModelForSequenceClassification, BertConfig, get_scheduler

from lightning_elan.accelerate import ElasticAccelerator

VOCAB, PAD, MAX_LENGTH = 48, 0, 24


class ToySentences(Dataset):
    """Sentences of 8–24 token ids; label 1 when token 7 occurs more often than token 9."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(8, MAX_LENGTH + 1, (size,), generator=generator)
        self.sentences = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.sentences)

    def __getitem__(self, index: int) -> dict[str, Any]:
        tokens = self.sentences[index]
        return {"idx": index, "input_ids": tokens, "label": int((tokens == 7).sum() > (tokens == 9).sum())}


def collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad to the longest sentence of the batch (dynamic padding)."""
    longest = max(len(example["input_ids"]) for example in examples)
    input_ids = torch.full((len(examples), longest), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        input_ids[row, : len(example["input_ids"])] = example["input_ids"]
        attention_mask[row, : len(example["input_ids"])] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": torch.tensor([example["label"] for example in examples]),
            "idx": torch.tensor([example["idx"] for example in examples])}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--train_samples", type=int, default=160)
    parser.add_argument("--eval_samples", type=int, default=50)
    parser.add_argument("--per_device_train_batch_size", type=int, default=5)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--resume_from_checkpoint", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--test_after_training", action="store_true",
                        help="evaluate a held-out test split once more after the training loop (logged as test_*)")
    return parser.parse_args()


def build_model() -> torch.nn.Module:
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=MAX_LENGTH, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    return AutoModelForSequenceClassification.from_config(config).double()


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.learning_rate)


def evaluate(accelerator: ElasticAccelerator, model: torch.nn.Module, loader: DataLoader) -> dict[str, float]:
    model.eval()
    correct = total = tokens = 0
    loss_sum = 0.0
    for batch in loader:
        batch.pop("idx")
        with torch.no_grad():
            logits = model(**batch).logits
        losses = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
        # each process padded its batch to its own longest sentence: pad across processes before gathering
        input_ids = accelerator.pad_across_processes(batch["input_ids"], dim=1, pad_index=PAD)
        predictions, labels, losses, input_ids = accelerator.gather_for_metrics(
            (logits.argmax(dim=-1), batch["labels"], losses, input_ids))
        correct += int((predictions == labels).sum())
        total += len(labels)
        tokens += int((input_ids != PAD).sum())
        loss_sum += float(losses.sum())
    model.train()
    return {"eval_accuracy": correct / total, "eval_loss": loss_sum / total, "eval_samples": total,
            "eval_tokens": tokens}


def main() -> None:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                                     log_with=[JsonLinesTracker(args.output_dir / "metrics.jsonl")])
    set_seed(args.seed)
    model = build_model()
    train_dataloader = DataLoader(ToySentences(args.train_samples, seed=1), shuffle=True, collate_fn=collate,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(ToySentences(args.eval_samples, seed=2), collate_fn=collate,
                                 batch_size=args.per_device_eval_batch_size)
    optimizer = build_optimizer(model, args)
    # as run_glue_no_trainer: counted before prepare() (Accelerate steps the scheduler once per process)
    max_train_steps = args.num_train_epochs * -(-len(train_dataloader) // args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=max_train_steps)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)  # before prepare(): a joiner receives it there
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accelerator.init_trackers("classify_bert", config={key: str(value) for key, value in vars(args).items()})
    if args.resume_from_checkpoint is not None:
        accelerator.load_state(str(args.resume_from_checkpoint))

    trained = SampleLog(args.output_dir)
    model.train()
    for epoch in accelerator.epochs(args.num_train_epochs):
        for batch in train_dataloader:
            trained.add(batch.pop("idx").tolist())
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            if accelerator.optimizer_step_was_skipped:  # a member of the job died: the step is trained again
                trained.step_skipped()
                continue
            trained.step_applied(epoch, progress.completed_steps, accelerator.process_index,
                                 accelerator.num_processes)
            accelerator.log({"train_loss": outputs.loss.item(), "lr": lr_scheduler.get_last_lr()[0],
                             "world_size": accelerator.num_processes}, step=progress.completed_steps)
            progress.completed_steps += 1
        metrics = evaluate(accelerator, model, eval_dataloader)
        accelerator.log({**metrics, "epoch": epoch}, step=progress.completed_steps)
        accelerator.save_state(str(args.output_dir / f"epoch_{epoch}"))

    if args.test_after_training:
        test_dataloader = accelerator.prepare(DataLoader(ToySentences(args.eval_samples, seed=3), collate_fn=collate,
                                                         batch_size=args.per_device_eval_batch_size))
        metrics = evaluate(accelerator, model, test_dataloader)
        accelerator.log({f"test_{key.removeprefix('eval_')}": value for key, value in metrics.items()},
                        step=progress.completed_steps)
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(args.output_dir / "final", save_function=accelerator.save,
                                                    is_main_process=accelerator.is_main_process)
    accelerator.end_training()


if __name__ == "__main__":
    main()
