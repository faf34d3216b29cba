"""Where mars_hf keeps what it builds or converts on this machine: ``$MARS_HF_HOME``, else ``~/.cache/mars_hf``;
and what this machine's CPU is, for the keys of what is built or measured there.

One definition for the package and the decoding files that ship in checkpoints (``custom_generate/home.py``;
standard library only), so the embedded model's converted copy, trained caches and the gated C kernel's
builds always land under the same folder. An empty ``MARS_HF_HOME`` counts as unset.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def mars_hf_home() -> Path:
    return Path(os.environ.get("MARS_HF_HOME") or Path.home() / ".cache" / "mars_hf")


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``; the processor name where there is none). Why part of a key:
    one home folder may serve several machines (a shared or restored home, a VM moved to another host), and
    what a kernel build or a cost curve is worth differs between an AVX2-only CPU and one with AVX-512 BF16."""
    found = _cpuinfo_field(("flags", "Features"))
    return found if found is not None else platform.processor() + platform.machine()


# The flags that decide what a CPU matmul costs: AVX2 / AVX-512, native bf16 and fp16, AMX; Arm's SIMD.
SPEED_CPU_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16",
)  # fmt: skip


def speed_cpu_flags() -> str:
    """Which of `SPEED_CPU_FLAGS` this CPU has, space-separated: what a benchmark prints beside its numbers
    (``"avx2 fma"`` and ``"avx2 fma avx512f ... amx_bf16"`` are different machines for a bf16 forward)."""
    flags = set(cpu_flags().split())
    found = [flag for flag in SPEED_CPU_FLAGS if flag in flags]
    return " ".join(found) if found else "none of " + "/".join(SPEED_CPU_FLAGS)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    return _cpuinfo_field(("model name",)) or platform.processor() or platform.machine()


def _cpuinfo_field(names: tuple[str, ...]) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(names):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
