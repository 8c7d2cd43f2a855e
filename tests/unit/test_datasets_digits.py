"""``phalanx.datasets.digits()``: scikit-learn's digits, bit for bit, without importing
scikit-learn (1.0-1.3 CPU-seconds in every rank that loads them); its absence names the pip line."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import phalanx
from phalanx import _optional
from phalanx._optional import MissingExtraError
from phalanx.datasets import digits


def test_the_digits_are_scikit_learns() -> None:
    from sklearn.datasets import load_digits

    x, y = digits()
    want_x, want_y = load_digits(return_X_y=True)
    assert x.dtype == want_x.dtype and y.dtype == want_y.dtype
    assert np.array_equal(x, want_x) and np.array_equal(y, want_y)


def test_loading_them_does_not_import_scikit_learn() -> None:
    code = (
        "import sys; from phalanx.datasets import digits; x, y = digits(); "
        "print('sklearn' in sys.modules, x.shape, y.shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "(1797,", "64)", "(1797,)"]


def test_without_scikit_learn_the_error_names_the_pip_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_optional, "_installed", lambda module: module != "sklearn")
    with pytest.raises(MissingExtraError, match=r"pip install 'phalanx\[examples\]'"):
        phalanx.datasets.digits()
