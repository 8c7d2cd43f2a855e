"""Small data sets for examples, tests and benchmarks: a text corpus that ships with phalanx, and
scikit-learn's digits.

``shakespeare.txt``: Shakespeare's works (public domain), in the "tinyshakespeare" compilation
from karpathy/char-rnn (``data/tinyshakespeare/input.txt``), truncated at a paragraph boundary
to stay under 1,000,000 bytes. 65 distinct characters.

:func:`digits`: the 1,797 8x8 handwritten digits that scikit-learn ships, read from its file
without importing scikit-learn.

Loading reads the file and builds Python objects only; token tensors are built when first asked
for (importing phalanx computes no tensors).
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phalanx._optional import require

__all__ = ["CORPORA", "CharCorpus", "char_corpus", "digits", "random_windows"]

CORPORA = ("shakespeare",)
"""Names accepted by :func:`char_corpus`."""


@dataclass(frozen=True)
class CharCorpus:
    """A text with a character-level vocabulary (token id = index in the sorted characters)."""

    text: str
    """The whole text."""
    vocab: tuple[str, ...]
    """The distinct characters of ``text``, sorted; ``vocab[i]`` is token ``i``."""

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.vocab)

    @functools.cached_property
    def _codepoints(self) -> np.ndarray:
        return np.array([ord(c) for c in self.vocab], dtype=np.uint32)

    def encode(self, s: str) -> torch.Tensor:
        """Token ids of ``s`` as an int64 tensor of shape (len(s),).

        Raises:
            ValueError: ``s`` holds a character outside the vocabulary.
        """
        # utf-32 gives one fixed-width code point per character: a vectorised lookup by binary
        # search into the sorted vocabulary encodes 1 MB in milliseconds.
        points = np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._codepoints, points)
        ids = np.minimum(ids, len(self.vocab) - 1)
        bad = np.flatnonzero(self._codepoints[ids] != points)
        if bad.size:
            raise ValueError(f"encode: s[{bad[0]}]={s[bad[0]]!r} is not in the corpus vocabulary")
        return torch.from_numpy(ids.astype(np.int64))

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of a 1-D sequence of token ids."""
        seq = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        for i in seq:
            if not 0 <= i < len(self.vocab):
                raise ValueError(f"decode: id {i} is outside 0..{len(self.vocab) - 1}")
        return "".join(self.vocab[i] for i in seq)

    @functools.cached_property
    def data(self) -> torch.Tensor:
        """The whole text as int64 token ids (built on first access, then cached)."""
        return self.encode(self.text)

    def split(self, frac: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
        """Split :attr:`data` into a leading train part (``frac``) and the trailing val part."""
        if not 0.0 < frac < 1.0:
            raise ValueError(f"split: frac must be in (0, 1), got {frac}")
        n = int(frac * self.data.numel())
        return self.data[:n], self.data[n:]


def _read_text(name: str) -> str:
    if name not in CORPORA:
        raise ValueError(f"char_corpus: name={name!r} is not one of {', '.join(CORPORA)}")
    resource = importlib.resources.files("phalanx.datasets") / f"{name}.txt"
    return resource.read_text(encoding="utf-8")


def char_corpus(name: str = "shakespeare") -> CharCorpus:
    """Load a bundled corpus with its character vocabulary.

    Args:
        name: One of :data:`CORPORA`.

    Returns:
        The :class:`CharCorpus`; ``.data`` holds the token ids.
    """
    text = _read_text(name)
    return CharCorpus(text=text, vocab=tuple(sorted(set(text))))


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits: ``(pixels, labels)``, exactly as
    ``sklearn.datasets.load_digits(return_X_y=True)`` gives them (float64 (1797, 64) in 0..16,
    int64 (1797,) in 0..9).

    Read with numpy from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``),
    without importing scikit-learn: that import costs 1.0-1.3 CPU-seconds in every process that
    loads the digits (each rank of a job).

    Raises:
        MissingExtraError: scikit-learn is not installed (``pip install 'phalanx[examples]'``).
    """
    require("examples", "phalanx.datasets.digits()", ["sklearn"])
    spec = importlib.util.find_spec("sklearn")
    assert spec is not None and spec.submodule_search_locations  # require() found it
    table = np.loadtxt(
        Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz",
        delimiter=",",
    )
    return table[:, :-1], table[:, -1].astype(np.int64)


def random_windows(
    data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` random windows of a 1-D token tensor for next-token prediction.

    Args:
        data: 1-D token ids.
        block_size: Window length T.
        batch_size: Number of windows B.
        generator: Source of the window offsets; the same generator state gives the same batch.

    Returns:
        ``(x, y)``, both (B, T) int64, with ``y[:, t] == x[:, t + 1]`` (targets shifted by one).
    """
    if data.dim() != 1:
        raise ValueError(f"random_windows: data must be 1-D, got shape {tuple(data.shape)}")
    if block_size < 1 or batch_size < 1:
        raise ValueError(
            f"random_windows: block_size={block_size} and batch_size={batch_size} must be >= 1"
        )
    if data.numel() <= block_size:
        raise ValueError(
            f"random_windows: data has {data.numel()} tokens, needs more than "
            f"block_size={block_size}"
        )
    starts = torch.randint(data.numel() - block_size, (batch_size,), generator=generator)
    windows = data.unfold(0, block_size + 1, 1)[starts]  # (B, T+1): a view, then one gather
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
