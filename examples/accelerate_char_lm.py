"""A small character-level Transformer language model in an ordinary Accelerate loop with gradient accumulation,
gradient clipping, a warm-up + cosine LR schedule and per-epoch checkpoints — made elastic by two changes
(``ElasticAccelerator`` for ``Accelerator``, ``accelerator.epochs(n)`` for ``range(n)``). It trains on this
repository's own documentation (README.md and docs/*.md), so it needs no download.

    elan run --nproc 2 --job char-lm --schedule "30:add=1,60:remove=rank:0,90:migrate=1" -- \\
        python examples/accelerate_char_lm.py --checkpoint-dir /tmp/char-lm
    python examples/accelerate_char_lm.py            # one process, like plain Accelerate

``--accumulation K`` micro-batches per optimizer step (default 2); ``--weak`` lets the global batch follow the world
size (the LR ramps towards the new scale). With ``--checkpoint-dir`` the main process saves the state at the end of
each epoch and a new run resumes from the latest (at any world size). The main process prints the loss per epoch and
a sample of generated text at the end.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator, ElasticPlugin

REPO = Path(__file__).resolve().parents[1]


class CharWindows(Dataset):
    """Every ``length + 1``-character window of the text (non-overlapping), as (input, next-character target)."""

    def __init__(self, text: str, length: int = 64) -> None:
        self.vocabulary = sorted(set(text))
        codes = torch.tensor([self.vocabulary.index(c) for c in text], dtype=torch.long)
        usable = (len(codes) - 1) // length * length
        self.inputs = codes[:usable].view(-1, length)
        self.targets = codes[1 : usable + 1].view(-1, length)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


class CharTransformer(nn.Module):
    def __init__(self, vocabulary: int, width: int = 64, layers: int = 2, heads: int = 4, length: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.zeros(1, length, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocabulary)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        length = codes.shape[1]
        hidden = self.embed(codes) + self.position[:, :length]
        return self.head(self.encoder(hidden, mask=self.causal[:length, :length], is_causal=True))


def corpus() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))])


def warmup_cosine(total_steps: int, warmup: int = 20):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return factor


@torch.no_grad()
def sample(model: nn.Module, data: CharWindows, prompt: str = "Elastic ", length: int = 120) -> str:
    codes = torch.tensor([[data.vocabulary.index(c) for c in prompt if c in data.vocabulary]])
    for _ in range(length):
        logits = model(codes[:, -data.inputs.shape[1]:])[:, -1]
        codes = torch.cat([codes, logits.argmax(-1, keepdim=True)], dim=1)
    return "".join(data.vocabulary[i] for i in codes[0].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--weak", action="store_true", help="weak scaling: the global batch follows the world size")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    args = parser.parse_args()
    plugin = ElasticPlugin(coordinate_every=5, scaling="weak" if args.weak else "strong", lr_ramp_steps=10)
    accelerator = ElasticAccelerator(cpu=True, gradient_accumulation_steps=args.accumulation, elastic_plugin=plugin)
    torch.manual_seed(0)
    data = CharWindows(corpus())
    model = CharTransformer(len(data.vocabulary))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = DataLoader(data, batch_size=16, shuffle=True)
    steps_per_epoch = math.ceil(len(loader) / args.accumulation)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.epochs * steps_per_epoch))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    latest = args.checkpoint_dir / "latest" if args.checkpoint_dir else None
    if latest is not None and latest.exists():
        accelerator.load_state(str(latest))  # at any world size: the data position comes back too
    for epoch in accelerator.epochs(args.epochs):
        total, batches = torch.zeros(()), 0
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                logits = model(inputs)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total, batches = total + loss.detach(), batches + 1
        mean = accelerator.reduce(total / max(batches, 1), reduction="mean")
        if accelerator.is_main_process:
            print(f"epoch {epoch}: loss {mean.item():.3f}, world {accelerator.num_processes}, "
                  f"optimizer step {accelerator.optimizer_steps}, lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        if latest is not None:
            accelerator.save_state(str(latest))
    if accelerator.is_main_process:
        print(sample(accelerator.unwrap_model(model), data), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
