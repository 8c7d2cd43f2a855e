"""Tensor parallel on gloo ranks: every layer, the loss and a whole GPT equal their dense twins.

Two jobs (tp=2 on 2 ranks; tp=4 and two tp=2 subgroups on 4 ranks) each run every check and
return ``(parallel, dense)`` tensor pairs; the tests below compare them. The dense reference is
computed in the same worker from the same seed, so both sides see identical inputs.

Tolerances:
- Outputs, input gradients, losses: the parallel layer splits each dot product over ranks and
  sums the pieces with an all-reduce, a different association than one matmul, so float32 agrees
  to a few ulps: ``assert_close``'s float32 defaults (rtol 1.3e-6, atol 1e-5).
- A layer's weight and bias gradients (``_assert_tight``): the shard is computed from the very
  same numbers as the dense slice (``grad_out[..., rows]^T @ x`` against the rows of
  ``grad_out^T @ x``: the same dot products over the same batch elements). Weight gradients come
  out bit-identical here; a bias gradient is a column sum that a narrower matrix may vectorise
  in another order. Allowed: 2 ulps at the tensor's largest magnitude, no relative slack.
- After optimizer steps: SGD stays within 1e-6 (observed ~2e-8). AdamW divides by sqrt(v), so
  an element whose gradient is near zero moves by a ratio of two tiny numbers; few-ulp gradient
  differences then shift it by a small fraction of lr (observed 6e-6 at lr 1e-2): atol 5e-5,
  0.5% of one step. ``eps=1e-6`` because attention's k_proj bias has an exactly-zero gradient
  (softmax ignores a shift shared by all keys) that is rounding noise in both models; with the
  default 1e-8 Adam would turn that noise into lr-sized steps of either sign.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.models import GPT, Block, GPTConfig
from phalanx.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tp,
    gpt_comm_counts,
    gpt_loss,
    gpt_plan,
    parallelize_gpt,
    parallelize_module,
    scatter_to_tp,
    shard_sizes,
    vocab_parallel_cross_entropy,
)
from phalanx.testing import run_distributed

STEPS_TOL = {"sgd": {"rtol": 1.3e-6, "atol": 1e-6}, "adamw": {"rtol": 0.0, "atol": 5e-5}}
CONFIG = GPTConfig(65, 16, 2, 4, 32)
Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _tp_group(size: int) -> Any:
    """Split the world into groups of ``size`` consecutive ranks; return this rank's group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    return groups[rank // size]


def _grads(y: torch.Tensor, inputs: list[torch.Tensor], gy: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(y, inputs, gy))


def _sliced(model: nn.Module, name: str, dense: torch.Tensor) -> torch.Tensor:
    """The part of a dense tensor (parameter or gradient) that parameter ``name`` holds."""
    owner, _, kind = name.rpartition(".")
    layer = model.get_submodule(owner)
    if isinstance(layer, ColumnParallelLinear):
        return dense[layer.start : layer.start + layer.weight.shape[0]]
    if isinstance(layer, RowParallelLinear) and kind == "weight":
        return dense[:, layer.start : layer.start + layer.weight.shape[1]]
    if isinstance(layer, VocabParallelEmbedding):
        return dense[layer.start : layer.end]
    return dense


def _linear_checks(group: Any, seed: int) -> dict[str, Pairs]:
    torch.manual_seed(seed)
    dense_c, dense_r = nn.Linear(8, 6), nn.Linear(8, 6)
    g = torch.Generator().manual_seed(seed)
    x, gy = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 6, generator=g)
    xd = x.clone().requires_grad_()
    close: Pairs = {}
    tight: Pairs = {}
    # Column, output sharded: this rank's output columns and their gradient.
    y = dense_c(xd)
    dx, dw, db = _grads(y, [xd, dense_c.weight, dense_c.bias], gy)
    col = ColumnParallelLinear.from_dense(dense_c, group)
    rows = slice(col.start, col.start + col.weight.shape[0])
    xc = x.clone().requires_grad_()
    yc = col(xc)
    yc.backward(gy[..., rows])
    close |= {"col.out": (yc, y[..., rows]), "col.x_grad": (xc.grad, dx)}
    tight |= {"col.w_grad": (col.weight.grad, dw[rows]), "col.b_grad": (col.bias.grad, db[rows])}
    # Column, output gathered.
    colg = ColumnParallelLinear.from_dense(dense_c, group, gather_output=True)
    xg = x.clone().requires_grad_()
    yg = colg(xg)
    yg.backward(gy)
    close |= {"colg.out": (yg, y), "colg.x_grad": (xg.grad, dx)}
    tight |= {"colg.w_grad": (colg.weight.grad, dw[rows])}
    # Row, input scattered from the full x (scatter's backward all-gathers x's gradient).
    y = dense_r(xd)
    dx, dw, db = _grads(y, [xd, dense_r.weight, dense_r.bias], gy)
    row = RowParallelLinear.from_dense(dense_r, group)
    cols = slice(row.start, row.start + row.weight.shape[1])
    xr = x.clone().requires_grad_()
    yr = row(scatter_to_tp(xr, group))
    yr.backward(gy)
    close |= {"row.out": (yr, y), "row.x_grad": (xr.grad, dx), "row.b_grad": (row.bias.grad, db)}
    tight |= {"row.w_grad": (row.weight.grad, dw[:, cols])}
    return {"close": close, "tight": tight}


def _vocab_checks(group: Any, vocab: int) -> dict[str, Any]:
    torch.manual_seed(1)
    dense = nn.Embedding(vocab, 4)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(vocab, (3, 7), generator=g)
    ids[0, :3] = torch.tensor([0, vocab // 2, vocab - 1])
    gy = torch.randn(3, 7, 4, generator=g)
    emb = VocabParallelEmbedding.from_dense(dense, group)
    y = emb(ids)
    y.backward(gy)
    (dw,) = _grads(dense(ids), [dense.weight], gy)
    close: Pairs = {"emb.out": (y, dense(ids))}
    tight: Pairs = {"emb.w_grad": (emb.weight.grad, dw[emb.start : emb.end])}
    logits = 3 * torch.randn(3, 7, vocab, generator=g)
    targets = torch.randint(vocab, (3, 7), generator=g)
    targets[0, 0], targets[1, :2] = -100, torch.tensor([0, vocab - 1])
    weights = torch.rand(3, 7, generator=g)  # a gradient for reduction="none"
    for reduction in ("mean", "sum", "none"):
        full, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        local = scatter_to_tp(full, group)  # uneven shards as shard_sizes lays them out
        ours = vocab_parallel_cross_entropy(
            local, targets, group, vocab_size=vocab, reduction=reduction
        )
        want = F.cross_entropy(ref.reshape(-1, vocab), targets.reshape(-1), reduction=reduction)
        want = want.reshape(targets.shape) if reduction == "none" else want
        (ours * weights if reduction == "none" else ours).sum().backward()
        (want * weights if reduction == "none" else want).sum().backward()
        close |= {f"ce.{reduction}": (ours, want), f"ce.{reduction}.grad": (full.grad, ref.grad)}
    leaf = scatter_to_tp(logits, group).requires_grad_()
    phalanx.reset_comm_stats()
    loss = vocab_parallel_cross_entropy(leaf, targets, group, vocab_size=vocab)
    forward = phalanx.comm_stats()
    phalanx.reset_comm_stats()
    loss.backward()
    counts = {"ce.forward": forward, "ce.backward": phalanx.comm_stats()}
    return {"close": close, "tight": tight, "counts": counts}


def _functional_and_errors(group: Any) -> dict[str, Any]:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = shard_sizes(5, tp)
    full = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    start = sum(sizes[:rank])
    local = full[:, start : start + sizes[rank]].clone().requires_grad_()
    gathered = gather_from_tp(local, group, dim=1, sizes=sizes)
    gathered.backward(full)
    errors = {}
    for key, build in {
        "column": lambda: ColumnParallelLinear(4, 2 * tp + 1, group=group),
        "row": lambda: RowParallelLinear(2 * tp + 1, 4, group=group),
        "plan": lambda: parallelize_module(
            nn.Sequential(nn.Linear(4, tp + 1)), {"0": "colwise"}, group
        ),
        "even_ce": lambda: vocab_parallel_cross_entropy(
            torch.zeros(2, sizes[rank]), torch.zeros(2, dtype=torch.long), group
        ),
    }.items():
        try:
            build()
        except ValueError as exc:
            errors[key] = str(exc)
    close = {
        "gather.out": (gathered, full),
        "gather.grad": (local.grad, full[:, start:][:, : sizes[rank]]),
    }
    return {"close": close, "errors": errors}


def _block_counts(group: Any, f_once: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    block = Block(CONFIG)
    plan = {k.removeprefix("blocks.*."): v for k, v in gpt_plan(CONFIG).items() if "*" in k}
    if not f_once:  # each of q/k/v (and fc1) applies its own f
        plan = {k: v for k, v in plan.items() if v != "parallel_input"}
    parallelize_module(block, plan, group)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    phalanx.reset_comm_stats()
    y = block(x)
    forward = phalanx.comm_stats()
    phalanx.reset_comm_stats()
    y.backward(torch.ones_like(y))
    return {"forward": forward, "backward": phalanx.comm_stats()}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randint(65, (3, 16), generator=g), torch.randint(65, (3, 16), generator=g)


def _twins(group: Any, loss: str) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    dense = GPT(CONFIG)
    torch.manual_seed(0)
    return dense, parallelize_gpt(GPT(CONFIG), group, loss=loss)


def _gpt_checks(group: Any, loss: str) -> dict[str, Any]:
    dense, par = _twins(group, loss)
    idx, targets = _batch(0)
    logits_d, loss_d = dense(idx, targets)
    assert loss_d is not None
    loss_d.backward()
    phalanx.reset_comm_stats()
    logits, ce = gpt_loss(par, idx, targets)
    forward = phalanx.comm_stats()
    phalanx.reset_comm_stats()
    ce.backward()
    counts = {"forward": forward, "backward": phalanx.comm_stats()}
    want_logits = logits_d
    if loss == "vocab_parallel":  # this rank's vocabulary columns
        want_logits = _sliced(par, "head.weight", logits_d.transpose(0, -1)).transpose(0, -1)
    close: Pairs = {"loss": (ce, loss_d), "logits": (logits, want_logits)}
    dense_params = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        close[f"grad.{name}"] = (p.grad, _sliced(par, name, dense_params[name].grad))
    return {"close": close, "counts": counts}


def _gpt_steps(group: Any, loss: str, steps: int = 3) -> Pairs:
    out: Pairs = {}
    for name, make in {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-6),
    }.items():
        dense, par = _twins(group, loss)
        opts = make(dense.parameters()), make(par.parameters())
        for step in range(steps):
            idx, targets = _batch(step)
            for model, opt in zip((dense, par), opts):
                opt.zero_grad()
                gpt_loss(model, idx, targets)[1].backward()
                opt.step()
        dense_params = dict(dense.named_parameters())
        for pname, p in par.named_parameters():
            out[f"{name}.{pname}"] = (p.detach(), _sliced(par, pname, dense_params[pname].detach()))
    return out


def _job_tp2() -> dict[str, Any]:
    group = _tp_group(2)
    res = {
        "linear": _linear_checks(group, seed=0),
        "vocab": _vocab_checks(group, 65),
        "vocab_even": _vocab_checks(group, 64),
        "functional": _functional_and_errors(group),
        "block_f_once": _block_counts(group, f_once=True),
        "block_f_each": _block_counts(group, f_once=False),
        "steps": _gpt_steps(group, "vocab_parallel"),
    }
    for loss in ("vocab_parallel", "gather"):
        res[f"gpt_{loss}"] = _gpt_checks(group, loss)
    return res


def _job_world4() -> dict[str, Any]:
    pair = _tp_group(2)  # two independent tp=2 groups, different data on each
    res = {"pair_linear": _linear_checks(pair, seed=100 + dist.get_rank() // 2)}
    group = _tp_group(4)
    res |= {
        "vocab": _vocab_checks(group, 65),
        "functional": _functional_and_errors(group),
        "gpt_vocab_parallel": _gpt_checks(group, "vocab_parallel"),
    }
    return res


@pytest.fixture(scope="module")
def tp2() -> list[dict[str, Any]]:
    return run_distributed(_job_tp2, world_size=2, timeout=120)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    return run_distributed(_job_world4, world_size=4, timeout=180)


def _assert_pairs(pairs: Pairs, **tol: float) -> None:
    for name, (got, want) in pairs.items():
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, msg=lambda m, n=name: f"{n}: {m}", **tol)


def _assert_tight(pairs: Pairs) -> None:
    for name, (got, want) in pairs.items():
        ulp2 = 2 * torch.finfo(want.dtype).eps * float(want.abs().max())
        torch.testing.assert_close(
            got, want, rtol=0.0, atol=ulp2, msg=lambda m, n=name: f"{n}: {m}"
        )


def _check(results: list[dict[str, Any]], key: str) -> None:
    for res in results:
        _assert_pairs(res[key]["close"])
        _assert_tight(res[key].get("tight", {}))


def test_column_and_row_parallel_linear_match_dense(tp2: list[dict[str, Any]]) -> None:
    _check(tp2, "linear")


def test_uneven_vocab_embedding_and_cross_entropy_match_dense(tp2: list[dict[str, Any]]) -> None:
    _check(tp2, "vocab")  # 65 = 33 + 32
    _check(tp2, "vocab_even")  # 64 = 32 + 32
    for res in tp2:
        # MAX of the row maxima, then one SUM of exp-sums and target logits; backward is local.
        assert res["vocab"]["counts"]["ce.forward"] == {
            "all_reduce": (2, 3 * 7 * 4 + 2 * 3 * 7 * 4)
        }
        assert res["vocab"]["counts"]["ce.backward"] == {}


def test_uneven_gather_and_errors_name_the_values(tp2: list[dict[str, Any]]) -> None:
    _check(tp2, "functional")
    errors = tp2[0]["functional"]["errors"]
    assert "ColumnParallelLinear" in errors["column"] and "out_features=5" in errors["column"]
    assert "tp=2" in errors["column"]
    assert "RowParallelLinear" in errors["row"] and "in_features=5" in errors["row"]
    assert "'0'" in errors["plan"] and "out_features=3" in errors["plan"]
    assert "vocab_size=" in errors["even_ce"] and "from 2 to 3 columns" in errors["even_ce"]


def test_block_issues_two_all_reduces_forward_and_two_backward(tp2: list[dict[str, Any]]) -> None:
    for res in tp2:
        assert res["block_f_once"]["forward"]["all_reduce"][0] == 2  # g after out_proj, fc2
        assert res["block_f_once"]["backward"]["all_reduce"][0] == 2  # f before attn, mlp
        # Without "parallel_input", q, k, v and fc1 each all-reduce the input gradient.
        assert res["block_f_each"]["backward"]["all_reduce"][0] == 4


@pytest.mark.parametrize("loss", ["vocab_parallel", "gather"])
def test_gpt_matches_dense_loss_logits_and_every_gradient(
    tp2: list[dict[str, Any]], loss: str
) -> None:
    _check(tp2, f"gpt_{loss}")
    want = gpt_comm_counts(CONFIG, loss=loss)  # 2L+1(+2 | all-gather) forward, 2L+1 backward
    for res in tp2:
        counts = res[f"gpt_{loss}"]["counts"]
        for phase in ("forward", "backward"):
            assert {op: n for op, (n, _) in counts[phase].items()} == want[phase]


def test_gpt_sgd_and_adamw_steps_stay_equal(tp2: list[dict[str, Any]]) -> None:
    for res in tp2:
        for opt in ("sgd", "adamw"):
            pairs = {k: v for k, v in res["steps"].items() if k.startswith(opt + ".")}
            assert len(pairs) == len(list(GPT(CONFIG).parameters()))
            _assert_pairs(pairs, **STEPS_TOL[opt])


def test_tp4_uneven_vocab_gpt_and_independent_subgroups(world4: list[dict[str, Any]]) -> None:
    _check(world4, "vocab")  # 65 = 17 + 16 + 16 + 16
    _check(world4, "functional")
    _check(world4, "gpt_vocab_parallel")
    _check(world4, "pair_linear")  # each tp=2 subgroup sums only its own ranks
    want = gpt_comm_counts(CONFIG)
    for res in world4:
        counts = res["gpt_vocab_parallel"]["counts"]
        assert {op: n for op, (n, _) in counts["forward"].items()} == want["forward"]
    assert "tp=4" in world4[0]["functional"]["errors"]["column"]
