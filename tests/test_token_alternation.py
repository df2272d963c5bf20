"""benchmarks/token_alternation.py: which way each TPOT interval runs, the pairs' orientation whichever
way runs first, pooling over runs; and e2e_decode's alternating variants on the CPU (the switch is made
before every token of the warm-up and of the measured call)."""

from __future__ import annotations

import math

import pytest

from benchmarks import token_alternation as ta


def test_intervals_alternate_from_the_offsets_way():
    assert [ta.way_of_interval(i, 0) for i in range(5)] == [0, 1, 0, 1, 0]
    assert [ta.way_of_interval(i, 1) for i in range(5)] == [1, 0, 1, 0, 1]


def test_pair_ratios_are_way_one_over_way_zero_whichever_runs_first():
    tpot = [90.0, 10.0, 10.0, 12.0, 20.0, 15.0, 7.0]  # the first pair and the unpaired last interval are left out
    assert ta.pair_ratios(tpot, offset=0) == pytest.approx([1.2, 0.75])
    assert ta.pair_ratios(tpot, offset=1) == pytest.approx([1 / 1.2, 1 / 0.75])
    assert ta.pair_ratios(tpot, offset=0, skip_pairs=0) == pytest.approx([10.0 / 90.0, 1.2, 0.75])
    assert ta.pair_ratios([5.0, 6.0], offset=0) == []


def test_pairs_holding_an_excluded_interval_are_left_out():
    tpot = [90.0, 10.0, 10.0, 12.0, 20.0, 15.0, 30.0, 24.0]
    assert ta.pair_ratios(tpot, 0, exclude=[5]) == pytest.approx([1.2, 0.8])
    s = ta.alternation_summary(tpot, 0, ("plans", "direct"), exclude=[5, 99])
    assert s["alternate_pair_ratios"] == pytest.approx([1.2, 0.8]) and s["alternate_excluded_intervals"] == [5]
    assert s["alternate_tpot_ms_median"] == {"plans": pytest.approx(20.0), "direct": pytest.approx(18.0)}


def test_the_summary_names_each_ways_median_over_the_paired_intervals():
    tpot = [90.0, 10.0, 10.0, 12.0, 20.0, 15.0, 7.0]
    s = ta.alternation_summary(tpot, 1, ("plans", "direct"))
    assert s["tpot_ways"] == [1, 0, 1, 0, 1, 0, 1]
    # Intervals 2-5 are paired: way 1 ("direct") ran 2 and 4, way 0 ("plans") 3 and 5.
    assert s["alternate_tpot_ms_median"] == {"plans": pytest.approx(13.5), "direct": pytest.approx(15.0)}
    assert s["alternate_pair_ratios"] == pytest.approx([10.0 / 12.0, 20.0 / 15.0])
    assert s["alternate_pair_ratio_median"] == pytest.approx((10.0 / 12.0 + 20.0 / 15.0) / 2)
    assert s["alternate_pair_ratio_geomean"] == pytest.approx(math.sqrt(10.0 / 12.0 * 20.0 / 15.0))
    assert s["alternate_pairs_way1_faster"] == 1
    assert ta.alternation_summary([1.0, 2.0], 0, ("a", "b"))["alternate_pair_ratio_median"] is None


def test_pooling_joins_a_points_runs_and_keeps_points_and_values_apart():
    def row(model, ratios, values=("plans", "direct"), status="ok"):
        return {"model": model, "batch": 4, "context": 32768, "status": status, "alternate_values": list(values),
                "alternate_pair_ratios": ratios, "alternate_pair_ratio_median": sorted(ratios)[len(ratios) // 2]}

    rows = [row("m", [0.9, 0.8, 1.1]), row("m", [0.95]), row("m", [1.0, 1.0], ("plans", "plans")),
            row("q", [1.2]), row("m", [0.1], status="error"), {"model": "m", "status": "ok"}]
    out = {(r["model"], tuple(r["values"])): r for r in ta.pooled(rows)}
    assert set(out) == {("m", ("plans", "direct")), ("m", ("plans", "plans")), ("q", ("plans", "direct"))}
    m = out[("m", ("plans", "direct"))]
    assert (m["runs"], m["pairs"], m["way1_faster_pairs"]) == (2, 4, 3)
    assert m["median_ratio"] == pytest.approx(0.925) and m["run_medians"] == [0.9, 0.95]
    assert m["geomean_ratio"] == pytest.approx((0.9 * 0.8 * 1.1 * 0.95) ** 0.25)


def test_bad_alternations_are_refused():
    holder = type("H", (), {})()
    with pytest.raises(ValueError, match="two values"):
        ta.alternation_hook(holder, "claim_launch", ("plans",), 0)
    with pytest.raises(ValueError, match="offset 2"):
        ta.alternation_hook(holder, "claim_launch", ("plans", "direct"), 2)
    hook = ta.alternation_hook(holder, "claim_launch", ("plans", "direct"), 1)
    hook(0)
    assert holder.claim_launch == "direct"
    hook(3)
    assert holder.claim_launch == "plans"


# ---------------------------------------------------------------------------- in e2e_decode, on the CPU
pytest.importorskip("transformers", reason="the e2e benchmark needs the `models` extra")

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks import e2e_decode as e2e  # noqa: E402
from hybrid_runtime.executors.torch_ref import TorchRefExecutor  # noqa: E402

CONTEXT, BATCH = 300, 2
RUNTIME = {"kv_cache": {"sink": 16, "local": 32, "generated_cap": 16},
           "scheduler": {"cpu_workers": 1, "gpu_worker": True, "pin_cores": False}}


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=4096)
    return e2e.build_model(cfg, "cpu", torch.float32, seed=0)


def test_an_alternating_variant_switches_claim_launch_before_every_token(model, monkeypatch):
    # The CPU's GPU lane (the torch reference executor) has no claim_launch; a stand-in records the switches.
    seen: list[str] = []
    monkeypatch.setattr(TorchRefExecutor, "claim_launch",
                        property(lambda self: seen[-1] if seen else "plans", lambda self, v: seen.append(v)),
                        raising=False)
    row = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion_alt_direct_plans"], BATCH, CONTEXT, new_tokens=8,
                       warmup_tokens=64, cpu_workers=1, hybrid_overrides=RUNTIME)
    assert row["status"] == "ok", row.get("reason")
    # The warm-up's 3 tokens, then the measured call's 8: direct first (offset 1), before every token.
    assert seen == ["direct", "plans", "direct"] + ["direct", "plans"] * 4
    assert row["tpot_ways"] == [1, 0, 1, 0, 1, 0, 1] and len(row["alternate_pair_ratios"]) == 2
    assert row["alternate_values"] == ["plans", "direct"]
    md = e2e.markdown({"device": "d", "host_cpu": "h", "commit": "c", "created": "t", "complete": True,
                       "points": [row], "metrics": {}})
    assert "| tiny | 2 | 300 | gpu_executor.claim_launch | direct / plans | 1 | 2 |" in md


def test_a_scheduler_setting_alternates_too(model):
    row = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion_alt_auto_gpu_selection"], BATCH, CONTEXT, new_tokens=6,
                       warmup_tokens=64, cpu_workers=1, hybrid_overrides=RUNTIME)
    assert row["status"] == "ok", row.get("reason")
    assert row["alternate_attribute"] == "scheduler.picks_always" and row["alternate_values"] == ["False", "True"]
    assert row["tpot_ways"] == [0, 1, 0, 1, 0] and len(row["alternate_pair_ratios"]) == 1


def test_an_alternating_variant_without_a_uva_executor_is_an_error_row_that_says_so(model):
    row = e2e.run_unit(model, "tiny", e2e.VARIANTS["fluxion_alt_plans_direct"], BATCH, CONTEXT, new_tokens=4,
                       warmup_tokens=64, cpu_workers=1, hybrid_overrides=RUNTIME)
    assert row["status"] == "error" and "gpu_executor.claim_launch" in row["reason"]
    assert "needs the GPU lane's UVA executor" in row["reason"]
    assert "TorchRefExecutor" in row["reason"]
