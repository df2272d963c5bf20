import json

import yaml

from hybrid_runtime.cli import main

TINY = {
    "geometry": {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32},
    "kv_cache": {"sink": 16, "local": 64, "generated_cap": 32, "cpu_capacity_tokens": 4096, "max_sequences": 2},
    "policy": {"name": "fixed", "block_size": 16, "budget": 0.1},
    "scheduler": {"policy": "fluxion", "cpu_workers": 2, "gpu_worker": True, "pin_cores": False},
    "workload": {"batch": 2, "context": 1500, "decode_steps": 3, "layers": 0, "seed": 1},
}


def test_run_writes_a_complete_run_folder(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--set", "policy.budget=1.0"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["policy"]["budget"] == 1.0
    assert len(results["step_ms"]) == 3
    # Budget 1.0: the hybrid result is dense attention up to bf16 storage.
    assert results["max_rel_output_error"] < 1e-3
    assert results["timeline"]["tasks"] > 0
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert yaml.safe_load((out / "config.yaml").read_text())["policy"]["budget"] == 1.0
    assert not (out / "FAILED").exists()
    assert "max relative output error" in capsys.readouterr().out


def test_bad_config_exits_2_and_names_the_key(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "kv_cache": {**TINY["kv_cache"], "sinks": 4}}))
    assert main(["run", str(cfg), "--out", str(tmp_path / "r")]) == 2
    assert "kv_cache.sinks: unknown key" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2


def test_failed_run_is_marked_failed(tmp_path):
    cfg = tmp_path / "big.yaml"
    # Prompts larger than the CPU store: the run fails during prefill.
    cfg.write_text(yaml.safe_dump({**TINY, "workload": {**TINY["workload"], "context": 9000}}))
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out)]) == 1
    assert (out / "FAILED").exists() and not (out / "results.json").exists()
