"""SET, RigL and GradualPruning end to end: invariants, growth rule, optimizer state, resume."""

import copy
import gc
import inspect
import io
import re
import warnings

import pytest
import torch
from torch import nn

import snack
from conftest import check_topology_invariants
from snack.dst.prune_grow import linear_index
from snack.topology import random_coo


def _model(seed=0, sparsity=0.8):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 4))
    return snack.sparsify(net, sparsity, distribution="erk", init="random")


def _sparse_layers(model):
    return [m for m in model.modules() if isinstance(m, snack.SparseLinear)]


def _batches(n, seed=0, batch=8):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=gen), torch.randint(0, 4, (batch,), generator=gen)) for _ in range(n)]


def _train(model, opt, dst, batches):
    changed = 0
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        changed += dst.step()
    return changed


@pytest.mark.parametrize(
    "algorithm, options",
    [(snack.dst.SET, {}), (snack.dst.SET, {"split_sign": True, "grow_init": "random"}), (snack.dst.RigL, {}),
     (snack.dst.SRigL, {}), (snack.dst.SRigL, {"grow_init": "random"})],
    ids=["set", "set-split-sign", "rigl", "srigl", "srigl-random-init"],
)
def test_invariants_hold_after_many_updates(algorithm, options):
    model = _model()
    layers = _sparse_layers(model)
    nnz = [m.nnz for m in layers]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = algorithm(
        model, opt, drop_fraction=0.3, update_every=2, total_steps=80, stop_fraction=1.0, schedule="constant", **options
    )
    assert _train(model, opt, dst, _batches(80)) == 40
    for layer, n in zip(layers, nnz):
        check_topology_invariants(layer, n)
        assert opt.state[layer.values]["exp_avg"].shape == (n,)


def test_updates_stop_after_stop_fraction_and_return_flags():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.SET(model, opt, update_every=5, total_steps=40, stop_fraction=0.5)
    flags = []
    for x, y in _batches(40):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        flags.append(dst.step())
    assert [t + 1 for t, f in enumerate(flags) if f] == [5, 10, 15]  # step 20: cosine fraction is 0


ALGORITHMS = [
    snack.dst.SET, snack.dst.RigL, snack.dst.SRigL, snack.dst.GradualPruning, snack.dst.GraNet, snack.dst.MEST
]


def _options(algorithm, *, total_steps=1000, final_sparsity=0.95, start_step=0, end_step=10):
    """The arguments ``algorithm`` requires: the pruning schedule for GradualPruning and GraNet,
    ``total_steps`` for the others and GraNet."""
    options = {}
    if algorithm in (snack.dst.GradualPruning, snack.dst.GraNet):
        options.update(final_sparsity=final_sparsity, start_step=start_step, end_step=end_step)
    if algorithm is not snack.dst.GradualPruning:
        options.update(total_steps=total_steps)
    return options


def _squared_error(module, x, target):
    ((module(x) - target) ** 2).sum().backward()


def _relu_in_place_on_3d_input(module, x, target):
    y = module(x.reshape(1, *x.shape))  # (1, B, out): the layer returns a view of its (B, out) result
    torch.relu_(y)
    ((y - target) ** 2).sum().backward()


def _keyword_call(module, x, target):
    ((module(input=x) - target) ** 2).sum().backward()


def _two_backward_passes(module, x, target):
    y = module(x)
    (y**2).sum().backward(retain_graph=True)
    (y * target).sum().backward()  # .grad holds the sum of both


def _micro_batches_through_one_reused_buffer(module, x, target):
    buffer = torch.empty_like(x[:1])  # a static input buffer: each micro-batch (a row) is copied into it
    for row in range(x.shape[0]):
        buffer.copy_(x[row : row + 1])
        ((module(buffer) - target[row : row + 1]) ** 2).sum().backward()


def _input_changed_in_place_after_its_backward(module, x, target):
    x = x.clone()
    ((module(x) - target) ** 2).sum().backward()
    x.mul_(-2.0).add_(0.5)  # e.g. an adversarial step x.data.add_(...) between two passes
    ((module(x) - target) ** 2).sum().backward()


@pytest.mark.parametrize(
    "forward_backward",
    [
        _squared_error, _relu_in_place_on_3d_input, _keyword_call, _two_backward_passes,
        _micro_batches_through_one_reused_buffer, _input_changed_in_place_after_its_backward,
    ],
)  # fmt: skip
def test_rigl_grows_exactly_the_top_gradient_inactive_positions(forward_backward):
    torch.manual_seed(0)
    layer = snack.SparseLinear(10, 8, sparsity=0.7, dtype=torch.float64)
    old_key = linear_index(layer.topology)
    old_values = layer.values.detach().clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)  # weights stay put: the drop is predictable
    dst = snack.dst.RigL(layer, opt, drop_fraction=0.25, update_every=1, total_steps=10, schedule="constant")
    x, target = torch.randn(5, 10, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    forward_backward(layer, x, target)
    opt.step()
    # dense reference of dL/dW for the same batch and the same loss
    dense = nn.Linear(10, 8, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        dense.bias.copy_(layer.bias)
    forward_backward(dense, x, target)
    assert dst.step()
    _assert_rigl_update(layer, old_key, old_values, dense.weight.grad, drop_fraction=0.25)


def _assert_rigl_update(layer, old_key, old_values, dense_grad, drop_fraction):
    """The layer's topology is RigL's update of (old_key, old_values) for the dense gradient
    ``dense_grad (out, in)``: the smallest |w| dropped, the largest |grad| among positions inactive
    before the drop grown, at zero."""
    k = int(drop_fraction * old_key.numel())
    dropped = old_key[old_values.abs().sort(stable=True).indices[:k]]
    scores = dense_grad.abs().reshape(-1).clone()
    scores[old_key] = -1  # positions active before the drop are never grown
    grown = scores.topk(k).indices
    expected = (set(old_key.tolist()) - set(dropped.tolist())) | set(grown.tolist())
    assert set(linear_index(layer.topology).tolist()) == expected
    assert layer.nnz == old_key.numel()
    new = torch.isin(linear_index(layer.topology), grown)
    assert bool((layer.values[new] == 0).all())


@pytest.mark.parametrize("in_place", [False, True])
def test_rigl_scores_the_layers_own_gradient_when_a_forward_hook_changes_its_output(in_place):
    """A user's forward hook that rescales the output (gating, steering) was registered before
    RigL's recording hook, which then recorded the gradient with respect to the rescaled output:
    16 of 30 grown connections were not the top |dL/dW|. RigL's hook now runs first."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(10, 8, sparsity=0.7, dtype=torch.float64)
    scale = torch.rand(8, dtype=torch.float64) * 10
    layer.register_forward_hook(lambda module, args, out: out.mul_(scale) if in_place else out * scale)
    old_key, old_values = linear_index(layer.topology), layer.values.detach().clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = snack.dst.RigL(layer, opt, drop_fraction=0.25, update_every=1, total_steps=10, schedule="constant")
    x, target = torch.randn(5, 10, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    ((layer(x) - target) ** 2).sum().backward()
    weight = layer.to_dense().detach().requires_grad_()  # dL/dW of the layer's own weight
    ((nn.functional.linear(x, weight, layer.bias.detach()) * scale - target) ** 2).sum().backward()
    torch.testing.assert_close(layer.values.grad, weight.grad.reshape(-1)[old_key])
    opt.step()
    assert dst.step()
    _assert_rigl_update(layer, old_key, old_values, weight.grad, drop_fraction=0.25)


def test_a_model_armed_for_rigl_can_be_saved_and_copied():
    """The hooks of an armed step travel with the model as inert ones: a copy records nothing
    into the original's update."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.RigL(model, opt, update_every=1, total_steps=10)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    for other in (loaded, twin):
        other(torch.randn(2, 16)).sum().backward()
    with pytest.raises(RuntimeError, match="no gradient was recorded"):
        dst.step()
    assert dst.step_count == 0
    _train(model, opt, dst, _batches(1))  # the original still records and updates
    assert dst.step_count == 1


@pytest.mark.parametrize("cut", [1, 2], ids=["disarmed", "armed"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_model_optimizer_and_rigl_trains_like_the_original(cut, how):
    """Copied together, while the hooks are armed for the next step (cut 2) or not: the copy
    records in its own layers and updates exactly as the original does."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = snack.dst.RigL(model, opt, update_every=3, total_steps=30)
    batches = _batches(9)
    _train(model, opt, dst, batches[:cut])
    if how == "deepcopy":
        model2, opt2, dst2 = copy.deepcopy((model, opt, dst))
    else:
        buffer = io.BytesIO()
        torch.save((model, opt, dst), buffer)
        buffer.seek(0)
        model2, opt2, dst2 = torch.load(buffer, weights_only=False)
    assert [len(m._forward_hooks) for m in _sparse_layers(model2)] == [cut - 1] * 3  # no inert hook left
    assert _train(model, opt, dst, batches[cut:]) == _train(model2, opt2, dst2, batches[cut:]) == 3
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


def test_set_grows_only_inactive_positions():
    layer = snack.SparseLinear(10, 8, sparsity=0.5)
    old_key = linear_index(layer.topology)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = snack.dst.SET(layer, opt, drop_fraction=0.5, update_every=1, total_steps=10, schedule="constant")
    layer(torch.randn(2, 10)).sum().backward()
    assert dst.step()
    new_key = linear_index(layer.topology)
    grown = new_key[~torch.isin(new_key, old_key)]
    assert grown.numel() == int(0.5 * old_key.numel())  # nothing dropped was regrown
    assert bool((layer.values[~torch.isin(new_key, old_key)] == 0).all())


@pytest.mark.parametrize(
    "make_opt, keys",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ["momentum_buffer"]),
        (lambda p: torch.optim.Adam(p, lr=1e-2), ["exp_avg", "exp_avg_sq"]),
        (lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True), ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]),
        (lambda p: torch.optim.Adam(p, lr=1e-2, fused=True), ["exp_avg", "exp_avg_sq"]),
        (lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True), ["exp_avg", "exp_avg_sq"]),
    ],
    ids=["sgd-momentum", "adam", "adamw-amsgrad", "adam-fused", "adamw-foreach"],
)
def test_optimizer_state_is_remapped(make_opt, keys):
    model = _model()
    opt = make_opt(model.parameters())
    dst = snack.dst.RigL(model, opt, drop_fraction=0.3, update_every=3, total_steps=100, schedule="constant")
    batches = _batches(3)
    _train(model, opt, dst, batches[:2])
    layers = _sparse_layers(model)
    before = []
    for layer in layers:
        key = linear_index(layer.topology).tolist()
        before.append({name: dict(zip(key, opt.state[layer.values][name].tolist())) for name in keys})
    steps = {id(l): opt.state[l.values].get("step") for l in layers}
    steps = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in steps.items()}
    groups_before = [list(map(id, g["params"])) for g in opt.param_groups]
    _train(model, opt, dst, batches[2:])  # opt.step() then the update
    for layer, old in zip(layers, before):
        if layer.sparsity == 0.0:
            continue
        # state after opt.step() of step 3, then remapped: compare kept with a fresh step on old values
        state = opt.state[layer.values]
        key = linear_index(layer.topology).tolist()
        for name in keys:
            new = dict(zip(key, state[name].tolist()))
            grown = [p for p in key if p not in old[name]]
            assert grown and all(new[p] == 0.0 for p in grown)
            assert state[name].shape == layer.values.shape
        if torch.is_tensor(steps[id(layer)]):
            assert torch.equal(state["step"], steps[id(layer)] + 1)  # scalar state untouched by the remap
    assert [list(map(id, g["params"])) for g in opt.param_groups] == groups_before
    opt.load_state_dict(opt.state_dict())  # still a valid optimizer state_dict


@pytest.mark.parametrize(
    "make_opt, fresh",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {"momentum_buffer": 0.0}),
        (lambda p: torch.optim.Adam(p, lr=1e-2), {"exp_avg": 0.0, "exp_avg_sq": 0.0}),
        (lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True), {"exp_avg": 0.0, "exp_avg_sq": 0.0,
                                                                 "max_exp_avg_sq": 0.0}),
        (lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, fused=True),
         {"exp_avg": 0.0, "exp_avg_sq": 0.0, "max_exp_avg_sq": 0.0}),
        (lambda p: torch.optim.Adagrad(p, lr=1e-2, initial_accumulator_value=0.25), {"sum": 0.25}),
        (lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
         {"square_avg": 0.0, "momentum_buffer": 0.0, "grad_avg": 0.0}),
    ],
    ids=["sgd-momentum", "adam", "adamw-amsgrad", "adamw-amsgrad-fused", "adagrad", "rmsprop"],
)
def test_optimizer_state_of_kept_connections_is_copied_exactly(make_opt, fresh):
    layer = snack.SparseLinear(10, 8, sparsity=0.6)
    opt = make_opt(layer.parameters())
    for _ in range(2):
        layer(torch.randn(4, 10)).pow(2).sum().backward()
        opt.step()
    old_key = linear_index(layer.topology).tolist()
    old = {n: dict(zip(old_key, opt.state[layer.values][n].tolist())) for n in fresh}
    step = opt.state[layer.values].get("step")
    drop = torch.tensor([1, 2, 7])
    grow = snack.dst.random_grow(layer.topology, 3, torch.Generator().manual_seed(0))
    snack.dst.rewire(layer, opt, drop, grow)
    new_key = linear_index(layer.topology).tolist()
    grown = set(grow.tolist())
    for n, start in fresh.items():
        assert len(opt.state[layer.values][n]) == len(new_key)
        for p, v in zip(new_key, opt.state[layer.values][n].tolist()):
            assert v == (start if p in grown else old[n][p]), (n, p)
    assert opt.state[layer.values].get("step") is step


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_fused_and_foreach_adamw_train_with_rigl_as_the_for_loop_one(implementation):
    """The multi-tensor implementations (fused=True: 3× faster for a 4096², 90% layer's values on
    the CPU) step the remapped state as the per-parameter loop does."""
    runs = {}
    for name in ("for-loop", implementation):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **({name: True} if name != "for-loop" else {}))
        dst = snack.dst.RigL(model, opt, update_every=3, total_steps=30, seed=0)
        assert _train(model, opt, dst, _batches(30)) > 0
        runs[name] = [t.clone() for t in model.state_dict().values()]
    for expected, got in zip(runs["for-loop"], runs[implementation], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _run(seed, algorithm=snack.dst.SET, steps=30):
    model = _model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = algorithm(model, opt, update_every=3, total_steps=steps, seed=seed)
    _train(model, opt, dst, _batches(steps))
    return [t.clone() for t in model.state_dict().values() if torch.is_tensor(t)]


def test_same_seed_same_run_different_seed_different_topology():
    a, b, c = _run(1), _run(1), _run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("algorithm", [snack.dst.SET, snack.dst.RigL, snack.dst.SRigL])
def test_resume_from_checkpoint_is_bitwise_identical(algorithm):
    batches = _batches(40)
    kwargs = dict(drop_fraction=0.3, update_every=4, total_steps=40, seed=7)

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = algorithm(model, opt, **kwargs)
    _train(model, opt, dst, batches[:15])  # stop just before update step 16: hooks are armed
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "dst": dst.state_dict()}, buffer)
    _train(model, opt, dst, batches[15:])

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed = _model(seed=99)  # different init and topology, replaced by the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed_dst = algorithm(resumed, resumed_opt, **kwargs)
    resumed_dst.load_state_dict(checkpoint["dst"])
    _train(resumed, resumed_opt, resumed_dst, batches[15:])

    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name
    assert dst.state_dict()["step"] == resumed_dst.state_dict()["step"] == 40
    assert torch.equal(dst.generator.get_state(), resumed_dst.generator.get_state())


def test_load_state_dict_rejects_another_configuration():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = snack.dst.SET(model, opt, update_every=10, total_steps=100).state_dict()
    with pytest.raises(ValueError, match=r"configuration differs \(total_steps: saved 100, this object 200\)$"):
        snack.dst.SET(model, opt, update_every=10, total_steps=200).load_state_dict(state)
    with pytest.raises(ValueError, match="algorithm"):
        snack.dst.RigL(model, opt, update_every=10, total_steps=100).load_state_dict(state)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_load_state_dict_rejects_malformed_states_naming_what_is_wrong(algorithm):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = algorithm(model, opt, **_options(algorithm, final_sparsity=0.9, start_step=0, end_step=100))
    state = dst.state_dict()
    before = copy.deepcopy(state)
    with pytest.raises(TypeError, match="expected the dict"):
        dst.load_state_dict(None)
    with pytest.raises(ValueError, match="no 'step' entry"):
        dst.load_state_dict({key: value for key, value in state.items() if key != "step"})
    # GradualPruning's, GraNet's and MEST's counts, which would later divide by zero or crash a step
    for key in {"initial_nnz", "target_nnz"} & state.keys():
        for bad in (["a"] * 3, [-5, 1, 1], [2.5, 1, 1], [10**9, 1, 1], [True, 1, 1]):
            with pytest.raises(ValueError, match=key):
                dst.load_state_dict({**state, key: bad})
    after = dst.state_dict()
    assert after.keys() == before.keys() and torch.equal(after["generator"], before["generator"])
    assert {k: v for k, v in after.items() if k != "generator"} == {k: v for k, v in before.items() if k != "generator"}


def test_numpy_numbers_are_accepted_as_arguments():
    np = pytest.importorskip("numpy")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.SET(model, opt, drop_fraction=np.float32(0.25), update_every=np.int64(2), total_steps=np.int64(10),
                        seed=np.int64(3))  # fmt: skip
    assert torch.equal(dst.generator.get_state(), torch.Generator().manual_seed(3).get_state())
    assert dst.state_dict()["config"]["total_steps"] == 10 and type(dst.state_dict()["config"]["total_steps"]) is int
    snack.dst.GradualPruning(model, opt, final_sparsity=np.float32(0.9), start_step=np.int64(0), end_step=np.int64(10))


class _ListHistorySGD(torch.optim.SGD):
    """SGD that also keeps per-element tensors inside a list (as LBFGS's history does)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("history", []).append(p.detach().clone())
        return super().step(closure)


def test_an_optimizer_keeping_tensors_in_lists_is_refused():
    # per-element state inside a list: a remap would miss it and leave it in the old order
    layer = snack.SparseLinear(6, 4, bias=False, sparsity=0.5)
    opt = _ListHistorySGD(layer.parameters(), lr=0.1)
    layer(torch.randn(5, 6)).square().sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="'history'.*inside a list"):
        snack.dst.SET(layer, opt, total_steps=1000)


@pytest.mark.parametrize("dense_first", [False, True])
def test_lbfgs_is_refused(dense_first):
    # LBFGS keeps one history of all parameters flattened together, in the state of the first
    # parameter only: with a dense layer first, no check of the sparse layer's state saw it
    sparse = snack.SparseLinear(6, 4, bias=False, sparsity=0.5)
    model = nn.Sequential(nn.Linear(6, 6), sparse) if dense_first else nn.Sequential(sparse)
    opt = torch.optim.LBFGS(model.parameters(), history_size=3)
    with pytest.raises(ValueError, match="cannot remap torch.optim.LBFGS"):
        snack.dst.SET(model, opt, total_steps=1000)


def test_a_dropped_armed_rigl_leaves_no_hooks_recording():
    """A DST object dropped while its hooks are armed (a notebook cell run again) must not leave
    them recording every later step into a capture nothing clears."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(32, 16, sparsity=0.5)
    opt = torch.optim.Adam(layer.parameters())
    dst = snack.dst.RigL(layer, opt, update_every=1, total_steps=100)  # armed for its first step
    assert layer._forward_hooks
    del dst
    gc.collect()
    assert not layer._forward_hooks
    layer(torch.randn(4, 32, requires_grad=True)).sum().backward()  # nothing to record into


def _live_tensors():
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # probing every object trips deprecated torch attributes
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("algorithm", [snack.dst.SET, snack.dst.RigL, snack.dst.SRigL])
def test_memory_does_not_grow_over_1000_updates(algorithm):
    torch.manual_seed(0)
    layer = snack.SparseLinear(12, 6, sparsity=0.7)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    dst = algorithm(
        layer, opt, drop_fraction=0.2, update_every=1, total_steps=2000, stop_fraction=1.0, schedule="constant"
    )
    x = torch.randn(4, 12)

    def steps(n):
        changed = 0
        for _ in range(n):
            layer(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            changed += dst.step()
        return changed

    steps(10)
    live, state_bytes = _live_tensors(), _state_bytes(layer, opt)
    assert steps(1000) == 1000
    assert _live_tensors() == live
    assert _state_bytes(layer, opt) == state_bytes


def _state_bytes(model, opt):
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = [*model.parameters(), *model.buffers(), *state]
    return sum(t.numel() * t.element_size() for t in tensors)


def _snapshot(model, opt):
    return copy.deepcopy((model.state_dict(), opt.state_dict()))


def _same(a, b):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma if torch.is_tensor(ma[k]))
    for sa, sb in zip(oa["state"].values(), ob["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k] for k in sa)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(drop_fraction=-0.1), ValueError, "drop_fraction"),
        (dict(drop_fraction=1.5), ValueError, "drop_fraction"),
        (dict(drop_fraction=float("nan")), ValueError, "drop_fraction"),
        (dict(update_every=0), ValueError, "update_every"),
        (dict(update_every=2.5), TypeError, "update_every"),
        (dict(total_steps=0), ValueError, "total_steps"),
        (dict(stop_fraction=2.0), ValueError, "stop_fraction"),
        (dict(schedule="linear"), ValueError, "schedule"),
        (dict(layers=["nope"]), ValueError, "layers"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(kwargs, error, match):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model, opt)
    with pytest.raises(error, match=match):
        snack.dst.RigL(model, opt, **{"total_steps": 10, "update_every": 1, **kwargs})
    assert not any(m._forward_hooks for m in model.modules())
    _same(before, _snapshot(model, opt))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(seed=2**70), ValueError, r"seed must be in \[0, 2\*\*64 - 1\].*got 1180591620717411303424"),
        (dict(seed=-1), ValueError, "seed must be >= 0"),
        (dict(seed=1.0), TypeError, "seed must be an int"),
        (dict(layers=[]), ValueError, "layers is empty"),
        (dict(layers=iter([])), ValueError, "layers is empty"),
        (dict(layers=0), TypeError, "layers must be None .* got int 0"),
    ],
)
@pytest.mark.parametrize("algorithm", ["SET", "RigL", "SRigL", "GradualPruning", "GraNet", "MEST"])
def test_bad_seed_and_layers_raise_a_clear_error_naming_them(algorithm, kwargs, error, match):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model, opt)
    algorithm = getattr(snack.dst, algorithm)
    with pytest.raises(error, match=match):
        algorithm(model, opt, **_options(algorithm), **kwargs)
    assert not any(m._forward_hooks for m in model.modules())
    _same(before, _snapshot(model, opt))


@pytest.mark.parametrize("algorithm", ["SET", "RigL", "SRigL", "GradualPruning", "GraNet", "MEST"])
@pytest.mark.parametrize(
    "make_iterable",
    [lambda names: (n for n in names), lambda names: filter(None, names), lambda names: iter(names)],
    ids=["generator", "filter", "iterator"],
)
def test_layers_may_be_a_one_shot_iterable(algorithm, make_iterable):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = getattr(snack.dst, algorithm)
    dst = algorithm(model, opt, layers=make_iterable(["0", "4"]), **_options(algorithm))
    assert [name for name, _ in dst.layers] == ["0", "4"]


@pytest.mark.parametrize("algorithm", ["SET", "RigL", "SRigL", "GradualPruning", "GraNet", "MEST"])
@pytest.mark.parametrize("layers", [None, ["0"]], ids=["all", "one of the two"])
def test_layers_sharing_one_values_parameter_are_refused(algorithm, layers):
    # a rewire of one would leave the other reading the new values at its old connections
    model = snack.sparsify(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), 0.5)
    model[2].set_topology(model[0].row, model[0].col)
    model[2].values = model[0].values
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = getattr(snack.dst, algorithm)
    with pytest.raises(ValueError, match="layers '0' and '2' share one values Parameter"):
        algorithm(model, opt, layers=layers, **_options(algorithm))


def test_model_without_sparse_layers_and_mismatched_optimizer_are_rejected():
    dense = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no SparseLinear"):
        snack.dst.SET(dense, torch.optim.SGD(dense.parameters(), lr=0.1), total_steps=1000)
    model = _model()
    other = torch.optim.SGD(_model(seed=1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not hold"):
        snack.dst.SET(model, other, total_steps=1000)
    with pytest.raises(TypeError, match="optimizer"):
        snack.dst.SET(model, "sgd", total_steps=1000)


def test_unknown_optimizer_state_shape_fails_before_any_change():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = snack.dst.SET(model, opt, update_every=2, total_steps=10, schedule="constant")
    _train(model, opt, dst, _batches(1))
    last = _sparse_layers(model)[-1]
    opt.state[last.values]["weird"] = torch.zeros(3, 3)
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="'weird'"):
        dst.step()
    _same(before, _snapshot(model, opt))
    assert dst.step_count == 1


@pytest.mark.parametrize("where", ["plan_rewire", "_data_swap"])
@pytest.mark.parametrize("algorithm", [snack.dst.SET, snack.dst.RigL, snack.dst.SRigL])
def test_a_failure_on_a_later_layer_leaves_every_layer_as_it_was(algorithm, where, monkeypatch):
    """Every layer's rewiring is computed, and every tensor it needs allocated, before any is
    applied: an error on the last one (here an allocation failure, while planning it or in the
    checks and copies of its new topology, which once ran while applying) leaves the first ones,
    the optimizer and the RNG untouched, and a retry gives the update an undisturbed run gives."""
    module = {"plan_rewire": snack.dst.base, "_data_swap": snack.nn.layer}[where]
    runs = []
    for fail in (True, False):
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        dst = algorithm(model, opt, update_every=2, total_steps=10, schedule="constant")
        x, y = _batches(2)[0]
        _train(model, opt, dst, [(x, y)])
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if fail:
            real, calls = getattr(module, where), []

            def failing(*args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise torch.OutOfMemoryError("simulated")
                return real(*args, **kwargs)

            before, rng = _snapshot(model, opt), dst.generator.get_state()
            with monkeypatch.context() as patch:
                patch.setattr(module, where, failing)
                with pytest.raises(torch.OutOfMemoryError):
                    dst.step()
            _same(before, _snapshot(model, opt))
            assert torch.equal(dst.generator.get_state(), rng) and dst.step_count == 1
        assert dst.step()
        runs.append(_snapshot(model, opt))
    _same(*runs)


def test_gradual_pruning_reaches_final_sparsity_from_any_initial_sparsity():
    model = _model(sparsity=0.5)
    layers = _sparse_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gp = snack.dst.GradualPruning(model, opt, final_sparsity=0.9, start_step=0, end_step=20, update_every=5,
                                  initial_sparsity=0.0)  # fmt: skip
    total = sum(m.out_features * m.in_features for m in layers)
    start = 1 - sum(m.nnz for m in layers) / total
    for t in range(1, 21):
        gp.step()
        # the schedule's sparsity from 0, once it passes the model's 0.5: 0.52 at step 5, ... 0.9
        expected = max(start, gp.sparsity(5 * (t // 5)))
        assert 1 - sum(m.nnz for m in layers) / total == pytest.approx(expected, abs=0.01)
    assert gp.sparsity(20) == 0.9


@pytest.mark.parametrize(
    "make_opt, key, fresh",
    [
        (lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.25), "sum", 0.25),
        (lambda p: torch.optim.Rprop(p, lr=0.03), "step_size", 0.03),
        (lambda p: torch.optim.Rprop(p, lr=0.03), "prev", 0.0),
    ],
    ids=["adagrad-sum", "rprop-step-size", "rprop-prev"],
)
def test_new_connections_get_the_state_the_optimizer_gives_a_fresh_parameter(make_opt, key, fresh):
    layer = snack.SparseLinear(10, 8, sparsity=0.6)
    opt = make_opt(layer.parameters())
    for _ in range(3):
        opt.zero_grad()
        layer(torch.randn(4, 10)).pow(2).sum().backward()
        opt.step()
    old_key = linear_index(layer.topology)
    old = dict(zip(old_key.tolist(), opt.state[layer.values][key].tolist()))
    grow = snack.dst.random_grow(layer.topology, 3, torch.Generator().manual_seed(0))
    snack.dst.rewire(layer, opt, torch.tensor([1, 2, 7]), grow)
    for p, v in zip(linear_index(layer.topology).tolist(), opt.state[layer.values][key].tolist()):
        assert v == pytest.approx(fresh if p in set(grow.tolist()) else old[p])


def test_rigl_update_without_a_recorded_gradient_is_an_error():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.RigL(model, opt, update_every=1, total_steps=10)
    before = _snapshot(model, opt)
    with torch.no_grad():
        model(torch.randn(2, 16))  # an eval pass records nothing
    with pytest.raises(RuntimeError, match="no gradient was recorded") as raised:
        dst.step()
    _same(before, _snapshot(model, opt))
    for cause in ("not used", "no_grad", "fullgraph"):  # the message lists the usual causes
        assert cause in str(raised.value)


def test_rigl_hooks_are_armed_only_before_update_steps():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.RigL(model, opt, update_every=3, total_steps=30)
    armed = []
    for x, y in _batches(7):
        armed.append(any(m._forward_hooks for m in _sparse_layers(model)))
        _train(model, opt, dst, [(x, y)])
    assert armed == [False, False, True, False, False, True, False]
    dst.remove()
    assert not any(m._forward_hooks for m in _sparse_layers(model))


def test_gradual_pruning_follows_the_cubic_schedule():
    model = _model(sparsity=0.5)
    layers = _sparse_layers(model)
    initial = [m.nnz for m in layers]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gp = snack.dst.GradualPruning(model, opt, final_sparsity=0.9, start_step=0, end_step=20, update_every=5)
    assert abs(gp.initial_sparsity - 0.5) < 0.01
    batches = _batches(30)
    for t, (x, y) in enumerate(batches, start=1):
        _train(model, opt, gp, [(x, y)])
        ratio = (1 - gp.sparsity(5 * (t // 5) if t <= 20 else 20)) / (1 - gp.initial_sparsity)
        for layer, n in zip(layers, initial):
            check_topology_invariants(layer, max(1, round(n * ratio)))
            assert opt.state[layer.values]["exp_avg"].shape == (layer.nnz,)
    total = sum(m.out_features * m.in_features for m in layers)
    assert abs(1 - sum(m.nnz for m in layers) / total - 0.9) < 0.01


def test_grow_init_random_draws_new_weights_within_the_layer_init_bound():
    layer = snack.SparseLinear(10, 8, sparsity=0.5)
    old_key = linear_index(layer.topology)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = snack.dst.SET(layer, opt, update_every=1, total_steps=10, schedule="constant", grow_init="random")
    assert dst.step()
    new = ~torch.isin(linear_index(layer.topology), old_key)
    bound = 1 / (layer.nnz / layer.out_features) ** 0.5
    assert bool((layer.values[new] != 0).all()) and bool((layer.values[new].abs() <= bound).all())


class _GradientGrowth(snack.dst.DropGrow):
    """RigL written with DropGrow's public hooks: it must reproduce RigL exactly."""

    needs_gradient = True

    def grow(self, layer, k):
        x, dy = self.recorded_batch(layer)
        return snack.dst.gradient_grow(x, dy, layer.topology, k)


def test_a_drop_grow_subclass_written_like_rigl_reproduces_rigl():
    runs = []
    for algorithm in (snack.dst.RigL, _GradientGrowth):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dst = algorithm(model, opt, drop_fraction=0.3, update_every=3, total_steps=30, seed=5)
        assert _train(model, opt, dst, _batches(30)) > 0
        runs.append(model.state_dict())
    for key, value in runs[0].items():
        if torch.is_tensor(value):
            assert torch.equal(value, runs[1][key]), key


def test_drop_grow_hooks_see_each_layer_its_count_and_the_recorded_batch():
    seen = []

    class Spy(snack.dst.DropGrow):
        needs_gradient = True

        def drop(self, layer, k):
            seen.append(("drop", layer, k))
            return torch.randperm(layer.nnz, generator=self.generator)[:k]

        def grow(self, layer, k):
            x, dy = self.recorded_batch(layer)
            seen.append(("grow", layer, k, x.shape, dy.shape))
            return snack.dst.random_grow(layer.topology, k, self.generator)

    model = _model()
    layers = _sparse_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = Spy(model, opt, drop_fraction=0.25, update_every=2, total_steps=10, schedule="constant")
    x, y = _batches(1)[0]
    for _ in range(2):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        dst.step()
    expected = []
    for layer in layers:
        k = layer.nnz // 4
        expected += [("drop", layer, k), ("grow", layer, k, (8, layer.in_features), (8, layer.out_features))]
    assert seen == expected
    with pytest.raises(RuntimeError, match="no batch is recorded"):
        dst.recorded_batch(layers[0])  # only while an update is planned
    with pytest.raises(ValueError, match="is not one of the layers"):
        dst.recorded_batch(snack.SparseLinear(4, 4))


@pytest.mark.parametrize(
    "returned, error, match",
    [
        (lambda layer, k: torch.arange(k - 1), ValueError, r"Bad\.grow must return \d+ positions for layer '0'"),
        (lambda layer, k: [0] * k, ValueError, r"Bad\.grow must return \d+ positions .* got list"),
        (lambda layer, k: snack.dst.prune_grow.linear_index(layer.topology)[:k], ValueError, "must be inactive"),
        (lambda layer, k: torch.zeros(k, dtype=torch.int64), ValueError, "must be unique"),
    ],
    ids=["too-few", "not-a-tensor", "active", "repeated"],
)
def test_a_drop_grow_hook_returning_bad_positions_raises_and_changes_nothing(returned, error, match):
    class Bad(snack.dst.DropGrow):
        def grow(self, layer, k):
            return returned(layer, k)

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = Bad(model, opt, update_every=1, total_steps=10, schedule="constant")
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    before, rng = _snapshot(model, opt), dst.generator.get_state()
    with pytest.raises(error, match=match):
        dst.step()
    _same(before, _snapshot(model, opt))
    assert torch.equal(dst.generator.get_state(), rng) and dst.step_count == 0


def test_a_drop_grow_subclass_without_grow_is_refused_at_construction():
    class NoGrowth(snack.dst.DropGrow):
        pass

    model = _model()
    with pytest.raises(TypeError, match="NoGrowth must implement grow"):
        NoGrowth(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=1000)


def _topology_and_values(layer):
    return layer.row.clone(), layer.col.clone(), layer.values.detach().clone()


def _unchanged(layer, before):
    return all(torch.equal(a, b) for a, b in zip(before, _topology_and_values(layer)))


@pytest.mark.parametrize("frozen_index", [0, 1], ids=["first", "middle"])
@pytest.mark.parametrize("algorithm", [snack.dst.SET, snack.dst.RigL, snack.dst.SRigL])
def test_a_frozen_layer_is_left_alone_until_it_is_unfrozen(algorithm, frozen_index):
    """The optimizer is built from every parameter (it skips those without a gradient); the DST
    object keeps the frozen layer, leaves it alone while it is frozen (RigL records nothing for it
    and does not raise), and updates it once it is unfrozen."""
    model = _model()
    layers = _sparse_layers(model)
    frozen = layers[frozen_index]
    frozen.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = algorithm(model, opt, update_every=2, total_steps=40, stop_fraction=1.0, schedule="constant")
    assert frozen in [layer for _, layer in dst.layers]
    before = _topology_and_values(frozen)
    others = [_topology_and_values(layer) for layer in layers if layer is not frozen]
    assert _train(model, opt, dst, _batches(6)) == 3
    assert _unchanged(frozen, before)
    assert not any(_unchanged(layer, b) for layer, b in zip([m for m in layers if m is not frozen], others))
    frozen.requires_grad_(True)
    _train(model, opt, dst, _batches(2, seed=1))
    assert not torch.equal(frozen.row * frozen.in_features + frozen.col, before[0] * frozen.in_features + before[1])
    check_topology_invariants(frozen, before[0].numel())


def test_an_optimizer_of_the_trainable_parameters_only_names_the_frozen_layer_it_lacks():
    model = _model()
    _sparse_layers(model)[0].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match=r"\['0'\] is frozen \(values.requires_grad is False\), which an optimizer"):
        snack.dst.SET(model, opt, total_steps=1000)


@pytest.mark.parametrize(
    "options, why",
    [
        (dict(total_steps=10), "updates stop after step 7 of 10 (update_every=100"),  # total_steps in epochs
        (dict(total_steps=8, update_every=6), "step 6, the only update step, has a drop fraction of 0"),
    ],
)
@pytest.mark.parametrize("algorithm", [snack.dst.SET, snack.dst.RigL, snack.dst.SRigL])
def test_a_schedule_that_never_changes_the_topology_warns(algorithm, options, why):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = f"{algorithm.__name__} will never change the topology: .*{re.escape(why)}"
    with pytest.warns(UserWarning, match=expected) as caught:
        dst = algorithm(model, opt, **options)
    assert caught[0].filename == __file__  # the line that built it, not snack's
    assert _train(model, opt, dst, _batches(options["total_steps"])) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        algorithm(model, opt, total_steps=10, update_every=2)  # changes at steps 2, 4, 6
        algorithm(model, opt, total_steps=10, drop_fraction=0.0)  # asked for no change
        algorithm(model, opt, total_steps=8, update_every=6, schedule="constant")


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("fullgraph", [False, True])
def test_rigl_through_a_compiled_model(fullgraph):
    """Without fullgraph the recording hooks run between graphs and the updates are RigL's (with
    Dynamo guarding on hooks, which RigL adds before each update step); with fullgraph=True a
    compiled update step refuses, saying why (it failed inside Dynamo's functorch internals)."""
    model, reference = _model(), _model()
    compiled = torch.compile(model, fullgraph=fullgraph)  # imports Dynamo, which arming then sees
    torch._dynamo.reset()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    every = 1 if fullgraph else 2
    dsts = [snack.dst.RigL(m, opt, update_every=every, total_steps=10) for m, opt in zip((model, reference), opts)]
    if fullgraph:
        with pytest.raises(Exception, match="RigL records each layer's X and dY eagerly on update steps"):
            compiled(_batches(1)[0][0])
        return
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # it warned "Dynamo does not know how to trace..." at every layer
        assert _train(compiled, opts[0], dsts[0], _batches(4)) == 2
    assert not [w for w in caught if "Dynamo" in str(w.message)]
    assert _train(reference, opts[1], dsts[1], _batches(4)) == 2
    for layer, expected in zip(_sparse_layers(model), _sparse_layers(reference)):
        assert torch.equal(layer.row, expected.row) and torch.equal(layer.col, expected.col)
        torch.testing.assert_close(layer.values, expected.values)


def test_rigl_through_a_model_compiled_without_hook_guards_says_what_to_set():
    # Dynamo skips guards on module hooks by default: a graph compiled before RigL armed its hooks
    # never runs them, and the update found nothing recorded
    model = _model()
    model(_batches(1)[0][0])  # one eager call first, so that the compiled call is one graph
    torch._dynamo.reset()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.RigL(model, opt, update_every=2, total_steps=10)
    with pytest.raises(RuntimeError, match="skip_nnmodule_hook_guards = False"):
        _train(compiled, opt, dst, _batches(2))


def test_gradual_pruning_does_not_prune_a_frozen_layer():
    model = _model(sparsity=0.5)
    layers = _sparse_layers(model)
    layers[1].requires_grad_(False)
    nnz = [layer.nnz for layer in layers]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gp = snack.dst.GradualPruning(model, opt, final_sparsity=0.9, start_step=0, end_step=10, update_every=5)
    before = _topology_and_values(layers[1])
    _train(model, opt, gp, _batches(10))
    assert _unchanged(layers[1], before)
    assert layers[0].nnz < nnz[0] and layers[2].nnz < nnz[2]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_step_under_inference_mode_leaves_trainable_layers_and_optimizer_state(algorithm):
    model = _model(sparsity=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = algorithm(model, opt, update_every=2, **_options(algorithm, total_steps=20, end_step=6))
    changed = 0
    for x, y in _batches(6):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # the next step's optimizer step updates what the previous update made
        with torch.inference_mode():
            changed += dst.step()
    assert changed == 3
    tensors = [*model.parameters(), *model.buffers()] + [v for s in opt.state.values() for v in s.values()]
    assert not any(t.is_inference() for t in tensors if torch.is_tensor(t))
    assert not any(layer.row.is_inference() or layer.col.is_inference() for layer in _sparse_layers(model))


class _TwoBranches(nn.Module):
    """Two layers on separate inputs: one batch can be non-finite for one layer only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.left = snack.SparseLinear(10, 8, sparsity=0.7)
        self.right = snack.SparseLinear(10, 8, sparsity=0.7)

    def forward(self, a, b):
        return self.left(a).square().sum() + self.right(b).square().sum()


@pytest.mark.parametrize("algorithm", [snack.dst.RigL, snack.dst.SRigL, _GradientGrowth])
def test_a_layer_whose_recorded_batch_is_not_finite_is_left_alone_with_a_warning(algorithm):
    """An overflowed mixed-precision step: the layer's update is skipped (no drop, no grow), the
    others' still happen; a DropGrow subclass with needs_gradient gets the same."""
    model = _TwoBranches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = algorithm(model, opt, update_every=1, total_steps=10, schedule="constant")
    left, right = _topology_and_values(model.left), _topology_and_values(model.right)
    a = torch.randn(4, 10)
    a[1, 3] = float("inf")
    model(a, torch.randn(4, 10)).backward()  # no optimizer step: as GradScaler skips it
    with pytest.warns(RuntimeWarning, match=r"update at step 1: .* layer 'left' has non-finite values"):
        assert dst.step()
    assert _unchanged(model.left, left)
    assert not torch.equal(model.right.row * 10 + model.right.col, right[0] * 10 + right[1])


@pytest.mark.parametrize("checkpoint_step", [10, 35], ids=["mid-schedule", "after-end"])
@pytest.mark.parametrize("order", ["built-before-loading", "built-after-loading"])
def test_gradual_pruning_resumes_whether_built_before_or_after_loading_the_model(order, checkpoint_step):
    """With the default initial_sparsity the values derived from the model at construction come
    from the DST state on resume, so the model may be loaded first; even after end_step, when
    rounding each layer's count left the model a little sparser than final_sparsity."""
    batches = _batches(40)
    kwargs = dict(final_sparsity=0.92, start_step=2, end_step=30, update_every=4)  # ends at 0.92045
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dst = snack.dst.GradualPruning(model, opt, **kwargs)
    _train(model, opt, dst, batches[:checkpoint_step])
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "dst": dst.state_dict()})
    _train(model, opt, dst, batches[checkpoint_step:])

    resumed = _model(seed=99)
    if order == "built-after-loading":
        resumed.load_state_dict(checkpoint["model"])
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    resumed_dst = snack.dst.GradualPruning(resumed, resumed_opt, **kwargs)
    if order == "built-before-loading":
        resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed_dst.load_state_dict(checkpoint["dst"])
    assert resumed_dst.initial_sparsity == dst.initial_sparsity
    _train(resumed, resumed_opt, resumed_dst, batches[checkpoint_step:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_gradual_pruning_loads_a_state_dict_saved_before_initial_sparsity_was_state():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = dict(final_sparsity=0.95, start_step=2, end_step=30, update_every=4)
    dst = snack.dst.GradualPruning(model, opt, **kwargs)
    state = dst.state_dict()
    old = {key: value for key, value in state.items() if key != "initial_sparsity"}
    old["config"] = {**old["config"], "initial_sparsity": 0.85}  # the old format: the value in use
    again = snack.dst.GradualPruning(model, opt, **kwargs)
    again.load_state_dict(old)
    assert again.initial_sparsity == 0.85
    given = snack.dst.GradualPruning(model, opt, initial_sparsity=0.5, **kwargs)
    differs = r"cannot load DST state: its configuration differs \(initial_sparsity: saved 0.85, this object 0.5\)"
    with pytest.raises(ValueError, match=differs):
        given.load_state_dict(old)  # another initial sparsity than the one given
    broken = {**state, "initial_sparsity": "0.8"}
    with pytest.raises(ValueError, match="initial_sparsity must be a number"):
        again.load_state_dict(broken)
    assert again.initial_sparsity == 0.85 and again.step_count == 0


def test_gradual_pruning_reaches_final_sparsity_when_end_step_is_off_the_update_grid():
    model = _model(sparsity=0.5)
    layers = _sparse_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gp = snack.dst.GradualPruning(model, opt, final_sparsity=0.9, start_step=0, end_step=10, update_every=4)
    flags = []
    for batch in _batches(14):
        flags.append(_train(model, opt, gp, [batch]))
    assert [t for t, f in enumerate(flags, start=1) if f] == [4, 8, 10]  # end_step too
    total = sum(m.out_features * m.in_features for m in layers)
    assert 1 - sum(m.nnz for m in layers) / total == pytest.approx(0.9, abs=0.005)


def test_layers_may_be_glob_patterns_as_in_sparsify():
    model = _model()  # SparseLinear layers 0, 2 and 4
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def names(layers):
        return [name for name, _ in snack.dst.SET(model, opt, total_steps=1000, layers=layers).layers]

    assert names("[02]") == ["0", "2"]
    assert names(["4", "*"]) == ["4", "0", "2"]  # a pattern does not list a layer twice
    with pytest.raises(ValueError, match=r"pattern 'fc\*' matches no SparseLinear of the model \(have \['0', '2'"):
        names("fc*")


def test_layers_given_as_a_set_follow_the_model_order():
    """A set's iteration order differs between processes: the order a checkpoint records (and
    the ranks compare) must not."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [name for name, m in model.named_modules() if isinstance(m, snack.SparseLinear)]
    for layers in (set(names), frozenset(reversed(names)), {model.get_submodule(n) for n in names}):
        assert snack.dst.SET(model, opt, total_steps=1000, layers=layers).state_dict()["layers"] == names
    assert snack.dst.distributed.comparable({"4", "0", "2"}, model) == sorted(["'0'", "'2'", "'4'"])


def test_gradual_pruning_resumes_when_a_count_was_rounded_down_by_half_a_connection():
    # 14 of 15 connections pruned to 70%: round(4.5) = 4 left, a little sparser than final_sparsity
    row, col = torch.ones(3, 5).nonzero().T[:, :14]
    layer = snack.SparseLinear.from_coo(row, col, torch.randn(14), (3, 5), bias=torch.zeros(3))
    model = nn.Sequential(layer)
    arguments = dict(final_sparsity=0.7, start_step=0, end_step=1, update_every=1)
    pruning = snack.dst.GradualPruning(model, torch.optim.SGD(model.parameters(), lr=0.1), **arguments)
    pruning.step()
    assert layer.nnz == 4
    resumed = nn.Sequential(snack.SparseLinear(5, 3, sparsity=0.1))
    resumed.load_state_dict(model.state_dict())  # the model first, then the DST object
    again = snack.dst.GradualPruning(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), **arguments)
    again.load_state_dict(pruning.state_dict())
    assert again.sparsity(1) == pruning.sparsity(1) == pytest.approx(0.7)


def test_a_drop_grow_hook_returning_float_positions_names_the_hook():
    class FloatGrowth(snack.dst.DropGrow):
        def grow(self, layer, k):
            return torch.zeros(k)

    model = _model()
    dst = FloatGrowth(model, torch.optim.SGD(model.parameters(), lr=0.1), update_every=1, total_steps=4)
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(TypeError, match=r"FloatGrowth\.grow must return integer positions for layer '0', got torch.float32"):
        dst.step()


@pytest.mark.parametrize("fraction, expected", [(0.29, 29), (0.57, 57), (0.58, 58)])
def test_the_replaced_count_is_the_exact_floor_of_fraction_times_nnz(fraction, expected):
    layer = snack.SparseLinear(20, 20, sparsity=0.75)  # nnz = 100; 0.29 · 100 = 28.999999999999996 in binary
    dst = snack.dst.SET(layer, torch.optim.SGD(layer.parameters(), lr=0.1), drop_fraction=fraction,
                        update_every=1, total_steps=10, schedule="constant")
    before = set(linear_index(layer.topology).tolist())
    assert dst.step()
    assert len(before - set(linear_index(layer.topology).tolist())) == expected


def test_rigl_under_vmap_records_nothing_and_says_so():
    """Per-sample gradients (vmap of grad) would record vmap's batched tensors, which must not escape it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.RigL(model, opt, update_every=1, total_steps=4)
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(params, x, y):
        out = torch.func.functional_call(model, (params, buffers), (x[None],))
        return nn.functional.cross_entropy(out, y[None])

    x, y = _batches(1)[0]
    torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    with pytest.raises(RuntimeError, match="ran inside torch.func.vmap"):
        dst.step()
    assert dst.step_count == 0


@pytest.mark.parametrize("vectorized", ["jacrev", "is_grads_batched"])
def test_a_vectorized_backward_on_an_update_step_adds_nothing_to_rigl_records(vectorized):
    """A Jacobian (vmap over the backward) carries many cotangents, not the loss's dY."""
    runs = []
    for extra in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dst = snack.dst.RigL(model, opt, update_every=1, total_steps=4)
        x, y = _batches(1)[0]
        x.requires_grad_(True)
        out = model(x)
        if extra and vectorized == "jacrev":
            torch.func.jacrev(lambda inp: model(inp).sum(0))(x.detach())
        elif extra:
            cotangents = torch.eye(4).repeat(8, 1, 1).permute(1, 0, 2)
            torch.autograd.grad(out, x, cotangents, is_grads_batched=True, retain_graph=True)
        nn.functional.cross_entropy(out, y).backward()
        assert dst.step()
        runs.append([layer.col.clone() for layer in _sparse_layers(model)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_grow_init_random_matches_the_layer_init_distribution():
    """grow_init="random" draws U(-b, b) with the layer's own b = 1/sqrt(nnz/out): not the dense
    fan-in's bound (new weights 3x too small at 90%), not one sign only."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(100, 200, sparsity=0.9)  # fan-in nnz/out = 20, dense fan-in 200
    old_key = linear_index(layer.topology)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = snack.dst.SET(layer, opt, drop_fraction=0.5, update_every=1, total_steps=10,
                        schedule="constant", grow_init="random", seed=3)
    assert dst.step()
    new_values = layer.values.detach()[~torch.isin(linear_index(layer.topology), old_key)]
    bound = 1 / (layer.nnz / layer.out_features) ** 0.5
    assert new_values.numel() == 1000
    assert bool((new_values.abs() <= bound).all())
    # 1000 uniform draws: the extremes come within 1% of both ends, the mean is near 0
    assert float(new_values.max()) > 0.95 * bound and float(new_values.min()) < -0.95 * bound
    assert abs(float(new_values.mean())) < 0.1 * bound


def test_rigl_updates_after_an_autocast_training_step():
    """Under torch.autocast the recorded dY is bfloat16 while X is the float32 input: scoring
    |dYᵀX| must still work (mixed-precision RigL)."""
    torch.manual_seed(0)
    model = snack.sparsify(nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4)), 0.8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.RigL(model, opt, drop_fraction=0.3, update_every=1, total_steps=10, schedule="constant")
    layers = [m for m in model.modules() if isinstance(m, snack.SparseLinear)]
    nnz = [layer.nnz for layer in layers]
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert dst.step()
    assert [layer.nnz for layer in layers] == nnz
    for layer in layers:
        assert layer.values.dtype == torch.float32


def test_gradual_pruning_never_disconnects_a_small_layer():
    """A 2-connection layer next to a 10000-connection one, pruned to 99% overall, would get
    round(2 · 0.01) = 0 connections and output its bias only: every layer keeps at least one."""
    torch.manual_seed(0)
    model = snack.sparsify(nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 2)), 0.99)
    # make the second layer tiny: 2 connections at the start of pruning
    big, small = [m for m in model.modules() if isinstance(m, snack.SparseLinear)]
    small.set_topology(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([0.5, -0.5]))
    big.set_topology(*random_coo(100, 100, 0.0), torch.randn(10000) * 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pruning = snack.dst.GradualPruning(model, opt, final_sparsity=0.99, start_step=1, end_step=5, update_every=1)
    for _ in range(6):
        pruning.step()
    assert small.nnz >= 1
    assert big.nnz + small.nnz <= 0.0105 * (10000 + 200)  # the overall target is still met


def _set_run(seed, global_seed):
    torch.manual_seed(0)
    layer = snack.SparseLinear(20, 20, sparsity=0.9)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = snack.dst.SET(layer, opt, drop_fraction=0.25, update_every=1, total_steps=100,
                        schedule="constant", grow_init="random", seed=seed)
    torch.manual_seed(global_seed)  # the global RNG must play no part
    for _ in range(3):
        dst.step()
        torch.rand(7)  # e.g. dropout or data shuffling between steps draws from it
    return layer.values.detach().clone(), linear_index(layer.topology)


def test_random_grow_init_depends_on_the_seed_only():
    """grow_init="random" draws from the DST generator, not the global RNG: the same seed gives
    the same run whatever else draws (dropout, shuffling), so a resumed run is bitwise identical."""
    (values_a, key_a), (values_b, key_b) = _set_run(1, 10), _set_run(1, 11)
    assert torch.equal(key_a, key_b)
    assert torch.equal(values_a, values_b)


def test_set_growth_draws_fresh_positions_at_every_update():
    """SET's generator advances between updates (replaying its draws would cycle growth between
    two position sets). With frozen weights (lr 0) and zero-initialised growth, each update drops
    what the previous one grew; 100 growths among 360 inactive positions then reach about 88
    distinct positions, not 20."""
    torch.manual_seed(0)
    layer = snack.SparseLinear(20, 20, sparsity=0.9)  # nnz 40, k = 10 per update
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = snack.dst.SET(layer, opt, drop_fraction=0.25, update_every=1, total_steps=100,
                        schedule="constant", seed=0)
    grown = set()
    for _ in range(10):
        before = set(linear_index(layer.topology).tolist())
        assert dst.step()
        grown |= set(linear_index(layer.topology).tolist()) - before
    assert len(grown) > 60


def test_gradual_pruning_prunes_to_the_given_initial_sparsity_at_start_step():
    """With an initial_sparsity above the model's, s_t is initial_sparsity at start_step, and
    "every update_every steps from start_step" includes start_step: the model is pruned to 0.5
    there, not one interval later."""
    torch.manual_seed(0)
    model = snack.sparsify(nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 20)), 0.0)
    layers = [m for m in model.modules() if isinstance(m, snack.SparseLinear)]
    total = sum(m.out_features * m.in_features for m in layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gp = snack.dst.GradualPruning(model, opt, final_sparsity=0.9, initial_sparsity=0.5,
                                  start_step=3, end_step=30, update_every=10)
    for _ in range(2):
        assert not gp.step()
    assert gp.step()  # step 3 = start_step
    assert 1 - sum(m.nnz for m in layers) / total == 0.5


def test_fresh_optimizer_state_comes_from_the_layers_own_param_group():
    """A grown connection of values in a param group with its own initial_accumulator_value
    (Adagrad) / lr (Rprop) gets that group's fresh state, not the first group's."""
    for make_opt, key, fresh in (
        (lambda a, b: torch.optim.Adagrad([{"params": a, "initial_accumulator_value": 0.0},
                                           {"params": b, "initial_accumulator_value": 0.25}], lr=0.1), "sum", 0.25),
        (lambda a, b: torch.optim.Rprop([{"params": a, "lr": 0.5}, {"params": b, "lr": 0.03}]), "step_size", 0.03),
    ):
        torch.manual_seed(0)
        layer = snack.SparseLinear(10, 8, sparsity=0.6)
        opt = make_opt([layer.bias], [layer.values])
        for _ in range(2):
            opt.zero_grad()
            layer(torch.randn(4, 10)).pow(2).sum().backward()
            opt.step()
        grow = snack.dst.random_grow(layer.topology, 3, torch.Generator().manual_seed(0))
        snack.dst.rewire(layer, opt, torch.tensor([1, 2, 7]), grow)
        state = dict(zip(linear_index(layer.topology).tolist(), opt.state[layer.values][key].tolist()))
        assert [state[p] for p in grow.tolist()] == pytest.approx([fresh] * 3), key


def test_an_update_step_called_inside_autocast_scores_growth_in_full_precision():
    """A training step body inside torch.autocast, dst.step() included: RigL's growth scores
    (dYᵀX) were computed in bfloat16 there, and a few grown connections differed."""
    torch.manual_seed(0)
    model = nn.Sequential(
        snack.SparseLinear(256, 256, sparsity=0.9), nn.Tanh(), snack.SparseLinear(256, 16, sparsity=0.9)
    )
    x, target = torch.randn(64, 256), torch.randn(64, 16)
    topologies = []
    for inside in (False, True):
        copy_ = copy.deepcopy(model)
        opt = torch.optim.SGD(copy_.parameters(), lr=0.0)
        dst = snack.dst.RigL(copy_, opt, drop_fraction=0.5, update_every=1, total_steps=10, schedule="constant")
        ((copy_(x) - target) ** 2).sum().backward()
        opt.step()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
            assert dst.step()
        topologies.append([linear_index(layer.topology) for layer in _sparse_layers(copy_)])
    assert all(torch.equal(a, b) for a, b in zip(*topologies))


def test_set_shows_every_argument_with_its_default():
    """SET's constructor takes **kwargs on to DropGrow's; help() and inspect showed only them."""
    parameters = inspect.signature(snack.dst.SET).parameters
    assert parameters["split_sign"].default is False and parameters["drop_fraction"].default == 0.3
    assert list(parameters)[:3] == ["model", "optimizer", "split_sign"] and "kwargs" not in parameters
