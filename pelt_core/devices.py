"""Where a backbone and its jobs run: choosing a device, describing it, and its out-of-memory errors.

`resolve_device("auto")` is the first CUDA GPU torch sees, else the CPU. A backbone is moved to its device
once (`Backbone.load(..., device=...)`); every job's modules follow the backbone's device, and deltas are
always saved as fp32 CPU tensors, so a delta trained on one device loads on any other.
"""

from __future__ import annotations

from typing import Any

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")  # plus "cuda:N" for one GPU of several


class DeviceError(ValueError):
    """A device that does not exist here, or a name that is not a device."""


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """`auto` (a GPU when torch sees one, else the CPU), `cpu`, `cuda` or `cuda:N` as a torch device;
    a DeviceError names what is wrong (an unknown name, no GPU visible, a GPU index out of range)."""
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "gpu":
        name = "cuda"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {name!r}: no CUDA GPU is visible to torch {torch.__version__} here "
            "(a CPU build of torch, no driver, or CUDA_VISIBLE_DEVICES empty); use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"device {name!r}: torch sees {count} GPU(s), numbered 0 to {count - 1}")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def describe_device(device: torch.device) -> dict[str, Any]:
    """What a report says about a device: its type and name, and for a GPU its memory and bf16 support."""
    if device.type != "cuda":
        return {"type": device.type, "name": "cpu"}
    props = torch.cuda.get_device_properties(device)
    return {
        "type": "cuda",
        "index": device.index,
        "name": props.name,
        "total_memory_bytes": int(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
        "bf16": bool(torch.cuda.is_bf16_supported()),
    }


# what torch's allocators say when they are out of memory (CPU: "can't allocate memory", older builds "not
# enough memory"; CUDA raises torch.OutOfMemoryError, whose message says "out of memory")
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "not enough memory")


class DeviceOutOfMemory(RuntimeError):
    """A job's step did not fit in its device's memory. Not the job's fault for good: it may fit in a
    smaller pack or on another worker, so the service gives it back to the queue (a retryable failure)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocator's out-of-memory error (torch.OutOfMemoryError on CUDA; the CPU's
    allocator raises a RuntimeError: "DefaultCPUAllocator: can't allocate memory: you tried to allocate …")."""
    if isinstance(exc, DeviceOutOfMemory | torch.OutOfMemoryError):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(words in message for words in OUT_OF_MEMORY_WORDS)


def free_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the device (after an out-of-memory error)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring the device's peak memory from now (CUDA; the CPU's max RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


__all__ = [
    "DEVICE_CHOICES",
    "DeviceError",
    "DeviceOutOfMemory",
    "describe_device",
    "free_cached_memory",
    "is_out_of_memory",
    "reset_peak_memory",
    "resolve_device",
]
