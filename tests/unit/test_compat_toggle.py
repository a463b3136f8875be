"""``compat.undo_toggled_optimizer``: a discarded step's ``toggle_optimizer`` undone before its redo."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import torch

from lightning_elan import compat


class _Gan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.nn.Linear(2, 2)
        self.discriminator = torch.nn.Linear(2, 1)
        self.generator.bias.requires_grad_(False)  # frozen by the user: stays frozen


def test_the_toggled_parameters_get_their_flags_back() -> None:
    module = _Gan()
    optimizers = [torch.optim.SGD(module.generator.parameters(), lr=0.1),
                  torch.optim.SGD(module.discriminator.parameters(), lr=0.1)]
    module._trainer = SimpleNamespace(optimizers=optimizers)  # what toggle_optimizer reads
    module.toggle_optimizer(optimizers[0])  # the step is cut here: no untoggle_optimizer
    assert not any(parameter.requires_grad for parameter in module.discriminator.parameters())

    compat.undo_toggled_optimizer(module)
    assert all(parameter.requires_grad for parameter in module.discriminator.parameters())
    assert module.generator.weight.requires_grad and not module.generator.bias.requires_grad
    assert module._param_requires_grad_state == {}
    compat.undo_toggled_optimizer(module)  # nothing toggled: nothing to do
    assert module.generator.weight.requires_grad
