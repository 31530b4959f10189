"""What hardware this machine has, detected once, and what a hardware preset needs.

Detection imports no GPU library beyond torch itself (and torch_npu only when it is installed), so it is cheap
enough to run in the resolve step before anything loads.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass

# The recipe that runs on each detected preset: named in the error when a recipe's hardware is absent.
RECIPE_FOR = {"cpu": "tiny_cpu", "sm90": "flash_sm90", "sm100": "flash_sm100", "ascend950": "flash_ascend950"}
NEEDS = {
    "cpu": "a CPU",
    "sm90": "an NVIDIA SM90 GPU (Hopper: CUDA compute capability 9.x)",
    "sm100": "an NVIDIA SM100 GPU (Blackwell: CUDA compute capability 10.x)",
    "ascend950": "an Ascend NPU through torch_npu",
}


@dataclass(frozen=True)
class Found:
    """The accelerator of this machine. preset: the hardware option that fits it (cpu when none does)."""

    device: str  # cpu | cuda | npu
    preset: str
    description: str
    cuda_major: int | None = None
    memory_bytes: int | None = None  # total memory of accelerator 0 (None for the CPU: see cpu_memory_bytes)


def detect() -> Found:
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        name = torch.cuda.get_device_name(0)
        preset = {9: "sm90", 10: "sm100"}.get(major, "cpu")
        memory = torch.cuda.get_device_properties(0).total_memory
        return Found("cuda", preset, f"{name} (sm{major}{minor})", major, memory)
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            memory = torch.npu.get_device_properties(0).total_memory
            return Found("npu", "ascend950", f"Ascend NPU {torch.npu.get_device_name(0)}", None, memory)
        return Found("cpu", "cpu", "torch_npu installed but no NPU device")
    return Found("cpu", "cpu", "no CUDA device and no torch_npu (CPU only)")


def fits(name: str, device: str, cuda_major: int | None, found: Found) -> bool:
    """Whether a hardware preset (by its device and required CUDA major) can run on what was found."""
    if device == "cpu":
        return True
    if device != found.device:
        return False
    return cuda_major is None or cuda_major == found.cuda_major


def cpu_memory_bytes() -> int | None:
    """Physical RAM of this machine; None where the OS does not say."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device: str, found: Found) -> int | None:
    """Total memory of the device type a preset runs on, from what detect() found."""
    if device == "cpu":
        return cpu_memory_bytes()
    return found.memory_bytes if device == found.device else None


def set_cpu_threads(n: int | None) -> None:
    """torch's intra-op CPU threads for this process (runtime.num_threads); None or 0 leaves torch's setting. The one
    place DeepInfer sets them: process-wide (torch has no per-model setting), and a fresh process does not inherit
    its parent's, so each process that runs a model calls this on the thread that runs it."""
    if n:
        import torch

        torch.set_num_threads(n)


@contextmanager
def cpu_threads(n: int | None):
    """set_cpu_threads(n) for the duration of the block, then the previous count again."""
    import torch

    before = torch.get_num_threads()
    set_cpu_threads(n)
    try:
        yield
    finally:
        set_cpu_threads(before)
