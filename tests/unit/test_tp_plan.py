"""Tensor-parallel planning, one process: shard ranges, plan matching, validation, tp=1 parity.

Without a process group every layer runs at tp=1 (its group has one rank), so parallelizing a
model must change nothing: outputs are compared with ``torch.equal``, since the very same
matmuls run on the very same numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.models import GPT, GPTConfig
from phalanx.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_tp,
    gpt_comm_counts,
    gpt_loss,
    gpt_plan,
    match_plan,
    parallelize_gpt,
    parallelize_module,
    reduce_from_tp,
    scatter_to_tp,
    shard_range,
    shard_sizes,
    validate_tp,
    vocab_parallel_cross_entropy,
)

CONFIG = GPTConfig(65, 16, 2, 4, 32)


@pytest.mark.parametrize(
    ("total", "tp", "sizes"),
    [(65, 2, [33, 32]), (65, 4, [17, 16, 16, 16]), (64, 4, [16] * 4), (3, 4, [1, 1, 1, 0])],
)
def test_shard_sizes_differ_by_at_most_one_and_ranges_tile(
    total: int, tp: int, sizes: list[int]
) -> None:
    assert shard_sizes(total, tp) == sizes
    ranges = [shard_range(total, r, tp) for r in range(tp)]
    assert [e - s for s, e in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(ranges[r][1] == ranges[r + 1][0] for r in range(tp - 1))


def test_shard_arithmetic_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="tp=0"):
        shard_sizes(10, 0)
    with pytest.raises(ValueError, match="rank=2, tp=2"):
        shard_range(10, 2, 2)


NAMES = [
    "blocks",
    "blocks.0",
    "blocks.0.attn",
    "blocks.0.attn.q_proj",
    "blocks.1",
    "blocks.1.attn",
    "blocks.1.attn.q_proj",
    "head",
]


def test_wildcard_matches_exactly_one_path_component() -> None:
    got = match_plan(NAMES, {"blocks.*.attn.q_proj": "colwise", "head": "vocab_head"})
    assert got == {
        "blocks.0.attn.q_proj": ("blocks.*.attn.q_proj", "colwise"),
        "blocks.1.attn.q_proj": ("blocks.*.attn.q_proj", "colwise"),
        "head": ("head", "vocab_head"),
    }
    assert match_plan(NAMES, {"blocks.*": "parallel_input"}) == {
        "blocks.0": ("blocks.*", "parallel_input"),
        "blocks.1": ("blocks.*", "parallel_input"),
    }


def test_plan_errors_name_the_entry() -> None:
    with pytest.raises(ValueError, match=r"plan\['head'\] must be one of .*got str 'diagonal'"):
        match_plan(NAMES, {"head": "diagonal"})
    with pytest.raises(ValueError, match=r"\['blocks\.\*\.q_proj'\] match no submodule"):
        match_plan(NAMES, {"blocks.*.q_proj": "colwise"})
    with pytest.raises(
        ValueError, match=r"'blocks\.0\.attn\.q_proj' and 'blocks\.\*\.attn\.q_proj'"
    ):
        match_plan(NAMES, {"blocks.0.attn.q_proj": "colwise", "blocks.*.attn.q_proj": "rowwise"})


def test_validate_tp_names_the_values() -> None:
    validate_tp(CONFIG, 4)
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_head=4 \(each rank"):
        validate_tp(CONFIG, 3)
    with pytest.raises(ValueError, match=r"n_head=1 .* nor the MLP width 4\*n_embd=8 \(n_embd=2\)"):
        validate_tp(GPTConfig(65, 16, 1, 1, 2), 16)
    with pytest.raises(ValueError, match="tie_weights"):
        validate_tp(GPTConfig(65, 16, 1, 4, 32, tie_weights=True), 2)
    with pytest.raises(ValueError, match="vocab_size=3 is smaller than tp=4"):
        validate_tp(GPTConfig(3, 16, 1, 4, 32), 4)


def test_gpt_plan_styles_and_errors() -> None:
    plan = gpt_plan(CONFIG)
    assert plan["blocks.*.attn"] == plan["blocks.*.mlp"] == "parallel_input"
    assert {plan[f"blocks.*.attn.{p}_proj"] for p in "qkv"} == {"colwise"}
    assert plan["blocks.*.attn.out_proj"] == plan["blocks.*.mlp.fc2"] == "rowwise"
    assert plan["embed.tok_emb"] == "embedding" and plan["head"] == "vocab_head"
    gather = gpt_plan(GPT(CONFIG), loss="gather", vocab_parallel_embedding=False)
    assert gather["head"] == "colwise_gather" and "embed.tok_emb" not in gather
    with pytest.raises(ValueError, match="loss='all'"):
        gpt_plan(CONFIG, loss="all")
    with pytest.raises(ValueError, match="tp=8 does not divide n_head=4"):
        gpt_plan(CONFIG, tp=8)
    with pytest.raises(TypeError, match="GPT or GPTConfig"):
        gpt_plan(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_gpt_comm_counts_formula() -> None:
    # Forward: 2 per block + embedding g + the loss's MAX and SUM; backward: 2 per block + head f.
    assert gpt_comm_counts(CONFIG) == {
        "forward": {"all_reduce": 7},
        "backward": {"all_reduce": 5},
    }
    assert gpt_comm_counts(CONFIG, loss="gather", vocab_parallel_embedding=False) == {
        "forward": {"all_reduce": 4, "all_gather_into_tensor": 1},
        "backward": {"all_reduce": 5},
    }


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(65, (2, 16), generator=g), torch.randint(65, (2, 16), generator=g)


@pytest.mark.parametrize("loss", ["vocab_parallel", "gather"])
def test_tp1_parallel_gpt_equals_dense(loss: str) -> None:
    torch.manual_seed(0)
    dense = GPT(CONFIG)
    torch.manual_seed(0)
    par = parallelize_gpt(GPT(CONFIG), None, loss=loss)
    assert isinstance(par.blocks[0].attn.q_proj, ColumnParallelLinear)
    assert not par.blocks[0].attn.q_proj.sync_input_grad  # f applied once by "parallel_input"
    assert isinstance(par.blocks[1].mlp.fc2, RowParallelLinear)
    assert isinstance(par.embed.tok_emb, VocabParallelEmbedding)
    idx, targets = _tokens()
    want_logits, want = dense(idx, targets)
    logits, got = gpt_loss(par, idx, targets)
    assert torch.equal(logits, want_logits) and torch.equal(got, want)


def test_layers_draw_the_dense_init_and_from_dense_draws_nothing() -> None:
    torch.manual_seed(3)
    want = nn.Linear(6, 4), nn.Embedding(9, 3)
    torch.manual_seed(3)
    got = ColumnParallelLinear(6, 4, group=None), VocabParallelEmbedding(9, 3, group=None)
    assert torch.equal(got[0].weight, want[0].weight) and torch.equal(got[0].bias, want[0].bias)
    assert torch.equal(got[1].weight, want[1].weight)
    torch.manual_seed(3)
    row = RowParallelLinear(6, 4, group=None)
    assert torch.equal(row.weight, want[0].weight) and torch.equal(row.bias, want[0].bias)
    state = torch.get_rng_state()
    ColumnParallelLinear.from_dense(want[0], None)
    RowParallelLinear.from_dense(want[0], None)
    VocabParallelEmbedding.from_dense(want[1], None)
    assert torch.equal(torch.get_rng_state(), state)


def test_functional_ops_are_identity_on_one_rank() -> None:
    x = torch.randn(2, 3)
    for op in (copy_to_tp, reduce_from_tp, gather_from_tp, scatter_to_tp):
        assert op(x, None) is x


def test_cross_entropy_on_one_rank_is_f_cross_entropy() -> None:
    logits, targets = torch.randn(2, 5, 7), torch.randint(7, (2, 5))
    targets[0, 0] = -100
    want = nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    assert torch.equal(vocab_parallel_cross_entropy(logits, targets, None), want)
    with pytest.raises(ValueError, match="reduction='avg'"):
        vocab_parallel_cross_entropy(logits, targets, None, reduction="avg")
    with pytest.raises(ValueError, match=r"targets of shape \(2, 5\)"):
        vocab_parallel_cross_entropy(logits, targets[0], None)


def test_parallelize_module_rejects_wrong_types_and_leaves_the_model_untouched() -> None:
    model = GPT(CONFIG)
    before = model.blocks[0].attn.q_proj
    with pytest.raises(TypeError, match=r"'blocks\.\*\.ln_1' \(blocks\.0\.ln_1\).*nn\.Linear"):
        parallelize_module(
            model, {"blocks.*.attn.q_proj": "colwise", "blocks.*.ln_1": "colwise"}, None
        )
    assert model.blocks[0].attn.q_proj is before
    with pytest.raises(TypeError, match=r"'head'.*nn\.Embedding, got Linear"):
        parallelize_module(model, {"head": "embedding"}, None)


def test_parallel_input_needs_only_parallel_parameters_and_a_column_layer() -> None:
    model = GPT(CONFIG)
    with pytest.raises(ValueError, match=r"'blocks\.\*'.*'ln_1\.weight'"):
        parallelize_module(
            model, {"blocks.*": "parallel_input", "blocks.*.attn.q_proj": "colwise"}, None
        )
    with pytest.raises(ValueError, match="needs a column-parallel layer"):
        parallelize_module(
            model,
            {
                "blocks.*.mlp": "parallel_input",
                "blocks.*.mlp.fc1": "rowwise",
                "blocks.*.mlp.fc2": "rowwise",
            },
            None,
        )
    with pytest.raises(ValueError, match="nested"):
        parallelize_module(
            nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(2, 2)))),
            {"0": "parallel_input", "0.0": "parallel_input", "0.0.0": "colwise"},
            None,
        )
