"""The results-file contract (`hybrid_runtime/profiling/results.py`) and the benchmarks' layer over
it (`benchmarks/common.py`, default folder benchmarks/results)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import common
from hybrid_runtime.profiling import results
from hybrid_runtime.profiling.machine import device_name, host_cpu

FIELDS = ("benchmark", "device", "host_cpu", "commit", "command", "created", "metrics", "points")


def test_record_has_the_contract_fields_and_extra_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_COMMIT", "abc1234")
    path = results.write_results("demo", {"speedup": 1.5, "tasks": 3}, [{"x": 1}], out_dir=tmp_path / "sub",
                                 extra={"command": "python -m demo --fast", "config": {"k": 2}})
    assert path == tmp_path / "sub" / f"demo-{results.device_slug()}.json"
    record = json.loads(path.read_text())
    assert list(record)[:len(FIELDS)] == list(FIELDS)
    assert record["benchmark"] == "demo" and record["commit"] == "abc1234"
    assert record["device"] == device_name() and record["host_cpu"] == host_cpu()
    assert record["metrics"] == {"speedup": 1.5, "tasks": 3} and record["points"] == [{"x": 1}]
    assert record["command"] == "python -m demo --fast" and record["config"] == {"k": 2}  # extra replaces
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no `.partial` left beside it


def test_out_path_is_the_file_itself(tmp_path):
    target = tmp_path / "a" / "mine.json"
    assert results.write_results("demo", {}, [], out_path=target) == target
    assert json.loads(target.read_text())["benchmark"] == "demo"


@pytest.mark.parametrize("where, word", [({}, "neither"), ({"out_dir": ".", "out_path": "x.json"}, "both")])
def test_the_caller_names_exactly_one_place(where, word):
    with pytest.raises(ValueError, match=f"out_dir .* or out_path .*exactly one; got {word}"):
        results.write_results("demo", {}, [], **where)


def test_metrics_that_are_not_numbers_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"not numbers: \{'ok': True, 'name': 'x'\}"):
        results.write_results("demo", {"ok": True, "name": "x", "n": 1}, [], out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_failed_write_leaves_the_previous_file(tmp_path):
    path = results.write_results("demo", {"n": 1}, [], out_dir=tmp_path)
    with pytest.raises(TypeError):
        results.write_results("demo", {"n": 2}, [object()], out_dir=tmp_path)  # points JSON cannot hold
    assert json.loads(path.read_text())["metrics"] == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_device_kind_slug_is_plain_cpu_without_cuda():
    slug = results.device_kind_slug()
    assert slug == (results.device_slug() if torch.cuda.is_available() else "cpu")
    assert results.device_slug().startswith("cpu") != torch.cuda.is_available()


def test_benchmarks_default_to_their_results_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    path = common.write_results("demo", {"n": 1}, [])
    assert path == tmp_path / "results" / f"demo-{common.device_slug()}.json"
    assert common.write_results("demo", {"n": 1}, [], tmp_path / "mine") == tmp_path / "mine" / path.name  # out_dir positional
    assert common.write_results("demo", {"n": 1}, [], out_path=tmp_path / "f.json") == tmp_path / "f.json"
    with pytest.raises(ValueError, match="got both"):
        common.write_results("demo", {"n": 1}, [], out_dir=tmp_path, out_path=tmp_path / "f.json")
