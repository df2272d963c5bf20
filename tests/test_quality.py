"""The quality harness: its pure pieces, and a CI-sized run on the real model (2K tokens, few positions)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from hybrid_runtime.experiments.quality import (
    POLICIES,
    QualitySettings,
    compare_logits,
    length_tag,
    load_settings,
    markdown,
    metrics_of,
    other_metrics,
    repeated_fraction,
    runtime_config,
)
from hybrid_runtime.models import INSTALL_COMMAND, SMOLLM2_GEOMETRY, smollm2_available

needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(), reason=f"SmolLM2 GGUF not installed (CI installs it): {INSTALL_COMMAND}"
)
SLUGS = ("full", "fixed16_005", "fixed16_002", "fixed32_005", "fixed32_002", "streaming")


def test_policy_slugs_and_runtime_configs():
    assert tuple(POLICIES) == SLUGS
    s = QualitySettings(lengths=(512,), positions=8, passkey_lengths=())
    cfg = runtime_config(s, "fixed32_002")
    assert (cfg.policy.name, cfg.policy.block_size, cfg.policy.budget) == ("fixed", 32, 0.02)
    assert cfg.kv_cache.dtype == "bf16" and runtime_config(s, "full", store_dtype="fp32").kv_cache.dtype == "fp32"
    assert runtime_config(s, "streaming").policy.name == "streaming"
    assert length_tag(2048) == "2k" and length_tag(8192) == "8k" and length_tag(1000) == "1000"


def test_settings_are_validated(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        QualitySettings(policies=("fixed16_005", "oracle"))
    with pytest.raises(ValueError, match="exceed"):
        QualitySettings(lengths=(256,), positions=256)
    bad = tmp_path / "bad.yaml"
    bad.write_text("quality: {lenghts: [2048]}\n")
    with pytest.raises(ValueError, match="lenghts"):
        load_settings(bad)
    good = tmp_path / "good.yaml"
    good.write_text("quality: {lengths: [1024], positions: 4}\nruntime: {kv_cache: {sink: 16}}\n")
    s = load_settings(good, {"positions": 8})
    assert s.lengths == (1024,) and s.positions == 8 and runtime_config(s, "full").kv_cache.sink == 16


def test_compare_logits_measures_what_it_says():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 50, generator=g)
    targets = torch.randint(0, 50, (6,), generator=g)
    same = compare_logits(ref, ref, targets)
    assert same["agreement"] == 1.0 and abs(same["kl"]) < 1e-6
    uniform = compare_logits(torch.zeros(6, 50), ref, targets)
    assert math.isclose(uniform["ppl"], 50.0, rel_tol=1e-5)
    p = torch.softmax(ref, -1)
    assert math.isclose(uniform["kl"], float((p * (p.log() + math.log(50))).sum(-1).mean()), rel_tol=1e-4)
    flipped = compare_logits(-ref, ref, targets)
    assert flipped["agreement"] == 0.0 and flipped["kl"] > same["kl"]


def test_repeated_fraction_counts_copied_ngrams():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    # targets 9..18: only those at 16 (1..8) and 17 (2..9) complete an 8-gram seen before
    assert repeated_fraction(ids, 9) == pytest.approx(2 / 10)
    assert repeated_fraction(torch.arange(40), 20) == 0.0
    assert repeated_fraction(torch.arange(10).repeat(3), 20, n=4) == 1.0


@pytest.fixture(scope="module")
def smollm2():
    from hybrid_runtime.models import shared_smollm2

    return shared_smollm2("float32")


@needs_smollm2
def test_quality_run_ci_sized(smollm2, tmp_path):
    """Every policy at 2K with a few teacher-forced positions, budget-1 match, one passkey trial."""
    from hybrid_runtime.experiments.quality import passkey_prompt, run_quality, write_outputs

    model, tok = smollm2
    ids = passkey_prompt(tok, 1000, 0.5, 12345)
    assert 900 <= ids.shape[1] <= 1000 and "12345" in tok.decode(ids[0])

    settings = QualitySettings(lengths=(2048,), positions=6, error_positions=4, passkey_lengths=(2048,),
                               passkey_depths=(0.5,), budget1_prompt_tokens=400, budget1_new_tokens=8,
                               runtime={"kv_cache": {"sink": 64, "local": 256, "generated_cap": 512}})
    t0 = time.perf_counter()
    results = run_quality(model, tok, settings, progress=lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}"))
    m, other = metrics_of(results), other_metrics(results)
    # The contract's metrics are exactly the headline ones (metrics_of); the rest sit beside them.
    assert set(m) == {"budget1_token_match"} | {f"{name}_{slug}_2k" for slug in SLUGS
                                                for name in ("agreement", "kl", "ppl", "bytes_per_step")}
    assert m["budget1_token_match"] == 1.0
    assert 0.0 <= other["budget1_token_match_bf16"] <= 1.0 and 0.0 <= other["repeated_8gram_2k"] <= 1.0
    pol = results["lengths"]["2048"]["policies"]
    # Budget 1.0 (bf16 store) is the dense model up to rounding; sparse policies are not.
    assert m["agreement_full_2k"] == 1.0 and m["kl_full_2k"] < 1e-2
    assert pol["full"]["output_error"]["max"] < 0.05
    assert m["kl_streaming_2k"] > m["kl_full_2k"]
    # Streaming reads nothing from the CPU; fixed budgets read a fraction of what FULL reads.
    cpu_tokens = pol["full"]["cpu_tokens_per_layer"]
    assert cpu_tokens == 2048 - 6 - 64 - 256
    assert m["bytes_per_step_streaming_2k"] == 0 and pol["streaming"]["tasks_per_step"] == 0
    g = SMOLLM2_GEOMETRY
    kv_bytes = cpu_tokens * g.kv_heads * g.head_dim * 2 * 2 * g.layers  # K and V, bf16, every layer
    assert kv_bytes <= m["bytes_per_step_full_2k"] <= 1.2 * kv_bytes
    for slug in ("fixed16_005", "fixed16_002", "fixed32_005", "fixed32_002"):
        assert 0 < m[f"bytes_per_step_{slug}_2k"] < 0.3 * m["bytes_per_step_full_2k"]
        assert other[f"bytes_per_step_modeled_{slug}_2k"] > 0
    assert m["bytes_per_step_fixed16_002_2k"] < m["bytes_per_step_fixed16_005_2k"]
    assert len(pol["fixed16_005"]["output_error_per_layer"]) == g.layers
    assert len(results["passkey"]) == 1 and "passkey_full_2k" in other

    written = write_outputs(results, tmp_path / "out", tmp_path / "results")
    record = json.loads((tmp_path / "results" / "quality_smollm2-cpu.json").read_text()) if not torch.cuda.is_available() \
        else json.loads(written[0].read_text())
    for key in ("benchmark", "device", "host_cpu", "commit", "command", "created", "metrics", "points"):
        assert key in record
    assert record["metrics"] == m and record["other_metrics"] == other
    table = (tmp_path / "out" / "quality.md").read_text()
    assert "| 2k | fixed16_005 |" in table and "Passkey" in table
    assert markdown(results) == table
