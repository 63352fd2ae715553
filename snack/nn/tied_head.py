"""``SparseTiedHead``: a language model's output layer tied to its sparse token embedding."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from snack.nn.embedding import SparseEmbedding

__all__ = ["SparseTiedHead"]


class SparseTiedHead(nn.Module):
    """The output layer whose weight is a :class:`SparseEmbedding`'s table: logits ``hidden ·
    tableᵀ (+ bias)``, as GPT-2's ``lm_head`` shares its weight with ``wte``.

    Input ``(*, embedding_dim)``, output ``(*, num_embeddings)``, by
    :meth:`SparseEmbedding.attend`: the table's ``nnz`` connections serve both uses, so training
    updates them from the gradients of both, and dynamic sparse training rewires them once for both
    (RigL scores growth from the lookups' and the logits' gradients together). The embedding is a
    submodule, held by reference: the model holds it under its own name too (``state_dict`` lists
    it under both names, as PyTorch lists a tied weight; ``parameters()`` gives it once).

    Args:
        embedding: the token embedding whose table is the weight.
        bias: whether to add a learnable bias ``(num_embeddings,)``, zeros at first.

    :func:`snack.sparsify` with ``embeddings=True`` makes one of an ``nn.Linear`` tied to an
    ``nn.Embedding``; :func:`snack.densify` turns it back into an ``nn.Linear`` tied to the dense
    embedding.
    """

    def __init__(self, embedding: SparseEmbedding, bias: bool = False):
        super().__init__()
        if not isinstance(embedding, SparseEmbedding):
            raise TypeError(
                f"SparseTiedHead: embedding must be a snack.SparseEmbedding, got {type(embedding).__name__}"
            )
        if not isinstance(bias, bool):
            raise TypeError(f"SparseTiedHead: bias must be a bool, got {type(bias).__name__} {bias!r}")
        self.embedding = embedding
        self.bias = None
        if bias:
            values = embedding.values
            self.bias = nn.Parameter(torch.zeros(embedding.num_embeddings, device=values.device, dtype=values.dtype))

    def reset_parameters(self) -> None:
        """Zero the bias (the table is the embedding's: its own ``reset_parameters`` draws it)."""
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    @property
    def in_features(self) -> int:
        return self.embedding.embedding_dim

    @property
    def out_features(self) -> int:
        return self.embedding.num_embeddings

    def forward(self, input: Tensor) -> Tensor:
        """``input (*, embedding_dim)`` → logits ``(*, num_embeddings)`` in the embedding's dtype."""
        logits = self.embedding.attend(input)
        # (under autocast the logits come in its dtype, as nn.Linear's with their bias)
        return logits if self.bias is None else logits + self.bias.to(logits.dtype)

    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(
                "SparseTiedHead has no dense weight: its weight is the table of its `embedding` (a "
                "snack.SparseEmbedding, whose to_dense() builds it); snack.densify(model) turns the pair back into a "
                "tied nn.Embedding and nn.Linear"
            )
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
