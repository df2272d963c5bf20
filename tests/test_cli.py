import json

import pytest
import yaml

from hybrid_runtime.cli import main

TINY = {
    "geometry": {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32},
    "kv_cache": {"sink": 16, "local": 64, "generated_cap": 32, "cpu_capacity_tokens": 4096, "max_sequences": 2},
    "selection": {"name": "fixed", "block_size": 16, "budget": 0.1},
    "scheduler": {"placement": "fluxion", "cpu_workers": 2, "gpu_worker": True, "pin_cores": False},
    "workload": {"batch": 2, "context": 1500, "decode_steps": 3, "seed": 1},
}


@pytest.fixture(autouse=True)
def _no_user_probe_cache(tmp_path, monkeypatch):
    """Runs read machine limits only from a cache of the test's own."""
    monkeypatch.setenv("HYBRID_RUNTIME_PROBE_CACHE", str(tmp_path / "machine_limits.json"))


def test_run_writes_a_complete_run_folder(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--set", "selection.budget=1.0"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["selection"]["budget"] == 1.0
    (run,) = results["runs"]
    flux = run["variants"]["fluxion"]
    assert len(flux["step_ms"]) == 3 and len(flux["attention_ms"]) == 3 * 2  # 3 steps x 2 layers
    # Budget 1.0: the hybrid result is dense attention up to bf16 storage.
    assert flux["max_rel_output_error"] < 1e-3
    assert sum(flux["tasks"]) > 0
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert yaml.safe_load((out / "config.yaml").read_text())["selection"]["budget"] == 1.0
    assert not (out / "FAILED").exists()
    printed = capsys.readouterr()
    assert "max relative output error" in printed.out and "warning" not in printed.err
    # The summary names both choices: which blocks heads read, and where tasks ran.
    assert "selection fixed (block 16, budget 1)" in printed.out and "placement fluxion" in printed.out
    assert (out / "report.md").exists() and (out / "results.csv").exists()


def test_resolved_config_records_what_ran(tmp_path):
    """The run folder's config.yaml has the geometry's layers the runtime was built for and the
    "auto" settings resolved; on a host without CUDA no GPU lane and nothing called GPU ran."""
    torch = pytest.importorskip("torch")
    data = {**TINY, "geometry": {"name": "llama-3.1-8b", "layers": 1},
            "kv_cache": {**TINY["kv_cache"], "cpu_capacity_tokens": 2048, "max_sequences": 1},
            "scheduler": {"cpu_workers": 1, "pin_cores": False}, "workload": {"batch": 1, "context": 600,
                                                                          "decode_steps": 2}}
    cfg = tmp_path / "auto.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    ran = yaml.safe_load((out / "config.yaml").read_text())
    assert ran["geometry"] == {"name": "llama-3.1-8b", "layers": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128}
    cuda = torch.cuda.is_available()
    assert ran["scheduler"]["gpu_worker"] is cuda and ran["kv_cache"]["device"] == ("cuda" if cuda else "cpu")
    results = json.loads((out / "results.json").read_text())
    assert results["geometry"]["layers"] == 1
    if not cuda:  # no GPU figure: only the record that no GPU lane ran
        assert results["runtime"]["gpu_worker"] is False
        measured = json.dumps(results["runs"]).lower()
        assert '"gpu_idle_ms": null' in measured and '"gpu_bytes": null' in measured
        assert "GPU" not in (out / "trace.json").read_text()
        assert "This run had no GPU" in (out / "report.md").read_text()


def test_output_error_above_the_tolerance_warns(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    # The streaming selection reads no budget (config refuses one that would do nothing).
    cfg.write_text(yaml.safe_dump({**TINY, "selection": {k: v for k, v in TINY["selection"].items() if k != "budget"}}))
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--set", "selection.name=streaming"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["runs"][0]["variants"]["fluxion"]["max_rel_output_error"] > 0.1
    printed = capsys.readouterr()
    assert "warning: 2x1500 fluxion: max relative output error" in printed.err
    assert "workload.rel_error_tolerance=0.1" in printed.err
    assert "`streaming` selection attends the GPU window only" in printed.err
    assert "prefilled" not in printed.out  # --quiet: the summary only


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("hybrid-runtime ")


def test_bad_config_exits_2_and_names_the_key(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "kv_cache": {**TINY["kv_cache"], "sinks": 4}}))
    assert main(["run", str(cfg), "--out", str(tmp_path / "r")]) == 2
    assert "kv_cache.sinks: unknown key" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    # A key of the old names: the error names the new one.
    assert main(["run", _write(tmp_path, TINY), "--set", "policy.name=full", "--out", str(tmp_path / "r2")]) == 2
    assert "policy: replaced by selection" in capsys.readouterr().err


def _write(tmp_path, data) -> str:
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_prompts_the_store_cannot_hold_are_refused_before_the_run(tmp_path, capsys):
    cfg = tmp_path / "big.yaml"
    # Prompts larger than the CPU store: refused before anything runs or is written.
    cfg.write_text(yaml.safe_dump({**TINY, "workload": {**TINY["workload"], "context": 9000}}))
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-runtime: workload.context: 2x9000 holds up to 17840 CPU-resident tokens")
    assert "kv_cache.cpu_capacity_tokens >= 17840" in err
    assert not out.exists()
