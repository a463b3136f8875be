"""Lightning's own demo model, unchanged, through LightningCLI. Its ``prepare_data`` "downloads" WikiText-2 to
``./data/wikitext-2.txt`` (the download is skipped when the file is there).

    python transformer_cli.py fit --trainer.strategy=elan --model.vocab_size 64 ...
"""

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.transformer import LightningTransformer

import lightning_elan  # noqa: F401  (registers strategy="elan")

if __name__ == "__main__":
    LightningCLI(LightningTransformer)
