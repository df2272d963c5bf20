"""What machine and code a measurement ran on: CPU, GPU, usable cores, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import numpy as np
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


def _read(path: str) -> str:
    """A /proc file's text; empty where there is none."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def read_cpu_stat() -> str:
    """/proc/stat as it is now, unparsed (a read is ~20 us; `parse_cpu_jiffies` later): for
    snapshots taken where parsing would cost the measured thread time."""
    return _read("/proc/stat")


def parse_cpu_jiffies(text: str) -> dict[int, np.ndarray]:
    """Per core, its time counters in a /proc/stat text (user, nice, system, idle, iowait, irq,
    softirq, steal, in ticks); empty for an empty or unreadable text."""
    out = {}
    try:
        for line in text.splitlines():
            name, *vals = line.split() or [""]
            if name.startswith("cpu") and name != "cpu":
                out[int(name[3:])] = np.array([int(v) for v in vals[:8]], dtype=np.int64)
    except ValueError:
        return {}
    return out


def cpu_jiffies() -> dict[int, np.ndarray]:
    """Per core, its time counters from /proc/stat (user, nice, system, idle, iowait, irq,
    softirq, steal, in ticks); empty where there is no /proc/stat."""
    return parse_cpu_jiffies(read_cpu_stat())


def read_thread_status() -> str:
    """/proc/thread-self/status of the calling thread, unparsed (`parse_thread_switches` later)."""
    return _read("/proc/thread-self/status")


def parse_thread_switches(text: str) -> tuple[int, int] | None:
    """(voluntary, involuntary) context switches in a /proc/thread-self/status text; None where
    they are missing."""
    vals = {}
    try:
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                name, val = line.split(":")
                vals[name] = int(val)
        return vals["voluntary_ctxt_switches"], vals["nonvoluntary_ctxt_switches"]
    except (ValueError, KeyError):
        return None


def thread_switches() -> tuple[int, int] | None:
    """The calling thread's context switches so far, (voluntary, involuntary), from
    /proc/thread-self/status; None where there is none. Involuntary ones are the scheduler taking
    the core from a thread that wanted to run (another runnable thread on its core)."""
    return parse_thread_switches(read_thread_status())


def steal_core_ms(before: dict[int, np.ndarray], after: dict[int, np.ndarray]) -> float | None:
    """Between two `cpu_jiffies` snapshots, the time a hypervisor ran something else while this
    machine's cores wanted to run, summed over the cores in both (core-ms; ticks are ~10 ms, so
    it counts in steps of a tick); None where either snapshot is empty."""
    keys = [c for c in before if c in after]
    if not keys:
        return None
    ticks = sum(int(after[c][7] - before[c][7]) for c in keys)
    return ticks * 1e3 / os.sysconf("SC_CLK_TCK")


def thread_cpu() -> int | None:
    """The core the calling thread last ran on (/proc/thread-self/stat, field 39); None where
    there is none."""
    try:
        with open("/proc/thread-self/stat") as f:
            stat = f.read()
        # Fields after the command (in parentheses, which may hold spaces): field 3 on.
        return int(stat[stat.rindex(")") + 2:].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def cpu_shares(before: dict[int, np.ndarray], after: dict[int, np.ndarray],
               cores: list[int] | None = None) -> dict[str, float]:
    """Between two `cpu_jiffies` snapshots, over `cores` (default: every core in both): `busy`,
    the share of their time not idle, and `steal`, the share a virtual machine's hypervisor ran
    something else while they wanted to run (vCPUs sharing fewer physical cores lose time to each
    other when busy). NaN where /proc/stat was missing or no tick passed (ticks are ~10 ms)."""
    keys = [c for c in (before if cores is None else cores) if c in before and c in after]
    tot = np.sum([after[c] - before[c] for c in keys], axis=0) if keys else None
    total = 0 if tot is None else int(tot.sum())
    if total <= 0:
        return {"busy": float("nan"), "steal": float("nan")}
    return {"busy": (total - int(tot[3] + tot[4])) / total, "steal": int(tot[7]) / total}


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
