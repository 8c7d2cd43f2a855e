"""Activation checkpointing on one process: which blocks, the gradients, the memory, the errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.activation_checkpointing import (
    ActivationCheckpointing,
    checkpoint_activations,
    checkpointed_blocks,
)
from phalanx.models import GPT, GPTConfig
from phalanx.models.gpt import Block, gpt_as_sequential
from phalanx.plan.measure import activation_bytes


def _gpt(layers: int = 4, dropout: float = 0.1) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(65, 32, layers, 4, 64, dropout=dropout))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 65, (4, 32), generator=g)
    return x, torch.randint(0, 65, (4, 32), generator=g)


def _grads(model: GPT) -> dict[str, torch.Tensor]:
    x, y = _batch()
    torch.manual_seed(5)  # the dropout masks
    loss = model(x, y)[1]
    assert loss is not None
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_repeated_blocks_are_found_and_every_kth_taken() -> None:
    assert checkpoint_activations(_gpt(), "full") == [f"blocks.{i}" for i in range(4)]
    every = ActivationCheckpointing(every=2)
    assert checkpoint_activations(_gpt(), every) == ["blocks.0", "blocks.2"]
    # The blocks of a pipeline's nn.Sequential form are found by their class too.
    assert checkpoint_activations(gpt_as_sequential(_gpt()), "full") == ["1", "2", "3", "4"]
    named = ActivationCheckpointing(blocks=lambda name, m: name.endswith(".mlp"))
    assert checkpoint_activations(_gpt(), named) == [f"blocks.{i}.mlp" for i in range(4)]
    by_class = _gpt()
    checkpoint_activations(by_class, ActivationCheckpointing(blocks=(Block,), every=3))
    assert checkpointed_blocks(by_class) == ["blocks.0", "blocks.3"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_equal_those_without_checkpointing_dropout_included(mode: str) -> None:
    plain, checkpointed = _gpt(), _gpt()
    checkpoint_activations(checkpointed, mode)
    expected, got = _grads(plain), _grads(checkpointed)
    assert expected.keys() == got.keys() and expected
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


def test_the_model_is_unchanged_to_state_dicts_copies_and_evaluation() -> None:
    model = _gpt()
    keys = list(model.state_dict())
    checkpoint_activations(model, "full")
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)  # its blocks' forward is bound to the copy, not the original
    with torch.no_grad():
        twin.blocks[0].mlp.fc1.weight.zero_()
    assert not torch.equal(twin.blocks[0].mlp.fc1.weight, model.blocks[0].mlp.fc1.weight)
    x, _ = _batch()
    model.eval()
    twin.eval()
    assert not torch.equal(model(x)[0], twin(x)[0])
    with torch.no_grad():
        assert torch.equal(model(x)[0], model(x)[0])


def test_checkpointing_keeps_less_activation_memory() -> None:
    x, y = _batch()
    sizes = {}
    for mode in (None, "selective", "full"):
        model = _gpt(dropout=0.0)
        if mode is not None:
            checkpoint_activations(model, mode)
        sizes[mode] = activation_bytes(model, (x, y))
    assert sizes["full"] < sizes["selective"] < sizes[None]
    assert sizes["full"] < 0.4 * sizes[None], sizes


def _fails(error: type[Exception], text: str, call: Any) -> None:
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value), str(info.value)


def test_bad_options_name_the_argument_and_the_value() -> None:
    _fails(ValueError, "mode='half'", lambda: ActivationCheckpointing(mode="half"))
    _fails(ValueError, "every=0", lambda: ActivationCheckpointing(every=0))
    _fails(TypeError, "blocks=3", lambda: ActivationCheckpointing(blocks=3))  # type: ignore[arg-type]
    _fails(ValueError, "save=('mm',)", lambda: ActivationCheckpointing(save=("mm",)))
    _fails(
        ValueError,
        "torch.ops.aten has no 'matmul_x'",
        lambda: ActivationCheckpointing(mode="selective", save=("matmul_x",)),
    )
    _fails(
        ValueError,
        "activation_checkpointing='yes'",
        lambda: checkpoint_activations(_gpt(), "yes"),
    )
    _fails(TypeError, "model=", lambda: checkpoint_activations("gpt"))  # type: ignore[arg-type]
    flat = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    _fails(ValueError, "Sequential has no repeated blocks", lambda: checkpoint_activations(flat))
    twice = _gpt()
    checkpoint_activations(twice)
    _fails(
        ValueError,
        "'blocks.0' of GPT is checkpointed already",
        lambda: checkpoint_activations(twice),
    )


def test_job_refuses_a_bad_activation_checkpointing_before_any_process_group() -> None:
    _fails(
        ValueError,
        "Job(activation_checkpointing='all')",
        lambda: phalanx.Job(activation_checkpointing="all"),
    )
    _fails(TypeError, "activation_checkpointing=2", lambda: phalanx.Job(activation_checkpointing=2))
