"""What the device can do for FP8: the one hardware check every engine and the CLI share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda" or "cpu"
    name: str
    capability: Optional[Tuple[int, int]] = None
    cuda_version: Optional[str] = None  # the CUDA torch is built for (None: not a CUDA device, or unknown)

    @property
    def fp8_gemm(self) -> bool:
        """Whether FP8 GEMMs run here: on CUDA sm_89+ in hardware, on a CPU emulated (fp8plug.backends.gemm)."""
        if self.type == "cuda":
            return self.capability is not None and self.capability >= FP8_MIN_CAPABILITY
        return self.type == "cpu"

    def describe(self) -> str:
        if self.type == "cuda":
            major, minor = self.capability
            return f"{self.name} (CUDA, compute capability {major}.{minor})"
        return f"{self.name} (CPU)"


def parse_device(text, option: str = "--device") -> torch.device:
    """The device a command line names (None: CUDA if present, else the CPU), or a ValueError
    naming `option` and what to give instead: an unknown name, a device kind other than cuda or
    cpu, or cuda where this torch has no CUDA GPU."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(str(text).strip())
    except (RuntimeError, ValueError):
        raise ValueError(f"{option}: {text!r} is not a device; use cuda, cuda:N or cpu.") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{option}: {device.type!r} is not supported; use cuda or cpu.")
    if device.type == "cuda" and not torch.cuda.is_available():
        built = "has no CUDA support" if torch.version.cuda is None else "sees no CUDA GPU"
        raise ValueError(f"{option}: cuda asked for, but torch {torch.__version__} {built}; use --device cpu.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{option}: {text!r} does not exist: torch sees {torch.cuda.device_count()} CUDA GPU(s).")
    return device


def device_info(device=None) -> DeviceInfo:
    """Describe `device` (default: the current CUDA device if there is one, else the CPU)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return DeviceInfo("cuda", torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index),
                          torch.version.cuda)
    if device.type == "cpu":
        import platform

        return DeviceInfo("cpu", platform.processor() or platform.machine() or "cpu")
    return DeviceInfo(device.type, device.type)
