"""What machine and code a measurement ran on: CPU, GPU, usable cores, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from hybrid_runtime.pinning import usable_cores

_ROOT = Path(__file__).resolve().parents[2]


def host_cpu() -> str:
    """The CPU's model name and core count, e.g. `Intel(R) Xeon(R) Processor x16`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"


def gpu_name() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def device_name() -> str:
    """The GPU's name, or `cpu (<host cpu>)` without one."""
    return gpu_name() or f"cpu ({host_cpu()})"


def fingerprint() -> dict:
    """What identifies this machine's limits: host name, CPU, cores this process may use, GPU."""
    return {"host": platform.node(), "cpu": host_cpu(), "usable_cores": usable_cores(), "gpu": gpu_name()}


def git_commit() -> str:
    """The commit of this checkout: $HYBRID_COMMIT (set where the tree is copied without .git), else
    git's HEAD with `-dirty` when the tree has changes, else "unknown"."""
    if os.environ.get("HYBRID_COMMIT"):
        return os.environ["HYBRID_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=_ROOT)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=_ROOT).stdout
        return head.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


__all__ = ["device_name", "fingerprint", "git_commit", "gpu_name", "host_cpu"]
