"""Pre-train a small BERT with masked language modelling with Hugging Face Accelerate, in the style of transformers'
``run_mlm_no_trainer.py``. For elastic training ``ElasticAccelerator`` replaces ``Accelerator`` and epochs come from
``accelerator.epochs(n)``; launch with ``elan run --nproc 2 --job mlm -- python masked_lm_bert.py --output_dir OUT``.

Everything as a user has it by default, which is not reproducible across world sizes: float32, BERT's default dropout
(0.1), tokens masked at random by ``DataCollatorForLanguageModeling`` in each process, and a loss that is the mean
over the masked tokens of each process's batch. The tokenizer is a word-level ``tokenizers`` tokenizer built in the
script (nothing is downloaded), the text sentences of a small grammar. The loop: AdamW with a constant schedule after
warm-up, gradient clipping, the masked-LM loss on held-out sentences with ``gather_for_metrics`` after every epoch, a
JSON-lines tracker (``OUT/metrics.jsonl``), ``save_state`` after every epoch (``OUT/epoch_<n>``; with
``--automatic_checkpoint_naming``, Accelerate's own naming: ``OUT/checkpoints/checkpoint_<i>``), the trained model saved
with ``save_pretrained`` (``OUT/final``).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import ProjectConfiguration, set_seed
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing
from torch.utils.data import DataLoader
from training_utils import JsonLinesTracker, SampleLog, TrainingProgress
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    get_scheduler,
)

from lightning_elan.accelerate import ElasticAccelerator

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SUBJECTS = ["the cat", "a dog", "the bird", "a child", "the old man"]
VERBS = ["sat", "ran", "slept", "waited", "jumped"]
PLACES = ["on the mat", "under the tree", "in the house", "near a river", "by the door"]
WORDS = sorted({word for phrase in SUBJECTS + VERBS + PLACES + ["quietly", "and"] for word in phrase.split()})


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.post_processor = TemplateProcessing(single="[CLS] $A [SEP]",
                                                  special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    text = []
    for _ in range(count):
        sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(PLACES)}"
        if rng.random() < 0.4:
            sentence += f" and {rng.choice(SUBJECTS)} {rng.choice(VERBS)} quietly"
        text.append(sentence)
    return text


def tokenized(tokenizer: PreTrainedTokenizerFast, text: list[str]) -> list[dict[str, Any]]:
    return [{**tokenizer(sentence, return_token_type_ids=False), "idx": index} for index, sentence in enumerate(text)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--train_sentences", type=int, default=128)
    parser.add_argument("--eval_sentences", type=int, default=40)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--num_warmup_steps", type=int, default=4)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--mlm_probability", type=float, default=0.15)
    parser.add_argument("--automatic_checkpoint_naming", action="store_true",
                        help="save_state() into OUT/checkpoints/checkpoint_<i> (else OUT/epoch_<n>)")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


def build_model(vocab_size: int) -> BertForMaskedLM:
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32)
    return BertForMaskedLM(config)


def evaluate(accelerator: ElasticAccelerator, model: torch.nn.Module, loader: DataLoader) -> dict[str, float]:
    model.eval()
    losses = []
    for batch in loader:
        batch.pop("idx")
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(len(batch["input_ids"]))))
    model.train()
    losses_all = torch.cat(losses)
    return {"eval_loss": losses_all.mean().item(), "eval_samples": len(losses_all)}


def main() -> None:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    project = ProjectConfiguration(project_dir=str(args.output_dir),
                                   automatic_checkpoint_naming=args.automatic_checkpoint_naming)
    accelerator = ElasticAccelerator(project_config=project,
                                     log_with=[JsonLinesTracker(args.output_dir / "metrics.jsonl")])
    set_seed(args.seed)
    tokenizer = build_tokenizer()
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=args.mlm_probability)
    train_dataloader = DataLoader(tokenized(tokenizer, sentences(args.train_sentences, seed=1)), shuffle=True,
                                  collate_fn=collator, batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(tokenized(tokenizer, sentences(args.eval_sentences, seed=2)), collate_fn=collator,
                                 batch_size=args.per_device_eval_batch_size)
    model = build_model(len(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)  # before prepare(): a joiner receives it there
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accelerator.init_trackers("masked_lm_bert", config={key: str(value) for key, value in vars(args).items()})

    trained = SampleLog(args.output_dir)
    model.train()
    for epoch in accelerator.epochs(args.num_train_epochs):
        for batch in train_dataloader:
            trained.add(batch.pop("idx").tolist())
            with accelerator.accumulate(model):
                loss = model(**batch).loss
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
            accelerator.log({"train_loss": loss.item(), "world_size": accelerator.num_processes},
                            step=progress.completed_steps)
            progress.completed_steps += 1
        metrics = evaluate(accelerator, model, eval_dataloader)
        accelerator.log({**metrics, "epoch": epoch}, step=progress.completed_steps)
        if args.automatic_checkpoint_naming:
            accelerator.save_state()  # OUT/checkpoints/checkpoint_<i>
        else:
            accelerator.save_state(str(args.output_dir / f"epoch_{epoch}"))

    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(args.output_dir / "final", save_function=accelerator.save,
                                                    is_main_process=accelerator.is_main_process)
    accelerator.end_training()


if __name__ == "__main__":
    main()
