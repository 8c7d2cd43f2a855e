"""The GPT workload and the bundled character corpus: shapes, causality, stages, data windows."""

from __future__ import annotations

import math
from importlib.resources import files

import pytest
import torch

from phalanx.datasets import char_corpus, random_windows
from phalanx.models import GPT, GPTConfig, gpt_as_sequential

VOCAB = 65


def tiny(**overrides: object) -> GPT:
    torch.manual_seed(0)
    fields: dict = dict(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return GPT(GPTConfig(**{**fields, **overrides}))


def tokens(b: int = 3, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_initial_loss() -> None:
    model = tiny()
    idx = tokens()
    logits, loss = model(idx)
    assert logits.shape == (3, 16, VOCAB) and loss is None
    _, loss = model(idx, tokens(seed=2))
    assert loss is not None and abs(loss.item() - math.log(VOCAB)) < 0.3


def test_standard_names_for_tensor_parallel_plans() -> None:
    names = {n for n, _ in tiny().named_parameters()}
    for leaf in (
        "attn.q_proj",
        "attn.k_proj",
        "attn.v_proj",
        "attn.out_proj",
        "mlp.fc1",
        "mlp.fc2",
    ):
        assert f"blocks.1.{leaf}.weight" in names and f"blocks.1.{leaf}.bias" in names
    assert {"embed.tok_emb.weight", "embed.pos_emb.weight", "ln_f.weight", "head.weight"} <= names


def test_gpt2_init_scales_residual_projections() -> None:
    model = tiny(n_layer=8, n_embd=256)
    block = model.blocks[0]
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.fc2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(16)
    assert block.attn.q_proj.bias.abs().max().item() == 0.0


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    model = tiny().eval()
    idx = tokens()
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % VOCAB
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sequential_stages_equal_the_model() -> None:
    model = tiny().eval()
    idx = tokens()
    seq = gpt_as_sequential(model)
    assert len(seq) == 2 + 2  # embedding, 2 blocks, final norm + head
    torch.testing.assert_close(seq(idx), model(idx)[0], rtol=0, atol=0)
    stage_params = {id(p) for stage in model.stages() for p in stage.parameters()}
    assert stage_params == {id(p) for p in model.parameters()}


def test_tied_weights_share_one_parameter() -> None:
    untied, tied = tiny(), tiny(tie_weights=True)
    assert tied.head.weight is tied.embed.tok_emb.weight
    assert untied.num_parameters() - tied.num_parameters() == VOCAB * 32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_embd": 30}, "n_embd=30 is not divisible by n_head=4"),
        ({"n_layer": 0}, "GPTConfig.n_layer must be a positive int, got 0"),
        ({"vocab_size": -1}, "GPTConfig.vocab_size"),
        ({"dropout": 1.0}, "GPTConfig.dropout"),
    ],
)
def test_config_validation_names_the_field(overrides: dict, message: str) -> None:
    fields = dict(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32)
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**fields, **overrides})


def test_forward_rejects_too_long_sequences() -> None:
    with pytest.raises(ValueError, match="17 exceeds block_size=16"):
        tiny()(tokens(t=17))


def test_generate_is_deterministic_with_a_generator() -> None:
    model = tiny().eval()
    prompt = tokens(b=2, t=3)

    def run(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 20, temperature=0.8, top_k=5, generator=g)

    out = run(0)
    assert out.shape == (2, 23) and torch.equal(out[:, :3], prompt)
    assert torch.equal(out, run(0)) and not torch.equal(out, run(1))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 1, temperature=0.0)


def test_corpus_round_trip_and_size() -> None:
    resource = files("phalanx.datasets") / "shakespeare.txt"
    assert len(resource.read_bytes()) <= 1_000_000
    corpus = char_corpus()
    assert corpus.vocab_size == VOCAB and list(corpus.vocab) == sorted(corpus.vocab)
    assert corpus.text.startswith("First Citizen:")
    head = corpus.text[:500]
    assert corpus.decode(corpus.encode(head)) == head
    assert corpus.decode(corpus.encode(head).tolist()) == head
    assert corpus.data.dtype == torch.int64 and corpus.data.numel() == len(corpus.text)
    train, val = corpus.split(0.9)
    assert train.numel() + val.numel() == corpus.data.numel()
    with pytest.raises(ValueError, match="'€' is not in the corpus vocabulary"):
        corpus.encode("ab€")
    with pytest.raises(ValueError, match="name='missing'"):
        char_corpus("missing")


def test_random_windows_are_deterministic_and_shifted() -> None:
    data = torch.arange(1000)
    x, y = random_windows(data, 8, 4, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (4, 8)
    torch.testing.assert_close(y, x + 1)  # data[i] == i, so the next token is x + 1
    torch.testing.assert_close(x[:, 1:], x[:, :1] + torch.arange(1, 8))  # contiguous windows
    x2, _ = random_windows(data, 8, 4, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="block_size=8"):
        random_windows(torch.arange(8), 8, 4, torch.Generator())


def test_forward_with_targets_refuses_a_vocabulary_shard_instead_of_a_wrong_loss() -> None:
    model = GPT(GPTConfig(65, 8, 1, 2, 16))
    model.head = torch.nn.Linear(16, 33, bias=False)  # what a tp=2 "vocab_head" holds
    idx = torch.zeros(1, 4, dtype=torch.long)
    assert model(idx)[0].shape[-1] == 33  # logits alone are fine
    with pytest.raises(ValueError, match=r"33 of vocab_size=65 logits.*gpt_loss"):
        model(idx, idx)
