"""Two gloo ranks on this CPU running dynamic sparse training under DDP (and sparse layers under
FSDP), for test_dst_distributed.

``python distributed_worker.py OUT_DIR`` spawns the ranks; each runs every scenario below and
saves what it saw to ``OUT_DIR/rank<r>.pt``, which the tests compare with each other and with a
single-process run.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import snack
from snack.dst import algorithms

WORLD = 2
STEPS = 6
LOCAL_BATCH = 8


class TokenEmbedding(nn.Module):
    """``h``, ``x (N, 12)`` plus the embedding of a token read off ``x`` (the signs of its first three
    features, an id in [0, 8)), plus ``h``'s logits against the table (a head tied to the
    embedding) mixed back to 12 features. An embedding's records are ids ``(N,)``, a tied head's
    ``(N, 12)`` and ``(N, 8)`` rows: the ranks gather all four."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(8, 12)
        self.head = nn.Linear(12, 8, bias=False)
        self.head.weight = self.embedding.weight
        self.mix = nn.Linear(8, 12)

    def forward(self, x):
        ids = ((x[:, :3] > 0).long() * torch.tensor([1, 2, 4])).sum(1)
        h = x + self.embedding(ids)
        return h + self.mix(self.head(h))


def model(seed: int = 0, *, embedding: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    # convolutions too, one grouped, and a grouped transposed one: RigL scores them from the padded
    # inputs (output gradients) alone, from the gathered im2col rows on several ranks, and both
    # must grow the same connections; with `embedding`, first a token embedding, scored from the
    # gathered ids
    net = nn.Sequential(nn.Unflatten(1, (3, 2, 2)), nn.Conv2d(3, 6, 2, padding=1), nn.ReLU(),
                        nn.Conv2d(6, 6, 1, groups=3), nn.ReLU(), nn.ConvTranspose2d(6, 4, 2, groups=2), nn.Flatten(),
                        nn.ReLU(), nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 5)).double()  # fmt: skip
    if embedding:
        net = nn.Sequential(TokenEmbedding().double(), *net)
    return snack.sparsify(net, 0.7, init="random", embeddings=True)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: ``WORLD · LOCAL_BATCH`` rows, rank ``r`` trains on the ``r``-th slice."""
    generator = torch.Generator().manual_seed(1000 + step)
    rows = WORLD * LOCAL_BATCH
    x = torch.randn(rows, 12, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 5, (rows,), generator=generator)


def rigl(net: nn.Module, optimizer):
    # random grow values: drawn by rank 0 alone, which plans, yet every rank's RNG must follow
    return snack.dst.RigL(net, optimizer, drop_fraction=0.3, update_every=2, total_steps=10, grow_init="random")


def pruning(net: nn.Module, optimizer):
    return snack.dst.GradualPruning(net, optimizer, final_sparsity=0.9, start_step=2, end_step=4, update_every=1)


def granet(net: nn.Module, optimizer):
    # prunes (nnz shrinks) and regrows from the gathered records at steps 2 and 4
    return snack.dst.GraNet(net, optimizer, final_sparsity=0.9, start_step=0, end_step=4, total_steps=8,
                            update_every=2, grow_init="random")


def mest(net: nn.Module, optimizer):
    # nnz rises above the targets and falls back; the drop reads DDP's averaged gradient
    return snack.dst.MEST(net, optimizer, total_steps=8, update_every=2, drop_fraction=0.2, gradient_weight=0.5,
                          grow_init="random")


ALGORITHMS = {"rigl": rigl, "pruning": pruning, "granet": granet, "mest": mest}


def layers_state(net: nn.Module) -> list[dict]:
    return [{"row": m.row.clone(), "col": m.col.clone(), "values": m.values.detach().clone()}
            for m in net.modules() if isinstance(m, snack.SparseLinear)]


def train_under_ddp(rank: int, algorithm: str) -> tuple[list[dict], torch.Tensor]:
    """``algorithm`` on a DDP model, each rank on its slice of the global batches: the layers, and
    the state of the DST object's RNG."""
    net = model(embedding=True)
    ddp = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    dst = ALGORITHMS[algorithm](net, optimizer)
    for step in range(STEPS):
        x, y = global_batch(step)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        if rank == 1 and step == 1:
            mine = slice(mine.start, mine.start + 3)  # an uneven batch on an update step
        loss = nn.functional.cross_entropy(ddp(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dst.step() and algorithm in ("pruning", "granet", "mest"):
            ddp = DistributedDataParallel(net)  # DDP's gradient buckets have the old sizes
    return layers_state(net), dst.generator.get_state()


def set_random(net: nn.Module, optimizer):
    return snack.dst.SET(net, optimizer, drop_fraction=0.3, update_every=2, total_steps=10, grow_init="random")


def srigl(net: nn.Module, optimizer):
    # rows balanced by the first update and kept so, from every rank's records (grouped and
    # transposed convolutions among the layers)
    return snack.dst.SRigL(net, optimizer, drop_fraction=0.3, update_every=2, total_steps=10, grow_init="random")


# under FSDP: (the algorithm, which keeps nnz (None: a fixed topology), the optimizer, whose
# per-element state FSDP shards too: SGD's momentum, Adam's moments beside its scalar step, and
# whether the model starts with the token embedding, whose tied head calls attend: a method FSDP
# must gather the table around, as it does around forward)
FSDP_RUNS = {
    "static": (None, "sgd", False), "set": (set_random, "sgd", False), "rigl": (rigl, "sgd", False),
    "rigl_adam": (rigl, "adam", False), "rigl_tied_embedding": (rigl, "sgd", True), "srigl": (srigl, "sgd", False),
}


def fsdp_optimizer(net: nn.Module, kind: str = "sgd") -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(net.parameters(), lr=0.01)
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def shard(net: nn.Module) -> nn.Module:
    """``fully_shard`` every sparse layer and the model (FSDP2): values and bias become DTensors."""
    mesh = init_device_mesh("cpu", (WORLD,))
    for module in net.modules():
        if isinstance(module, snack.SparseLinear):
            fully_shard(module, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def train_under_fsdp(rank: int, run: str) -> dict:
    """``FSDP_RUNS[run]`` on a sharded model, each rank on its slice of the global batches: the
    full state gathered at the end, and the DST object's RNG state."""
    make, kind, embedding = FSDP_RUNS[run]
    net = shard(model(embedding=embedding))
    optimizer = fsdp_optimizer(net, kind)
    dst = make(net, optimizer) if make is not None else None
    for step in range(STEPS):
        x, y = global_batch(step)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = nn.functional.cross_entropy(net(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dst is not None:
            dst.step()
    state = {key: value.full_tensor() if isinstance(value, DTensor) else value
             for key, value in net.state_dict().items()}  # fmt: skip
    return {"state": state, "generator": dst.generator.get_state() if dst is not None else None}


def refused_under_fsdp(rank: int) -> dict:
    """What an algorithm that changes nnz, a direct rewire and a rank acting alone say of sharded
    layers."""
    net = shard(model())
    optimizer = fsdp_optimizer(net)
    nothing = torch.empty(0, dtype=torch.int64)
    return {
        "granet": failure(lambda: granet(net, optimizer)),
        "rewire": failure(lambda: snack.dst.rewire(net[1], optimizer, nothing, nothing, name="conv")),
        "alone": failure(lambda: snack.dst.SET(net, optimizer, total_steps=1000, process_group=False)),
    }


def built_on_meta_under_fsdp(rank: int) -> list[dict]:
    """A model built and sharded on the meta device, then materialised (``to_empty``) and reset:
    each rank draws the coordinates itself (not sharded), from the same seed."""
    mesh = init_device_mesh("cpu", (WORLD,))
    with torch.device("meta"):
        net = snack.sparsify(nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5)), 0.7, init="random")
    for module in [*net[::2], net]:
        fully_shard(module, mesh=mesh)
    net.to_empty(device="cpu")
    torch.manual_seed(0)
    with warnings.catch_warnings():  # torch: "DTensor random operators may not have complete support on cpu"
        warnings.simplefilter("ignore", UserWarning)
        net.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    net(torch.randn(4, 12)).sum().backward()  # computes: a topology was drawn
    return [{"row": m.row.clone(), "col": m.col.clone(), "nnz": m.nnz} for m in net[::2]]


def different_seeds(rank: int) -> str:
    net = model()
    try:
        snack.dst.SET(net, torch.optim.SGD(net.parameters(), lr=0.1), total_steps=1000, seed=rank)
    except ValueError as error:
        return str(error)
    return "no error"


def failure(call) -> str:
    """What ``call()`` raised, as ``"Type: message"``, or ``"no error"``."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def a_bad_argument_on_one_rank(rank: int) -> str:
    """Caught by the agreement that comes first, on every rank (the constructor's own check
    would raise on rank 1 only, and leave rank 0 waiting)."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    return failure(lambda: snack.dst.SET(net, optimizer, total_steps=1000, drop_fraction=1.5 if rank else 0.3))


def an_update_failing_on_one_rank(rank: int) -> dict:
    """Rank 1 runs out of memory choosing connections: every rank raises, none changes, and the
    retry succeeds on both."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    dst = snack.dst.SET(net, optimizer, drop_fraction=0.5, update_every=1, total_steps=10, schedule="constant")
    before = layers_state(net)
    real = algorithms.random_grow

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    algorithms.random_grow = out_of_memory if rank == 1 else real
    try:
        error = failure(dst.step)
    finally:
        algorithms.random_grow = real
    unchanged = all(torch.equal(a["col"], b["col"]) for a, b in zip(before, layers_state(net)))
    return {"error": error, "unchanged": unchanged and dst.step_count == 0, "retry": dst.step(),
            "after": layers_state(net)}


def another_topology_on_one_rank(rank: int) -> str:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    dst = snack.dst.SET(net, optimizer, drop_fraction=0.5, update_every=1, total_steps=10)
    if rank == 1:  # e.g. a checkpoint of another run loaded on one rank only
        torch.manual_seed(99)
        other = snack.SparseLinear(64, 20, sparsity=0.7, dtype=torch.float64)
        net[8].set_topology(other.row, other.col)
    return failure(dst.step)


def groups(rank: int) -> dict:
    """A group this rank is not in is refused; ``process_group=False`` acts alone (no collective:
    rank 0 builds and steps its own)."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    only_rank_0 = dist.new_group([0])
    result = {"not_a_member": "skipped on rank 0"}
    if rank == 1:
        set_up = lambda: snack.dst.SET(net, optimizer, total_steps=1000, process_group=only_rank_0)  # noqa: E731
        result["not_a_member"] = failure(set_up)
    if rank == 0:
        alone = snack.dst.SET(net, optimizer, update_every=1, total_steps=10, process_group=False)
        result["alone_updated"] = alone.step()
    dist.barrier()
    return result


def rank_zero_decides(rank: int) -> list[dict]:
    """SET without DDP, rank 1's weights scaled so its own magnitude drop would differ."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    dst = snack.dst.SET(net, optimizer, drop_fraction=0.5, update_every=1, total_steps=10, schedule="constant")
    if rank == 1:
        with torch.no_grad():
            for m in net.modules():
                if isinstance(m, snack.SparseLinear):
                    m.values.copy_(m.values.flip(0))
    assert dst.step()
    return layers_state(net)


def run_rank(rank: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD)
    try:
        results = {
            **{f"{name}_under_ddp": train_under_ddp(rank, name) for name in ALGORITHMS},
            **{f"{name}_under_fsdp": train_under_fsdp(rank, name) for name in FSDP_RUNS},
            "refused_under_fsdp": refused_under_fsdp(rank),
            "built_on_meta_under_fsdp": built_on_meta_under_fsdp(rank),
            "different_seeds": different_seeds(rank),
            "rank_zero_decides": rank_zero_decides(rank),
            "a_bad_argument_on_one_rank": a_bad_argument_on_one_rank(rank),
            "an_update_failing_on_one_rank": an_update_failing_on_one_rank(rank),
            "another_topology_on_one_rank": another_topology_on_one_rank(rank),
            "groups": groups(rank),
        }
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run_rank, args=(Path(sys.argv[1]),), nprocs=WORLD)
