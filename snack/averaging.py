"""Weight averaging (EMA, SWA) of models whose sparse layers rewire.

``torch.optim.swa_utils.AveragedModel`` averages a copy of the model parameter by parameter,
position by position. A sparse layer's ``values`` are only meaningful with its ``row``/``col``
buffers, which break that in two ways:

- after a rewire (a :mod:`snack.dst` update, ``set_topology``, a load) position ``i`` of the
  model's ``values`` is another connection than position ``i`` of the average, which then mixes
  connections (or fails with a size error when ``nnz`` changed);
- with ``use_buffers=True`` (to average BatchNorm's running statistics) it averages the integer
  ``row``/``col`` too: an EMA rounds them down, and after a few updates the copy's coordinates
  are no longer a topology.

:func:`align_topology` gives the averaged copy's sparse layers the model's topology, keeping the
average of every connection both have; :class:`AveragedModel` calls it on every update and never
averages coordinates.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel as _TorchAveragedModel
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices, _group_tensors_by_device_and_dtype

from snack.dst.sharded import is_sharded
from snack.indexing import matching_positions, positions_where, take_or_fill
from snack.nn.layer import SparseLinear, _NewTopology, _version

__all__ = ["AveragedModel", "align_topology"]

# follower layer -> the (row, col) tensors and versions of both layers when they were last seen
# aligned: an unchanged pair is not compared again (a comparison reads four index arrays, about
# what one EMA update of the values costs)
_ALIGNED: weakref.WeakKeyDictionary[SparseLinear, tuple] = weakref.WeakKeyDictionary()


@torch.no_grad()
def align_topology(averaged: nn.Module, model: nn.Module) -> None:
    """Give every sparse layer of ``averaged`` the topology of its counterpart in ``model``.

    ``averaged`` is a copy of ``model`` (``copy.deepcopy``, an EMA or SWA model's ``.module``)
    whose sparse layers may have fallen behind ``model``'s rewires. Layers are paired in
    ``modules()`` order, as ``AveragedModel`` pairs parameters, so ``model`` may be wrapped
    (DDP, ``torch.compile``). For each pair, a connection both hold keeps ``averaged``'s value;
    a connection only ``model`` holds takes ``model``'s value (an average starting where the
    connection started, as ``AveragedModel`` starts from the model); a connection only
    ``averaged`` holds is dropped. ``averaged``'s layers stay on their device and dtype and never
    share tensors with ``model``'s. Nothing else (biases, dense layers) is touched.

    Cost: a merge of the old and new coordinates per rewired layer (native on the CPU); a layer
    whose coordinates have not changed since the last call costs nothing.

    Raises:
        TypeError: an argument is not an ``nn.Module``.
        ValueError: the models' sparse layers differ in number, type or shape.
        NotImplementedError: a layer's ``values`` are sharded (FSDP).
    On error neither model changes.
    """
    pairs = _sparse_layer_pairs(averaged, model)
    changes = [(layer, _aligned(layer, source)) for layer, source in pairs if not _seen_aligned(layer, source)]
    for layer, new in changes:  # reference swaps only: all layers change, or none
        if new is not None:
            layer._commit_topology(new)
    for layer, source in pairs:
        _ALIGNED[layer] = _stamp(layer, source)


def _sparse_layer_pairs(averaged: nn.Module, model: nn.Module) -> list[tuple[SparseLinear, SparseLinear]]:
    """``(averaged's layer, model's layer)`` for every sparse layer, in ``modules()`` order, checked."""
    for argument, module in (("averaged", averaged), ("model", model)):
        if not isinstance(module, nn.Module):
            raise TypeError(f"align_topology: {argument} must be an nn.Module, got {type(module).__name__}")
    named = [(name, m) for name, m in averaged.named_modules() if isinstance(m, SparseLinear)]
    sources = [m for m in model.modules() if isinstance(m, SparseLinear)]
    if len(named) != len(sources):
        raise ValueError(
            f"align_topology: the averaged model has {len(named)} sparse layers and the model {len(sources)}; "
            "averaged must be a copy of model"
        )
    for (name, layer), source in zip(named, sources):
        name = name or "the averaged model"
        mine = (type(layer).__name__, layer.out_features, layer.in_features)
        theirs = (type(source).__name__, source.out_features, source.in_features)
        if mine != theirs:
            raise ValueError(
                f"align_topology: sparse layer {name} is {mine[0]} of shape {mine[1:]}, its counterpart in the "
                f"model {theirs[0]} of shape {theirs[1:]}; averaged must be a copy of model"
            )
        if is_sharded(layer.values) or is_sharded(source.values):
            raise NotImplementedError(f"align_topology: sparse layer {name} holds sharded values (FSDP)")
    return [(layer, source) for (_, layer), source in zip(named, sources)]


def _coordinates(layer: SparseLinear, source: SparseLinear) -> tuple[Tensor, ...]:
    return layer.row, layer.col, source.row, source.col


def _stamp(layer: SparseLinear, source: SparseLinear) -> tuple:
    """``(weak reference, version)`` of each of the pair's ``row``/``col`` (weak: the record must
    not keep a rewired-away topology alive)."""
    return tuple((weakref.ref(t), _version(t)) for t in _coordinates(layer, source))


def _seen_aligned(layer: SparseLinear, source: SparseLinear) -> bool:
    """Whether both layers hold the very tensors, unchanged in place, they held when last aligned
    (never for inference tensors, which have no version counter)."""
    seen = _ALIGNED.get(layer)
    return seen is not None and all(
        ref() is tensor and version is not None and version == _version(tensor)
        for (ref, version), tensor in zip(seen, _coordinates(layer, source))
    )


def _aligned(layer: SparseLinear, source: SparseLinear) -> _NewTopology | None:
    """``layer``'s new topology (prepared, not installed), or ``None`` if it already has ``source``'s."""
    device = layer.values.device
    topology = source.topology  # validated (when its buffers changed since): the copy trusts them
    row, col = topology.row, topology.col
    same_row = row.shape == layer.row.shape and torch.equal(row.to(device), layer.row)
    if same_row and torch.equal(col.to(device), layer.col):
        return None
    # copies, never views of the model's buffers: a later in-place change of one must not reach the other
    row = row.to(device=device, dtype=torch.int32, copy=True)
    col = col.to(device=device, dtype=torch.int32, copy=True)
    src = matching_positions(layer.row, layer.col, row, col)
    values = take_or_fill(layer.values.detach(), src, 0.0)
    new = positions_where(src, "<", 0)  # (a pass over src, not a where() over every value: 2-3x faster)
    fresh = source.values.detach().index_select(0, new.to(source.values.device))
    values.index_copy_(0, new, fresh.to(device=device, dtype=values.dtype))
    return layer._prepare_topology(row, col, values, made_for_it=True)


class AveragedModel(_TorchAveragedModel):
    """``torch.optim.swa_utils.AveragedModel`` for models with sparse layers (EMA, SWA).

    Arguments and use as torch's (``avg_fn``, ``multi_avg_fn``, e.g.
    ``get_ema_multi_avg_fn(0.999)``, ``use_buffers``, ``device``; ``update_bn`` works on it),
    with two differences, both for sparse layers:

    - :meth:`update_parameters` first gives the averaged copy the model's topology
      (:func:`align_topology`): after a rewire, connections both hold keep their average, new
      connections start from the model's value, dropped ones leave the average. So an EMA can
      follow dynamic sparse training (``dst.step()``, then ``ema.update_parameters(model)``).
    - The layers' ``row``/``col`` are never averaged, also with ``use_buffers=True`` (torch's
      EMA would round them down and break the topology): they follow the model.

    Everything else (dense layers' parameters, floating buffers with ``use_buffers=True``,
    BatchNorm's ``num_batches_tracked``) is averaged, or copied, as torch does.
    """

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Align the sparse topologies with ``model``'s, then average ``model`` into this copy.

        Raises ``ValueError`` (changing nothing) if ``model`` is not of this copy's structure: its
        sparse layers (:func:`align_topology`), or the number or shapes of the other tensors, differ.
        """
        averaged, current = _averaged_tensors(self.module, self.use_buffers), _averaged_tensors(model, self.use_buffers)
        kept, followed = _followed_buffers(self.module, self.use_buffers), _followed_buffers(model, self.use_buffers)
        _check_same_structure(averaged, current, kept, followed, _sparse_values(self.module))
        align_topology(self.module, model)
        # after the alignment: it gave the sparse layers' values new data
        current = [tensor.detach().to(mine.device) for mine, tensor in zip(averaged, current)]
        averaged = [tensor.detach() for tensor in averaged]
        if self.n_averaged == 0:
            for mine, tensor in zip(averaged, current):
                mine.copy_(tensor)
        else:
            self._average(averaged, current)
        for mine, tensor in zip(kept, followed):
            mine.detach().copy_(tensor.detach().to(mine.device))
        self.n_averaged += 1

    def _average(self, averaged: list[Tensor], current: list[Tensor]) -> None:
        """Move ``averaged`` towards ``current`` with torch's choice of function: ``avg_fn`` per
        tensor if given; else ``multi_avg_fn`` (default: SWA's) per device and dtype, per tensor
        where the device has no foreach kernels."""
        if self.avg_fn is not None and self.multi_avg_fn is None:
            for mine, tensor in zip(averaged, current):
                mine.copy_(self.avg_fn(mine, tensor, self.n_averaged.to(mine.device)))
            return
        grouped = _group_tensors_by_device_and_dtype([averaged, current])
        for (device, _), ([mine, tensors], _) in grouped.items():
            n_averaged = self.n_averaged.to(device)
            if self.multi_avg_fn is not None:
                self.multi_avg_fn(mine, tensors, n_averaged)
            elif device is not None and device.type in _get_foreach_kernels_supported_devices():
                torch.optim.swa_utils.get_swa_multi_avg_fn()(mine, tensors, n_averaged)
            else:
                swa = torch.optim.swa_utils.get_swa_avg_fn()
                for one, tensor in zip(mine, tensors):
                    one.copy_(swa(one, tensor, n_averaged))


def _check_same_structure(
    averaged: list[Tensor], current: list[Tensor], kept: list[Tensor], followed: list[Tensor], sparse: set[int]
) -> None:
    """Raise ``ValueError`` unless the model's tensors pair with the copy's (sparse layers'
    ``values`` excepted: their sizes follow the topology, which :func:`align_topology` checks)."""
    if len(averaged) != len(current) or len(kept) != len(followed):
        raise ValueError(
            f"AveragedModel.update_parameters: the model has {len(current)} tensors to average and "
            f"{len(followed)} buffers to copy, the averaged copy {len(averaged)} and {len(kept)}; pass a model "
            "of the structure this AveragedModel was made from"
        )
    for mine, tensor in [*zip(averaged, current), *zip(kept, followed)]:
        if id(mine) not in sparse and mine.shape != tensor.shape:
            raise ValueError(
                f"AveragedModel.update_parameters: a tensor of shape {tuple(tensor.shape)} in the model pairs with "
                f"one of shape {tuple(mine.shape)} in the averaged copy; pass a model of the structure this "
                "AveragedModel was made from"
            )


def _sparse_values(module: nn.Module) -> set[int]:
    """ids of the ``values`` Parameters of ``module``'s sparse layers."""
    return {id(m.values) for m in module.modules() if isinstance(m, SparseLinear)}


def _index_buffers(module: nn.Module) -> set[int]:
    """ids of the ``row``/``col`` buffers of ``module``'s sparse layers."""
    return {id(t) for m in module.modules() if isinstance(m, SparseLinear) for t in (m.row, m.col)}


def _averaged_tensors(module: nn.Module, use_buffers: bool) -> list[Tensor]:
    """What is averaged: the parameters, and with ``use_buffers`` the buffers but the sparse coordinates."""
    if not use_buffers:
        return list(module.parameters())
    coordinates = _index_buffers(module)
    return [*module.parameters(), *(b for b in module.buffers() if id(b) not in coordinates)]


def _followed_buffers(module: nn.Module, use_buffers: bool) -> list[Tensor]:
    """What is copied from the model: without ``use_buffers`` its buffers but the sparse
    coordinates (which :func:`align_topology` keeps in step, without a copy that would make the
    layers rebuild their index data)."""
    if use_buffers:
        return []
    coordinates = _index_buffers(module)
    return [b for b in module.buffers() if id(b) not in coordinates]
