"""How programs made by tracing (``torch.fx.symbolic_trace``, ``torch.jit.trace``,
``torch.export``) compute a :class:`~snack.nn.SparseLinear`: the calls FX records for a layer, and
the custom op ``snack::topology_index_data`` through which a program derives a layer's index
data from the coordinates it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from snack.backends.derived import derived
from snack.embedding_ops import embedding_bag, embedding_lookup, without_padding_gradient
from snack.nn import locking
from snack.nn.bags import bag_of_each_id, bag_weights, embedding_bags
from snack.ops import sparse_linear, spmm_t
from snack.topology import INDEX_DTYPE, Topology

if TYPE_CHECKING:
    from snack.nn.layer import SparseLinear


def fx_sparse_linear(
    x: Tensor, values: Tensor, bias: Tensor | None, row: Tensor, col: Tensor, out_features: int, in_features: int
) -> Tensor:
    """A :class:`SparseLinear` forward as ``torch.fx.symbolic_trace`` records it: one call taking
    the layer's tensors (``get_attr`` nodes), so FX-based tools (feature extractors, graph
    rewriters) see the layer as one node, as they see ``nn.Linear``. The index data are derived
    as in traced programs (:func:`topology_index_data`, cached per row/col)."""
    return sparse_linear(x, values, traced_topology(row, col, (out_features, in_features)), bias)


def fx_sparse_linear_transposed(
    rows: Tensor, values: Tensor, row: Tensor, col: Tensor, out_features: int, in_features: int
) -> Tensor:
    """``rows (B, out_features)`` times the ``(out_features, in_features)`` sparse weight
    (:func:`snack.ops.spmm_t`), as ``torch.fx.symbolic_trace`` records it for a transposed
    convolution it traces as the root (:meth:`SparseConvTranspose2d._fx_root_forward`)."""
    return spmm_t(rows, values, traced_topology(row, col, (out_features, in_features)))


def fx_sparse_embedding(
    ids: Tensor, values: Tensor, row: Tensor, col: Tensor, shape: tuple[int, int], padding_idx: int | None
) -> Tensor:
    """A :class:`SparseEmbedding` forward as ``torch.fx.symbolic_trace`` records it when it traces
    the layer itself: one call taking the layer's tensors (``shape``: the table's)."""
    topology = traced_topology(row, col, shape)
    flat = ids.reshape(-1).long()
    output = embedding_lookup(values, row, col, topology.rowptr, flat, shape[1])
    return without_padding_gradient(output, flat, padding_idx).view(*ids.shape, shape[1])


def fx_sparse_embedding_bag(
    ids: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None, values: Tensor, row: Tensor, col: Tensor,
    shape: tuple[int, int], padding_idx: int | None, mode: str, include_last_offset: bool,
) -> Tensor:
    """A :class:`SparseEmbeddingBag` forward as ``torch.fx.symbolic_trace`` records it when it
    traces the layer itself: one call taking the layer's tensors and options."""
    flat = ids.reshape(-1).long()
    bag, bags = bag_of_each_id(ids, offsets, include_last_offset)
    weights = None if per_sample_weights is None else per_sample_weights.reshape(-1)
    if mode == "max":
        rows = fx_sparse_embedding(flat, values, row, col, shape, padding_idx)
        return embedding_bags(rows, flat, bag, bags, mode, weights, padding_idx)
    weights = bag_weights(flat, bag, bags, mode, weights, padding_idx, values.dtype)
    rowptr = traced_topology(row, col, shape).rowptr
    return embedding_bag(values, row, col, rowptr, flat, bag, weights, bags, shape[1])


def traced_topology(row: Tensor, col: Tensor, shape: tuple[int, int]) -> Topology:
    """The topology of ``row``/``col`` as a traced program computes it: the index data from
    :func:`topology_index_data`, which the program records as one op."""
    return Topology.with_index_data(row, col, shape, *torch.ops.snack.topology_index_data(row, col, *shape))


def fx_layer_forward(layer: SparseLinear, x: Tensor, *args) -> Tensor:
    """``layer.forward(x, *args)``: what a program made by ``torch.fx.symbolic_trace`` calls for a
    layer its root holds (see :meth:`SparseLinear._fx_forward`; ``args``: a transposed
    convolution's ``output_size``)."""
    return layer.forward(x, *args)


def fx_embedding_attend(embedding, hidden: Tensor) -> Tensor:
    """``embedding.attend(hidden)`` (:meth:`SparseEmbedding.attend`): what a program made by
    ``torch.fx.symbolic_trace`` calls for a tied head's use of an embedding its root holds."""
    return embedding.attend(hidden)


# symbolic_trace records calls to these instead of tracing into them
torch.fx.wrap("fx_sparse_linear")
torch.fx.wrap("fx_sparse_linear_transposed")
torch.fx.wrap("fx_sparse_embedding")
torch.fx.wrap("fx_sparse_embedding_bag")
torch.fx.wrap("fx_layer_forward")
torch.fx.wrap("fx_embedding_attend")


def fx_module_reference(module: torch.nn.Module, tracer) -> torch.fx.Proxy | None:
    """A ``get_attr`` node for ``module`` in the program ``tracer`` records, reached through the
    root by the module's path, so that the program computes with the module's state of the
    moment; ``None`` where there is no tracer, the module is the root, or the root does not hold it."""
    if tracer is None or tracer.root is module:
        return None
    try:
        path = tracer.path_of_module(module)
    except NameError:
        return None
    return tracer.create_proxy("get_attr", path, (), {}) if path else None


def fx_module_call(module: torch.nn.Module, *arguments):
    """What ``torch.fx.symbolic_trace`` records for a module of several sparse layers (an
    attention, a recurrent layer): one call of its ``forward``, reached through the module (a
    ``get_attr`` node), as it records PyTorch's ``nn.MultiheadAttention`` and ``nn.LSTM`` as one
    node each; the call computes with the layers' connections of the moment."""
    tracer = next((a.tracer for a in arguments if isinstance(a, torch.fx.Proxy)), None)
    reference = fx_module_reference(module, tracer)
    if reference is None:
        raise NotImplementedError(
            f"torch.fx.symbolic_trace of a {type(module).__name__} itself (as the root, or given no traced input): "
            "trace a module that holds it"
        )
    return fx_layer_forward(reference, *arguments)


def fx_symbolic_tracing() -> bool:
    """Whether ``torch.fx.symbolic_trace`` runs (its flag is also set under ``torch.export``,
    which compiles; torch 2.13's ``is_fx_symbolic_tracing``, read directly for older versions)."""
    return torch.fx._symbolic_trace._is_fx_tracing_flag and not torch.compiler.is_compiling()


def program_tracing() -> bool:
    """Whether ``torch.export`` or ``torch.jit.trace`` records a program (whose index data come
    from :func:`topology_index_data`); not ``torch.compile``."""
    return torch.compiler.is_exporting() or (
        not torch.compiler.is_compiling() and torch._C._get_tracing_state() is not None  # torch.jit.trace
    )


@torch.library.custom_op("snack::topology_index_data", mutates_args=())
def topology_index_data(row: Tensor, col: Tensor, out_features: int, in_features: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(rowptr, colptr, csc_perm)`` of ``row``/``col``, validated, as :meth:`Topology.tensors`
    gives them (``csc_perm`` empty on the CPU, whose kernels never read it): what traced and
    exported programs call (see :attr:`SparseLinear.topology`). Built once per ``row``/``col``
    (identity and version, :func:`snack.backends.derived.derived`) and returned as copies, which
    the program may write into (a compiler reuses buffers)."""
    shape = (out_features, in_features)

    def build() -> Tensor:
        # validates (a program may hold any loaded coordinates), under the lock a same-nnz
        # load_state_dict holds while it copies into the layer's row/col, whose tensors a traced
        # program holds: never a half-copied state (it raised spurious "not sorted" errors)
        with locking.STATE_LOCK:
            tensors = Topology(row, col, shape).tensors()
        return torch.cat([tensors.rowptr, tensors.colptr, tensors.csc_perm])

    # the shape is part of the key: one row/col pair may serve layers of other shapes
    packed = derived(f"topology_index_data/{out_features}x{in_features}", (row, col), build)
    sizes = [out_features + 1, in_features + 1, _csc_perm_length(row)]
    return tuple(part.clone() for part in packed.split(sizes))


@topology_index_data.register_fake
def _(row, col, out_features, in_features):
    index = dict(dtype=INDEX_DTYPE, device=row.device)  # what Topology derives, whatever row/col's dtype
    return (
        torch.empty(out_features + 1, **index),
        torch.empty(in_features + 1, **index),
        torch.empty(_csc_perm_length(row), **index),
    )


def _csc_perm_length(row: Tensor) -> int:
    """How long the ``csc_perm`` of :meth:`Topology.tensors` is for coordinates ``row``."""
    return 0 if row.device.type == "cpu" else row.shape[0]
