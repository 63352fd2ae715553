"""The models ``snack train`` trains, dense and sparse: an MLP, a CNN, a small vision transformer
(on digits), and a small character-level GPT and LSTM (on Shakespeare).

The sparse ones hold the layers ``snack.sparsify(..., distribution=..., init="random")`` makes:
every linear and convolution layer, attention projection and recurrent weight matrix, at
per-layer sparsities of the distribution at the overall sparsity, with random topologies.
Embeddings stay dense (the tables of 84 characters and 64 positions are small next to the
blocks; ``sparsify`` converts embeddings only when asked).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import snack
from snack.distributions import layer_sparsities

__all__ = [
    "CharLSTM", "CharTransformer", "NextCharacterModel", "PatchTransformer", "TransformerBlock", "cnn", "mlp",
    "sparse_char_lstm", "sparse_char_transformer", "sparse_cnn", "sparse_mlp", "sparse_vit",
]

# --model vit: the image is cut into PATCHES_PER_SIDE² patches (tokens), run through VIT_BLOCKS
# pre-norm blocks of VIT_HEADS-head attention and an MLP of VIT_MLP_RATIO × the width
PATCHES_PER_SIDE, VIT_BLOCKS, VIT_HEADS, VIT_MLP_RATIO = 4, 2, 4, 2

# --model gpt: GPT_BLOCKS causal pre-norm blocks of GPT_HEADS-head attention and an MLP of
# GPT_MLP_RATIO × the width (GPT-2's ratio)
GPT_BLOCKS, GPT_HEADS, GPT_MLP_RATIO = 2, 4, 4

# --model lstm: LSTM_LAYERS stacked LSTM layers of the width (Selfish-RNN's language models have 2)
LSTM_LAYERS = 2


def mlp(in_features: int, width: int, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes)
    )


def sparse_mlp(
    in_features: int, width: int, sparsity: float, distribution: str, device, classes: int = 10
) -> nn.Sequential:
    """:func:`mlp` built sparse, with the per-layer sparsities of ``distribution`` at overall
    ``sparsity`` and random topologies: what ``sparsify(mlp(...), init="random")`` makes, without
    first building the dense layers (at ``--width 40000`` those would be 6.4 GB each)."""
    sizes = [(in_features, width), (width, width), (width, classes)]  # (in, out)
    names = [str(2 * i) for i in range(len(sizes))]  # nn.Sequential's names, ReLUs between
    per_layer = layer_sparsities({n: (out, inn) for n, (inn, out) in zip(names, sizes)}, sparsity, distribution)
    layers: list[nn.Module] = []
    for name, (inn, out) in zip(names, sizes):
        layers += [snack.SparseLinear(inn, out, sparsity=per_layer[name], device=device), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def cnn(side: int, width: int, classes: int = 10) -> nn.Sequential:
    """``(N, side·side)`` flattened one-channel images → logits ``(N, classes)``: two 3×3
    convolutions (padding 1; 32 and 64 channels), each followed by ReLU and 2×2 max pooling,
    then ``→ width → classes``."""
    pooled = side // 4  # two 2×2 poolings, rounding down as nn.MaxPool2d does
    return nn.Sequential(
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * pooled * pooled, width), nn.ReLU(), nn.Linear(width, classes),
    )


def sparse_cnn(side: int, width: int, sparsity: float, distribution: str, device, classes: int = 10) -> nn.Sequential:
    """:func:`cnn` with every convolution and linear layer sparsified at overall ``sparsity``
    (``distribution``'s per-layer sparsities, random topologies: ``init="random"``)."""
    return _sparsified(cnn(side, width, classes), sparsity, distribution, device)


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))`` (GELU,
    ``mlp_ratio × width`` hidden); ``(N, tokens, width)`` in and out. ``causal``: each token
    attends to itself and the tokens before it only (a language model's)."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, causal: bool = False):
        super().__init__()
        self.causal = causal
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        hidden = mlp_ratio * width
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        mask = None
        if self.causal:  # True above the diagonal: a later token, not attended to
            tokens = x.shape[1]
            mask = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attention(h, h, h, attn_mask=mask, is_causal=self.causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class PatchTransformer(nn.Module):
    """A small vision transformer: ``(N, side·side)`` flattened one-channel images → logits
    ``(N, classes)``. The image is cut into ``PATCHES_PER_SIDE²`` square patches (7×7 pixels for
    28×28 digits), each embedded linearly to ``width`` plus a learned position, then
    ``VIT_BLOCKS`` pre-norm blocks (:class:`TransformerBlock`), a final norm, the mean over tokens and a
    linear head."""

    def __init__(self, side: int, width: int, classes: int = 10):
        super().__init__()
        if side % PATCHES_PER_SIDE:
            raise ValueError(f"PatchTransformer: the image side ({side}) must be a multiple of {PATCHES_PER_SIDE}")
        self.patch = side // PATCHES_PER_SIDE
        self.embed = nn.Linear(self.patch * self.patch, width)
        self.position = nn.Parameter(0.02 * torch.randn(PATCHES_PER_SIDE**2, width))
        self.blocks = nn.Sequential(*(TransformerBlock(width, VIT_HEADS, VIT_MLP_RATIO) for _ in range(VIT_BLOCKS)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        n, p, k = x.shape[0], self.patch, PATCHES_PER_SIDE
        patches = x.view(n, k, p, k, p).transpose(2, 3).reshape(n, k * k, p * p)  # (N, tokens, p·p), row by row
        tokens = self.blocks(self.embed(patches) + self.position)
        return self.head(self.norm(tokens).mean(dim=1))


def sparse_vit(side: int, width: int, sparsity: float, distribution: str, device, classes: int = 10) -> nn.Module:
    """:class:`PatchTransformer` with every linear layer and attention projection sparsified at
    overall ``sparsity`` (``distribution``'s per-layer sparsities, random topologies)."""
    return _sparsified(PatchTransformer(side, width, classes), sparsity, distribution, device)


class NextCharacterModel(nn.Module):
    """What the character-level language models share: ``(N, T)`` character ids → logits
    ``(N, T, vocabulary)`` of the character after each, trained on sequences of ``context``
    characters, and sampling from them (:meth:`generate`). Subclasses set ``context`` and
    ``embed`` (the characters' ``nn.Embedding``) and define ``forward``."""

    context: int
    embed: nn.Embedding

    def _check_ids(self, ids: Tensor, most: int | None) -> None:
        """Raise unless ``ids`` is ``(N, T)``, with ``T <= most`` unless ``most`` is ``None``."""
        if ids.dim() != 2 or (most is not None and ids.shape[1] > most):
            longest = "" if most is None else f" with T <= {most}"
            raise ValueError(
                f"{type(self).__name__}: expected (N, T) character ids{longest}, got shape {tuple(ids.shape)}"
            )

    @torch.no_grad()
    def generate(self, prompt: Tensor, count: int, generator: torch.Generator | None = None) -> Tensor:
        """``count`` characters sampled one at a time after ``prompt`` (``(P,)`` ids, P >= 1), each
        from the softmax of the logits given the last ``context`` characters (as in training);
        ``(count,)`` ids. ``generator`` (on the model's device) makes the draw repeatable."""
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(
                f"{type(self).__name__}.generate: prompt must be 1-D and non-empty, got shape {tuple(prompt.shape)}"
            )
        was_training = self.training
        self.eval()
        ids = prompt.to(self.embed.weight.device)
        for _ in range(count):
            logits = self(ids[-self.context :].unsqueeze(0))[0, -1]
            following = torch.multinomial(logits.float().softmax(-1), 1, generator=generator)
            ids = torch.cat([ids, following])
        self.train(was_training)
        return ids[prompt.numel() :]


class CharTransformer(NextCharacterModel):
    """A small GPT over characters: ``(N, T)`` character ids (``T <= context``) → logits
    ``(N, T, vocabulary)`` of the character after each. A learned embedding of each character
    plus one of its position, ``GPT_BLOCKS`` causal pre-norm blocks (:class:`TransformerBlock`),
    a final norm and a linear head."""

    def __init__(self, vocabulary: int, width: int, context: int):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(0.02 * torch.randn(context, width))
        self.blocks = nn.Sequential(
            *(TransformerBlock(width, GPT_HEADS, GPT_MLP_RATIO, causal=True) for _ in range(GPT_BLOCKS))
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, ids: Tensor) -> Tensor:
        self._check_ids(ids, self.context)
        tokens = self.embed(ids) + self.position[: ids.shape[1]]
        return self.head(self.norm(self.blocks(tokens)))


class CharLSTM(NextCharacterModel):
    """A character-level LSTM language model: ``(N, T)`` character ids → logits ``(N, T,
    vocabulary)`` of the character after each. A learned embedding of each character (``width``),
    ``LSTM_LAYERS`` stacked ``nn.LSTM`` layers of ``width`` (from a zero state) and a linear head.
    ``context``: the length of the training sequences, which :meth:`generate` reads back."""

    def __init__(self, vocabulary: int, width: int, context: int):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocabulary, width)
        self.lstm = nn.LSTM(width, width, LSTM_LAYERS, batch_first=True)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, ids: Tensor) -> Tensor:
        self._check_ids(ids, None)
        return self.head(self.lstm(self.embed(ids))[0])


def sparse_char_transformer(
    vocabulary: int, width: int, context: int, sparsity: float, distribution: str, device
) -> CharTransformer:
    """:class:`CharTransformer` with every linear layer and attention projection sparsified at
    overall ``sparsity`` (``distribution``'s per-layer sparsities, random topologies); the
    embeddings stay dense."""
    return _sparsified(CharTransformer(vocabulary, width, context), sparsity, distribution, device)


def sparse_char_lstm(vocabulary: int, width: int, context: int, sparsity: float, distribution: str, device) -> CharLSTM:
    """:class:`CharLSTM` with its LSTM's weight matrices (each layer's input-to-hidden and
    hidden-to-hidden: :class:`snack.SparseLSTM`) and its head sparsified at overall ``sparsity``
    (``distribution``'s per-layer sparsities, random topologies); the embedding stays dense."""
    return _sparsified(CharLSTM(vocabulary, width, context), sparsity, distribution, device)


def _sparsified(model: nn.Module, sparsity: float, distribution: str, device) -> nn.Module:
    """``model`` on ``device`` with its layers sparsified, random topologies at ``distribution``'s
    per-layer sparsities for the overall ``sparsity``."""
    return snack.sparsify(model.to(device), sparsity, distribution=distribution, init="random")
