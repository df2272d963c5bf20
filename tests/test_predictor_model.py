"""The head-property predictor: network, checkpoint, labels contract and training on a tiny dataset."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from predictor.model import HeadPropertyNet, load_checkpoint
from predictor.train import TrainSettings, evaluate, load_labels, main, train

N_FEATURES = 6


def synthetic_labels(n_texts: int = 30, rows_per_text: int = 60, heldout_texts: int = 6, seed: int = 0) -> dict:
    """A labels file with a known relation: streaming is a linear boundary in (x0, x1); bgt0 and k are
    smooth functions of x2..x5; each text shifts its features a little (rows of a text correlate)."""
    rng = np.random.default_rng(seed)
    n = n_texts * rows_per_text
    text = np.repeat(np.arange(n_texts), rows_per_text).astype(np.int32)
    x = rng.normal(size=(n, N_FEATURES)) + 0.3 * rng.normal(size=(n_texts, N_FEATURES))[text]
    streaming = x[:, 0] + 0.5 * x[:, 1] > 0.5
    bgt0 = 0.30 + 0.10 * np.tanh(x[:, 2]) + 0.04 * x[:, 3]
    k = -0.04 + 0.010 * np.tanh(x[:, 4]) - 0.005 * x[:, 5]
    split = np.where(text >= n_texts - heldout_texts, "heldout", "train")
    per = np.arange(n) % rows_per_text
    return {
        "features": x.astype(np.float32), "feature_names": np.array([f"x{i}" for i in range(N_FEATURES)]),
        "bgt0": bgt0.astype(np.float32), "k": k.astype(np.float32), "streaming": streaming, "split": split,
        "text_id": text, "layer": (per % 5).astype(np.int32), "head": (per // 5 % 4).astype(np.int32),
        "position": (per // 20).astype(np.int32), "tau": np.float64(0.1),
    }


def write(tmp_path, arrays: dict, name: str = "labels.npz") -> str:
    path = str(tmp_path / name)
    np.savez(path, **arrays)
    return path


# One thread: on shared cores a network this small trains ~10x faster than on two.
TINY = TrainSettings(hidden=(32, 32), lr=1e-2, batch_size=128, max_epochs=40, patience=10, seed=0, threads=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = write(tmp_path_factory.mktemp("labels"), synthetic_labels())
    labels = load_labels(path)
    model, info = train(labels, TINY)
    return labels, model, info


def test_default_network_is_about_a_tenth_of_a_million_parameters():
    n = HeadPropertyNet(41).parameter_count()  # the 41 features of Fluxion appendix A
    assert 80_000 <= n <= 130_000


def test_tiny_predictor_learns_a_known_relation(trained):
    """Held-out texts: streaming accuracy >= 0.95; bgt0 and k MAE below a fifth of what the training
    median scores (the relation is smooth and noise-free: a working network gets to about 1/20)."""
    labels, model, info = trained
    m = evaluate(model, labels.rows(labels.split == "heldout"), labels.rows(labels.split == "train"))
    assert m["streaming_accuracy"] >= 0.95, m
    assert m["streaming_accuracy"] > m["streaming_accuracy_majority_baseline"] + 0.2, m
    assert m["bgt0_mae"] < m["bgt0_mae_median_baseline"] / 5, m
    assert m["k_mae"] < m["k_mae_median_baseline"] / 5, m
    assert info["best_epoch"] >= 0 and info["epochs_run"] <= TINY.max_epochs
    # Validation texts come from the training split and are disjoint from the fitted texts.
    val = set(info["validation_texts"])
    assert val and val <= set(np.unique(labels.text_id[labels.split == "train"]).tolist())


def test_training_is_seeded(tmp_path):
    path = write(tmp_path, synthetic_labels(n_texts=10, rows_per_text=40, heldout_texts=2))
    labels = load_labels(path)
    quick = TrainSettings(hidden=(16,), batch_size=64, max_epochs=5, patience=5, seed=3, threads=1)
    a, _ = train(labels, quick)
    b, _ = train(labels, quick)
    x = torch.from_numpy(labels.features)
    for u, v in zip(a.predict(x), b.predict(x)):
        assert torch.equal(u, v)


def test_refit_trains_on_every_training_text_for_the_chosen_epochs(tmp_path):
    labels = load_labels(write(tmp_path, synthetic_labels(n_texts=10, rows_per_text=40, heldout_texts=2)))
    settings = TrainSettings(hidden=(16,), batch_size=64, max_epochs=6, patience=6, seed=1, threads=1, refit=True)
    _, info = train(labels, settings)
    assert info["refit_rows"] == int((labels.split == "train").sum()) > info["fit_rows"]
    assert info["refit_epochs"] == info["best_epoch"] + 1
    assert 0 <= info["validation"]["streaming_accuracy"] <= 1
    with pytest.raises(ValueError, match="refit needs"):
        train(labels, TrainSettings(refit=True, early_stop="heldout"))


def test_higher_quantile_predicts_larger_budgets(tmp_path):
    """With label noise the network's regression heads follow the requested quantile."""
    arrays = synthetic_labels(n_texts=12, rows_per_text=60, heldout_texts=2, seed=2)
    arrays["bgt0"] = arrays["bgt0"] + np.random.default_rng(0).uniform(-0.1, 0.1, arrays["bgt0"].shape).astype(np.float32)
    labels = load_labels(write(tmp_path, arrays))
    x = torch.from_numpy(labels.features)
    means = []
    for q in (0.2, 0.8):
        model, _ = train(labels, TrainSettings(hidden=(16,), lr=1e-2, batch_size=128, max_epochs=30, patience=30,
                                               threads=1, quantile=q))
        means.append(float(model.predict(x)[0].mean()))
    # Uniform noise of width 0.2: the 0.8 and 0.2 quantiles lie 0.12 apart.
    assert means[1] - means[0] > 0.06, means


def test_checkpoint_round_trip_predicts_the_same(trained, tmp_path):
    from predictor.model import Checkpoint

    labels, model, _ = trained
    path = tmp_path / "p.pt"
    Checkpoint(model, labels.feature_names, labels.tau, {"rows": len(labels)}, {"heldout": {"k_mae": 0.1}}).save(path)
    ck = load_checkpoint(path)
    assert ck.feature_names == labels.feature_names and ck.tau == pytest.approx(0.1)
    assert ck.metrics["heldout"]["k_mae"] == 0.1 and ck.data["rows"] == len(labels)
    x = torch.from_numpy(labels.features[:50])
    for u, v in zip(model.predict(x), ck.model.predict(x)):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
    ck.check_feature_names(labels.feature_names)
    with pytest.raises(ValueError, match="another order"):
        ck.check_feature_names(labels.feature_names[::-1])
    with pytest.raises(ValueError, match="missing"):
        ck.check_feature_names(labels.feature_names[:-1])


def test_predict_takes_raw_features_and_checks_them(trained):
    labels, model, _ = trained
    x = torch.from_numpy(labels.features[:7])
    bgt0, k, p = model.predict(x)
    assert bgt0.shape == k.shape == p.shape == (7,)
    assert ((p >= 0) & (p <= 1)).all()
    # float64 input is accepted (cast to the network's dtype); same values.
    torch.testing.assert_close(model.predict(x.double())[0], bgt0)
    with pytest.raises(ValueError, match=r"\[N, 6\]"):
        model.predict(x[:, :5])
    with pytest.raises(ValueError, match="floating-point"):
        model.predict(x.long())


def test_train_command_writes_checkpoint_and_metrics(tmp_path):
    path = write(tmp_path, synthetic_labels(n_texts=12, rows_per_text=40, heldout_texts=3))
    out = str(tmp_path / "ck" / "tiny.pt")
    rc = main(["--data", path, "--out", out, "--hidden", "16,16", "--max-epochs", "20", "--batch-size", "64",
               "--threads", "1"])
    assert rc == 0
    report = json.load(open(out[:-3] + ".json"))
    for key in ("streaming_accuracy", "bgt0_mae", "k_mae"):
        assert 0 <= report["heldout"][key] < 1e9
    assert report["data"]["heldout_texts"] == 3 and report["data"]["sha256"]
    assert report["checkpoint_bytes"] == os.path.getsize(out) < 1_000_000
    ck = load_checkpoint(out)
    finite = {k: v for k, v in report["heldout"].items() if v is not None}  # NaN is written as null
    assert {k: ck.metrics["heldout"][k] for k in finite} == pytest.approx(finite)
    assert ck.training["settings"]["hidden"] == [16, 16]
    # Bad input: exit code 2 and a message, nothing written.
    assert main(["--data", str(tmp_path / "none.npz"), "--out", str(tmp_path / "x.pt")]) == 2
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.pop("k"), "missing arrays"),
    (lambda a: a.update(features=a["features"].astype(np.float64)), "'features' must be float32"),
    (lambda a: a.update(feature_names=a["feature_names"][:-1]), "'feature_names' must be str"),
    (lambda a: a.update(streaming=a["streaming"].astype(np.int8)), "'streaming' must be bool"),
    (lambda a: a.update(layer=a["layer"].astype(np.int64)), "'layer' must be int32"),
    (lambda a: a.update(split=np.where(a["split"] == "heldout", "test", a["split"])), "allowed"),
    (lambda a: a.update(split=np.full(a["split"].shape, "train")), "no rows with split 'heldout'"),
    (lambda a: a.update(tau=np.float64(-1)), "'tau' must be a positive"),
    (lambda a: a["bgt0"].__setitem__(3, np.nan), "'bgt0' has non-finite values"),
    (lambda a: a["split"].__setitem__(0, "heldout"), "both splits; the split must be by text"),
])
def test_labels_contract_errors_name_the_array(tmp_path, edit, message):
    arrays = synthetic_labels(n_texts=6, rows_per_text=10, heldout_texts=2)
    edit(arrays)
    with pytest.raises(ValueError, match=message):
        load_labels(write(tmp_path, arrays))


def test_one_training_text_needs_early_stopping_on_the_heldout_texts(tmp_path):
    labels = load_labels(write(tmp_path, synthetic_labels(n_texts=3, rows_per_text=10, heldout_texts=2)))
    with pytest.raises(ValueError, match="at least 2 are needed"):
        train(labels, TINY)
    quick = TrainSettings(hidden=(8,), max_epochs=3, early_stop="heldout", threads=1)
    _, info = train(labels, quick)
    assert info["validation_texts"] == [1, 2] and info["fit_rows"] == 10
    with pytest.raises(ValueError, match="early_stop must be one of"):
        train(labels, TrainSettings(early_stop="test"))


@pytest.mark.parametrize("name", ["smollm2", "smollm2_q80"])
def test_shipped_checkpoints_match_the_features_and_carry_their_metrics(name):
    """A change to the feature columns makes a shipped checkpoint stale: retrain it."""
    from pathlib import Path

    from predictor.features import FEATURE_NAMES

    path = Path(__file__).resolve().parents[1] / "predictor" / "checkpoints" / f"{name}.pt"
    assert path.stat().st_size < 1_000_000
    ck = load_checkpoint(path)
    ck.check_feature_names(FEATURE_NAMES)
    report = json.loads(path.with_suffix(".json").read_text())
    assert ck.tau == pytest.approx(report["tau"]) and 0.0 < ck.tau <= 0.2
    for key in ("streaming_accuracy", "bgt0_mae", "k_mae"):
        assert ck.metrics["heldout"][key] == pytest.approx(report["heldout"][key])
    assert report["data"]["heldout_texts"] >= 1 and not report["heldout_used_for_early_stopping"]


def test_predictor_package_imports_no_runtime():
    code = ("import sys, predictor.model, predictor.train; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('hybrid_runtime', 'cpu_kernels', 'gpu_kernels')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
def test_predict_on_cuda_does_not_synchronise(trained):
    labels, model, _ = trained
    gpu = HeadPropertyNet(model.n_features, model.hidden)
    gpu.load_state_dict(model.state_dict())
    gpu = gpu.cuda().eval()
    x = torch.from_numpy(labels.features[:64]).cuda()
    gpu.predict(x)  # first call: kernels load
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bgt0, k, p = gpu.predict(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = model.predict(torch.from_numpy(labels.features[:64]))
    torch.testing.assert_close(bgt0.cpu(), ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p.cpu(), ref[2], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="move one of them"):
        gpu.predict(x.cpu())


# ---------------------------------------------------------------------------- budget criteria
def test_output_criteria_with_and_without_head_contribution():
    from predictor.budget_criteria import criterion_curve
    from predictor.budget_search import relative_errors

    # One position, two heads with output norms 1 and 10, each 0.5 off at block count 0 and exact at 1.
    o_full = torch.tensor([[[1.0, 0.0], [0.0, 10.0]]])
    err = torch.tensor([[[0.5, 0.0], [0.5, 0.0]]])
    with_c, bound = criterion_curve("output", 0.1, err=err, o_full=o_full)
    without, _ = criterion_curve("output_no_head_contribution", 0.1, err=err, o_full=o_full)
    assert bound == 0.1
    torch.testing.assert_close(with_c, relative_errors(err, o_full))
    torch.testing.assert_close(with_c, torch.tensor([[[0.05, 0.0], [0.05, 0.0]]]))
    # Without the contribution term the small head misses tau at count 0.
    torch.testing.assert_close(without, torch.tensor([[[0.5, 0.0], [0.05, 0.0]]]))
    with pytest.raises(ValueError, match="unknown budget criterion"):
        criterion_curve("score90", 0.1, err=err, o_full=o_full)
    with pytest.raises(ValueError, match="needs err and o_full"):
        criterion_curve("output", 0.1, err=err)
    with pytest.raises(ValueError, match="needs mass"):
        criterion_curve("score95", 0.1, err=err, o_full=o_full)


def test_prefix_mass_is_the_attention_probability_of_window_and_top_blocks():
    from predictor.budget_criteria import criterion_curve, prefix_mass
    from predictor.budget_search import block_bounds, block_scores, smallest_budget

    gen = torch.Generator().manual_seed(0)
    b, hkv, g, d, lc, w, blk = 2, 2, 3, 16, 70, 9, 16
    q = torch.randn(b, hkv * g, d, generator=gen) * 2
    k_cpu, wk = torch.randn(lc, hkv, d, generator=gen), torch.randn(w, hkv, d, generator=gen)
    scale = d ** -0.5
    qg = q.view(b, hkv, g, d)
    s_win = torch.einsum("bkgd,wkd->bkgw", qg, wk) * scale
    s_cpu = torch.einsum("bkgd,lkd->bkgl", qg, k_cpu) * scale
    mass = prefix_mass(q, k_cpu, torch.logsumexp(s_win, -1).reshape(b, -1), blk)
    nb = -(-lc // blk)
    assert mass.shape == (b, hkv * g, nb + 1)
    p = torch.softmax(torch.cat([s_win, s_cpu], -1), -1)
    order = block_scores(qg, *block_bounds(k_cpu, blk)).argsort(-1, descending=True)
    block_of = torch.arange(lc) // blk
    for n in range(nb + 1):
        kept = (block_of[None, None, None, :, None] == order[..., None, :n]).any(-1)  # [B, Hkv, G, Lc]
        ref = p[..., :w].sum(-1) + (p[..., w:] * kept).sum(-1)
        torch.testing.assert_close(mass[..., n], ref.reshape(b, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass[..., -1], torch.ones(b, hkv * g))
    # Score(95%): the smallest budget whose kept keys hold 95% of the probability.
    curve, bound = criterion_curve("score95", 0.1, mass=mass)
    budget = smallest_budget(curve, torch.arange(nb + 1), blk, lc, bound)
    first = (mass >= 0.95 - 1e-6).float().argmax(-1)
    monotone = bool((mass[..., 1:] >= mass[..., :-1] - 1e-6).all())
    assert monotone
    torch.testing.assert_close(budget, (first * blk / lc).clamp(max=1.0).float())


def test_refit_budget_law_fits_the_chosen_block_sizes_only(tmp_path):
    """Budgets on an exact law at the runtime's block sizes and off it at blk 1: the refit over
    16..128 recovers the law, the labels' own fit (all five) does not."""
    from predictor.train import refit_budget_law

    arrays = synthetic_labels(n_texts=6, rows_per_text=10, heldout_texts=2)
    n = arrays["bgt0"].size
    blocks = np.array([1, 16, 32, 64, 128], dtype=np.int32)
    budgets = (arrays["bgt0"][:, None] + arrays["k"][:, None] * np.log2(blocks)[None]).astype(np.float32)
    budgets[:, 0] = 0.001  # exact top-k tokens need far less than the line says
    labels = load_labels(write(tmp_path, {**arrays, "budgets": budgets, "budget_block_sizes": blocks}))
    refit = refit_budget_law(labels, (16, 32, 64, 128))
    np.testing.assert_allclose(refit.bgt0, arrays["bgt0"], atol=1e-5)
    np.testing.assert_allclose(refit.k, arrays["k"], atol=1e-6)
    assert refit.budgets is labels.budgets and len(refit.rows(refit.split == "train")) < n
    upper = refit_budget_law(labels, (16, 32, 64, 128), "upper")  # exact on a line: the same law
    np.testing.assert_allclose(upper.bgt0, arrays["bgt0"], atol=1e-5)
    budgets[:, 2] += 0.05  # a bump at blk 32: the least-squares law falls below it, the upper one does not
    bumped = load_labels(write(tmp_path, {**arrays, "budgets": budgets, "budget_block_sizes": blocks}, "bump.npz"))
    for method, below in (("least_squares", True), ("upper", False)):
        fit = refit_budget_law(bumped, (16, 32, 64, 128), method)
        law = fit.bgt0[:, None] + fit.k[:, None] * np.log2(blocks[1:])[None]
        assert bool((law < budgets[:, 1:] - 1e-5).any()) is below, method
    with pytest.raises(ValueError, match="fit method"):
        refit_budget_law(labels, (16, 32), "median")
    with pytest.raises(ValueError, match="at least two distinct"):
        refit_budget_law(labels, (16, 16))
    with pytest.raises(ValueError, match=r"\[8\] are not"):
        refit_budget_law(labels, (8, 16))
    no_budgets = load_labels(write(tmp_path, arrays, "old.npz"))
    with pytest.raises(ValueError, match="no 'budgets' array"):
        refit_budget_law(no_budgets, (16, 32))
    with pytest.raises(ValueError, match="come together"):
        load_labels(write(tmp_path, {**arrays, "budgets": budgets}, "half.npz"))
    with pytest.raises(ValueError, match="'budgets' must be finite float32"):
        load_labels(write(tmp_path, {**arrays, "budgets": budgets[:, :4], "budget_block_sizes": blocks}, "bad.npz"))
    # Training on the refitted targets: the settings say so and the held-out metrics use them.
    out = str(tmp_path / "refit.pt")
    rc = main(["--data", str(tmp_path / "labels.npz"), "--out", out, "--hidden", "8", "--max-epochs", "3",
               "--threads", "1", "--fit-block-sizes", "16,32,64,128", "--fit-method", "upper",
               "--streaming-threshold", "0.7"])
    assert rc == 0
    ck = load_checkpoint(out)
    assert ck.training["settings"]["fit_block_sizes"] == [16, 32, 64, 128]
    assert ck.training["settings"]["streaming_threshold"] == 0.7 and ck.training["settings"]["fit_method"] == "upper"
    assert main(["--data", str(tmp_path / "old.npz"), "--out", str(tmp_path / "x.pt"),
                 "--fit-block-sizes", "16,32"]) == 2


def test_folded_streaming_threshold_moves_the_decision_to_one_half(trained):
    """`p >= 0.5` of the folded network is `p >= threshold` of the original, row for row."""
    import copy

    from predictor.train import fold_streaming_threshold

    labels, model, _ = trained
    x = torch.from_numpy(labels.features)
    p = model.predict(x)[2]
    folded = copy.deepcopy(model)
    fold_streaming_threshold(folded, 0.8)
    b, k, p_folded = folded.predict(x)
    margin = (p - 0.8).abs() > 1e-4  # rows at the threshold itself may round either way
    assert torch.equal((p_folded >= 0.5)[margin], (p >= 0.8)[margin])
    assert torch.equal(b, model.predict(x)[0]) and torch.equal(k, model.predict(x)[1])
    with pytest.raises(ValueError, match="lie in"):
        fold_streaming_threshold(folded, 1.0)
