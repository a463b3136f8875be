"""AppliedSteps: a batch's applied optimizer steps are undone exactly (manual optimization's redo)."""

from __future__ import annotations

import torch

from lightning_elan.elastic.applied_steps import AppliedSteps, ClosureReevaluations


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: AppliedSteps | None = None) -> None:
    optimizer.zero_grad()
    model(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
    if steps is not None:
        steps.before_update(optimizer)
    optimizer.step()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def test_two_optimizers_stepped_in_a_batch_are_put_back_to_its_start() -> None:
    torch.manual_seed(0)
    critic, generator = torch.nn.Linear(4, 1).double(), torch.nn.Linear(4, 1).double()
    critic_opt = torch.optim.Adam(critic.parameters(), lr=0.1)
    generator_opt = torch.optim.SGD(generator.parameters(), lr=0.1, momentum=0.9)
    _step(critic, critic_opt)
    _step(generator, generator_opt)  # both have state before the batch
    before = _state(critic, critic_opt) + _state(generator, generator_opt)
    steps = AppliedSteps()

    _step(critic, critic_opt, steps)
    _step(generator, generator_opt, steps)
    _step(critic, critic_opt, steps)  # a second step of the same optimizer: its first snapshot stays
    assert steps
    steps.undo()

    after = _state(critic, critic_opt) + _state(generator, generator_opt)
    assert not steps
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert critic_opt.state_dict()["state"][0]["step"] == 1  # Adam's step count back too


def test_a_batch_that_stands_keeps_its_steps() -> None:
    model = torch.nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = AppliedSteps()
    _step(model, optimizer, steps)
    stepped = _state(model, optimizer)
    steps.batch_stands()
    steps.undo()
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), stepped, strict=True))


def test_an_lbfgs_step_is_undone_to_its_start_after_several_closure_evaluations() -> None:
    """L-BFGS updates the parameters between its closure's evaluations: the state kept before the first update puts
    the parameters and its history back, so that the redone step is the step a static run takes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)
    inputs = torch.randn(6, 4, dtype=torch.float64)
    steps, evaluations = AppliedSteps(), []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(inputs).pow(2).mean()
        loss.backward()
        evaluations.append(loss.item())
        steps.before_update(optimizer)
        return loss

    optimizer.step(closure)
    steps.batch_stands()
    before = _state(model, optimizer)
    optimizer.step(closure)
    assert len(evaluations) > 2, "L-BFGS evaluated the closure several times in a step"
    steps.undo()
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), before, strict=True))


def test_optimizers_that_evaluate_the_closure_again_are_known() -> None:
    model = torch.nn.Linear(4, 1)
    lbfgs, sgd = torch.optim.LBFGS(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)
    reevaluations = ClosureReevaluations()
    assert reevaluations.expected(lbfgs) and not reevaluations.expected(sgd)
    reevaluations.seen(sgd, 1)
    assert not reevaluations.expected(sgd)
    reevaluations.seen(sgd, 2)
    assert reevaluations.expected(sgd)
