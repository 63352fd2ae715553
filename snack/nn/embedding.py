"""``SparseEmbedding``, a truly sparse drop-in for ``nn.Embedding``."""

from __future__ import annotations

import math
import numbers
import sys
from collections import OrderedDict

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from snack.embedding_ops import (
    embedding_lookup, embedding_lookup_for_transforms, table_of_rows_looked_up, without_padding_gradient,
)
from snack.func import transforms_active
from snack.nn import tracing
from snack.nn.layer import SparseLinear, _reject_meta
from snack.topology import MAX_INDEX, Topology, coo_from_dense

__all__ = ["SparseEmbedding"]

# nn.Embedding options whose behaviour a sparse table does not have (see SparseEmbedding.from_dense)
_UNSUPPORTED_OPTIONS = {
    "max_norm": None,  # renormalises the looked-up rows in place
    "scale_grad_by_freq": False,
}


class SparseEmbedding(SparseLinear):
    """``nn.Embedding`` with a sparse table that stores only its ``nnz`` connections.

    Input: integer token ids ``(*)``; output ``(*, embedding_dim)``, row ``t`` of the
    ``(num_embeddings, embedding_dim)`` table for each id ``t``, zeros off its connections. The
    table is kept as every snack layer keeps its weight: buffers ``row`` (the token), ``col`` (the
    feature, ``(nnz,)`` int32, sorted) and the parameter ``values`` ``(nnz,)``. A lookup touches only
    the connections of the ids it reads, and its backward gives ``values`` a gradient of ``nnz``
    elements: no ``num_embeddings × embedding_dim`` tensor is built (``nn.Embedding``'s backward
    forms one, and its optimizer state is as large) unless :meth:`to_dense` is called.

    It is a :class:`SparseLinear` with ``out_features = num_embeddings`` and ``in_features =
    embedding_dim`` (its weight is the table, as ``nn.Embedding.weight`` is), so the dynamic sparse
    training algorithms of :mod:`snack.dst` rewire it like any other layer (RigL scores it from the
    ids and output gradients of the step: ``∂L/∂E[t] = Σ dY`` over the positions holding ``t``),
    and ``state_dict``, ``set_topology`` and :func:`snack.densify` work as for a linear layer.

    Initialisation keeps the output variance of ``nn.Embedding``, whose entries are ``N(0, 1)``:
    a row holds on average ``fan = nnz / num_embeddings`` of its ``embedding_dim`` features, so
    ``values ~ N(0, embedding_dim / fan)``. The topology is drawn uniformly at random over the
    table, so rows hold different numbers of connections (at high sparsity some none: such a token
    embeds as zeros until rewiring gives it connections).

    Args:
        num_embeddings: size of the vocabulary (ids run from 0 to ``num_embeddings - 1``).
        embedding_dim: size of each embedding.
        padding_idx: as ``nn.Embedding``'s: the row of this id gets no gradient (a padding token's
            embedding does not train), and starts without connections (zeros); negative counts
            from the end. Dynamic sparse training never grows connections into it
            (:attr:`~SparseLinear.growth_topology`).
        sparsity: fraction of zero entries in ``[0, 1)``; ``round((1 - sparsity) · num_embeddings ·
            embedding_dim)`` connections (at least one; with ``padding_idx``, of the other rows).
        sparse: as ``nn.Embedding``'s: ``values.grad`` is a sparse COO tensor holding the
            connections of the rows looked up, so that ``torch.optim.SparseAdam`` (or ``SGD``)
            steps only those instead of all ``nnz`` (eager lookups; compiled, exported and
            ``torch.func`` code, and :meth:`attend`'s gradient, give dense ones). For models whose
            optimizer needs sparse gradients: ``SparseAdam`` on them was slower than a fused
            ``Adam`` on all connections in the README's benchmarks.
        device, dtype: of ``values`` (indices are int32 on ``device``).

    :meth:`attend` uses the table as an output layer (``hidden · tableᵀ``, the logits of a language
    model whose head is tied to its token embedding, GPT-2's ``lm_head``); :class:`SparseTiedHead`
    is that head as a module.

    ``nn.Embedding``'s ``max_norm`` and ``scale_grad_by_freq`` have no counterpart
    (:meth:`from_dense` refuses a layer that sets them). Use :meth:`from_dense` to keep the largest
    entries of an ``nn.Embedding``, or ``snack.sparsify(model, embeddings=True)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        sparsity: float = 0.9,
        sparse: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        _check_sizes(num_embeddings, embedding_dim)
        self.sparse = _checked_sparse(sparse)
        # set first: the constructor draws the topology, which leaves this row out
        self.padding_idx = _checked_padding_idx(padding_idx, num_embeddings)
        super().__init__(embedding_dim, num_embeddings, False, sparsity=sparsity, device=device, dtype=dtype)

    @property
    def num_embeddings(self) -> int:
        return self.out_features

    @property
    def embedding_dim(self) -> int:
        return self.in_features

    @classmethod
    def from_dense(
        cls, embedding_or_weight: nn.Embedding | Tensor, *, sparsity: float | None = None
    ) -> SparseEmbedding:
        """A sparse embedding holding the non-zeros of an ``nn.Embedding`` or of a
        ``(num_embeddings, embedding_dim)`` table.

        Args:
            embedding_or_weight: an ``nn.Embedding`` (its ``padding_idx`` and ``sparse`` carry
                over; without ``max_norm`` or ``scale_grad_by_freq``, which a sparse table does not
                have) or its weight.
            sparsity: ``None`` keeps every non-zero; a float in ``[0, 1)`` keeps the
                largest-magnitude ``round((1 - sparsity) · num_embeddings · embedding_dim)`` entries.

        The result lives on the weight's device and dtype; ``values`` is a copy.
        """
        if isinstance(embedding_or_weight, nn.Embedding):
            unsupported = unsupported_options(embedding_or_weight)
            if unsupported:
                raise ValueError(
                    f"embedding_or_weight: SparseEmbedding has no counterpart of nn.Embedding's {unsupported}"
                )
            weight, padding_idx = embedding_or_weight.weight, embedding_or_weight.padding_idx
            sparse = embedding_or_weight.sparse
        elif isinstance(embedding_or_weight, Tensor):
            weight, padding_idx, sparse = embedding_or_weight, None, False
        else:
            raise TypeError(
                f"embedding_or_weight must be an nn.Embedding or a Tensor, got {type(embedding_or_weight).__name__}"
            )
        return cls._from_table(weight, sparsity, padding_idx, sparse, "embedding_or_weight")

    @classmethod
    def _from_table(
        cls, weight: Tensor, sparsity: float | None, padding_idx: int | None, sparse: bool, argument: str
    ) -> SparseEmbedding:
        """The layer holding the non-zeros of ``weight (num_embeddings, embedding_dim)`` (all, or the
        largest at ``sparsity``), with ``padding_idx`` (checked) and ``sparse`` (``from_dense``'s
        common part; ``argument`` names the table in errors)."""
        if weight.dim() != 2:
            raise ValueError(
                f"{argument}: the table must be (num_embeddings, embedding_dim), got {tuple(weight.shape)}"
            )
        _reject_meta(weight.device)
        padding_idx = _checked_padding_idx(padding_idx, weight.shape[0])
        row, col, values = coo_from_dense(weight, sparsity)
        num_embeddings, embedding_dim = weight.shape
        layer = cls._from_parts(embedding_dim, num_embeddings, row, col, values, None)
        layer.padding_idx, layer.sparse = padding_idx, sparse
        return layer

    def _init_state(self, in_features, out_features, row, col, values, bias) -> None:
        super()._init_state(in_features, out_features, row, col, values, bias)
        # hooks called after each attend() as forward hooks are after forward (see _register_attend_hook)
        self._attend_hooks: OrderedDict[int, object] = OrderedDict()

    def __setstate__(self, state):
        state.setdefault("_attend_hooks", OrderedDict())  # pickled before attend() existed
        state.setdefault("sparse", False)  # pickled before sparse existed
        super().__setstate__(state)

    @classmethod
    def _from_parts(cls, in_features, out_features, row, col, values, bias) -> SparseEmbedding:
        layer = super()._from_parts(in_features, out_features, row, col, values, bias)
        layer.padding_idx, layer.sparse = None, False
        return layer

    def reset_parameters(self) -> None:
        """Re-draw ``values`` as ``N(0, embedding_dim / fan)`` (class docstring); a layer built on
        the meta device and materialised since first draws its topology."""
        super().reset_parameters()  # (draws the topology where it must, and values we replace)
        with torch.no_grad():
            self.values.normal_(0.0, self._init_std)
            if self.padding_idx is not None:  # as nn.Embedding: the padding row's entries are zeros
                self.values.masked_fill_(self.row == self.padding_idx, 0.0)

    def _random_nnz(self, out_features: int, in_features: int, sparsity: float) -> int:
        if self.padding_idx is None:
            return super()._random_nnz(out_features, in_features, sparsity)
        return 0 if out_features == 1 else super()._random_nnz(out_features - 1, in_features, sparsity)

    def _random_topology(
        self, out_features: int, in_features: int, sparsity: float, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """The constructor's random topology, which with ``padding_idx`` leaves that row empty:
        drawn over the other rows, then the rows from the padding row on moved one down."""
        if self.padding_idx is None:
            return super()._random_topology(out_features, in_features, sparsity, device)
        if out_features == 1:
            nothing = torch.empty(0, dtype=torch.int32, device=device)
            return nothing, nothing.clone()
        row, col = super()._random_topology(out_features - 1, in_features, sparsity, device)
        return row + (row >= self.padding_idx).to(row.dtype), col

    def _ungrowable_rows(self) -> tuple[int, ...]:
        return () if self.padding_idx is None else (self.padding_idx,)

    @property
    def _init_std(self) -> float:
        return math.sqrt(self.embedding_dim / max(1.0, self.nnz / self.num_embeddings))

    def _random_initial_values(self, count: int, generator: torch.Generator) -> Tensor:
        return torch.randn(count, generator=generator, dtype=torch.float64) * self._init_std

    # ------------------------------------------------------------------ forward

    def forward(self, input: Tensor) -> Tensor:
        """``input (*)`` integer ids in ``[0, num_embeddings)`` → ``(*, embedding_dim)`` in the
        layer's dtype (under ``torch.autocast`` too, as ``nn.Embedding``'s)."""
        if tracing.fx_symbolic_tracing():
            return self._fx_forward(input)
        return self._rows(*self._state_and_checked_ids(input)).view(*input.shape, self.embedding_dim)

    def _rows(self, values: Tensor, topology: Topology, ids: Tensor) -> Tensor:
        """``(N, embedding_dim)``: the rows of the checked ``ids (N,)`` in the table of ``values`` at
        ``topology`` (:meth:`_state_and_checked_ids`); the padding row's pass no gradient."""
        lookup = embedding_lookup_for_transforms if transforms_active() else embedding_lookup
        output = lookup(*self._table_for(values, topology, ids), self.embedding_dim)
        return without_padding_gradient(output, ids, self.padding_idx)

    def _table_for(self, values: Tensor, topology: Topology, ids: Tensor) -> tuple[Tensor, ...]:
        """``(values, row, col, rowptr, ids)`` a lookup of ``ids`` reads: the layer's table, or with
        ``sparse``, in eager code that records a gradient, the table of the rows looked up
        (:func:`table_of_rows_looked_up`: only those rows' connections get a gradient)."""
        if self.sparse and values.requires_grad and torch.is_grad_enabled() and not (
            # (sparse gradients are eager autograd's: these give dense ones)
            transforms_active() or torch.compiler.is_compiling() or tracing.program_tracing()
        ):
            return table_of_rows_looked_up(values, topology.rowptr, topology.col, ids)
        return values, topology.row, topology.col, topology.rowptr, ids

    def _state_and_checked_ids(self, input: Tensor) -> tuple[Tensor, Topology, Tensor]:
        """``(values, topology, ids (N,) int64)``: one consistent state of the layer and the ids
        of ``input (*)``, flattened, checked (their range only in eager code)."""
        name = type(self).__name__
        if not isinstance(input, Tensor):
            raise TypeError(f"{name} expects a Tensor of token ids, got {type(input).__name__}")
        if input.dtype.is_floating_point or input.dtype.is_complex or input.dtype == torch.bool:
            raise TypeError(f"{name}: input must hold integer ids (int64 or int32), got dtype {input.dtype}")
        values, _, topology = self._consistent_state()
        if input.device != values.device:
            raise ValueError(f"{name}: input is on {input.device} but the layer is on {values.device}")
        if torch._C._get_tracing_state() is None and values.shape != (topology.nnz,):
            # values put in by assignment or torch.func.functional_call: the kernels trust its length
            raise ValueError(f"{name}: values must have shape ({topology.nnz},), got {tuple(values.shape)}")
        ids = input.reshape(-1).long()
        # (torch.func's vmap may batch the ids, and compiled code cannot read them: no range check)
        if not (transforms_active() or torch.compiler.is_compiling() or tracing.program_tracing()):
            self._check_ids(ids)
        return values, topology, ids

    def attend(self, hidden: Tensor) -> Tensor:
        """The table as an output layer: ``hidden (*, embedding_dim)`` → logits ``(*,
        num_embeddings)``, ``hidden · tableᵀ`` (GPT-2's ``lm_head``, whose weight is its token
        embedding's; :class:`SparseTiedHead` is this as a module, with an optional bias).

        It is :class:`SparseLinear`'s forward on the table (``in_features = embedding_dim``), so it
        runs the same kernels and never builds the dense table; its gradient adds to the lookup's
        in ``values.grad``. ``hidden`` must have the layer's dtype (as ``nn.Linear``'s input does;
        under ``torch.autocast`` both are cast). The padding row (``padding_idx``), which has no
        connections, gives logit 0. Dynamic sparse training scores growth from both uses: RigL
        records each call's ``hidden`` and logits' gradient as well as the lookups' ids and output
        gradients (:meth:`snack.dst.DynamicSparsity.recorded_head_batch`). Under FSDP
        (``fully_shard``), which gathers a module's parameters around ``forward`` only, the first
        call registers ``attend`` with it as a forward method."""
        if tracing.fx_symbolic_tracing():
            return self._fx_attend(hidden)
        if _sharded_by_fsdp(self) and "attend" not in self.__dict__:
            # FSDP (fully_shard) gathers a module's parameters around its forward only: make attend
            # a forward method to it (an attribute of this instance, which this call then runs)
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(self, "attend")
            return self.attend(hidden)
        if not isinstance(hidden, Tensor):
            raise TypeError(f"SparseEmbedding.attend expects a Tensor, got {type(hidden).__name__}")
        if hidden.dim() == 0 or self._width_differs(hidden):
            raise ValueError(
                f"SparseEmbedding.attend: hidden must have shape (*, embedding_dim={self.embedding_dim}), "
                f"got {tuple(hidden.shape)}"
            )
        logits = self._product(hidden)
        for hook in tuple(self._attend_hooks.values()):
            hook(self, (hidden,), {}, logits)
        return logits

    def _register_attend_hook(self, hook) -> RemovableHandle:
        """Call ``hook(layer, (hidden,), {}, logits)`` after each :meth:`attend`, as a forward hook
        registered ``with_kwargs=True`` is called after each forward (RigL's recording hooks)."""
        handle = RemovableHandle(self._attend_hooks)
        self._attend_hooks[handle.id] = hook
        return handle

    def _fx_attend(self, hidden):
        """What ``torch.fx.symbolic_trace`` records for :meth:`attend`: one call of it on this layer,
        reached through the program's root (as :meth:`SparseLinear._fx_forward` does), or on the
        layer's tensors when the root cannot reach it."""
        proxy = hidden if isinstance(hidden, torch.fx.Proxy) else self.values
        layer = tracing.fx_module_reference(self, proxy.tracer if isinstance(proxy, torch.fx.Proxy) else None)
        if layer is not None:
            return tracing.fx_embedding_attend(layer, hidden)
        shape = (self.out_features, self.in_features)
        return tracing.fx_sparse_linear(hidden, self.values, None, self.row, self.col, *shape)

    def _check_ids(self, ids: Tensor) -> None:
        """Raise ``IndexError`` (as ``nn.Embedding`` does) for an id outside ``[0, num_embeddings)``:
        the lookup would read out of bounds (one reduction, and a sync on a GPU)."""
        if ids.numel() == 0:
            return
        low, high = torch.aminmax(ids)
        if low < 0 or high >= self.num_embeddings:
            bad = int(low) if low < 0 else int(high)
            raise IndexError(
                f"{type(self).__name__}(num_embeddings={self.num_embeddings}): input holds id {bad}, outside "
                f"[0, {self.num_embeddings - 1}]"
            )

    def _fx_root_forward(self, input):
        shape = (self.num_embeddings, self.embedding_dim)
        return tracing.fx_sparse_embedding(input, self.values, self.row, self.col, shape, self.padding_idx)

    def _sizes_repr(self) -> str:
        return f"SparseEmbedding({self.num_embeddings}, {self.embedding_dim})"

    def _no_weight_message(self) -> str:
        return (
            "SparseEmbedding has no dense weight: it holds `values` at (`row`, `col`); `to_dense()` builds the "
            "(num_embeddings, embedding_dim) table, snack.densify(model) turns the layers back into nn.Embedding. "
            "(A head tied to the table, lm_head.weight = embedding.weight, needs both dense.)"
        )

    # ------------------------------------------------------------------ records for RigL

    def _record_of_input(self, x: Tensor) -> Tensor:
        """The ids ``(N,)`` (int64, a copy): row ``t`` of the table's gradient is the sum of the
        output gradient rows of id ``t`` (:func:`snack.dst.prune_grow.gradient_grow` scores them
        so, a block of rows at a time)."""
        return x.reshape(-1).long().clone()

    def _rows_of_output(self, y: Tensor) -> Tensor:
        return y.reshape(-1, self.embedding_dim)

    @property
    def _output_width(self) -> int:
        return self.embedding_dim

    def _empty_records(self, values: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(ids (0,), dY (0, embedding_dim), hidden (0, embedding_dim), dlogits (0,
        num_embeddings))``: the lookups' records and the head's (:meth:`attend`), of no rows."""
        ids = torch.empty(0, dtype=torch.int64, device=values.device)
        width = (self.embedding_dim, self.embedding_dim, self.num_embeddings)
        return ids, *(values.new_empty(0, w) for w in width)

    # ------------------------------------------------------------------ conversion

    def extra_repr(self) -> str:
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        sparse = ", sparse=True" if self.sparse else ""
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}{padding}, nnz={self.nnz}, "
            f"sparsity={self.sparsity:.4f}{sparse}"
        )


def _sharded_by_fsdp(module: nn.Module) -> bool:
    """Whether FSDP's ``fully_shard`` made ``module`` an ``FSDPModule`` (never importing FSDP)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def unsupported_options(embedding: nn.Embedding) -> str:
    """The options ``embedding`` sets that :class:`SparseEmbedding` has no counterpart of (``""``
    if none), as ``name=value, ...``."""
    return ", ".join(
        f"{name}={getattr(embedding, name)!r}"
        for name, default in _UNSUPPORTED_OPTIONS.items()
        if getattr(embedding, name) != default
    )


def _checked_padding_idx(padding_idx, num_embeddings: int) -> int | None:
    """``padding_idx`` in ``[0, num_embeddings)`` (a negative one counted from the end, as
    ``nn.Embedding`` does), or ``None``."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
        raise TypeError(f"SparseEmbedding: padding_idx must be an int or None, got {type(padding_idx).__name__}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"SparseEmbedding: padding_idx must be in [-{num_embeddings}, {num_embeddings - 1}] "
            f"(num_embeddings={num_embeddings}), got {padding_idx}"
        )
    return int(padding_idx) % num_embeddings


def _checked_sparse(sparse) -> bool:
    if not isinstance(sparse, bool):
        raise TypeError(f"SparseEmbedding: sparse must be a bool, got {type(sparse).__name__} {sparse!r}")
    return sparse


def _check_sizes(num_embeddings, embedding_dim) -> None:
    for name, size in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"SparseEmbedding: {name} must be an int, got {type(size).__name__} {size!r}")
        if not 0 < size <= MAX_INDEX:
            raise ValueError(f"SparseEmbedding: {name} must be in [1, {MAX_INDEX}], got {size}")
