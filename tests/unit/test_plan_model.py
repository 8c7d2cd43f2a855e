"""`phalanx plan SCRIPT`: the plan's prediction against a real training step, measurements
of Ψ and activations, size parsing and the recommendation."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from phalanx import cli
from phalanx.plan import estimate, memory_report
from phalanx.plan.fit import parse_size, recommend
from phalanx.plan.measure import activation_bytes, load_script, parameter_count

ROOT = Path(__file__).resolve().parents[2]
CHAR_GPT = ROOT / "examples" / "char_gpt.py"


@pytest.fixture(scope="module")
def char_gpt() -> dict[str, Any]:
    return runpy.run_path(str(CHAR_GPT), run_name="not_main")


def test_fp32_adamw_step_matches_the_plan_for_dp_1(char_gpt: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = char_gpt["build_model"]()
    x, y = char_gpt["example_batch"](2)
    opt = char_gpt["make_optimizer"](
        model.parameters(), 1e-3
    )  # the example's AdamW, two parameter groups
    model(x, y)[1].backward()
    opt.step()
    measured = memory_report(model, opt)
    psi = parameter_count(model)
    ddp = next(r for r in estimate(psi, 1, "adam", "fp32") if r.strategy == "ddp")
    for name in ("params", "grads", "optimizer"):
        predicted, got = getattr(ddp, name), getattr(measured, name)
        assert abs(got - predicted) <= 0.05 * predicted, (name, got, predicted)
    # exact: 4Ψ each; AdamW adds one 0-dim fp32 `step` per parameter tensor to its 8Ψ
    assert (measured.params, measured.grads) == (4 * psi, 4 * psi)
    assert measured.optimizer == 8 * psi + 4 * len(list(model.parameters()))


def test_dp_4_formulas_with_the_measured_psi(char_gpt: dict[str, Any]) -> None:
    psi = parameter_count(char_gpt["build_model"]())
    rows = {r.strategy: r for r in estimate(psi, 4, "adam", "fp32")}
    assert rows["ddp"].total == 16 * psi
    assert (rows["zero1"].params, rows["zero1"].grads, rows["zero1"].optimizer) == (
        4 * psi,
        4 * psi,
        8 * psi / 4,
    )
    assert (rows["zero2"].grads, rows["zero2"].optimizer) == (4 * psi / 4, 8 * psi / 4)
    assert rows["zero3"].total == 16 * psi / 4


def test_activations_of_a_linear_layer_are_its_input() -> None:
    layer = nn.Linear(8, 3)  # addmm saves its input and weight.t() (a parameter: excluded)
    x = torch.randn(5, 8)
    assert activation_bytes(layer, (x,)) == 5 * 8 * 4
    relu_net = nn.Sequential(nn.Linear(8, 3), nn.ReLU())  # ReLU also saves its (5, 3) output
    assert activation_bytes(relu_net, (x,)) == 5 * 8 * 4 + 5 * 3 * 4
    # a loss_fn runs inside the measurement: exp saves its result, one more (5, 3) tensor
    assert activation_bytes(layer, (x,), lambda out, _: out.exp().sum()) == 160 + 60
    layer.eval()
    activation_bytes(layer, (x,))
    assert not layer.training  # the mode is restored


def test_tied_weights_counted_once_in_psi() -> None:
    emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    assert parameter_count(nn.ModuleList([emb, head])) == 15


def test_parse_size() -> None:
    assert parse_size("16GB") == 16 * 10**9
    assert parse_size("16GiB") == 16 * 2**30
    assert parse_size("512mb") == 512 * 10**6
    assert parse_size("1.5e9") == 1_500_000_000
    assert parse_size("4096") == 4096
    for bad in ("16XB", "GB", "-1GB", "0", ""):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_recommend_prefers_least_communication_that_fits() -> None:
    # totals: ddp 16, zero1 5.5, zero2 3.75, zero3 2 GB
    rows = estimate(1e9, 8, "adam", "fp16-master")
    act = 1e9
    assert recommend(rows, act, 20e9).strategy == "ddp"
    assert recommend(rows, act, 10e9).strategy == "zero1"
    assert recommend(rows, act, 5e9).strategy == "zero2"
    fit = recommend(list(reversed(rows)), act, 4e9)
    assert (fit.strategy, fit.needed, fit.shortfall) == ("zero3", 3e9, 0.0)
    miss = recommend(rows, act, 2.5e9)
    assert (miss.strategy, miss.smallest, miss.needed, miss.shortfall) == (
        None,
        "zero3",
        3e9,
        0.5e9,
    )
    with pytest.raises(ValueError, match="budget must be positive"):
        recommend(rows, act, 0)


def test_script_protocol_does_not_run_main(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(4, 2)\n"
        "def example_batch(n):\n    return (torch.zeros(n, 4),)\n"
        "if __name__ == '__main__':\n    raise SystemExit('main ran')\n"
    )
    loaded = load_script(script)
    assert loaded.loss_fn is None
    assert activation_bytes(loaded.build_model(), loaded.example_batch(3)) == 3 * 4 * 4
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"must define build_model\(\) and example_batch\(\)"):
        load_script(tmp_path / "empty.py")
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        load_script(tmp_path / "nope.py")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [str(CHAR_GPT), "--batch-size", "2", "--device-memory", "16XB"],
            "argument --device-memory: '16XB' is not a size",
        ),
        ([str(CHAR_GPT)], "needs --batch-size"),
        (["--params", "1e6", "--batch-size", "2"], "--batch-size needs a script"),
        ([str(CHAR_GPT), "--params", "1e6"], "either a script or --params"),
        ([], "either a script or --params"),
    ],
)
def test_cli_errors_name_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_table_for_a_script(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(CHAR_GPT), "--batch-size", "2", "--dp", "2", "--device-memory", "1MB"]
    assert cli.main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "holds for backward" in out and "excluding temporaries" in out
    assert "nothing fits in 1.0 MB per device: the smallest, zero3" in out
    assert [line.split()[0] for line in out.splitlines()[4:8]] == ["ddp", "zero1", "zero2", "zero3"]
