"""Tensor parallelism for :class:`phalanx.models.GPT`: the plan, its checks, its loss.

Per block (Megatron-LM, Shoeybi et al., 2019, Fig. 3): attention's ``q/k/v_proj`` are
column-parallel behind one f (``"parallel_input"`` on ``attn``), so each rank runs
``n_head / tp`` whole heads -- attention infers its local head count from ``q_proj``'s width --
and ``out_proj`` is row-parallel; the MLP's ``fc1`` is column-parallel behind one f and ``fc2``
row-parallel. That is one all-reduce forward (g) and one backward (f) for attention and for the
MLP. The token embedding may be vocabulary-parallel, and the head either keeps its logits
sharded on the vocabulary (``loss="vocab_parallel"``: pair with
:func:`~phalanx.tensor_parallel.loss.vocab_parallel_cross_entropy`, or call :func:`gpt_loss`)
or all-gathers them (``loss="gather"``: ``model(idx, targets)`` then works unchanged, at the
cost of every rank holding all ``V`` logits).

Dropout: activations outside the sharded regions (embeddings, residual branches after g) are
replicated, so every rank of the tensor-parallel group must draw the same dropout mask there:
seed all of them identically (``torch.manual_seed`` with one seed per tensor-parallel group).
Dropout on the attention weights of a rank's own heads may then repeat the same pattern on each
rank's heads; Megatron draws those from a separate per-rank generator. Parity tests use
``dropout=0``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.models.gpt import GPT, GPTConfig
from phalanx.tensor_parallel.functional import tp_size
from phalanx.tensor_parallel.layers import ColumnParallelLinear
from phalanx.tensor_parallel.loss import vocab_parallel_cross_entropy
from phalanx.tensor_parallel.plan import parallelize_module

__all__ = ["LOSSES", "gpt_comm_counts", "gpt_loss", "gpt_plan", "parallelize_gpt", "validate_tp"]

Group = dist.ProcessGroup | None
LOSSES = ("vocab_parallel", "gather")


def validate_tp(config: GPTConfig, tp: int) -> None:
    """Raise ``ValueError`` naming the values if ``config`` cannot be split over ``tp`` ranks."""
    if tp < 1:
        raise ValueError(f"tensor parallel: tp must be >= 1, got tp={tp}")
    problems = []
    if config.n_head % tp:
        problems.append(f"n_head={config.n_head} (each rank runs whole attention heads)")
    if (4 * config.n_embd) % tp:
        problems.append(f"the MLP width 4*n_embd={4 * config.n_embd} (n_embd={config.n_embd})")
    if problems:
        raise ValueError(f"tensor parallel: tp={tp} does not divide {' nor '.join(problems)}")
    if config.vocab_size < tp:
        raise ValueError(
            f"tensor parallel: vocab_size={config.vocab_size} is smaller than "
            f"tp={tp}; every rank needs at least one row"
        )
    if config.tie_weights:
        raise ValueError(
            "tensor parallel: tie_weights=True is not supported (the head and the "
            "token embedding would be sharded into two separate parameters)"
        )


def _config(model_or_config: GPT | GPTConfig) -> GPTConfig:
    if isinstance(model_or_config, GPTConfig):
        return model_or_config
    if isinstance(model_or_config, GPT):
        return model_or_config.config
    raise TypeError(f"gpt_plan: expected a GPT or GPTConfig, got {type(model_or_config).__name__}")


def gpt_plan(
    model_or_config: GPT | GPTConfig,
    *,
    loss: str = "vocab_parallel",
    vocab_parallel_embedding: bool = True,
    tp: int | None = None,
) -> dict[str, str]:
    """The tensor-parallel plan of a GPT, for :func:`~phalanx.tensor_parallel.parallelize_module`.

    Args:
        model_or_config: The model or its config.
        loss: ``"vocab_parallel"`` (head logits stay sharded; use :func:`gpt_loss`) or
            ``"gather"`` (head all-gathers the logits; ``model(idx, targets)`` works as is).
        vocab_parallel_embedding: Shard the token embedding's rows; else it stays replicated.
        tp: When given, :func:`validate_tp` checks the config against it.
    """
    config = _config(model_or_config)
    if loss not in LOSSES:
        raise ValueError(f"gpt_plan: loss={loss!r} is not one of {', '.join(LOSSES)}")
    if tp is not None:
        validate_tp(config, tp)
    plan = {"embed.tok_emb": "embedding"} if vocab_parallel_embedding else {}
    plan.update(
        {
            "blocks.*.attn": "parallel_input",  # one f for q, k and v
            "blocks.*.attn.q_proj": "colwise",
            "blocks.*.attn.k_proj": "colwise",
            "blocks.*.attn.v_proj": "colwise",
            "blocks.*.attn.out_proj": "rowwise",
            "blocks.*.mlp": "parallel_input",
            "blocks.*.mlp.fc1": "colwise",
            "blocks.*.mlp.fc2": "rowwise",
            "head": "vocab_head" if loss == "vocab_parallel" else "colwise_gather",
        }
    )
    return plan


def parallelize_gpt(
    model: GPT, group: Group, *, loss: str = "vocab_parallel", vocab_parallel_embedding: bool = True
) -> GPT:
    """Validate ``model`` against the group size and apply :func:`gpt_plan` in place."""
    plan = gpt_plan(
        model, loss=loss, vocab_parallel_embedding=vocab_parallel_embedding, tp=tp_size(group)
    )
    parallelize_module(model, plan, group)
    return model


def gpt_loss(
    model: GPT, idx: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, mean cross-entropy)`` for a dense or tensor-parallel GPT.

    With a ``"vocab_head"`` head the logits are this rank's vocabulary shard and the loss is
    :func:`~phalanx.tensor_parallel.loss.vocab_parallel_cross_entropy`; ``GPT.forward``'s own
    ``F.cross_entropy`` would be wrong on them. Otherwise this is ``model(idx, targets)``.
    """
    head = model.head
    if isinstance(head, ColumnParallelLinear) and not head.gather_output:
        logits, _ = model(idx)
        ce = vocab_parallel_cross_entropy(logits, targets, head.group, vocab_size=head.out_features)
        return logits, ce
    logits, ce_or_none = model(idx, targets)
    assert ce_or_none is not None
    return logits, ce_or_none


def gpt_comm_counts(
    config: GPTConfig, *, loss: str = "vocab_parallel", vocab_parallel_embedding: bool = True
) -> dict[str, dict[str, Any]]:
    """Collectives one training step of a tensor-parallel GPT issues, forward and backward.

    Per block 2 all-reduces forward (g after ``out_proj`` and ``fc2``) and 2 backward (f before
    attention and the MLP). Forward adds 1 for a vocabulary-parallel embedding (its g) and
    either 2 for the vocabulary-parallel loss (MAX, then the fused SUM) or 1 all-gather of the
    logits; backward adds 1 (the head's f). Computed with :func:`gpt_loss`; tp > 1.
    """
    if loss not in LOSSES:
        raise ValueError(f"gpt_comm_counts: loss={loss!r} is not one of {', '.join(LOSSES)}")
    fwd = (
        2 * config.n_layer + int(vocab_parallel_embedding) + (2 if loss == "vocab_parallel" else 0)
    )
    forward: dict[str, int] = {"all_reduce": fwd}
    if loss == "gather":
        forward["all_gather_into_tensor"] = 1
    return {"forward": forward, "backward": {"all_reduce": 2 * config.n_layer + 1}}
