"""Parallel strategies (trainer/distributed/parallel.py) and sharded checkpoints (checkpoints/sharded.py), on
2 gloo ranks outside Ray: the components themselves. The Ray Train path (resizes through
sharded checkpoints) is in test_training.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support import parallel_check
from support.gloo_ranks import run_ranks

from raytrain_lm.checkpoints import file_listing
from raytrain_lm.checkpoints.sharded import consolidated_weights, is_sharded_checkpoint
from raytrain_lm.trainer.distributed.parallel import MemoryEstimate, check_fits, choose_strategy


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """One job of 2 ranks runs every strategy for both architectures (see parallel_check)."""
    return run_ranks("parallel_check", tmp_path_factory.mktemp("parallel"), world=2)


@pytest.mark.parametrize("arch", parallel_check.ARCHS)
def test_one_worker_ddp_and_fsdp_take_the_same_steps(two_ranks, arch):
    """Same global batch, 20 steps, fp32: DDP and FSDP on 2 ranks within 1e-4 of 1 worker."""
    reference = parallel_check.reference(arch)
    assert reference[-1] < reference[0] - 1.0  # it learns: the comparison is not of noise
    for strategy in ("ddp", "fsdp"):
        losses = two_ranks[arch][strategy]
        assert len(losses) == parallel_check.STEPS
        gap = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        assert gap < 1e-4, (strategy, gap)


@pytest.mark.parametrize("arch", parallel_check.ARCHS)
def test_uneven_shares_take_the_same_steps_as_equal_ones(two_ranks, arch):
    """scaling.balance's arithmetic: the global batch split 6 + 2 (weighted by tokens) gives
    the update of the equal 4 + 4 split, under DDP and under FSDP (where rank 1 pads its
    passes with a weight-0 one), within 1e-5 at every one of 20 steps in fp32."""
    for strategy in ("ddp", "fsdp"):
        equal, uneven = two_ranks[arch][strategy], two_ranks[arch][f"{strategy}_uneven"]
        assert len(uneven) == parallel_check.STEPS
        gap = max(abs(a - b) for a, b in zip(uneven, equal, strict=True))
        assert gap < 1e-5, (strategy, gap)


@pytest.mark.parametrize("arch", parallel_check.ARCHS)
def test_fsdp_holds_a_share_of_the_training_state(two_ranks, arch):
    """Parameters + gradients + AdamW state on one rank, from the tensors: at most 1/N of
    DDP's plus 10%."""
    share = two_ranks[arch]["bytes_fsdp"] / two_ranks[arch]["bytes_ddp"]
    assert share <= 1 / 2 * 1.1, share


@pytest.mark.parametrize("arch", parallel_check.ARCHS)
def test_a_sharded_checkpoint_resumes_bit_for_bit_and_consolidates(two_ranks, arch):
    results, folder = two_ranks[arch], two_ranks["out"] / f"checkpoint-{arch}"
    assert results["resumed"] == results["fsdp"][parallel_check.SAVE_AT :]
    assert is_sharded_checkpoint(folder)
    # Each rank listed its own shards: together, every file but the markers.
    parts = [json.loads((folder / f"PART-{r}").read_text())["files"] for r in range(2)]
    assert "__0_0.distcp" in parts[0] and "__1_0.distcp" in parts[1]
    assert {**parts[0], **parts[1]} == file_listing(folder)
    # The whole weights, rebuilt from the shards in one process without a process group, are
    # those rank 0 gathered into safetensors; the untied output projection is kept.
    whole = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" in whole or arch == "gpt2"
    rebuilt = consolidated_weights(folder, parallel_check.ARCHS[arch]())
    for name, tensor in whole.items():
        assert torch.equal(rebuilt[name], tensor), name


def test_auto_shards_only_what_would_not_fit():
    gib = 1 << 30
    small = MemoryEstimate(params=125_000_000, world=8, device_bytes=80 * gib, fraction=0.6)
    large = MemoryEstimate(params=6_738_415_616, world=8, device_bytes=80 * gib, fraction=0.6)
    assert choose_strategy("auto", small, None) == "ddp"
    assert choose_strategy("auto", large, None) == "fsdp"  # 100 GiB under ddp, 12.6 under fsdp
    assert choose_strategy("auto", large, "ddp") == "ddp"  # a run keeps its checkpoints' strategy
    assert choose_strategy("ddp", large, None) == "ddp"
    assert "100.41 GiB per device under ddp" in large.describe()
    check_fits("fsdp", large)
    with pytest.raises(Exception, match="does not fit under parallel.strategy=ddp"):
        check_fits("ddp", large)
