"""Dynamic sparse training on two ranks (gloo, CPU): the ranks keep one topology, and RigL under
DDP grows exactly as one process training on the whole batch does; sparse layers under FSDP train
as one process does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import distributed_worker as worker
import snack.topology

WORKER = Path(__file__).with_name("distributed_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("distributed")
    done = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(worker.WORLD)]


def _assert_same_topologies(a: list[dict], b: list[dict]) -> None:
    for layer_a, layer_b in zip(a, b, strict=True):
        assert torch.equal(layer_a["row"], layer_b["row"]) and torch.equal(layer_a["col"], layer_b["col"])


def _single_process(algorithm: str) -> tuple[list[dict], torch.Tensor]:
    """The same training in one process on the whole batch (minus what rank 1 skipped)."""
    net = worker.model(embedding=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    dst = worker.ALGORITHMS[algorithm](net, optimizer)
    for step in range(worker.STEPS):
        x, y = worker.global_batch(step)
        if step == 1:  # rank 1 trained on 3 of its 8 rows: DDP averages the two ranks' mean losses
            parts = [slice(0, 8), slice(8, 11)]
            loss = sum(nn.functional.cross_entropy(net(x[p]), y[p]) for p in parts) / 2
        else:
            loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dst.step()
    return worker.layers_state(net), dst.generator.get_state()


@pytest.mark.parametrize("algorithm", sorted(worker.ALGORITHMS))
def test_under_ddp_the_ranks_keep_one_topology_chosen_as_from_the_global_batch(ranks, algorithm):
    """RigL and GraNet grow from the gathered records (a token embedding's ids among them), MEST
    drops by DDP's averaged gradient;
    GradualPruning, GraNet and MEST, whose nnz changes, run with the DDP wrapper rebuilt after
    each update."""
    (rank0, generator0), (rank1, generator1) = (r[f"{algorithm}_under_ddp"] for r in ranks)
    _assert_same_topologies(rank0, rank1)
    for layer0, layer1 in zip(rank0, rank1):
        assert torch.equal(layer0["values"], layer1["values"])
    single, single_generator = _single_process(algorithm)
    # one RNG state: a checkpoint of any rank resumes the run (RigL draws its grow values on rank 0)
    assert torch.equal(generator0, generator1) and torch.equal(generator0, single_generator)
    _assert_same_topologies(rank0, single)
    for layer0, alone in zip(rank0, single):
        torch.testing.assert_close(layer0["values"], alone["values"], rtol=0, atol=1e-12)
    # the updates did change the topology of every layer but the smallest (4 connections: its one
    # dropped connection was grown again)
    initial = worker.layers_state(worker.model(embedding=True))
    changed = [not torch.equal(now["col"], then["col"]) for now, then in zip(single, initial)]
    assert all(done for done, then in zip(changed, initial) if then["col"].numel() > 4) and any(changed)


@pytest.mark.parametrize("run", sorted(worker.FSDP_RUNS))
def test_under_fsdp_the_ranks_train_and_rewire_as_one_process_does(ranks, run):
    """FSDP (fully_shard) shards values, bias and the optimizer's per-element state; an update
    gathers a layer's whole values and state, rewires them as one process would, and each rank
    keeps its shard: the gathered result is one process's training on the whole batch (RigL
    growing from every rank's records)."""
    make, kind, embedding = worker.FSDP_RUNS[run]
    net = worker.model(embedding=embedding)
    optimizer = worker.fsdp_optimizer(net, kind)
    dst = make(net, optimizer) if make is not None else None
    for step in range(worker.STEPS):
        x, y = worker.global_batch(step)
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dst is not None:
            dst.step()
    expected = net.state_dict()
    for rank in ranks:
        state = rank[f"{run}_under_fsdp"]["state"]
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-12)
        if dst is not None:
            assert torch.equal(rank[f"{run}_under_fsdp"]["generator"], dst.generator.get_state())
    if dst is not None:  # the updates changed the topology
        initial = worker.layers_state(worker.model(embedding=embedding))
        assert any(not torch.equal(now["col"], then["col"]) for now, then in zip(worker.layers_state(net), initial))


def test_under_fsdp_what_changes_nnz_a_direct_rewire_and_a_rank_alone_are_refused(ranks):
    for rank in ranks:
        refused = rank["refused_under_fsdp"]
        assert refused["granet"].startswith(
            "NotImplementedError: GraNet changes the nnz of its layers, and layer '1' holds sharded values"
        )
        assert refused["rewire"].startswith("NotImplementedError: conv holds sharded values")
        assert refused["alone"].startswith(
            "ValueError: layer '1' is sharded over ranks [0, 1], but this DST object acts with this rank alone"
        )


def test_a_model_built_on_meta_and_sharded_draws_one_topology_on_every_rank(ranks):
    rank0, rank1 = (r["built_on_meta_under_fsdp"] for r in ranks)
    _assert_same_topologies(rank0, rank1)
    assert [layer["nnz"] for layer in rank0] == [58, 24]  # 30% of 16·12 and 5·16 (uniform)
    for layer, (out, in_) in zip(rank0, [(16, 12), (5, 16)]):
        snack.topology.validate_coo(layer["row"], layer["col"], (out, in_))  # sorted, unique, in range


def test_ranks_with_different_seeds_are_refused_at_construction(ranks):
    for rank in ranks:
        assert "rank 1 differs from rank 0 in: arguments (seed)" in rank["different_seeds"]


def test_every_rank_applies_rank_zeros_choice(ranks):
    rank0, rank1 = (r["rank_zero_decides"] for r in ranks)
    _assert_same_topologies(rank0, rank1)
    # rank 1's flipped weights would have dropped other connections on their own
    assert not all(torch.equal(a["values"], b["values"]) for a, b in zip(rank0, rank1))


def test_a_bad_argument_on_one_rank_raises_on_every_rank(ranks):
    """Not only on that rank, which would leave the others waiting in a collective."""
    for rank in ranks:
        assert rank["a_bad_argument_on_one_rank"].startswith("ValueError: ")
        assert "rank 1 differs from rank 0 in: arguments (drop_fraction)" in rank["a_bad_argument_on_one_rank"]


def test_an_update_failing_on_one_rank_raises_on_every_rank_and_changes_none(ranks):
    rank0, rank1 = (r["an_update_failing_on_one_rank"] for r in ranks)
    assert rank1["error"] == "OutOfMemoryError: simulated"
    assert rank0["error"].startswith("RuntimeError: dynamic sparse training: rank 1 failed while choosing connections")
    assert rank0["unchanged"] and rank1["unchanged"]
    assert rank0["retry"] and rank1["retry"]
    _assert_same_topologies(rank0["after"], rank1["after"])


def test_ranks_whose_topologies_drifted_apart_refuse_to_update(ranks):
    for rank in ranks:
        assert "the ranks disagree while starting the update" in rank["another_topology_on_one_rank"]


def test_a_group_without_this_rank_is_refused_and_false_acts_alone(ranks):
    assert "is not in the group it was given" in ranks[1]["groups"]["not_a_member"]
    assert ranks[0]["groups"]["alone_updated"] is True
