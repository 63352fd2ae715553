"""The README's Python examples run as written (given the few names they leave to the reader)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import snack

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def _block(first_line: str) -> str:
    found = [block for block in _python_blocks() if block.splitlines()[0].startswith(first_line)]
    assert len(found) == 1, f"the README has {len(found)} Python blocks starting with {first_line!r}"
    return found[0]


def test_quick_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it saves sparse.pt
    namespace: dict = {}
    exec(_block("import torch, snack"), namespace)
    layer, model = namespace["layer"], namespace["model"]
    assert layer.nnz == 20_070 and layer.values.grad.shape == (20_070,)  # the comments' figures
    assert namespace["image"].shape == (8, 3, 64, 64) and namespace["volume"].shape == (2, 16, 16, 16, 16)
    assert namespace["larger"].shape == (2, 4, 32, 32, 32)
    assert namespace["attended"].shape == (4, 10, 256) and namespace["weights"].shape == (4, 10, 10)
    attention = namespace["encoder"].layers[1].self_attn
    assert isinstance(attention, snack.SparseMultiheadAttention) and attention.q_proj.sparsity == pytest.approx(0.9, abs=1e-4)
    loaded = torch.load(tmp_path / "sparse.pt")
    assert loaded.keys() == model.state_dict().keys()


def test_dynamic_sparse_training_example():
    torch.manual_seed(0)
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(6)]
    namespace = {
        "torch": torch, "snack": snack, "T": len(data), "data": data,
        "net": nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
        "loss_fn": nn.functional.cross_entropy,
    }  # fmt: skip
    code = _block("model = snack.sparsify(net")
    assert "update_every=100" in code
    exec(code.replace("update_every=100", "update_every=2"), namespace)  # updates within 6 steps
    assert namespace["dst"].step_count == len(data)
    assert namespace["model"][0].sparsity == pytest.approx(0.9, abs=0.1)


def test_transformers_example_trains_and_saves_a_model_from_pretrained_reads(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # it saves gpt2-sparse/
    torch.manual_seed(0)
    tiny = "transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)"
    code = _block("import torch, transformers, snack")
    assert "transformers.GPT2Config()" in code and "update_every=100" in code
    code = code.replace("transformers.GPT2Config()", tiny).replace("update_every=100", "update_every=2")
    batches = [torch.randint(0, 50, (2, 8)) for _ in range(4)]
    namespace = {"T": len(batches), "batches": batches}
    exec(code, namespace)
    assert namespace["dst"].step_count == len(batches)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2-sparse").eval()
    model = namespace["model"].eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(batches[0]).logits, model(batches[0]).logits)
    assert (loaded.transformer.wte.weight == 0).float().mean() == pytest.approx(0.9, abs=0.01)


def test_recommender_example_trains_sparse_tables_with_rigl():
    torch.manual_seed(0)
    code = _block("from torch import nn")
    assert "update_every=100" in code and "Recommender()" in code
    code = code.replace("update_every=100", "update_every=2").replace("Recommender()", "Recommender(300, 200, 8)")
    batches = [
        (torch.randint(0, 300, (12,)), torch.tensor([0, 5, 5]), torch.randint(0, 200, (3, 4)), torch.rand(3).round())
        for _ in range(4)
    ]
    namespace = {"T": len(batches), "batches": batches}
    exec(code, namespace)
    model = namespace["model"]
    assert isinstance(model.users, snack.SparseEmbeddingBag) and model.items.mode == "mean"
    assert namespace["dst"].step_count == len(batches)
    assert model.users.sparsity == pytest.approx(0.9, abs=0.01)


def test_weight_averaging_example_follows_the_rewires():
    torch.manual_seed(0)
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(6)]
    model = snack.sparsify(nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)), 0.8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.RigL(model, opt, update_every=2, total_steps=len(data), stop_fraction=1.0)
    namespace = {"snack": snack, "model": model, "opt": opt, "dst": dst, "data": data,
                 "loss_fn": nn.functional.cross_entropy}
    first = model[0].indices()
    exec(_block("from torch.optim.swa_utils import get_ema_multi_avg_fn"), namespace)
    assert not torch.equal(model[0].indices(), first), "RigL rewired"
    ema = namespace["ema"]
    assert int(ema.n_averaged) == len(data)
    for averaged, layer in zip(ema.module, model):
        if isinstance(layer, snack.SparseLinear):
            assert torch.equal(averaged.row, layer.row) and torch.equal(averaged.col, layer.col)
            assert not torch.equal(averaged.values, layer.values)  # an average, not a copy
    ema.eval()(torch.randn(3, 16))


def test_onnx_export_example_writes_a_file_onnx_runtime_runs(tmp_path, monkeypatch):
    import onnxruntime

    monkeypatch.chdir(tmp_path)  # it saves model.onnx
    torch.manual_seed(0)
    model = snack.sparsify(nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10)), 0.9)
    exec(_block("program = torch.onnx.export("), {"torch": torch, "snack": snack, "model": model})
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    x = torch.randn(4, 784)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), model(x).detach(), rtol=1e-5, atol=1e-5)


def test_resume_example_continues_bitwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it saves run.pt
    save, *load = _block("torch.save({\"model\"").strip().splitlines()
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(8)]

    def build(seed):
        torch.manual_seed(seed)  # another seed: another topology and init, which the load replaces
        model = snack.sparsify(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), 0.9, distribution="erk")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, snack.dst.RigL(model, opt, update_every=2, total_steps=len(data))

    def train(model, opt, dst, batches):
        for x, y in batches:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            dst.step()

    model, opt, dst = build(0)
    train(model, opt, dst, data[:3])
    exec(save, {"torch": torch, "model": model, "opt": opt, "dst": dst})
    train(model, opt, dst, data[3:])
    resumed = dict(zip(("model", "opt", "dst"), build(1)), torch=torch)
    exec("\n".join(load), resumed)
    train(resumed["model"], resumed["opt"], resumed["dst"], data[3:])
    for (name, a), b in zip(model.state_dict().items(), resumed["model"].state_dict().values()):
        assert torch.equal(a, b), name


def test_own_dst_algorithm_example():
    namespace = {"torch": torch, "snack": snack}
    exec(_block("class RandomDropGradientGrow"), namespace)
    torch.manual_seed(0)
    model = snack.sparsify(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), 0.8)
    dense = snack.densify(copy.deepcopy(model))  # for the expected growth: the dense gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = namespace["RandomDropGradientGrow"](model, opt, update_every=1, total_steps=4, schedule="constant")
    before = snack.dst.prune_grow.linear_index(model[0].topology)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for net in (model, dense):
        nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    assert dst.step()
    after = snack.dst.prune_grow.linear_index(model[0].topology)
    grown = after[~torch.isin(after, before)]
    scores = dense[0].weight.grad.abs().flatten()
    scores[before] = -1  # growth is among the positions inactive before the update
    assert torch.equal(grown, scores.topk(int(0.3 * before.numel())).indices.sort().values)


def test_per_sample_gradients_example():
    namespace = {"torch": torch, "snack": snack}
    exec(_block("from torch.func import"), namespace)
    model, per_sample = namespace["model"], namespace["per_sample"]
    assert per_sample["0.values"].shape == (32, model[0].nnz)
    x, y = namespace["x"], namespace["y"]
    nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()  # the first sample's own gradient
    torch.testing.assert_close(per_sample["0.values"][0], model[0].values.grad)


def test_sparsify_leaving_depthwise_convolutions_dense():
    block = nn.Sequential(nn.Conv2d(8, 32, 1), nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.Conv2d(32, 8, 1))
    namespace = {"torch": torch, "snack": snack, "model": block}
    exec(_block("depthwise = "), namespace)
    model = namespace["model"]
    assert namespace["depthwise"] == ["1"]
    assert [type(m) for m in model] == [snack.SparseConv2d, nn.Conv2d, snack.SparseConv2d]
