"""The predictor evaluation's pure pieces: settings, text overlap, plan tally, metrics and tables
(the measurement itself runs the real model: see the module docstring for its command)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_runtime.experiments import predictor_eval as pe
from hybrid_runtime.head_plans import HeadPlan
from hybrid_runtime.selector import Selection


def test_settings_are_validated(tmp_path):
    s = pe.EvalSettings(policies=("fixed16_005", "predicted"))
    assert s.lengths == (4096, 8192) and s.text_offset == 91750
    with pytest.raises(ValueError, match="unknown"):
        pe.EvalSettings(policies=("fixed16_005", "oracle"))
    with pytest.raises(ValueError, match="twice"):
        pe.EvalSettings(policies=("predicted", "predicted"))
    with pytest.raises(ValueError, match="exceed positions"):
        pe.EvalSettings(lengths=(200,), positions=256, policies=("predicted",))
    bad = tmp_path / "bad.yaml"
    bad.write_text("predictor_eval: {lenghts: [4096]}\n")
    with pytest.raises(ValueError, match="lenghts"):
        pe.load_settings(str(bad))
    assert pe.main(["--out", str(tmp_path / "o"), "--config", str(bad)]) == 2  # refused before the model loads
    good = tmp_path / "good.yaml"
    good.write_text("predictor_eval: {lengths: [1024], positions: 4, policies: [predicted]}\n"
                    "runtime: {kv_cache: {sink: 16}}\n")
    s = pe.load_settings(str(good), {"positions": 8})
    cfg = pe.runtime_config(s, "predicted_blk16", 1024)
    assert s.positions == 8 and cfg.kv_cache.sink == 16 and cfg.selection.block_sizes == (16,)
    assert pe.runtime_config(s, "predicted_no_streaming", 1024).selection.skip_streaming is False


def test_a_missing_checkpoint_names_the_commands_that_make_it(monkeypatch):
    monkeypatch.setitem(pe.POLICIES, "predicted_tau002",
                        ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_tau0.02_missing.pt"}, "x"))
    with pytest.raises(ValueError, match=r"python -m predictor.labels .* --tau 0.02 .*smollm2_tau0.02_missing.pt"):
        pe.EvalSettings(policies=("predicted_tau002",))
    assert pe.checkpoint_commands("predicted") == []
    cmds = pe.checkpoint_commands("predicted_score95")
    assert "--criterion score95" in cmds[0] and "smollm2_score95.pt" in cmds[1]


def test_training_overlap_and_labelled_ranges(tmp_path):
    rng = np.random.default_rng(0)
    corpus = rng.integers(0, 50_000, size=5000)
    ranges = [(0, 1000), (2000, 2500)]
    assert pe.training_overlap(corpus[3000:4000], corpus, ranges, 16) == 0.0
    window = np.concatenate([corpus[3000:3500], corpus[2100:2200]])  # 100 tokens copied from a labelled text
    assert pe.training_overlap(window, corpus, ranges, 16) == pytest.approx(85 / (600 - 15))
    path = tmp_path / "labels.npz"
    np.savez(path, text_id=np.array([0, 0, 3], dtype=np.int32), position=np.array([10, 2047, 500], dtype=np.int32))
    (tmp_path / "labels.json").write_text('{"settings": {"lengths": [1024, 2048]}}')
    assert pe.labelled_ranges(str(path)) == [(0, 2048), (6144, 6645)]


def test_labelled_text_reads_present_files_and_recomputes_absent_ones(tmp_path, monkeypatch):
    """A sweep checkpoint whose labels file is absent contributes the ranges its labels command reads."""
    from predictor.labels import LabelSettings, text_ranges

    monkeypatch.chdir(tmp_path)  # no runs/predictor/ here: every sweep checkpoint's labels file is absent
    shipped = tmp_path / "shipped.npz"
    np.savez(shipped, text_id=np.array([0, 2], dtype=np.int32), position=np.array([2047, 100], dtype=np.int32))
    (tmp_path / "shipped.json").write_text('{"settings": {"lengths": [2048, 4096, 8192]}}')
    labelled = np.random.default_rng(0).integers(0, 50_000, size=9 * 8192)  # random text: every chunk usable
    settings = pe.EvalSettings(policies=("fixed16_005", "predicted_tau002", "predicted_score95"), labels=str(shipped))
    ranges, sources = pe.labelled_text(settings, labelled)
    recomputed = text_ranges(torch.as_tensor(labelled), LabelSettings())
    assert len(recomputed) == 8 and recomputed[0][0] == 0
    assert ranges == sorted({(0, 2048), (16384, 16485), *recomputed})
    assert sources[0] == {"labels": str(shipped), "ranges_from": "file"}
    assert [s["ranges_from"].split(" --out ")[0] for s in sources[1:]] == ["python -m predictor.labels"] * 2
    assert "--tau 0.02" in sources[1]["ranges_from"] and "--criterion score95" in sources[2]["ranges_from"]


def test_labelled_text_recomputes_the_shipped_labels_when_absent(tmp_path, monkeypatch):
    """Without the shipped checkpoint's labels file (a validation run needs only its texts), the ranges
    are those its labels command reads; any other absent labels file is refused by name."""
    from predictor.labels import LabelSettings, text_ranges
    from predictor.model import load_checkpoint

    from hybrid_runtime.config import resolve_checkpoint

    monkeypatch.chdir(tmp_path)  # no runs/predictor/ here
    shipped = load_checkpoint(resolve_checkpoint(pe.DEFAULT_CHECKPOINT)).data["file"]
    labelled = np.random.default_rng(0).integers(0, 50_000, size=12 * 8192)
    settings = pe.EvalSettings(policies=("fixed16_005", "predicted_thr06", "predicted_thr07"), labels=shipped)
    ranges, sources = pe.labelled_text(settings, labelled)
    assert ranges == sorted(text_ranges(torch.as_tensor(labelled), LabelSettings(texts=11, positions=16)))
    assert len(ranges) == 11 and len(sources) == 1  # the thresholds' checkpoint is the shipped one
    assert sources[0]["ranges_from"].startswith(f"python -m predictor.labels --out {shipped} ")
    assert "--positions 16 --texts 11" in sources[0]["ranges_from"]
    with pytest.raises(FileNotFoundError, match="elsewhere.npz"):
        pe.labelled_text(pe.EvalSettings(policies=("fixed16_005",), labels="runs/elsewhere.npz"), labelled)


def test_threshold_policies_and_threads_option():
    for slug, threshold in (("predicted_thr06", 0.6), ("predicted_thr07", 0.7), ("predicted_thr08", 0.8)):
        cfg = pe.runtime_config(pe.EvalSettings(policies=(slug,)), slug, 8192)
        assert cfg.selection.streaming_threshold == threshold
        assert cfg.selection.checkpoint == pe.DEFAULT_CHECKPOINT
    with pytest.raises(ValueError, match="threads must be >= 0"):
        pe.EvalSettings(policies=("predicted",), threads=-1)
    assert pe.main(["--out", "unused", "--threads", "-1", "--policies", "predicted"]) == 2  # before the model loads


def test_plan_tally_metrics_and_markdown():
    tally = pe.PlanTally()
    plan = HeadPlan(np.array([[16, 64]]), np.array([[0.1, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32))
    tally(0, [7], Selection(plan, np.array([[True, False]]), np.zeros((1, 2)), np.zeros((1, 2), np.int64),
                            np.zeros((1, 2, 4)), (16, 32, 64, 128)))
    summary = tally.summary()
    assert summary["heads_with_budget"] == pytest.approx(1 / 6) and summary["groups_with_task"] == 0.5
    assert summary["block_sizes"] == {"16": 1.0} and summary["mean_budget_of_budgeted_heads"] == pytest.approx(0.1)
    policy = {"agreement": 0.9, "kl": 0.01, "ppl": 10.0, "bytes_per_step_counted": 5e6, "bytes_per_step_modeled": 6e6}
    results = {
        "settings": {"positions": 8, "overlap_ngram": 16},
        "text": {"first_token": 91750, "repeated_8gram": {"4096": 0.0}, "labelled_16gram_overlap": 0.0,
                 "labelled_8gram_overlap": 0.001},
        "heldout": {"streaming_accuracy": 0.85, "streaming_accuracy_majority_baseline": 0.69, "bgt0_mae": 0.02,
                    "k_mae": 0.01},
        "checkpoints": {"predicted": {"checkpoint": "predictor/checkpoints/smollm2.pt", "tau": 0.1,
                                      "heldout": {"streaming_accuracy": 0.85, "bgt0_mae": 0.02, "k_mae": 0.01}}},
        "lengths": {"4096": {"dense": {"ppl": 9.0}, "policies": {
            "fixed16_005": {**policy, "bytes_ratio_vs_fixed16_005": 1.0},
            "predicted": {**policy, "bytes_per_step_counted": 2e6, "bytes_ratio_vs_fixed16_005": 0.4, "plans": summary}}}},
    }
    m = pe.metrics_of(results)
    assert m["agreement_predicted_4096"] == 0.9 and m["bytes_ratio_predicted_vs_fixed16_005_4096"] == 0.4
    assert m["streaming_accuracy"] == 0.85 and m["bgt0_mae"] == 0.02 and m["k_mae"] == 0.01
    assert all(isinstance(v, float) for v in m.values())
    md = pe.markdown(results)
    assert f"| {pe.describe('predicted')} | 0.900 |" in md and "1.00/0.00/0.00/0.00" in md


@pytest.mark.parametrize("tau", [1e-9, 10.0])
def test_oracle_plans_read_everything_at_tau_0_and_nothing_at_a_loose_tau(tau):
    import torch

    from hybrid_runtime.experiments.oracle_plans import OraclePlanner
    from hybrid_runtime.reference import dense_attention
    from hybrid_runtime.runtime import HybridRuntime
    from tests.test_predicted_plans import HQ, config, random_kv, step_inputs

    cfg = config()
    with HybridRuntime(cfg, head_planner=None) as rt:
        rt.planner = OraclePlanner(rt.store, tau, cfg.selection.block_sizes)
        for layer in (0, 1):
            rt.prefill(0, layer, *random_kv(700, 2, 32, seed=layer), q_last=torch.randn(HQ, 32))
        gen = torch.Generator().manual_seed(1)
        for layer in (0, 1):
            q, k, v = step_inputs(1, gen)
            out = rt.decode(layer, [0], q, k, v)
            kf, vf = rt.store.full_kv(0, layer)
            if tau > 1:
                sink, cpu = rt.store.cfg.sink, rt.store.cpu_len(0, layer)
                keep = torch.cat([torch.arange(sink), torch.arange(sink + cpu, kf.shape[0])])
                kf, vf = kf[keep], vf[keep]
            torch.testing.assert_close(out[0], dense_attention(q[0], kf, vf)[0], atol=3e-5, rtol=1e-4)
        assert (sum(r.n_tasks for r in rt.timeline.records) == 0) == (tau > 1)


def test_every_evaluated_checkpoint_is_shipped_and_matches_the_features():
    """The tau sweep's and the ablations' checkpoints: current feature columns, the tau of their labels."""
    from hybrid_runtime.config import resolve_checkpoint
    from predictor.features import FEATURE_NAMES
    from predictor.model import load_checkpoint

    for slug, (section, _) in pe.POLICIES.items():
        if "checkpoint" not in section:
            continue
        ck = load_checkpoint(resolve_checkpoint(section["checkpoint"]))
        ck.check_feature_names(FEATURE_NAMES)
        flags = pe.LABEL_FLAGS.get(slug, "").split()
        tau = float(flags[flags.index("--tau") + 1]) if "--tau" in flags else 0.1
        assert ck.tau == pytest.approx(tau), slug
        assert ck.metrics["heldout"]["streaming_accuracy"] > ck.metrics["heldout"]["streaming_accuracy_majority_baseline"]


def test_a_validation_run_is_kept_apart_from_the_scored_text(tmp_path):
    """Settings are chosen on a window that does not overlap the scored one, and such a run never
    becomes a result."""
    s = pe.EvalSettings(policies=("fixed16_005",), validation_offset=91750 + 8193)
    assert pe.evaluated_offset(s) == 91750 + 8193 and pe.evaluated_offset(pe.EvalSettings()) == 91750
    with pytest.raises(ValueError, match="overlaps the scored window"):
        pe.EvalSettings(policies=("fixed16_005",), validation_offset=91750 + 8000)
    with pytest.raises(ValueError, match="overlaps the scored window"):
        pe.EvalSettings(policies=("fixed16_005",), validation_offset=91750 - 100)
    assert pe.main(["--out", str(tmp_path / "o"), "--validation-offset", "99943", "--results-dir",
                    str(tmp_path / "r")]) == 2  # refused before the model loads
    results = {"text": {"validation": True}}
    with pytest.raises(ValueError, match="not a result"):
        pe.write_outputs(results, tmp_path / "o", tmp_path / "r", "cmd")
    assert not (tmp_path / "r").exists()


def test_heldout_metrics_take_the_checkpoints_labels_or_a_remake_with_its_split(tmp_path, monkeypatch):
    """The exact file; a remake (same rows, texts and split, other low bits: a labels file made on
    another host's libraries) with `labels_remade`; a file with another split refused, naming it."""
    from predictor.train import main as train_main
    from tests.test_predictor_model import synthetic_labels, write

    arrays = synthetic_labels(n_texts=12, rows_per_text=40, heldout_texts=3)
    path = write(tmp_path, arrays)
    ckpt = str(tmp_path / "tiny.pt")
    assert train_main(["--data", path, "--out", ckpt, "--hidden", "16,16", "--max-epochs", "5", "--batch-size", "64",
                       "--threads", "1"]) == 0
    monkeypatch.setattr(pe, "resolve_checkpoint", lambda name: ckpt)
    exact = pe.heldout_metrics(path)
    assert exact["labels_remade"] is False and exact["heldout_texts"] == [9, 10, 11]

    remade = dict(arrays, features=arrays["features"] + np.float32(1e-6))
    got = pe.heldout_metrics(write(tmp_path, remade, "remade.npz"))
    assert got["labels_remade"] is True and got["labels_sha256"] != exact["labels_sha256"]
    assert got["heldout_texts"] == exact["heldout_texts"]
    assert got["streaming_accuracy"] == pytest.approx(exact["streaming_accuracy"], abs=0.02)

    moved = dict(arrays, split=np.where(arrays["text_id"] >= 8, "heldout", "train"))
    with pytest.raises(ValueError, match=r"nor a remake of it: train_rows 320 \(checkpoint's: 360\)"):
        pe.heldout_metrics(write(tmp_path, moved, "moved.npz"))
