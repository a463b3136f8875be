"""``elastic/error_origin.py``: an error out of a training step is the process's own (re-raised at once) unless it was
raised in communication a member's death may have broken. Every error here is really raised (a torch op on mismatched
tensors, an allocation too large, ``torch.distributed`` without a process group, the autograd engine running a hook);
the gloo messages are the survivors' as printed when a member of a 2-worker job was SIGKILLed in its backward and in
its optimizer step (gloo 2.13's ``pair.cc``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_elan.elastic.error_origin import may_be_a_peers_death, raised_in_communication
from lightning_elan.elastic.failures import PeerFailure

GLOO_RESET = ("Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/"
              "gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:38273: Connection reset by peer. This is "
              "typically caused by a remote worker hanging or bugs in the application.")
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:19329. This is typically caused by a remote worker crashing.")


def raised(action) -> BaseException:
    try:
        action()
    except BaseException as error:
        return error
    raise AssertionError("nothing was raised")


def dtype_mismatch() -> None:
    torch.nn.Linear(4, 2)(torch.ones(3, 4, dtype=torch.float64))


def shape_mismatch() -> None:
    torch.nn.Linear(4, 2)(torch.ones(3, 5))


def out_of_memory() -> None:
    torch.empty(2**50, dtype=torch.uint8)


def users_assertion() -> None:
    loss = torch.tensor(float("nan"))
    assert torch.isfinite(loss), "the loss diverged"


def loss_value_error() -> None:
    torch.nn.functional.binary_cross_entropy(torch.rand(3), torch.rand(4))


def users_oom() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def users_runtime_error() -> None:
    raise RuntimeError("the batch does not fit")


@pytest.mark.parametrize("action", [dtype_mismatch, shape_mismatch, out_of_memory, users_assertion, loss_value_error,
                                    users_oom, users_runtime_error])
def test_an_error_of_the_users_code_or_of_a_torch_op_it_called_is_its_own(action) -> None:
    error = raised(action)
    assert not may_be_a_peers_death(error), error


def test_the_errors_a_user_meets_read_as_expected() -> None:
    assert "same dtype" in str(raised(dtype_mismatch))
    assert "cannot be multiplied" in str(raised(shape_mismatch))
    assert "can't allocate memory" in str(raised(out_of_memory))


def test_an_error_raised_in_torch_distributed_may_be_a_death() -> None:
    error = raised(dist.get_rank)  # no default process group: a ValueError from distributed_c10d.py
    assert raised_in_communication(error.__traceback__)
    assert may_be_a_peers_death(error)


def test_an_error_of_the_autograd_engine_naming_gloo_may_be_a_death() -> None:
    """DDP's gradient all-reduce runs inside ``backward``: the survivor's error is raised from torch's autograd, and
    only its message says that gloo's connection broke."""
    weight = torch.ones(2, requires_grad=True)
    weight.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError(GLOO_RESET)))
    error = raised(lambda: (weight * 2).sum().backward())
    assert not raised_in_communication(error.__traceback__)
    assert may_be_a_peers_death(error)


@pytest.mark.parametrize("message", [GLOO_RESET, GLOO_CLOSED, "Timed out waiting 1800000ms for recv operation",
                                     "NCCL communicator was aborted"])
def test_a_message_naming_a_broken_transport_may_be_a_death(message: str) -> None:
    assert may_be_a_peers_death(raised(lambda: (_ for _ in ()).throw(RuntimeError(message))))


@pytest.mark.parametrize("error", [PeerFailure(3), ConnectionResetError(104, "reset"), TimeoutError("store"),
                                   dist.DistNetworkError("the client socket closed")])
def test_an_error_whose_type_says_communication_failed_may_be_a_death(error: BaseException) -> None:
    assert may_be_a_peers_death(error)


def test_a_users_error_raised_while_handling_a_broken_collective_may_be_a_death() -> None:
    def handler() -> None:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as broken:
            raise ValueError("my metric could not be synced") from broken

    assert may_be_a_peers_death(raised(handler))


def test_a_programming_error_is_its_own_wherever_it_was_raised() -> None:
    error = raised(lambda: dist.all_reduce("not a tensor"))  # a TypeError from torch.distributed
    assert isinstance(error, TypeError) and raised_in_communication(error.__traceback__)
    assert not may_be_a_peers_death(error)


def test_a_cyclic_chain_ends() -> None:
    first, second = RuntimeError("first"), RuntimeError("second")
    first.__context__, second.__context__ = second, first
    assert not may_be_a_peers_death(first)
