"""What the check ran on (versions, device) and how much memory it took."""

from __future__ import annotations

import datetime
import platform
from importlib.metadata import PackageNotFoundError, version

import torch
import transformers

from mars_hf.decoding.home import cpu_name, speed_cpu_flags


def environment(device: torch.device, dtype: str) -> dict:
    """Versions, device and date: the context every number of the JSON needs."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu": cpu_name(),
        "cpu_flags": speed_cpu_flags(),
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "dtype": dtype,
    }
    for package in ("trl", "peft", "accelerate", "mars-hf"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    return env


def peak_memory_reset(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory_mb(device) -> float | None:
    """Peak allocated GPU memory since the last reset (MiB); None on the CPU (see `max_rss_mb`)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return None


def max_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
