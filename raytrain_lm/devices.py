"""Device facts: precision settings, fused kernels and the peak FLOPs table for MFU."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from the vendors' data sheets. Keys are
# matched against CUDA/ROCm device names ("NVIDIA H100 PCIe", "AMD Instinct MI300X") and Ray
# accelerator types ("H100", "AMD-Instinct-MI300X-OAM") by `by_accelerator_type`: the longest
# key a name contains wins, so a form factor's own entry ("H100 PCIE") beats the family's.
GPU_PEAK_FLOPS = {
    "B200": 2250e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "H100": 989e12,  # SXM (Ray's type "H100" names no form factor)
    "H100 NVL": 835e12,
    "H100 PCIE": 756e12,
    "H800": 989e12,
    "H800 PCIE": 756e12,
    "MI300X": 1307e12,
    "MI325X": 1307e12,
    "MI250X": 383e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
}
# fp32 FLOP/s of one core: SIMD lanes x 2 (FMA) x 2 FMA units x 3.5 GHz, erring high so that
# CPU MFU is a lower bound.
CPU_PEAK_FLOPS_PER_THREAD = {"AVX512": 16 * 2 * 2 * 3.5e9, "AVX2": 8 * 2 * 2 * 3.5e9}
CPU_PEAK_FLOPS_FALLBACK = 4 * 2 * 2 * 3.5e9
UNKNOWN_GPU_PEAK_FLOPS = 312e12  # A100-class, so that an unknown GPU's MFU errs low


def by_accelerator_type(table: Mapping[str, float], kind: str) -> float | None:
    """`table`'s entry for an accelerator type: the key equal to it (case aside), else the
    longest key it contains ("A100" for "A100-80G", "L4" for "NVIDIA L4"; "L40S" before "L40"
    before "L4"), else `default`; None if none applies. Peaks, balance weights and prices are
    looked up alike."""
    named = {k.upper(): v for k, v in table.items()}
    kind = kind.upper()
    if kind in named:
        return named[kind]
    for key in sorted(named, key=len, reverse=True):
        if key != "DEFAULT" and key in kind:
            return named[key]
    return named.get("DEFAULT")


def price_per_hour(
    table: Mapping[str, float], kind: str, market: str | None = None
) -> float | None:
    """A worker's price from `fault.price_per_hour`: with its node's `market` (spot or
    on_demand), a `TYPE:market` key first ("A100:spot"), then the type's own entry."""
    if market:
        suffix = f":{market}".upper()
        marketed = {k[: -len(suffix)]: v for k, v in table.items() if k.upper().endswith(suffix)}
        found = by_accelerator_type(marketed, kind) if marketed else None
        if found is not None:
            return found
    return by_accelerator_type({k: v for k, v in table.items() if ":" not in k}, kind)


def gpu_peak_flops(name: str) -> float | None:
    """Peak for a CUDA device name ("NVIDIA A100-SXM4-80GB") or a Ray accelerator type ("A100",
    "A100-80G", "L4"); None if unknown."""
    return by_accelerator_type(GPU_PEAK_FLOPS, name)


def peak_flops(device: torch.device) -> float:
    if device.type == "cuda":
        peak = gpu_peak_flops(torch.cuda.get_device_name(device))
        return UNKNOWN_GPU_PEAK_FLOPS if peak is None else peak
    capability = torch.backends.cpu.get_cpu_capability()
    per_thread = CPU_PEAK_FLOPS_PER_THREAD.get(capability, CPU_PEAK_FLOPS_FALLBACK)
    return per_thread * max(1, torch.get_num_threads())


def mfu(flops_per_token: float, tokens_per_s_per_device: float, device: torch.device) -> float:
    """One device's MFU: the model FLOP/s it achieves over its peak."""
    return min(1.0, flops_per_token * tokens_per_s_per_device / peak_flops(device))


def training_peaks(types: Sequence[str], device: torch.device, own_type: str) -> list[float]:
    """The peak FLOP/s of the device each rank trains on, from its accelerator type (`types`,
    one per rank), as a rank of type `own_type` training on `device` knows them. A group
    trains on one kind of device (`scaling.use_gpu`): on CPU, every rank's peak is a CPU's,
    whatever its node's type says (a fake GPU node, CPU workers on a GPU node); on CUDA,
    ranks of this rank's type have its device's peak, the others their type's."""
    if device.type != "cuda":
        return [peak_flops(device)] * len(types)
    return [
        peak_flops(device) if kind == own_type else gpu_peak_flops(kind) or UNKNOWN_GPU_PEAK_FLOPS
        for kind in types
    ]


def group_mfu(flops_per_token: float, tokens_per_s: float, peaks: Sequence[float]) -> float:
    """The MFU of ranks that train `tokens_per_s` together, each on a device of peak FLOP/s
    `peaks` (`training_peaks`): the model FLOP/s they achieve over their peaks summed."""
    return min(1.0, flops_per_token * tokens_per_s / sum(peaks))


def use_bf16(device: torch.device, precision: str) -> bool:
    """bf16 autocast where the GPU computes in bf16 natively (Ampere and newer). Older GPUs
    (V100, T4) emulate it, slower than fp32: there only an explicit `bf16` turns it on."""
    if precision == "fp32" or device.type != "cuda":
        return False
    return torch.cuda.is_bf16_supported(including_emulation=precision == "bf16")


def use_compile(device: torch.device, setting: bool | str) -> bool:
    """`training.compile`: auto compiles on CUDA, where it pays; on CPU compiling a tiny model
    takes longer than training it."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def configure_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        # Ray starts workers with OMP_NUM_THREADS=1 unless told; honour what the worker reserved.
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)


def autocast(device: torch.device, bf16: bool):
    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_adamw(groups: list[dict], lr: float, betas: tuple[float, float], device: torch.device):
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.type == "cuda")


# Shards store ids as uint8/16/32 (tokenization.token_dtype). PyTorch's unsigned 16 and 32 bit
# types support little beyond copies, so those cross as the signed type of the same width and
# are widened on the device, where the mask restores the unsigned value.
_SIGNED_TWIN = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32}


def tokens_to_device(tokens: np.ndarray, device: torch.device) -> torch.Tensor:
    """Token ids as int64 on `device`. They cross in the shards' compact dtype (a quarter of
    int64's bytes for uint16); on CUDA from pinned memory, so the copy is truly asynchronous
    (torch's caching host allocator keeps the pinned buffer until the copy is done)."""
    if not tokens.flags.writeable:  # Ray Data's batches: torch wants a buffer it may own
        tokens = tokens.copy()
    twin = _SIGNED_TWIN.get(tokens.dtype)
    host = torch.from_numpy(tokens.view(twin) if twin is not None else tokens)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    ids = host.to(torch.int64)
    if twin is not None:
        ids &= (1 << (8 * tokens.dtype.itemsize)) - 1
    return ids
