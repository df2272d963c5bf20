"""`hybrid-runtime run | report | probe` end to end on the CPU: the shipped configs, the run folder
(report sections, re-rendering, comparison, failures, Ctrl-C, reuse), bad input refused before
anything runs, mixed-length points, the TPOT experiment through `generate`, the machine probe."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from hybrid_runtime.cli import main
from hybrid_runtime.config import ConfigError, PointConfig, config_from_dict, load_config, resolved
from hybrid_runtime.experiments import experiment, report
from hybrid_runtime.experiments.points import point_runs
from hybrid_runtime.experiments.summary import variant_rows
from hybrid_runtime.memory_plan import MachineMemory, admit
from hybrid_runtime.runtime import HybridRuntime

ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIGS = ["quickstart", "table5_idle", "tpot_grid", "mixed_length", "scheduler_ablation"]
GiB = 2**30
# The quickstart at a tenth of its size: every section of its report, in seconds.
SMALL_QUICKSTART = ["--set", "workload.context=2048", "--set", "kv_cache.cpu_capacity_tokens=4096",
                    "--set", "workload.decode_steps=3", "--set", "scheduler.pin_cores=false"]
TINY = {
    "geometry": {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32},
    "kv_cache": {"sink": 16, "local": 64, "generated_cap": 32, "cpu_capacity_tokens": 4096, "max_sequences": 2},
    "selection": {"name": "fixed", "block_size": 16, "budget": 0.1},
    "scheduler": {"placement": "fluxion", "cpu_workers": 1, "pin_cores": False},
    "experiment": {"points": [{"batch": 2, "context": 1200}, {"batch": 2, "context_range": [600, 1500]}],
                   "variants": [{"name": "cpu_only", "placement": "cpu_only"}, {"name": "fluxion"}],
                   "baseline": "cpu_only"},
    "workload": {"decode_steps": 2, "seed": 3},
}


@pytest.fixture(autouse=True)
def _own_probe_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_RUNTIME_PROBE_CACHE", str(tmp_path / "machine_limits.json"))


def _write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.suffix in (".md", ".png", ".csv")}


# ---------------------------------------------------------------------------- the shipped configs
@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_shipped_run_configs_validate_and_fit_the_h100_host(name):
    """Each experiment config loads, passes the checks a GPU machine makes, and its largest point fits
    the reference host (128 GiB, 120 available; an 80 GB GPU)."""
    cfg = resolved(load_config(ROOT / "configs" / f"{name}.yaml"), cuda=True)
    experiment.check(cfg, cuda=True)
    h100 = MachineMemory(host_available=120 * GiB, host_total=128 * GiB, gpu_free=79 * GiB, gpu_total=80 * GiB)
    admit(experiment.memory_plan(cfg, cuda=True), cfg.kv_cache, h100)


def test_the_other_shipped_configs_validate():
    from hybrid_runtime.experiments.predictor_eval import load_settings as eval_settings
    from hybrid_runtime.experiments.quality_settings import load_settings as quality_settings

    from hybrid_runtime.experiments import asynctls_quality, evosparse_quality, nosa_quality, sparda_quality
    from hybrid_runtime.experiments.quality_settings import load_section_settings

    load_config(ROOT / "configs" / "hf_smollm2.yaml")
    quality_settings(ROOT / "configs" / "quality_smollm2.yaml")
    eval_settings(str(ROOT / "configs" / "predictor_smollm2.yaml"))
    asynctls_quality.load_settings(str(ROOT / "configs" / "asynctls_smollm2.yaml"))
    sparda_quality.load_settings(str(ROOT / "configs" / "sparda_smollm2.yaml"))
    nosa = load_section_settings(str(ROOT / "configs" / "nosa_quality_smollm2.yaml"), {}, "nosa_quality",
                                 nosa_quality.NosaQualitySettings, ("lengths", "kq_fractions", "decayed_kq_fractions"))
    for policy in nosa.policies().values():
        nosa_quality.runtime_config(nosa, policy)
    for name in ("evosparse_smollm2", "evosparse_smollm2_heldout", "evosparse_smollm2_confirm"):
        evo = evosparse_quality.load_settings(str(ROOT / "configs" / f"{name}.yaml"))
        for method in evo.methods:
            run_cfg = evosparse_quality.runtime_config(evo, method, evo.budgets[0])
            # Every measured layer-step stays in the timeline (1024 positions x 30 layers > the default).
            assert run_cfg.profiling.max_steps >= evo.positions * run_cfg.geometry.layers
    shipped = {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped == set(RUN_CONFIGS) | {"hf_smollm2", "quality_smollm2", "predictor_smollm2", "asynctls_smollm2",
                                          "sparda_smollm2", "nosa_quality_smollm2", "evosparse_smollm2",
                                          "evosparse_smollm2_heldout", "evosparse_smollm2_confirm"}


def test_the_paper_points_are_the_configs_points():
    def points(name):
        return [(p.batch, p.context) for p in load_config(ROOT / "configs" / f"{name}.yaml").experiment.points]

    k = 1024
    assert points("table5_idle") == [(16, 32 * k), (8, 32 * k), (4, 32 * k), (4, 64 * k), (4, 128 * k)]
    assert points("tpot_grid") == [(4, 32 * k), (8, 32 * k), (16, 32 * k), (4, 64 * k), (8, 64 * k), (4, 128 * k)]
    mixed = load_config(ROOT / "configs" / "mixed_length.yaml").experiment
    assert [(p.batch, p.context_range) for p in mixed.points] == [(8, (16 * k, 64 * k)), (8, (32 * k, 128 * k))]
    assert mixed.runs == 20


# ---------------------------------------------------------------------------- the quickstart's folder
@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick") / "run"
    assert main(["run", str(ROOT / "configs" / "quickstart.yaml"), "--out", str(out), "--quiet"] + SMALL_QUICKSTART) == 0
    return out


def test_quickstart_report_has_every_section(quick):
    md = (quick / "report.md").read_text()
    positions = [md.index(s) for s in report.SECTIONS]
    assert positions == sorted(positions)
    for png in ("step_time.png", "step_timeline.png", "bandwidth.png", "scheduler_ablation.png"):
        assert (quick / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in md
    results = json.loads((quick / "results.json").read_text())
    assert [v["name"] for v in results["variants"]] == ["cpu_only", "fluxion"] and results["baseline"] == "cpu_only"
    assert len(results["runs"][0]["variants"]["fluxion"]["step_ms"]) == 3
    assert "| 2x2K | fluxion |" in md and "x |" in md  # a speedup over cpu_only
    csv = (quick / "results.csv").read_text().splitlines()
    assert len(csv) == 3 and csv[0].startswith("point,batch,") and csv[2].startswith("2x2K,2,")
    assert json.loads((quick / "trace.json").read_text())["traceEvents"]
    assert not (quick / "FAILED").exists()


def test_report_rerenders_byte_identically(quick, capsys):
    before = _digests(quick)
    (quick / "report.md").write_text("stale")
    (quick / "step_time.png").unlink()
    assert main(["report", str(quick)]) == 0
    assert _digests(quick) == before
    assert "rendered" in capsys.readouterr().out


def test_comparing_two_runs(quick, tmp_path, capsys):
    other = tmp_path / "other"
    assert main(["run", str(ROOT / "configs" / "quickstart.yaml"), "--out", str(other), "--quiet",
                 "--set", "selection.budget=0.1"] + SMALL_QUICKSTART) == 0
    capsys.readouterr()
    cmp = tmp_path / "cmp"
    assert main(["report", str(quick), str(other), "--out", str(cmp)]) == 0
    text = capsys.readouterr().out
    assert text == (cmp / "compare.md").read_text()
    assert f"# {other} against {quick}" in text
    rows = [line for line in text.splitlines() if line.startswith("| 2x2K |")]
    assert [r.split(" | ")[1] for r in rows] == ["cpu_only", "fluxion"]
    assert (cmp / "compare_step_time.png").exists()


# ---------------------------------------------------------------------------- bad input: exit 2, nothing written
def _bad(tmp_path, *args, config=None):
    cfg = config or _write(tmp_path / "tiny.yaml", TINY)
    out = tmp_path / "out"
    return main(["run", cfg, "--out", str(out), *args]), out


@pytest.mark.parametrize("args, says", [
    (["--set", "selection.budget=["], "hybrid-runtime: selection.budget: --set value '[' is not valid YAML"),
    (["--set", "experiment.points=[{batch: 4, context: 1200}]"], "experiment.points[0].batch: 2x... "),
    (["--set", "experiment.points=[{batch: 2, context: 5000}]"], "hybrid-runtime: experiment.points[0].context: 2x5000 "
                                                                 "holds up to"),
    (["--set", "experiment.variants=[{name: g, placement: gpu_only}]", "--set", "experiment.baseline=g",
      "--set", "scheduler.gpu_worker=false"], "hybrid-runtime: experiment.variants[0].placement: 'gpu_only' needs the "
                                              "GPU lane"),
    (["--set", "experiment.baseline=nope"], "hybrid-runtime: experiment.baseline: 'nope' is not a variant"),
    (["--set", "profiling.max_steps=4"], "hybrid-runtime: profiling.max_steps: 4, but a point run records 12"),
    (["--set", "workload.batch=2"], "hybrid-runtime: workload.batch: not read when experiment.points is given"),
])
def test_bad_config_exits_2_naming_the_key_and_writes_nothing(tmp_path, capsys, args, says):
    rc, out = _bad(tmp_path, *args)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    if says.endswith("2x... "):  # batch beyond kv_cache.max_sequences
        assert err.startswith("hybrid-runtime: experiment.points[0].batch: 4x1200 needs 4 sequences at once"), err
    else:
        assert err.startswith(says), err
    assert not out.exists()


def test_a_config_that_is_not_utf8_exits_2(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# Überschrift\nworkload: {batch: 1}\n".encode("latin-1"))
    rc, out = _bad(tmp_path, config=str(path))
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}: not UTF-8 text (byte 0xdc at offset 2)" in err and not out.exists()


def test_out_naming_a_file_or_a_foreign_folder_exits_2(tmp_path, capsys):
    cfg = _write(tmp_path / "tiny.yaml", TINY)
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    assert main(["run", cfg, "--out", str(afile)]) == 2
    assert f"--out {afile}: is a file" in capsys.readouterr().err and afile.read_text() == "mine"
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "thesis.tex").write_text("mine")
    assert main(["run", cfg, "--out", str(folder)]) == 2
    assert "holds thesis.tex, which no run writes" in capsys.readouterr().err
    assert [p.name for p in folder.iterdir()] == ["thesis.tex"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_kv_without_cuda_exits_2(tmp_path, capsys):
    rc, out = _bad(tmp_path, "--set", "kv_cache.device=cuda")
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("hybrid-runtime: kv_cache.device: 'cuda', but this machine has no CUDA device")
    assert not out.exists()


def test_report_of_a_folder_without_a_finished_run_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no results.json" in capsys.readouterr().err
    (tmp_path / "FAILED").write_text("ValueError: boom\n")
    assert main(["report", str(tmp_path)]) == 2
    assert "the run did not finish (FAILED: ValueError: boom)" in capsys.readouterr().err


# ---------------------------------------------------------------------------- failures, Ctrl-C, a reused folder
def test_failed_and_interrupted_runs_replace_the_earlier_run_and_leave_no_report(tmp_path, capsys, monkeypatch):
    cfg = _write(tmp_path / "tiny.yaml", TINY)
    out = tmp_path / "run"
    assert main(["run", cfg, "--out", str(out), "--quiet"]) == 0
    assert (out / "report.md").exists() and (out / "step_time.png").exists()
    capsys.readouterr()

    decode = HybridRuntime.decode
    calls = {"n": 0}

    def failing(self, *args, **kwargs):  # the second point's first step fails, as a worker's error would
        calls["n"] += 1
        if calls["n"] > 2 * 2 * 3:  # 2 variants x 3 steps x 2 layers of the first point
            raise ValueError("worker on sequence 2 failed")
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(HybridRuntime, "decode", failing)
    assert main(["run", cfg, "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "run failed: ValueError: worker on sequence 2 failed" in err and "FAILED" in err
    names = sorted(p.name for p in out.iterdir())
    assert names == ["FAILED", "config.yaml", "partial_results.json"]  # nothing of the earlier run
    assert "ValueError: worker on sequence 2 failed" in (out / "FAILED").read_text()
    assert [r["point"] for r in json.loads((out / "partial_results.json").read_text())["runs"]] == ["2x1200"]
    assert main(["report", str(out)]) == 2

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(HybridRuntime, "decode", interrupted)
    assert main(["run", cfg, "--out", str(out), "--quiet"]) == 130
    assert sorted(p.name for p in out.iterdir()) == ["INTERRUPTED", "config.yaml"]


# ---------------------------------------------------------------------------- points, variants, kinds
def test_mixed_length_points_draw_new_seeded_lengths_per_run():
    cfg = config_from_dict({**TINY, "experiment": {**TINY["experiment"], "runs": 3}})
    runs = point_runs(cfg)
    assert [(r.label, r.run) for r in runs] == [("2x1200", 0), ("2x1200", 1), ("2x1200", 2),
                                                ("2xU(600,1500)", 0), ("2xU(600,1500)", 1), ("2xU(600,1500)", 2)]
    assert all(r.contexts == (1200, 1200) for r in runs[:3])
    mixed = [r.contexts for r in runs[3:]]
    assert all(600 <= c <= 1500 for cs in mixed for c in cs) and len(set(mixed)) == 3
    assert point_runs(cfg) == runs  # seeded
    assert len({r.seed for r in runs}) == 6
    assert PointConfig(batch=8, context_range=(16384, 65536)).max_context == 65536


def test_mixed_lengths_and_a_predicted_variant_on_the_cpu(tmp_path, capsys):
    """Two points (one mixed-length), a `predicted` runtime with a fixed variant beside it: each
    variant's samples, the predictor's cost and the output error are in the results and report."""
    data = {**TINY, "selection": {"name": "predicted"}, "geometry": {**TINY["geometry"], "head_dim": 64},
            "experiment": {**TINY["experiment"], "variants": [
                {"name": "predicted"}, {"name": "full", "selection": {"name": "full"}}], "baseline": "full"}}
    out = tmp_path / "run"
    assert main(["run", _write(tmp_path / "p.yaml", data), "--out", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["point"] for r in results["runs"]] == ["2x1200", "2xU(600,1500)"]
    for r in results["runs"]:
        pred, full = r["variants"]["predicted"], r["variants"]["full"]
        assert len(pred["step_ms"]) == len(full["step_ms"]) == 2
        assert len(pred["planner_ms"]) == 2 * 2 and full["max_rel_output_error"] < 1e-3
    md = (out / "report.md").read_text()
    head = md[md.index("## Head-plan overhead"):md.index("## Output error")]
    assert "| 2x1200 | predicted |" in head and "No variant plans" not in head


def test_tpot_experiment_decodes_a_model_through_generate(tmp_path, capsys):
    pytest.importorskip("transformers", reason="the TPOT experiment needs the `models` extra")
    data = {
        "geometry": {"name": "tiny", "layers": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 32},
        "kv_cache": {"sink": 16, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 2048, "max_sequences": 2},
        "selection": {"name": "fixed", "budget": 0.1},
        "scheduler": {"placement": "fluxion", "cpu_workers": 1, "pin_cores": False},
        "experiment": {"kind": "tpot", "points": [{"batch": 2, "context": 300}, {"batch": 2, "context_range": [200, 400]}],
                       "warmup_steps": 1, "prefill_batch_tokens": 256,
                       "variants": [{"name": "cpu_only", "placement": "cpu_only"}, {"name": "fluxion"}],
                       "baseline": "cpu_only"},
        "workload": {"decode_steps": 3, "seed": 1},
    }
    out = tmp_path / "run"
    assert main(["run", _write(tmp_path / "t.yaml", data), "--out", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["kind"] == "tpot" and results["model"]["weights"] == "random" and results["model"]["layers"] == 2
    for r in results["runs"]:
        assert r["ttft_s"] > 0 and r["prefill_chunk_tokens"] == 128  # 256 tokens a forward over 2 sequences
        for v in ("cpu_only", "fluxion"):
            m = r["variants"][v]
            # 3 measured tokens per variant, each one forward of the 2 layers
            assert len(m["step_ms"]) == 3 and len(m["attention_ms"]) == 3 * 2 and min(m["step_ms"]) > 0
    md = (out / "report.md").read_text()
    assert "TPOT (time per output token, the whole model)" in md and "| TTFT s |" in md
    assert "A TPOT run decodes a model without a dense reference" in md


# ---------------------------------------------------------------------------- the machine probe
def test_probe_measures_caches_and_runs_report_the_limits(tmp_path, capsys):
    cache = tmp_path / "limits.json"
    assert main(["probe", "--threads", "1", "--size-gib", "0.01", "--cache", str(cache), "--quiet"]) == 0
    entry = json.loads(cache.read_text())["machines"][0]
    assert entry["host_read"][0]["threads"] == 1 and entry["host_read"][0]["GBps"] > 0
    assert f"cached in {cache}" in capsys.readouterr().out
    assert main(["probe", "--show", "--cache", str(cache)]) == 0
    assert "host read   1 threads" in capsys.readouterr().out
    assert main(["probe", "--threads", "0,x"]) == 2
    out = tmp_path / "run"
    assert main(["run", _write(tmp_path / "tiny.yaml", TINY), "--out", str(out), "--quiet",
                 "--probe-cache", str(cache)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["limits"] == entry
    md = (out / "report.md").read_text()
    assert "host read, 1 threads" in md and '"Of the ceiling" divides by the host read, 1 threads' in md


@pytest.mark.gpu
def test_gpu_idle_and_lane_shares_on_cuda(tmp_path, capsys):
    """On CUDA: GPU idle per attention layer step for every variant, the GPU lane's byte share by
    placement, and the report's GPU sections with their figures."""
    data = {**TINY, "scheduler": {"placement": "fluxion", "cpu_workers": 1, "pin_cores": False},
            "experiment": {"points": [{"batch": 2, "context": 1200}],
                           "variants": [{"name": "cpu_only", "placement": "cpu_only"},
                                        {"name": "gpu_only", "placement": "gpu_only"}, {"name": "fluxion"}],
                           "baseline": "cpu_only"}}
    out = tmp_path / "run"
    assert main(["run", _write(tmp_path / "g.yaml", data), "--out", str(out), "--quiet"]) == 0
    rows = {r["variant"]: r for r in variant_rows(json.loads((out / "results.json").read_text()))}
    for r in rows.values():
        assert 0.0 <= r["gpu_idle_ratio"] <= 1.0 and r["gpu_idle_ms_mean"] >= 0.0
    assert rows["cpu_only"]["gpu_byte_share"] == 0.0 and rows["gpu_only"]["gpu_byte_share"] == 1.0
    md = (out / "report.md").read_text()
    assert "](gpu_idle.png)" in md and "This run had no GPU" not in md and (out / "gpu_idle.png").exists()
    samples = json.loads((out / "results.json").read_text())["timeline_samples"]
    assert all({g[2] for g in s["gpu"]} == {"window", "merge"} for s in samples)


def test_a_synthetic_sparda_run_refuses_a_lookahead_it_cannot_compute():
    """`hybrid-runtime run` of kind attention has no model, so no next layer's query: only
    `sparda.lookahead: same_layer` describes what it runs."""
    data = {"geometry": {"name": "llama-3.1-8b", "layers": 2}, "selection": {"name": "sparda"},
            "scheduler": {"pin_cores": False}, "workload": {"batch": 1, "context": 1024}}
    with pytest.raises(ConfigError, match=r"sparda.lookahead: 'forecast', but experiment.kind 'attention' has no "
                                          r"model.*allowed: same_layer, or experiment.kind: tpot"):
        experiment.check(resolved(config_from_dict(data), cuda=False), cuda=False)
    data["sparda"] = {"lookahead": "same_layer"}
    experiment.check(resolved(config_from_dict(data), cuda=False), cuda=False)
