"""A Hugging Face BERT classifier resumed from a mid-epoch save ends bit-identical (ddp, zero2).

The case of the report: ``BertForSequenceClassification`` (a small random-weight config, nothing
downloaded, dropout on) saved after step 2 of epoch 1 and resumed in a fresh ``Job``, which
used to differ from the uninterrupted run in every tensor.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.testing import run_distributed

pytest.importorskip("transformers")

EPOCHS, BATCH, PER_EPOCH = 2, 2, 4  # batches per rank and epoch
SAVE_AT = (1, 2)  # (epoch, step in it): mid-epoch


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Dict samples, as a tokenized Hugging Face dataset in torch format gives them."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 64, (n, 12), generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.ones_like(self.ids[i])
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.labels[i]}


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def _run(strategy: str, ckpt: Path, keep: Path | None) -> dict[str, Any]:
    job = phalanx.Job(strategy, checkpoint_dir=ckpt, straggler_check_every=0)
    model = _bert()
    model, _ = job.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = job.loader(_Tokens(PER_EPOCH * BATCH * job.world.world_size), batch_size=BATCH)
    losses = []
    for epoch in job.epochs(EPOCHS):
        for step, batch in enumerate(job.progress(loader), 1):
            loss = model(**batch).loss
            job.backward(loss)
            job.step()
            losses.append(job.log(loss=float(loss))["loss"])
            if keep is not None and (epoch, step) == SAVE_AT:
                path = job.save(note="mid-epoch")
                if job.world.is_main:
                    phalanx.checkpoint.wait()  # committed: copy it
                    shutil.copytree(path, keep / path.name)
    final = job.save()
    phalanx.checkpoint.wait()
    files = json.loads((final / "manifest.json").read_text())["files"]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    out = {"losses": losses, "params": digest.hexdigest(), "files": files}
    out["extra"] = job.resumed_extra
    job.close()
    return out


def _both(root: str) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    out = {}
    for strategy in ("ddp", "zero2"):
        base = Path(root) / strategy
        ref = _run(strategy, base / "ref", base / "saved")
        dist.barrier()  # rank 0 has copied the mid-epoch checkpoint
        out[strategy] = {"ref": ref, "resumed": _run(strategy, base / "saved", None)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_both, str(tmp_path_factory.mktemp("bert")), timeout=300)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_bert_resumed_mid_epoch_is_bitwise_identical(
    strategy: str, results: list[dict[str, Any]]
) -> None:
    for rank, by_strategy in enumerate(results):
        ref, resumed = by_strategy[strategy]["ref"], by_strategy[strategy]["resumed"]
        done = (SAVE_AT[0] * PER_EPOCH) + SAVE_AT[1]  # steps trained before the save
        assert resumed["losses"] == ref["losses"][done:], f"rank {rank}"
        assert resumed["params"] == ref["params"], f"rank {rank}: parameters differ"
        assert resumed["files"] == ref["files"], f"rank {rank}: final checkpoints differ"
        assert resumed["extra"] == {"note": "mid-epoch"}
