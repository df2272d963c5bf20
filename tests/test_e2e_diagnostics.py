"""The end-to-end diagnostics (`benchmarks/diag/e2e_lanes.py`, `e2e_host_profile.py`) are run on the
GPU machine, at 8B geometry; here they run end to end at one layer on the host, so a change to the
e2e benchmark's helpers they import, or to the runtime's stats and timeline they read, breaks a
test rather than the next device call."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "1", "--batch", "1", "--context", "512", "--tokens", "3", "--cpu-workers", "1"]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "diag" / script), *SMALL, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_e2e_lanes_prints_each_lanes_times_from_q_and_the_lane_estimates():
    res = run("e2e_lanes.py", "--variants", "fluxion", "--set", "profiling.sample_every=1")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "## fluxion: TPOT median" in out and "1 layer-steps" in out
    for line in ("cpu_first", "cpu_last", "merged", "host milestones", "estimates: gpu_share",
                 "jit_launches_after_warmup 0", "calling thread: "):
        assert line in out
    assert "context switches; on a CPU worker's core at" in out
    # The launcher's milestones in order, each measured on the one layer-step (ms from q).
    stamps = out.split("host milestones", 1)[1].splitlines()[1:10]
    names = [line.split()[0] for line in stamps]
    assert names == ["prev_cpu_last", "settled", "collect_in", "collected", "run", "wake", "run_out", "record_in",
                     "returned"]
    at = {line.split()[0]: float(line.split()[1]) for line in stamps if "n 1)" in line}
    assert {"run", "wake", "run_out", "record_in", "returned"} <= set(at)
    assert at["run"] <= at["wake"] <= at["run_out"] <= at["record_in"] <= at["returned"]
    # Each kind of step (no CUDA here: every step selects on the host) with what its steps cost.
    kind = out.split("steps selecting on the host", 1)[1].splitlines()
    assert kind[0].split(",")[0].strip() == "1"
    assert kind[1].split()[0] == "merged" and kind[2].split()[0] == "decode_host" and "n 1)" in kind[2]


def test_e2e_host_profile_writes_both_profiles(tmp_path):
    res = run("e2e_host_profile.py", "--out", str(tmp_path), "--set", "profiling.enabled=false")
    assert res.returncode == 0, res.stderr[-2000:]
    text = (tmp_path / "host_profile-fluxion-1x512.txt").read_text()
    assert "config overrides: {'profiling': {'enabled': False}}" in text
    assert "## fluxion: TPOT median" in text and "by cumulative time" in text
    # What the decode path calls, down to the step's own closures (the CPU lane's `before_cpu`).
    assert "### callees of runtime.py:decode" in text and "### callees of runtime.py:before_cpu" in text
    assert (tmp_path / "host_profile-fluxion-1x512.prof").stat().st_size > 0


def test_a_bad_override_is_an_argument_error():
    res = run("e2e_lanes.py", "--set", "profiling")
    assert res.returncode == 2 and "--set 'profiling': expected key=value" in res.stderr


def test_the_model_is_one_of_the_benchmarks_geometries():
    res = run("e2e_host_profile.py", "--model", "gpt-2")
    assert res.returncode == 2 and "--model: invalid choice: 'gpt-2'" in res.stderr, res.stderr[-500:]
    assert "qwen2.5-7b" in res.stderr, "the error lists the allowed models"
