"""Choices the CUDA path makes that no CPU run reaches: each checked on the choice itself
(precision, MFU peaks, DDP's buffers, torch's synchronization counting, the torch floor)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version

from raytrain_lm import devices
from raytrain_lm.llama import Llama, LlamaShape
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.distributed.parallel import replicate_model

pytestmark = pytest.mark.no_ray

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("native", "precision", "expected"),
    [
        (False, "auto", False),  # V100, T4: bf16 only emulated, slower than fp32
        (False, "bf16", True),  # asked for by name: emulated is still bf16
        (True, "auto", True),  # A100 and newer
        (True, "fp32", False),
    ],
)
def test_bf16_autocast_only_where_the_gpu_has_it(monkeypatch, native, precision, expected):
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return native or including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert devices.use_bf16(CUDA, precision) is expected
    assert devices.use_bf16(torch.device("cpu"), precision) is False


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989),  # SXM
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("H100", 989),  # Ray's accelerator type names no form factor
        ("NVIDIA H800", 989),
        ("NVIDIA H800 PCIe", 756),
        ("NVIDIA H200", 989),
        ("NVIDIA GH200 480GB", 989),
        ("AMD Instinct MI300X", 1307),
        ("AMD-Instinct-MI300X-OAM", 1307),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
    ],
)
def test_mfu_peaks_by_device_name(name, tflops):
    assert devices.gpu_peak_flops(name) == tflops * 1e12


def test_ddp_does_not_broadcast_buffers_every_step():
    """llama's RoPE tables are the same on every rank: no broadcast from rank 0 inside the
    first forward of every step (which scaling.balance times)."""
    model = Llama(LlamaShape(64, 16, 1, 2, 2, 16, 32, True))
    assert replicate_model(model, torch.device("cpu"), world=1) is model
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = replicate_model(model, torch.device("cpu"), world=2)
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        setting = "forward_sync_buffers"  # torch 2.13's name; broadcast_buffers before
        assert (
            getattr(wrapped, setting if hasattr(wrapped, setting) else "broadcast_buffers") is False
        )
    finally:
        dist.destroy_process_group()


def test_count_syncs_on_cuda_also_counts_torch_own(monkeypatch):
    """On CUDA the counter turns on torch's sync debug mode and counts its warnings (every
    synchronization, inside torch too) apart from our own reads; other warnings still show."""
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    for name in chaos.SyncCounter.METHODS:  # the counter wraps these: undone after the test
        monkeypatch.setattr(torch.Tensor, name, getattr(torch.Tensor, name))
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    counter = chaos.sync_counter(chaos.parse("count-syncs"), CUDA)
    assert modes == ["warn"] and counter.counts_device
    for _ in range(2):  # the same source line twice: both count
        warnings.warn(chaos.SYNC_WARNING + " (Triggered internally)", UserWarning, stacklevel=1)
    counter.close_step(1)
    with pytest.warns(UserWarning, match="something else"):
        warnings.warn("something else", UserWarning, stacklevel=1)
    counter.close_read(1)
    assert counter.device_per_step == {1: 2} and counter.per_step == {1: 0}
    assert counter.device_at_reads == {1: 0}
    assert set(counter.summary()) == {"per_step", "at_reads", "device_per_step", "device_at_reads"}


def test_torch_floor_has_what_the_gpu_path_uses():
    """FSDP2's public `torch.distributed.fsdp.fully_shard` (which parallel.py imports) and a
    compiled DDP around activation-checkpointed blocks need torch 2.6; an older floor would
    let pip keep a torch on which the GPU path fails at its first step."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'^\s*"torch>=([\d.]+)', pyproject, re.MULTILINE).group(1)
    assert Version(floor) >= Version("2.6")
    assert Version(torch.__version__.split("+")[0]) >= Version(floor)
