"""snack.AveragedModel and snack.align_topology: EMA/SWA of models whose sparse layers rewire,
against a dense oracle that averages each connection over the updates it existed in."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel as TorchAveragedModel
from torch.optim.swa_utils import get_ema_multi_avg_fn, update_bn

import snack
from tests.test_truly_sparse import LargestTensorMode


def _model(dtype=torch.float64) -> nn.Sequential:
    return nn.Sequential(
        snack.SparseLinear(9, 7, sparsity=0.6), nn.BatchNorm1d(7), nn.ReLU(), snack.SparseLinear(7, 5, sparsity=0.4),
        nn.Linear(5, 3),
    ).to(dtype)


def _sparse_layers(model: nn.Module) -> list[snack.SparseLinear]:
    return [m for m in model.modules() if isinstance(m, snack.SparseLinear)]


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model.train()
    loss = model(torch.randn(6, 9, dtype=torch.float64)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _random_rewire(layer: snack.SparseLinear, optimizer, generator: torch.Generator, kind: int) -> None:
    """One of four topology changes: a DST rewire of equal nnz, a smaller topology (set_topology),
    no connection at all, or another topology of equal nnz loaded in place through the state_dict."""
    size = layer.out_features * layer.in_features
    if kind == 0:
        drop = torch.randperm(layer.nnz, generator=generator)[: max(1, layer.nnz // 3)]
        free = torch.ones(size, dtype=torch.bool)
        free[(layer.row.long() * layer.in_features + layer.col.long())] = False
        grow = free.nonzero().flatten()[torch.randperm(int(free.sum()), generator=generator)[: drop.numel()]]
        snack.dst.rewire(layer, optimizer, drop, grow, grow_values=torch.randn(grow.numel(), generator=generator))
    elif kind == 1:
        positions = torch.randperm(size, generator=generator)[: size // 5].sort().values
        values = torch.randn(positions.numel(), generator=generator, dtype=layer.values.dtype)
        layer.set_topology(positions // layer.in_features, positions % layer.in_features, values)
        optimizer.state.pop(layer.values, None)
    elif kind == 2:
        empty = torch.zeros(0, dtype=torch.int64)
        layer.set_topology(empty, empty)
        optimizer.state.pop(layer.values, None)
    else:
        positions = torch.randperm(size, generator=generator)[: layer.nnz].sort().values
        other = snack.SparseLinear.from_coo(
            positions // layer.in_features, positions % layer.in_features,
            torch.randn(positions.numel(), generator=generator, dtype=layer.values.dtype),
            shape=(layer.out_features, layer.in_features), bias=layer.bias.detach(),
        )
        row = layer.row
        layer.load_state_dict(other.state_dict())
        assert layer.row is row, "loaded in place: the case a check of identity alone would miss"


class DenseOracle:
    """Each layer's average as a dense matrix plus the mask of the connections it holds."""

    def __init__(self, update):
        self.update, self.averages, self.masks = update, None, None

    def step(self, layers, n_averaged: int) -> None:
        weights = [layer.to_dense().detach() for layer in layers]
        masks = [_connection_mask(layer) for layer in layers]
        if self.averages is None:
            self.averages = weights
        else:
            starts = [
                torch.where(old_mask & mask, average, weight)
                for average, old_mask, mask, weight in zip(self.averages, self.masks, masks, weights)
            ]
            self.averages = [
                self.update(start, weight, n_averaged) * mask for start, weight, mask in zip(starts, weights, masks)
            ]
        self.masks = masks


def _connection_mask(layer: snack.SparseLinear) -> torch.Tensor:
    """``(out, in)`` bool: where the layer holds a connection (the test's dense oracle)."""
    mask = torch.zeros(layer.out_features, layer.in_features, dtype=torch.bool)
    mask[layer.row.long(), layer.col.long()] = True
    return mask


REWIRES = [0, 3, 2, 1]  # the empty topology (2) is followed by one grown from nothing (1)

UPDATES = {
    "swa": (lambda: {}, lambda start, weight, n: start + (weight - start) / (n + 1)),
    "ema": (
        lambda: {"multi_avg_fn": get_ema_multi_avg_fn(0.8)},
        lambda start, weight, n: torch.lerp(start, weight, 0.2),
    ),
    "avg_fn": (
        lambda: {"avg_fn": lambda average, current, n: 0.5 * average + 0.5 * current},
        lambda start, weight, n: 0.5 * start + 0.5 * weight,
    ),
}


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("update", sorted(UPDATES))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_average_of_each_connection_over_the_updates_it_existed_in(update, use_buffers, seed):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    arguments, oracle_update = UPDATES[update]
    averaged = snack.AveragedModel(model, use_buffers=use_buffers, **arguments())
    oracle = DenseOracle(oracle_update)
    for step in range(12):
        _train_step(model, optimizer)
        if step % 3 == 1:
            for layer in _sparse_layers(model):
                _random_rewire(layer, optimizer, generator, kind=REWIRES[(step // 3 + seed) % 4])
        averaged.update_parameters(model)
        oracle.step(_sparse_layers(model), step)
        for mine, theirs, expected in zip(_sparse_layers(averaged.module), _sparse_layers(model), oracle.averages):
            assert torch.equal(mine.row, theirs.row) and torch.equal(mine.col, theirs.col)
            assert mine.row is not theirs.row and mine.values is not theirs.values
            torch.testing.assert_close(mine.to_dense(), expected)
    assert int(averaged.n_averaged) == 12
    x = torch.randn(4, 9, dtype=torch.float64)
    averaged.eval()
    # the averaged copy computes with its averages and its topology: dense math on them
    hidden = _sparse_layers(averaged.module)[0]
    expected = nn.functional.linear(x, hidden.to_dense(), hidden.bias)
    torch.testing.assert_close(averaged.module[0](x), expected)
    assert averaged(x).shape == (4, 3)


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("update", sorted(UPDATES))
def test_without_rewires_it_averages_as_torchs_averaged_model(update, use_buffers):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    arguments, _ = UPDATES[update]
    ours = snack.AveragedModel(model, use_buffers=use_buffers, **arguments())
    torchs = TorchAveragedModel(model, use_buffers=use_buffers, **arguments())
    for _ in range(5):
        _train_step(model, optimizer)
        ours.update_parameters(model)
        torchs.update_parameters(model)
    expected = torchs.state_dict()
    for key, value in ours.state_dict().items():
        if key.endswith((".row", ".col")):
            # torch's EMA with use_buffers averages the coordinates too, rounding them down
            assert torch.equal(value, model.state_dict()[key.removeprefix("module.")]), key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, expected[key]), key


def test_an_ema_of_buffers_keeps_the_coordinates_a_topology():
    """torch's AveragedModel with an EMA and use_buffers=True rounds row/col down: after three
    updates the copy's coordinates hold duplicates. Ours copies them."""
    torch.manual_seed(0)
    model = nn.Sequential(snack.SparseLinear(8, 6, sparsity=0.5), nn.BatchNorm1d(6))
    torchs = TorchAveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ours = snack.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for _ in range(3):
        model(torch.randn(4, 8))  # moves BatchNorm's statistics
        torchs.update_parameters(model)
        ours.update_parameters(model)
    assert not torch.equal(torchs.module[0].row, model[0].row), "the failure this guards against"
    assert torch.equal(ours.module[0].row, model[0].row) and torch.equal(ours.module[0].col, model[0].col)
    torch.testing.assert_close(ours.module[1].running_mean, torchs.module[1].running_mean)
    ours(torch.randn(2, 8))


def test_unchanged_coordinates_are_neither_compared_nor_replaced():
    model = _model()
    averaged = snack.AveragedModel(model)
    averaged.update_parameters(model)
    layer = averaged.module[0]
    row, col, topology = layer.row, layer.col, layer.topology
    calls = []
    original = torch.equal
    try:
        torch.equal = lambda *args: calls.append(1) or original(*args)
        averaged.update_parameters(model)
    finally:
        torch.equal = original
    assert calls == [], "aligned pairs seen before are not compared again"
    assert layer.row is row and layer.col is col and layer.topology is topology, "index data kept"
    model[0].row.add_(0)  # an in-place write (DDP's broadcast): compared again, still aligned
    averaged.update_parameters(model)
    assert layer.row is row


def test_a_model_that_is_not_a_copy_is_refused_and_nothing_changes():
    model = _model()
    averaged = snack.AveragedModel(model)
    averaged.update_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    snack.dst.rewire(model[0], optimizer, torch.tensor([0]), _a_free_position(model[0]))
    before = copy.deepcopy(averaged.state_dict())
    others = {
        "fewer sparse layers": nn.Sequential(*list(model)[:3], nn.Linear(7, 5), model[4]),
        "other shape": nn.Sequential(*list(model)[:3], snack.SparseLinear(7, 4).double(), model[4]),
        "other type": nn.Sequential(*list(model)[:3], snack.SparseConv1d(7, 5, 1).double(), model[4]),
        "dense tensors of other shapes": nn.Sequential(*list(model)[:4], nn.Linear(5, 2).double()),
        "more tensors": nn.Sequential(*list(model), nn.Linear(3, 3).double()),
    }
    for why, other in others.items():
        with pytest.raises(ValueError, match="copy of model|structure"):
            averaged.update_parameters(other)
        after = averaged.state_dict()
        assert before.keys() == after.keys(), why
        for key in before:
            assert torch.equal(before[key], after[key]), (why, key)
    model[3].row[0] = 99  # the model's coordinates broken in place: validated, not copied
    with pytest.raises(ValueError, match="row index 99 is out of range"):
        averaged.update_parameters(model)
    assert all(torch.equal(before[key], value) for key, value in averaged.state_dict().items())
    with pytest.raises(TypeError, match="model must be an nn.Module, got Tensor"):
        snack.align_topology(averaged.module, torch.zeros(3))
    with pytest.raises(TypeError, match="averaged must be an nn.Module, got dict"):
        snack.align_topology({}, model)


def test_sharded_layers_are_refused(monkeypatch):
    """FSDP shards values across ranks; an averaged copy of them is not supported (a DTensor
    cannot be made on one process here: the check is what is tested)."""
    model = _model()
    averaged = snack.AveragedModel(model)
    monkeypatch.setattr(snack.averaging, "is_sharded", lambda values: values is model[3].values)
    with pytest.raises(NotImplementedError, match="sparse layer 3 holds sharded values"):
        snack.align_topology(averaged.module, model)


def _a_free_position(layer: snack.SparseLinear) -> torch.Tensor:
    held = set((layer.row.long() * layer.in_features + layer.col.long()).tolist())
    return torch.tensor([next(p for p in range(layer.out_features * layer.in_features) if p not in held)])


def test_align_topology_pairs_layers_in_order_and_keeps_the_copys_device_and_dtype():
    model = _model(torch.float32)
    copy_ = copy.deepcopy(model).double()
    wrapped = nn.ModuleDict({"inner": model})  # other names (as DDP's module. or compile's _orig_mod.)
    layer = model[3]
    kept_value = copy_[3].values[1].item()
    kept = (int(layer.row[1]), int(layer.col[1]))
    snack.dst.rewire(layer, torch.optim.SGD(model.parameters(), lr=0.1), torch.tensor([0]), _a_free_position(layer),
                     grow_values=torch.tensor([2.5]))
    snack.align_topology(copy_, wrapped)
    mine = copy_[3]
    assert mine.values.dtype == torch.float64 and torch.equal(mine.row, layer.row) and torch.equal(mine.col, layer.col)
    dense = mine.to_dense()
    assert dense[kept] == kept_value, "a connection both hold keeps the copy's value"
    assert 2.5 in dense, "a new connection starts from the model's value"
    assert mine.row is not layer.row


def test_align_topology_never_builds_an_out_by_in_tensor():
    model = nn.Sequential(snack.SparseLinear(400, 300, sparsity=0.95))
    averaged = snack.AveragedModel(model)
    averaged.update_parameters(model)
    layer = model[0]
    drop = torch.arange(0, layer.nnz, 2)
    free = _a_free_position(layer)
    snack.dst.rewire(layer, torch.optim.SGD(model.parameters(), lr=0.1), drop, free)
    with LargestTensorMode() as mode:
        averaged.update_parameters(model)
    assert torch.equal(averaged.module[0].row, layer.row)
    assert mode.largest < 300 * 400 // 4, f"{mode.largest_op} produced {mode.largest} elements"


def test_an_ema_follows_rigl_and_update_bn_and_the_state_dict_work():
    torch.manual_seed(0)
    model = nn.Sequential(snack.SparseLinear(10, 16, sparsity=0.8), nn.BatchNorm1d(16), nn.ReLU(),
                          snack.SparseLinear(16, 2, sparsity=0.5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rigl = snack.dst.RigL(model, optimizer, update_every=2, total_steps=12, drop_fraction=0.5)
    ema = snack.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    rewired = 0
    for _ in range(8):
        loss = model(torch.randn(8, 10)).logsumexp(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rewired += rigl.step()
        ema.update_parameters(model)
        assert torch.equal(ema.module[0].row, model[0].row) and torch.equal(ema.module[0].col, model[0].col)
    assert rewired >= 2
    update_bn([torch.randn(8, 10) for _ in range(3)], ema)
    restored = snack.AveragedModel(nn.Sequential(snack.SparseLinear(10, 16, sparsity=0.3), nn.BatchNorm1d(16),
                                                 nn.ReLU(), snack.SparseLinear(16, 2, sparsity=0.9)))
    restored.load_state_dict(ema.state_dict())
    ema.eval(), restored.eval()
    x = torch.randn(5, 10)
    torch.testing.assert_close(restored(x), ema(x))


def test_a_compiled_average_follows_the_rewires():
    torch.manual_seed(0)
    model = _model(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.SET(model, optimizer, update_every=1, total_steps=10, drop_fraction=0.5)
    averaged = snack.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    compiled = torch.compile(averaged.module, backend="eager")
    x = torch.randn(4, 9)
    for _ in range(3):
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert dst.step()
        averaged.update_parameters(model)
        averaged.eval()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), averaged.module(x))
        assert torch.equal(averaged.module[0].row, model[0].row)
