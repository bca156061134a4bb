"""Hybrid sharding (hsdp) and tensor parallelism: the rank layout (trainer/distributed/mesh.py), the
strategy `auto` picks, and 4 gloo ranks outside Ray checked against one process
(support/hybrid_check.py). The Ray Train path (a 2x2 run resized to 1x2 and back through its
DCP checkpoints) is in test_training.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import parallel_check
from support.gloo_ranks import run_ranks

from raytrain_lm.config import ParallelConfig
from raytrain_lm.errors import UserError
from raytrain_lm.trainer.distributed.mesh import node_contiguous_order, plan_layout
from raytrain_lm.trainer.distributed.parallel import MemoryEstimate, choose_layout, choose_strategy

GIB = 1 << 30


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    return run_ranks("hybrid_check", tmp_path_factory.mktemp("hybrid"), world=4)


def test_ranks_that_ray_scattered_over_nodes_are_ordered_node_by_node():
    # ray#45799's layout: 8 ranks on the first node, then one on each other node
    scattered = ["a"] * 8 + ["b", "c", "d"]
    assert node_contiguous_order(scattered) == list(range(11))
    # Ray's numbering interleaved across two nodes of 4 workers
    interleaved = ["a", "b", "b", "a", "a", "b", "a", "b"]
    assert node_contiguous_order(interleaved) == [0, 3, 4, 6, 1, 2, 5, 7]
    layout = plan_layout("hsdp", interleaved)
    assert (layout.replicate, layout.shard) == (2, 4)  # a node's workers share one copy
    assert layout.order[:4] == (0, 3, 4, 6) and layout.order[4:] == (1, 2, 5, 7)
    assert layout.data_rank(5) == 5  # ranks keep their own data share without tensor groups


def test_uneven_nodes_follow_the_documented_rule_or_are_refused():
    # 4 + 4 + 2 workers: groups of gcd = 2, none across a node
    layout = plan_layout("hsdp", ["a"] * 4 + ["b"] * 4 + ["c"] * 2)
    assert (layout.replicate, layout.shard) == (5, 2)
    # explicit groups of 4 do not divide 10 workers
    with pytest.raises(UserError, match="does not divide the 10 workers"):
        plan_layout("hsdp", ["a"] * 4 + ["b"] * 4 + ["c"] * 2, shard_size=4)
    # 3 + 1 + 2 + 2 in groups of 4: a with b, then c with d, each group of whole nodes
    assert plan_layout("hsdp", ["a"] * 3 + ["b"] + ["c"] * 2 + ["d"] * 2, shard_size=4).shard == 4
    with pytest.raises(UserError, match="across part of a node: nodes hold a: 3, b: 3"):
        plan_layout("hsdp", ["a"] * 3 + ["b"] * 3, shard_size=2)
    with pytest.raises(UserError, match="each must hold a multiple of 2"):
        plan_layout("fsdp", ["a"] * 3 + ["b"], tensor_parallel=2)
    tp = plan_layout("fsdp", ["a", "b", "a", "b"], tensor_parallel=2)
    assert tp.order == (0, 2, 1, 3) and [tp.data_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [tp.tensor_rank(r) for r in range(4)] == [0, 0, 1, 1]


def test_auto_picks_hsdp_when_a_node_holds_the_sharded_state():
    # 7B: 100 GiB of state under ddp; 8 nodes of 8 x 80 GiB devices
    seven_b = 6_738_415_616
    estimate = MemoryEstimate(seven_b, world=64, device_bytes=80 * GIB, fraction=0.6, group=8)
    assert choose_strategy("auto", estimate, None) == "hsdp"  # 12.6 GiB per device in a node
    assert "12.55 GiB under hsdp in groups of 8" in estimate.describe()
    # single-GPU nodes: a node's group is one device, which cannot hold it
    lonely = MemoryEstimate(seven_b, world=64, device_bytes=80 * GIB, fraction=0.6, group=1)
    assert choose_strategy("auto", lonely, None) == "fsdp"
    # one node: hsdp would be fsdp
    one_node = MemoryEstimate(seven_b, world=8, device_bytes=80 * GIB, fraction=0.6, group=8)
    assert choose_strategy("auto", one_node, None) == "fsdp"
    small = MemoryEstimate(125_000_000, world=64, device_bytes=80 * GIB, fraction=0.6, group=8)
    assert choose_strategy("auto", small, None) == "ddp"


def test_the_worker_settles_strategy_and_mesh_together():
    """What a worker group calls at its start: 1e9 parameters (14.9 GiB of state) on 16 GiB
    devices, 2 pretend nodes of 2: ddp's would not fit the 9.6 GiB budget, a node's pair holds
    7.5 GiB each, so auto takes hsdp 2x2 with the nodes' ranks in its shard groups; an
    explicit ddp that cannot fit the device at all is refused."""
    nodes = ["a", "b", "a", "b"]
    auto = ParallelConfig(strategy="auto")
    layout, estimate = choose_layout(auto, nodes, 10**9, 16 * GIB, previous=None)
    assert layout.describe() == "hsdp: mesh 2 (replicate) x 2 (shard)"
    assert layout.order == (0, 2, 1, 3) and estimate.group == 2
    # A resumed run keeps its checkpoints' format: ddp stays ddp (it fits the device); a
    # sharded one picks hsdp or fsdp afresh for the nodes it now has.
    layout, _ = choose_layout(auto, nodes, 10**9, 16 * GIB, previous="ddp")
    assert layout.describe() == "ddp over 4 workers"
    layout, _ = choose_layout(auto, nodes, 10**9, 16 * GIB, previous="fsdp")
    assert layout.describe() == "hsdp: mesh 2 (replicate) x 2 (shard)"
    layout, _ = choose_layout(auto, ["a"] * 4, 10**9, 16 * GIB, previous="hsdp")
    assert layout.describe() == "fsdp: mesh 4 (shard)"  # one node now
    with pytest.raises(UserError, match="does not fit under parallel.strategy=ddp"):
        choose_layout(ParallelConfig(strategy="ddp"), nodes, 10**9, 8 * GIB, previous=None)


@pytest.mark.parametrize("arch", parallel_check.ARCHS)
def test_hsdp_2x2_takes_the_steps_of_one_process_and_of_ddp(four_ranks, arch):
    """20 fp32 steps of the same global batch: hsdp over a 2x2 mesh (shard groups inside the
    pretend nodes), the same accumulating 2 passes per step (the all-reduce between the
    groups held back to the last), and DDP over 4 ranks, each within 1e-4 of one process."""
    results = four_ranks[arch]
    assert results["layout"] == [0, 2, 1, 3]
    assert results["groups"] == {"replicate": [0, 1], "shard": [0, 2]}
    reference = parallel_check.reference(arch)
    assert reference[-1] < reference[0] - 1.0  # it learns: the comparison is not of noise
    for strategy in ("ddp", "hsdp", "hsdp_accumulating"):
        gap = max(abs(a - b) for a, b in zip(results[strategy], reference, strict=True))
        assert gap < 1e-4, (strategy, gap)
    gap = max(abs(a - b) for a, b in zip(results["hsdp"], results["ddp"], strict=True))
    assert gap < 1e-4, gap


@pytest.mark.parametrize("arch", parallel_check.ARCHS)
def test_hsdp_gradients_are_the_one_process_gradients(four_ranks, arch):
    """Gathered from their shards after the reduce-scatter and the all-reduce across groups:
    the whole batch's gradients, not those of an average the gloo AVG bug
    (pytorch#162338) would have got wrong."""
    assert four_ranks[arch]["grad_gap_hsdp"] < 1e-6


@pytest.mark.parametrize("arch", parallel_check.ARCHS)
def test_hsdp_holds_one_shard_groups_share_of_the_state(four_ranks, arch):
    share = four_ranks[arch]["bytes_hsdp"] / four_ranks[arch]["bytes_ddp"]
    assert share <= 1 / 2 * 1.1, share  # shard groups of 2


def test_a_tensor_parallel_block_matches_the_whole_block(four_ranks):
    """One llama block split over 2 ranks (column-wise q/k/v, gate/up; row-wise o, down;
    sequence-parallel norms): its output and input gradient are the whole block's."""
    assert four_ranks["llama"]["block_gap"] < 1e-5


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_tensor_parallel_under_fsdp_and_hsdp_takes_the_steps_of_one_process(four_ranks, strategy):
    """Tensor parallelism in each pretend node (2 ranks) with fsdp (shard across the nodes) or
    hsdp (replicate across them) over the rest: 20 steps within 1e-4 of one process, the
    gradients the same, the state a quarter (fsdp) or half (hsdp) of DDP's."""
    results = four_ranks["llama"]
    name = f"tp_{strategy}"
    reference = parallel_check.reference("llama")
    gap = max(abs(a - b) for a, b in zip(results[name], reference, strict=True))
    assert gap < 1e-4, gap
    assert results[f"grad_gap_{name}"] < 1e-6
    divisor = 4 if strategy == "fsdp" else 2
    assert results[f"bytes_{name}"] / results["bytes_ddp"] <= 1 / divisor * 1.1
    expected = {
        "fsdp": "fsdp: mesh 2 (shard) x 2 (tensor)",
        "hsdp": "hsdp: mesh 2 (replicate) x 1 (shard) x 2 (tensor)",
    }
    assert results[f"{name}_layout"] == expected[strategy]


def test_a_tensor_parallel_checkpoint_resumes_and_reshards(four_ranks, tmp_path):
    """Tensor parallel x fsdp, checkpointed at step 10 (DCP): resumed under the same layout
    it continues bit for bit; under hsdp 2x2 without tensor parallelism (every tensor cut
    differently) within 1e-5; the whole weights rank 0 gathered equal those rebuilt from the
    shards in one process."""
    results = four_ranks["llama"]
    after_save = results["tp_losses"][parallel_check.SAVE_AT :]
    assert results["tp_resumed"]["same"] == after_save
    gap = max(abs(a - b) for a, b in zip(results["tp_resumed"]["hsdp"], after_save, strict=True))
    assert gap < 1e-5, gap
    _assert_consolidates(Path(four_ranks["out"]) / "checkpoint-tp", "llama")


def test_shards_of_ranks_numbered_across_nodes_are_where_the_checkpoint_says(four_ranks):
    """fsdp over ranks on nodes a, b, a, b (mesh order 0, 2, 1, 3): saved at step 10 and loaded
    by ranks in plain order, a different cut of every tensor, it continues within 1e-5 of the
    run that saved it; the whole weights rank 0 gathered equal those rebuilt from the shards."""
    results = four_ranks["gpt2"]
    assert results["fsdp_layout"] == [0, 2, 1, 3]
    after_save = results["fsdp_losses"][parallel_check.SAVE_AT :]
    gap = max(abs(a - b) for a, b in zip(results["fsdp_resumed"], after_save, strict=True))
    assert gap < 1e-5, gap
    _assert_consolidates(Path(four_ranks["out"]) / "checkpoint-fsdp", "gpt2")


def _assert_consolidates(folder: Path, arch: str) -> None:
    """The whole weights rank 0 gathered into a sharded checkpoint equal, bit for bit, those
    rebuilt from its shards in one process (where DCP's metadata says each piece is)."""
    from safetensors.torch import load_file

    from raytrain_lm.checkpoints.sharded import consolidated_weights

    whole = load_file(str(folder / "model.safetensors"))
    rebuilt = consolidated_weights(folder, parallel_check.ARCHS[arch]())
    for name, tensor in whole.items():
        assert torch.equal(rebuilt[name], tensor), name
