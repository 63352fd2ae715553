"""``SparseEmbeddingBag``, a truly sparse drop-in for ``nn.EmbeddingBag``."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from snack.embedding_ops import embedding_bag
from snack.func import transforms_active
from snack.nn import tracing
from snack.nn.bags import MODES, bag_of_each_id, bag_weights, embedding_bags
from snack.nn.embedding import SparseEmbedding, _check_sizes, unsupported_options

__all__ = ["SparseEmbeddingBag"]


class SparseEmbeddingBag(SparseEmbedding):
    """``nn.EmbeddingBag`` with a sparse table: sums, means or maxima of bags of embeddings
    (a recommender's categorical features, a bag of words) without forming them.

    ``forward(input, offsets=None, per_sample_weights=None)`` takes its arguments as
    ``nn.EmbeddingBag``'s does:

    - ``input (B, L)`` integer ids: ``B`` bags of ``L`` ids each (``offsets`` must be ``None``);
    - ``input (N,)`` with ``offsets (B,)``: bag ``b`` holds ids ``offsets[b] .. offsets[b+1] - 1``
      (the last one up to ``N``); ``offsets[0]`` is 0, offsets do not decrease, and equal ones
      make empty bags. With ``include_last_offset=True``, ``offsets`` is ``(B + 1,)`` and ends
      with ``N``;
    - ``per_sample_weights`` (``mode="sum"`` only): one weight per id, ``input``'s shape, the
      layer's dtype; each row is scaled by it before the sum.

    Output ``(B, embedding_dim)`` in the layer's dtype. Ids equal to ``padding_idx`` are left out
    of their bag (nor counted in a mean); an empty bag gives zeros. A sum or mean is one fused op
    (:func:`snack.embedding_ops.embedding_bag`: each bag's ids' connections added up as they are
    read, native on the CPU); a ``max`` looks the ids' rows up ``(N, embedding_dim)``, as
    :class:`SparseEmbedding` does, then reduces them (:mod:`snack.nn.bags`). Either way only the
    ids' connections are read, the table's gradient has ``nnz`` entries, and no
    ``num_embeddings × embedding_dim`` tensor is built.

    Dynamic sparse training rewires it as any embedding: RigL records each lookup's ids and the
    gradient of its rows (the bag's gradient as it reaches each id: times the id's weight, over
    the bag's size, or only at the entries a ``max`` took).

    Args:
        num_embeddings, embedding_dim, padding_idx, sparsity, sparse, device, dtype: as
            :class:`SparseEmbedding`'s (keyword-only here but for the sizes: ``nn.EmbeddingBag``'s
            third positional argument is ``max_norm``).
        mode: ``"sum"``, ``"mean"`` (``nn.EmbeddingBag``'s default) or ``"max"``.
        include_last_offset: whether ``offsets`` ends with the number of ids, as in CSR form.

    ``nn.EmbeddingBag``'s ``max_norm`` and ``scale_grad_by_freq`` have no counterpart.
    :meth:`from_dense` keeps the largest entries of an ``nn.EmbeddingBag``;
    ``snack.sparsify(model, embeddings=True)`` converts them; :func:`snack.densify` turns one back.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        mode: str = "mean",
        padding_idx: int | None = None,
        include_last_offset: bool = False,
        sparsity: float = 0.9,
        sparse: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        _check_sizes(num_embeddings, embedding_dim)
        _check_bag_options(mode, include_last_offset)
        self.mode, self.include_last_offset = mode, include_last_offset
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, sparsity=sparsity, sparse=sparse, device=device, dtype=dtype
        )

    @classmethod
    def from_dense(
        cls, embedding_bag_or_weight: nn.EmbeddingBag | Tensor, *, sparsity: float | None = None, mode: str = "mean"
    ) -> SparseEmbeddingBag:
        """A sparse bag layer holding the non-zeros of an ``nn.EmbeddingBag`` (its ``mode``,
        ``padding_idx``, ``include_last_offset`` and ``sparse`` carry over; without ``max_norm`` or
        ``scale_grad_by_freq``) or of a ``(num_embeddings, embedding_dim)`` table (reduced by
        ``mode``).

        ``sparsity``: ``None`` keeps every non-zero; a float in ``[0, 1)`` keeps the
        largest-magnitude ``round((1 - sparsity) · num_embeddings · embedding_dim)`` entries. The
        result lives on the weight's device and dtype; ``values`` is a copy.
        """
        if isinstance(embedding_bag_or_weight, nn.EmbeddingBag):
            dense = embedding_bag_or_weight
            unsupported = unsupported_options(dense)
            if unsupported:
                raise ValueError(
                    f"embedding_bag_or_weight: SparseEmbeddingBag has no counterpart of nn.EmbeddingBag's {unsupported}"
                )
            weight, options = dense.weight, (dense.mode, dense.padding_idx, dense.include_last_offset, dense.sparse)
        elif isinstance(embedding_bag_or_weight, Tensor):
            weight, options = embedding_bag_or_weight, (mode, None, False, False)
        else:
            raise TypeError(
                "embedding_bag_or_weight must be an nn.EmbeddingBag or a Tensor, got "
                f"{type(embedding_bag_or_weight).__name__}"
            )
        bag_mode, padding_idx, include_last_offset, sparse = options
        _check_bag_options(bag_mode, include_last_offset)  # (before anything is built)
        layer = cls._from_table(weight, sparsity, padding_idx, sparse, "embedding_bag_or_weight")
        layer.mode, layer.include_last_offset = bag_mode, include_last_offset
        return layer

    @classmethod
    def _from_parts(cls, in_features, out_features, row, col, values, bias) -> SparseEmbeddingBag:
        layer = super()._from_parts(in_features, out_features, row, col, values, bias)
        layer.mode, layer.include_last_offset = "mean", False
        return layer

    def _init_state(self, in_features, out_features, row, col, values, bias) -> None:
        super()._init_state(in_features, out_features, row, col, values, bias)
        # hooks called after each lookup with (layer, (ids,), {}, rows): RigL records there (the
        # module's forward hooks see the bags, whose gradient is not each id's)
        self._lookup_hooks: OrderedDict[int, object] = OrderedDict()

    # ------------------------------------------------------------------ forward

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        """``input (B, L)``, or ``input (N,)`` with ``offsets`` → ``(B, embedding_dim)`` (class
        docstring)."""
        if tracing.fx_symbolic_tracing():
            return self._fx_forward(input, offsets, per_sample_weights)
        self._check_bag_arguments(input, offsets, per_sample_weights)
        values, topology, ids = self._state_and_checked_ids(input)
        bag, bags = bag_of_each_id(input, offsets, self.include_last_offset)
        weights = None if per_sample_weights is None else per_sample_weights.reshape(-1)
        if self.mode == "max" or self._lookup_hooks or transforms_active():
            # the rows looked up, then reduced: for max, for RigL's records (each id's rows and
            # their gradient) and inside torch.func transforms (which the fused op does not support)
            rows = self._rows(values, topology, ids)  # (N, embedding_dim)
            for hook in tuple(self._lookup_hooks.values()):
                hook(self, (ids,), {}, rows)
            return embedding_bags(rows, ids, bag, bags, self.mode, weights, self.padding_idx)
        weights = bag_weights(ids, bag, bags, self.mode, weights, self.padding_idx, values.dtype)
        return embedding_bag(*self._table_for(values, topology, ids), bag, weights, bags, self.embedding_dim)

    def _register_recording_hook(self, hook) -> RemovableHandle:
        """Call ``hook(layer, (ids (N,),), {}, rows (N, embedding_dim))`` after each lookup, before
        the bags are reduced: what RigL records (see :meth:`SparseLinear._register_recording_hook`)."""
        handle = RemovableHandle(self._lookup_hooks)
        self._lookup_hooks[handle.id] = hook
        return handle

    def _check_bag_arguments(self, input, offsets, per_sample_weights) -> None:
        """Raise for arguments ``nn.EmbeddingBag`` would refuse (the ids are checked by the lookup;
        the offsets' values only in eager code: the checks read them)."""
        if not isinstance(input, Tensor) or input.dim() not in (1, 2):
            shape = tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__
            raise ValueError(f"SparseEmbeddingBag: input must be 1-D ids with offsets, or 2-D (bags, ids), got {shape}")
        if input.dim() == 2 and offsets is not None:
            raise ValueError(
                "SparseEmbeddingBag: offsets must be None for a 2-D input (each row is a bag of fixed length)"
            )
        if input.dim() == 1:
            self._check_offsets(offsets, input)
        if per_sample_weights is not None:
            self._check_per_sample_weights(per_sample_weights, input)

    def _check_offsets(self, offsets, input: Tensor) -> None:
        if offsets is None:
            raise ValueError("SparseEmbeddingBag: a 1-D input needs offsets (the start of each bag)")
        if not isinstance(offsets, Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
            shown = f"{offsets.dtype} {tuple(offsets.shape)}" if isinstance(offsets, Tensor) else type(offsets).__name__
            raise ValueError(f"SparseEmbeddingBag: offsets must be a 1-D int64 or int32 tensor, got {shown}")
        if offsets.device != input.device:
            raise ValueError(f"SparseEmbeddingBag: offsets are on {offsets.device} but input on {input.device}")
        if self.include_last_offset and offsets.shape[0] == 0:
            raise ValueError("SparseEmbeddingBag: with include_last_offset, offsets must hold at least the last one")
        if torch.compiler.is_compiling() or tracing.program_tracing():
            return
        if offsets.shape[0] == 0:
            if input.shape[0] > 0:
                raise ValueError(f"SparseEmbeddingBag: offsets is empty, but input holds {input.shape[0]} ids")
            return
        problem = _offsets_problem(offsets, input.shape[0], self.include_last_offset)
        if problem:
            raise ValueError(f"SparseEmbeddingBag: {problem} (input holds {input.shape[0]} ids)")

    def _check_per_sample_weights(self, weights, input: Tensor) -> None:
        if self.mode != "sum":
            raise ValueError(f"SparseEmbeddingBag: per_sample_weights needs mode='sum', the layer's is {self.mode!r}")
        # (under torch.jit.trace shapes are traced values: the check would be a constant)
        if not isinstance(weights, Tensor) or (torch._C._get_tracing_state() is None and weights.shape != input.shape):
            shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
            raise ValueError(
                f"SparseEmbeddingBag: per_sample_weights must have input's shape {tuple(input.shape)}, got {shape}"
            )
        if weights.dtype != self.values.dtype or weights.device != input.device:
            raise ValueError(
                f"SparseEmbeddingBag: per_sample_weights must be {self.values.dtype} on {input.device} as the layer, "
                f"got {weights.dtype} on {weights.device}"
            )

    def _fx_root_forward(self, input, offsets=None, per_sample_weights=None):
        shape = (self.num_embeddings, self.embedding_dim)
        options = (self.padding_idx, self.mode, self.include_last_offset)
        return tracing.fx_sparse_embedding_bag(
            input, offsets, per_sample_weights, self.values, self.row, self.col, shape, *options
        )

    # ------------------------------------------------------------------ text

    def _sizes_repr(self) -> str:
        return f"SparseEmbeddingBag({self.num_embeddings}, {self.embedding_dim})"

    def _no_weight_message(self) -> str:
        return (
            "SparseEmbeddingBag has no dense weight: it holds `values` at (`row`, `col`); `to_dense()` builds the "
            "(num_embeddings, embedding_dim) table, snack.densify(model) turns the layers back into nn.EmbeddingBag."
        )

    def extra_repr(self) -> str:
        last = ", include_last_offset=True" if self.include_last_offset else ""
        return f"{super().extra_repr()}, mode={self.mode!r}{last}"


def _check_bag_options(mode: str, include_last_offset: bool) -> None:
    if mode not in MODES:
        raise ValueError(f"SparseEmbeddingBag: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if not isinstance(include_last_offset, bool):
        raise TypeError(
            f"SparseEmbeddingBag: include_last_offset must be a bool, got {type(include_last_offset).__name__}"
        )


def _offsets_problem(offsets: Tensor, count: int, include_last_offset: bool) -> str:
    """What is wrong with ``offsets (B,)`` (not empty) of a 1-D input of ``count`` ids (``""`` if
    nothing)."""
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        return f"offsets must start at 0, got offsets[0] = {first}"
    decreasing = (offsets[1:] < offsets[:-1]).nonzero()
    if decreasing.numel():
        b = int(decreasing[0])
        start, end = int(offsets[b]), int(offsets[b + 1])
        return f"offsets must not decrease, got offsets[{b}] = {start} > offsets[{b + 1}] = {end}"
    if include_last_offset and last != count:
        return f"with include_last_offset, offsets must end with the number of ids, got {last}"
    if last > count:
        return f"offsets must not pass the number of ids, got offsets[-1] = {last}"
    return ""
