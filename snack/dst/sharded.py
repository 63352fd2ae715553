"""DST on layers whose ``values`` FSDP shards (``fully_shard``: a ``DTensor`` per parameter).

A rewiring moves connections anywhere in a layer, so it needs the whole ``values`` and the whole
optimizer state, of which each rank holds a shard. During an update, :class:`WholeLayers` puts a
plain Parameter holding the gathered tensor in each sharded layer's place (in the layer and in
the optimizer, with the gathered state), the update runs as for any layer, and each rank then
copies its shard of the result into the sharded tensors in place: FSDP keeps the Parameters and
the storage it shards. Only updates that keep nnz can be written back so (a shard's size is
fixed once ``fully_shard`` ran): the algorithms that change nnz refuse sharded layers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from snack.nn import SparseLinear

__all__ = ["WholeLayers", "check_not_sharded", "check_sharded_layers", "is_sharded"]


def is_sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP's sharded parameters and their optimizer state)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def check_sharded_layers(model, algorithm: str, keeps_nnz: bool, group) -> None:
    """Raise if a SparseLinear of ``model`` has sharded ``values`` that ``algorithm`` cannot act
    on: ``NotImplementedError`` when its updates change nnz (not ``keeps_nnz``), as a shard keeps
    its size; ``ValueError`` unless the layer is sharded over exactly the ranks of ``group``
    (``None``: this rank alone), which then update it together (rank 0 deciding for all): ranks
    acting apart would write back shards of different layers. Checked before any collective, so
    every rank (all sharded alike) raises."""
    if not isinstance(model, nn.Module):
        return
    ranks = sorted(torch.distributed.get_process_group_ranks(group)) if group is not None else None
    for name, module in model.named_modules():
        if not (isinstance(module, SparseLinear) and is_sharded(module.values)):
            continue
        if not keeps_nnz:
            raise NotImplementedError(
                f"{algorithm} changes the nnz of its layers, and layer {name!r} holds sharded values (a DTensor, as "
                "FSDP's fully_shard makes), whose shards keep the size they were made with. Under FSDP use an "
                f"algorithm that keeps nnz (SET, RigL, a DropGrow subclass); for {algorithm}, wrap the model in "
                "DistributedDataParallel (rebuilt after each update that changed the topology)."
            )
        sharding = sorted(module.values.device_mesh.mesh.flatten().tolist())
        if sharding != ranks and not (ranks is None and len(sharding) == 1):
            acting = f"ranks {ranks}" if ranks is not None else "this rank alone (process_group=False)"
            raise ValueError(
                f"layer {name!r} is sharded over ranks {sharding}, but this DST object acts with {acting}: "
                "pass process_group=None (all ranks) or the process group of the FSDP mesh, so that the ranks "
                "holding a layer's shards update it together"
            )


def check_not_sharded(name: str, layer: SparseLinear) -> None:
    """Raise ``NotImplementedError`` if ``layer.values`` is sharded: :func:`snack.dst.rewire`
    changes one layer's tensors in place, which each rank holds a shard of (a DST object gathers
    them for its updates). ``name`` starts the message."""
    if is_sharded(layer.values):
        raise NotImplementedError(
            f"{name} holds sharded values (a DTensor, as FSDP's fully_shard makes): snack.dst.rewire needs the whole "
            "layer; under FSDP rewire through a DST object (SET, RigL, a DropGrow subclass), which gathers it"
        )


class WholeLayers:
    """The layers of ``layers`` whose ``values`` are sharded, whose whole tensors :meth:`gather`
    puts in place for an update; a context manager that puts the sharded Parameters back on
    leaving (unchanged unless :meth:`write_back` ran)."""

    def __init__(self, layers: list[tuple[str, SparseLinear]], optimizer: torch.optim.Optimizer):
        self.sharded = [(name, layer) for name, layer in layers if is_sharded(layer.values)]
        self.optimizer = optimizer
        self.swaps: list[_WholeLayer] = []

    def __enter__(self) -> WholeLayers:
        return self

    def __exit__(self, *exc_info) -> None:
        for swap in reversed(self.swaps):
            swap.restore()
        self.swaps = []

    def gather(self) -> None:
        """Put a plain Parameter of each sharded layer's whole ``values`` in its place, in the
        layer and in the optimizer, with its state gathered: collectives, which every rank runs
        (with the same layers: the ranks agreed on the update before)."""
        for name, layer in self.sharded:
            self.swaps.append(_WholeLayer(name, layer, self.optimizer))

    def write_back(self) -> None:
        """Copy this rank's shard of each whole tensor (rewired by now) into the sharded ones."""
        for swap in self.swaps:
            swap.write_back()


class _WholeLayer:
    """One sharded layer with its whole ``values`` (and optimizer state) put in place."""

    def __init__(self, name: str, layer: SparseLinear, optimizer: torch.optim.Optimizer):
        self.name, self.layer, self.optimizer = name, layer, optimizer
        self.sharded = layer.values
        self.sharded_state = optimizer.state.get(self.sharded)
        whole = nn.Parameter(self.sharded.full_tensor().detach().clone(), requires_grad=self.sharded.requires_grad)
        state = None
        if self.sharded_state is not None:
            state = {key: value.full_tensor().detach().clone() if is_sharded(value) else value
                     for key, value in self.sharded_state.items()}  # fmt: skip
        self.whole = whole
        self.group, self.slot = next(
            (group, i) for group in optimizer.param_groups for i, p in enumerate(group["params"]) if p is self.sharded
        )
        layer._parameters["values"] = whole
        self.group["params"][self.slot] = whole
        optimizer.state.pop(self.sharded, None)
        if state is not None:
            optimizer.state[whole] = state

    def write_back(self) -> None:
        """Copy this rank's shard of the (rewired) whole values and state into the sharded ones."""
        if self.layer.values.shape != self.sharded.shape:  # the algorithms that change nnz refuse FSDP
            raise RuntimeError(f"{self.name}: a sharded layer's nnz cannot change (FSDP's shards have fixed sizes)")
        with torch.no_grad():
            _copy_shard(self.layer.values.detach(), self.sharded)
            state = self.optimizer.state.get(self.whole)
            if self.sharded_state is not None and state is not None:
                for key, value in state.items():
                    old = self.sharded_state[key]
                    if is_sharded(old):
                        _copy_shard(value, old)
                    else:
                        self.sharded_state[key] = value
        self.sharded.grad = None  # it belonged to the old connections

    def restore(self) -> None:
        self.layer._parameters["values"] = self.sharded
        self.group["params"][self.slot] = self.sharded
        self.optimizer.state.pop(self.whole, None)
        if self.sharded_state is not None:
            self.optimizer.state[self.sharded] = self.sharded_state


def _copy_shard(whole: Tensor, sharded: Tensor) -> None:
    """Copy into ``sharded`` (a DTensor) this rank's part of ``whole``, laid out as it is."""
    from torch.distributed.tensor import distribute_tensor

    # every rank holds the same whole tensor: each takes its own shard, without communicating
    mine = distribute_tensor(whole.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None)
    sharded.to_local().copy_(mine.to_local())
