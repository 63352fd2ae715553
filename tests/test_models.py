"""The models snack train trains (snack.models): the character-level GPT's causality, its
sampling, and which of its layers are sparse; the character-level LSTM's."""

import pytest
import torch

import snack
from snack.models import CharLSTM, CharTransformer, TransformerBlock, sparse_char_lstm, sparse_char_transformer


CHARACTER_MODELS = {"gpt": (CharTransformer, sparse_char_transformer), "lstm": (CharLSTM, sparse_char_lstm)}


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("kind", CHARACTER_MODELS)
def test_a_character_is_predicted_from_the_characters_up_to_it_only(kind, sparse):
    torch.manual_seed(0)
    dense_class, sparse_model = CHARACTER_MODELS[kind]
    model = sparse_model(13, 16, 10, 0.8, "erk", "cpu") if sparse else dense_class(13, 16, 10)
    ids = torch.randint(0, 13, (2, 10))
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 13  # only the characters from position 6 on
    logits, logits_changed = model(ids), model(changed)
    assert logits.shape == (2, 10, 13)
    torch.testing.assert_close(logits_changed[:, :6], logits[:, :6])
    assert not torch.allclose(logits_changed[:, 6:], logits[:, 6:])
    # a shorter sequence gives the same predictions as the start of a longer one
    torch.testing.assert_close(model(ids[:, :4]), logits[:, :4])
    if kind == "lstm":  # no context limit: a sequence longer than the training one runs
        torch.testing.assert_close(model(torch.cat([ids, ids], dim=1))[:, :10], logits)


def test_a_causal_block_masks_exactly_the_later_tokens():
    torch.manual_seed(0)
    block = TransformerBlock(8, 2, 2, causal=True)
    x = torch.randn(3, 5, 8)
    h = block.norm1(x)
    later = torch.ones(5, 5, dtype=torch.bool).triu(1)
    attended = block.attention(h, h, h, attn_mask=later, need_weights=False)[0]  # no is_causal hint
    expected = (x + attended) + block.mlp(block.norm2(x + attended))
    torch.testing.assert_close(block(x), expected)


def test_the_sparse_character_model_converts_every_linear_layer_and_keeps_the_embeddings():
    model = sparse_char_transformer(13, 16, 10, 0.9, "uniform", "cpu")
    assert isinstance(model.embed, torch.nn.Embedding) and isinstance(model.position, torch.nn.Parameter)
    assert all(isinstance(b.attention, snack.SparseMultiheadAttention) for b in model.blocks)
    assert not any(type(m) is torch.nn.Linear or isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
    sparse = [m for m in model.modules() if isinstance(m, snack.SparseLinear)]
    assert len(sparse) == 2 * (4 + 2) + 1  # per block: 4 projections, 2 MLP layers; the head
    assert all(m.sparsity == pytest.approx(0.9, abs=0.01) for m in sparse)


def test_generate_samples_repeatably_from_the_last_context_characters():
    torch.manual_seed(0)
    model = CharTransformer(7, 8, 4)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6])  # longer than the context: its last 4 are read
    first = model.generate(prompt, 12, torch.Generator().manual_seed(3))
    again = model.generate(prompt, 12, torch.Generator().manual_seed(3))
    assert first.shape == (12,) and first.dtype == torch.int64 and first.equal(again)
    assert int(first.min()) >= 0 and int(first.max()) < 7
    assert model.training  # restored
    # the first character is drawn from the prediction after the last 4 prompt characters
    probabilities = model.eval()(prompt[-4:].unsqueeze(0))[0, -1].softmax(-1)
    expected = torch.multinomial(probabilities, 1, generator=torch.Generator().manual_seed(3))
    assert int(first[0]) == int(expected)


def test_the_character_model_refuses_bad_input_clearly():
    model = CharTransformer(7, 8, 4)
    with pytest.raises(ValueError, match=r"expected \(N, T\) character ids with T <= 4, got shape \(1, 5\)"):
        model(torch.zeros(1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"expected \(N, T\) character ids with T <= 4, got shape \(4,\)"):
        model(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"prompt must be 1-D and non-empty, got shape \(0,\)"):
        model.generate(torch.zeros(0, dtype=torch.int64), 3)
    assert model.training


def test_the_sparse_character_lstm_converts_its_lstm_and_head_and_keeps_the_embedding():
    model = sparse_char_lstm(13, 16, 10, 0.9, "uniform", "cpu")
    assert type(model.embed) is torch.nn.Embedding and isinstance(model.lstm, snack.SparseLSTM)
    assert isinstance(model.head, snack.SparseLinear)
    assert (model.lstm.num_layers, model.lstm.hidden_size, model.lstm.batch_first) == (2, 16, True)
    sparse = [m for m in model.modules() if isinstance(m, snack.SparseLinear)]
    assert len(sparse) == 2 * 2 + 1  # per layer: input-to-hidden, hidden-to-hidden; the head
    assert all(m.sparsity == pytest.approx(0.9, abs=0.01) for m in sparse)


def test_the_character_lstm_samples_repeatably_and_refuses_bad_input_clearly():
    torch.manual_seed(0)
    model = CharLSTM(7, 8, 4)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6])
    first = model.generate(prompt, 5, torch.Generator().manual_seed(3))
    assert first.equal(model.generate(prompt, 5, torch.Generator().manual_seed(3))) and model.training
    # from the prediction after the last `context` (4) prompt characters, as in training
    probabilities = model.eval()(prompt[-4:].unsqueeze(0))[0, -1].softmax(-1)
    assert int(first[0]) == int(torch.multinomial(probabilities, 1, generator=torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match=r"CharLSTM: expected \(N, T\) character ids, got shape \(4,\)"):
        model(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"CharLSTM.generate: prompt must be 1-D and non-empty, got shape \(2, 1\)"):
        model.generate(torch.zeros(2, 1, dtype=torch.int64), 3)
