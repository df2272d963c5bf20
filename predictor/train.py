"""Train the head-property predictor on a labels file and write its checkpoint and metrics.

    python -m predictor.train --data DATA.npz --out predictor/checkpoints/NAME.pt [--seed 0]

The labels file (written by the labels pipeline) holds one row per (text, layer, head, decode
position): `features` float32 [N, F], `feature_names` str [F], `bgt0`, `k` float32 [N],
`streaming` bool [N], `split` str [N] in {"train", "heldout"} (split by text), int32 columns
`text_id`, `layer`, `head`, `position`, and the scalar error bound `tau`. `load_labels` checks all
of it. By default some training texts (not rows) are set aside for early stopping, so the
held-out texts are touched only once, for the reported metrics; `--early-stop heldout` stops on
the held-out texts instead (for label sets with a single training text) and the report marks its
held-out metrics as used for stopping. Writes `NAME.pt` and `NAME.json` (the metrics, the
training settings and a description of the data).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from predictor.model import DEFAULT_HIDDEN, Checkpoint, HeadPropertyNet

SPLITS = ("train", "heldout")
INT_COLUMNS = ("text_id", "layer", "head", "position")
EARLY_STOP = ("validation", "heldout")
FIT_METHODS = ("least_squares", "upper")  # how refit_budget_law fits Eq. 1
# Block sizes the runtime reads at (Eq. 1 is evaluated at these for the budget error metric).
BLOCK_SIZES = (16, 32, 64, 128)


# ---------------------------------------------------------------------------- data
@dataclass
class Labels:
    """A validated labels file (numpy arrays, one row per (text, layer, head, position))."""

    features: np.ndarray  # [N, F] float32
    feature_names: list[str]
    bgt0: np.ndarray  # [N] float32
    k: np.ndarray  # [N] float32
    streaming: np.ndarray  # [N] bool
    split: np.ndarray  # [N] str
    text_id: np.ndarray  # [N] int32
    layer: np.ndarray
    head: np.ndarray
    position: np.ndarray
    tau: float
    source: str = ""
    # The smallest budgets before the Eq. 1 fit, [N, B] at `budget_block_sizes` (labels files that
    # record them); `refit_budget_law` fits Eq. 1 again over a subset of those block sizes.
    budgets: np.ndarray | None = None
    budget_block_sizes: tuple[int, ...] = ()

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def rows(self, mask: np.ndarray) -> "Labels":
        return Labels(self.features[mask], self.feature_names, self.bgt0[mask], self.k[mask], self.streaming[mask],
                      self.split[mask], self.text_id[mask], self.layer[mask], self.head[mask], self.position[mask],
                      self.tau, self.source, None if self.budgets is None else self.budgets[mask],
                      self.budget_block_sizes)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": len(self), "features": len(self.feature_names), "tau": self.tau,
                               "layers": int(np.unique(self.layer).size), "heads": int(np.unique(self.head).size)}
        for name in SPLITS:
            m = self.split == name
            out[f"{name}_rows"] = int(m.sum())
            out[f"{name}_texts"] = int(np.unique(self.text_id[m]).size)
            out[f"{name}_streaming_fraction"] = float(self.streaming[m].mean()) if m.any() else float("nan")
        return out


def _fail(path: str, msg: str) -> ValueError:
    return ValueError(f"labels file {path}: {msg}")


def load_labels(path: str | Path) -> Labels:
    """Read and check a labels `.npz`; every error names the array and what is allowed."""
    p = str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"no labels file at {p}")
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    required = ("features", "feature_names", "bgt0", "k", "streaming", "split", "tau") + INT_COLUMNS
    missing = [r for r in required if r not in arrays]
    if missing:
        raise _fail(p, f"missing arrays {missing}; a labels file holds {list(required)}")
    feats = arrays["features"]
    if feats.ndim != 2 or feats.dtype != np.float32:
        raise _fail(p, f"'features' must be float32 [N, F], got {feats.dtype} {list(feats.shape)}")
    n, f = feats.shape
    if n == 0 or f == 0:
        raise _fail(p, f"'features' is empty ({list(feats.shape)})")
    names = arrays["feature_names"]
    if names.dtype.kind != "U" or names.shape != (f,):
        raise _fail(p, f"'feature_names' must be str [{f}] (one per feature column), got {names.dtype} {list(names.shape)}")
    if len(set(names.tolist())) != f:
        raise _fail(p, "'feature_names' has duplicates")
    for name, kind in (("bgt0", np.float32), ("k", np.float32), ("streaming", np.bool_)):
        a = arrays[name]
        if a.shape != (n,) or a.dtype != kind:
            raise _fail(p, f"'{name}' must be {np.dtype(kind).name} [{n}], got {a.dtype} {list(a.shape)}")
    for name in INT_COLUMNS:
        a = arrays[name]
        if a.shape != (n,) or a.dtype != np.int32:
            raise _fail(p, f"'{name}' must be int32 [{n}], got {a.dtype} {list(a.shape)}")
    split = arrays["split"]
    if split.dtype.kind != "U" or split.shape != (n,):
        raise _fail(p, f"'split' must be str [{n}], got {split.dtype} {list(split.shape)}")
    bad = sorted(set(np.unique(split).tolist()) - set(SPLITS))
    if bad:
        raise _fail(p, f"'split' has values {bad}; allowed {list(SPLITS)}")
    tau = arrays["tau"]
    if tau.shape != () or tau.dtype.kind != "f" or not math.isfinite(float(tau)) or float(tau) <= 0:
        raise _fail(p, f"'tau' must be a positive finite float scalar, got {tau.dtype} {list(tau.shape)} {tau!r}")
    for name in ("features", "bgt0", "k"):
        finite = np.isfinite(arrays[name])
        if not finite.all():
            rows = np.nonzero(~finite.reshape(n, -1).all(axis=1))[0]
            raise _fail(p, f"'{name}' has non-finite values in {rows.size} rows (first {rows[:5].tolist()})")
    for name in SPLITS:
        if not (split == name).any():
            raise _fail(p, f"no rows with split '{name}'; both {list(SPLITS)} are needed")
    text = arrays["text_id"]
    shared = np.intersect1d(text[split == "train"], text[split == "heldout"])
    if shared.size:
        raise _fail(p, f"texts {shared[:5].tolist()} have rows in both splits; the split must be by text")
    budgets, budget_blocks = arrays.get("budgets"), arrays.get("budget_block_sizes")
    if (budgets is None) != (budget_blocks is None):
        raise _fail(p, "'budgets' and 'budget_block_sizes' come together (one is missing)")
    if budgets is not None:
        if budget_blocks.ndim != 1 or budget_blocks.dtype.kind not in "iu" or (budget_blocks < 1).any():
            raise _fail(p, f"'budget_block_sizes' must be positive integers [B], got {budget_blocks.dtype} {budget_blocks!r}")
        if budgets.shape != (n, budget_blocks.size) or budgets.dtype != np.float32 or not np.isfinite(budgets).all():
            raise _fail(p, f"'budgets' must be finite float32 [{n}, {budget_blocks.size}], got {budgets.dtype} "
                           f"{list(budgets.shape)}")
    return Labels(feats, [str(x) for x in names.tolist()], arrays["bgt0"], arrays["k"], arrays["streaming"], split,
                  text, arrays["layer"], arrays["head"], arrays["position"], float(tau), source=p, budgets=budgets,
                  budget_block_sizes=() if budget_blocks is None else tuple(int(b) for b in budget_blocks))


def refit_budget_law(labels: Labels, block_sizes: Sequence[int], method: str = "least_squares") -> Labels:
    """`labels` with `bgt0`, `k` fitted again (Eq. 1) to the smallest budgets at `block_sizes`
    only. The labels' own fit spans every measured block size, exact top-k tokens (blk 1)
    included, which the runtime never reads at: fitting the runtime's block sizes alone puts the
    law where the selector evaluates it. `method` (`FIT_METHODS`): `least_squares`, or `upper`,
    the least law at or above every budget (`predictor.budget_search.fit_budget_law_upper`)."""
    from predictor.budget_search import fit_budget_law, fit_budget_law_upper

    if method not in FIT_METHODS:
        raise ValueError(f"fit method {method!r} is not one of {list(FIT_METHODS)}")

    if labels.budgets is None:
        raise ValueError(f"labels file {labels.source}: no 'budgets' array (made before the labels recorded them); "
                         "refitting the budget law needs it: make the labels again with python -m predictor.labels")
    blocks = tuple(int(b) for b in block_sizes)
    missing = [b for b in blocks if b not in labels.budget_block_sizes]
    if len(set(blocks)) < 2 or missing:
        raise ValueError(f"fit block sizes {list(blocks)} must be at least two distinct block sizes of the labels' "
                         f"{list(labels.budget_block_sizes)}" + (f" ({missing} are not)" if missing else ""))
    cols = [labels.budget_block_sizes.index(b) for b in blocks]
    fit = fit_budget_law if method == "least_squares" else fit_budget_law_upper
    bgt0, k = fit(torch.from_numpy(labels.budgets[:, cols]), blocks)
    return dataclasses.replace(labels, bgt0=bgt0.numpy().astype(np.float32), k=k.numpy().astype(np.float32))


def fold_streaming_threshold(model: HeadPropertyNet, threshold: float) -> None:
    """Shift the streaming logit's bias so that `p_streaming >= 0.5` of the result is
    `p_streaming >= threshold` of `model`: the planner's default threshold then makes the decision
    the threshold was chosen for, with no setting to carry beside the checkpoint."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"streaming threshold must lie in (0, 1), got {threshold}")
    with torch.no_grad():
        model.streaming_head.bias -= math.log(threshold / (1.0 - threshold))


def validation_texts(labels: Labels, fraction: float, seed: int) -> np.ndarray:
    """Training texts set aside for early stopping: `fraction` of them, at least one."""
    texts = np.unique(labels.text_id[labels.split == "train"])
    if texts.size < 2:
        raise ValueError(
            f"labels file {labels.source}: {texts.size} training text; at least 2 are needed so that one "
            "can be set aside for early stopping (the held-out texts are kept for the final metrics)")
    n_val = min(texts.size - 1, max(1, round(fraction * texts.size)))
    return np.sort(np.random.default_rng(seed).choice(texts, size=n_val, replace=False))


# ---------------------------------------------------------------------------- metrics
def _budget(bgt0: np.ndarray, k: np.ndarray, blk: int) -> np.ndarray:
    return np.clip(bgt0 + k * math.log2(blk), 0.0, 1.0)


@torch.no_grad()
def evaluate(model: HeadPropertyNet, labels: Labels, reference: Labels | None = None,
             threshold: float = 0.5) -> dict[str, float]:
    """Streaming accuracy over all rows; MAE of bgt0, k and of the clipped Eq. 1 budget at each
    block size over retrieval rows (a streaming head's budget law is never used). Constant
    baselines say what the network adds: the majority class of `labels`, and the median (the
    constant with the least MAE) of `reference`'s retrieval rows, the training split."""
    dev = model.feature_mean.device
    bgt0, k, p = model.predict(torch.from_numpy(labels.features).to(dev))
    bgt0, k, p = bgt0.cpu().double().numpy(), k.cpu().double().numpy(), p.cpu().double().numpy()
    s = labels.streaming
    r = ~s
    pred_s = p >= threshold
    out: dict[str, float] = {
        "rows": float(len(labels)),
        "streaming_fraction": float(s.mean()),
        "streaming_accuracy": float((pred_s == s).mean()),
        "streaming_recall": float(pred_s[s].mean()) if s.any() else float("nan"),
        # Of the heads called streaming, the fraction that are: a retrieval head called streaming
        # reads nothing from the CPU segment, the costly mistake.
        "streaming_precision": float(s[pred_s].mean()) if pred_s.any() else float("nan"),
        "retrieval_recall": float((~pred_s[r]).mean()) if r.any() else float("nan"),
        "streaming_accuracy_majority_baseline": float(max(s.mean(), 1.0 - s.mean())),
    }
    if r.any():
        tb, tk = labels.bgt0[r].astype(np.float64), labels.k[r].astype(np.float64)
        out["bgt0_mae"] = float(np.abs(bgt0[r] - tb).mean())
        out["k_mae"] = float(np.abs(k[r] - tk).mean())
        if reference is not None and (~reference.streaming).any():
            ref_r = ~reference.streaming
            med_b, med_k = float(np.median(reference.bgt0[ref_r])), float(np.median(reference.k[ref_r]))
            out["bgt0_mae_median_baseline"] = float(np.abs(med_b - tb).mean())
            out["k_mae_median_baseline"] = float(np.abs(med_k - tk).mean())
            for blk in BLOCK_SIZES:
                out[f"budget_mae_blk{blk}_median_baseline"] = float(
                    np.abs(_budget(np.float64(med_b), np.float64(med_k), blk) - _budget(tb, tk, blk)).mean())
        for blk in BLOCK_SIZES:
            pred_b, true_b = _budget(bgt0[r], k[r], blk), _budget(tb, tk, blk)
            out[f"budget_mae_blk{blk}"] = float(np.abs(pred_b - true_b).mean())
            # Heads given less than their label budget: the ones at risk of missing tau.
            out[f"budget_under_fraction_blk{blk}"] = float((pred_b < true_b - 1e-6).mean())
    else:
        out.update({"bgt0_mae": float("nan"), "k_mae": float("nan")})
    return out


# ---------------------------------------------------------------------------- training
@dataclass
class TrainSettings:
    hidden: tuple[int, ...] = DEFAULT_HIDDEN
    lr: float = 1e-3
    weight_decay: float = 1e-5
    batch_size: int = 1024
    max_epochs: int = 200
    patience: int = 15
    validation_fraction: float = 0.15
    # "validation": stop on training texts set aside (held-out metrics stay untouched);
    # "heldout": stop on the held-out texts themselves (all training texts are fitted; the
    # held-out metrics are then optimistic, and the report says so).
    early_stop: str = "validation"
    # After early stopping on the validation texts, train again on every training text for the
    # best epoch count (validation metrics are those of the first network).
    refit: bool = False
    # Quantile the bgt0 and k heads aim at (pinball loss); 0.5 is the absolute error.
    quantile: float = 0.5
    # Block sizes the Eq. 1 targets are fitted to (`refit_budget_law`); empty: the labels' own fit.
    fit_block_sizes: tuple[int, ...] = ()
    fit_method: str = "least_squares"  # with fit_block_sizes: one of FIT_METHODS
    # Folded into the streaming head's bias after training (`fold_streaming_threshold`); 0.5: none.
    streaming_threshold: float = 0.5
    seed: int = 0
    device: str = "cpu"
    # torch intra-op threads while training; 0 keeps torch's setting. A network this small trains
    # fastest on one thread when the cores are shared (measured: 11 s vs 153 s for a tiny run).
    threads: int = 0

    def check(self) -> None:
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"hidden must be positive layer widths, got {self.hidden}")
        for name in ("lr", "batch_size", "max_epochs", "patience"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.early_stop not in EARLY_STOP:
            raise ValueError(f"early_stop must be one of {list(EARLY_STOP)}, got {self.early_stop!r}")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile must lie in (0, 1), got {self.quantile}")
        if self.refit and self.early_stop != "validation":
            raise ValueError("refit needs early_stop='validation' (the epoch count comes from the validation texts)")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must lie in (0, 1), got {self.validation_fraction}")
        if not 0.0 < self.streaming_threshold < 1.0:
            raise ValueError(f"streaming_threshold must lie in (0, 1), got {self.streaming_threshold}")
        if self.fit_method not in FIT_METHODS:
            raise ValueError(f"fit_method must be one of {list(FIT_METHODS)}, got {self.fit_method!r}")
        if self.fit_block_sizes and (len(set(self.fit_block_sizes)) < 2 or min(self.fit_block_sizes) < 1):
            raise ValueError(f"fit_block_sizes must be at least two distinct positive block sizes, got "
                             f"{list(self.fit_block_sizes)}")


def _tensors(labels: Labels, dev: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.from_numpy(labels.features).to(dev), torch.from_numpy(labels.bgt0).to(dev),
            torch.from_numpy(labels.k).to(dev), torch.from_numpy(labels.streaming).to(dev))


def _loss(model: HeadPropertyNet, x: torch.Tensor, bgt0: torch.Tensor, k: torch.Tensor, s: torch.Tensor,
          pos_weight: torch.Tensor, quantile: float = 0.5) -> torch.Tensor:
    """BCE on the streaming label plus the pinball loss of the standardised regression targets on
    retrieval rows (`quantile` 0.5: the absolute error). Not squared: the labels are heavy-tailed
    (a few heads need far more budget than the rest) and the metric is MAE; on the SmolLM2 labels
    squared error fitted the tail and scored worse than a constant (validation text: bgt0 MAE 0.034
    vs 0.028). A quantile above 0.5 aims above the typical label: fewer heads get less budget than
    they need, at the cost of bytes."""
    b_z, k_z, logit = model(model.standardise(x))
    loss = nn.functional.binary_cross_entropy_with_logits(logit, s.float(), pos_weight=pos_weight)
    r = (~s).float()
    n_r = r.sum().clamp_min(1.0)
    db = (bgt0 - model.target_mean[0]) / model.target_std[0] - b_z
    dk = (k - model.target_mean[1]) / model.target_std[1] - k_z
    pinball = torch.maximum(quantile * db, (quantile - 1) * db) + torch.maximum(quantile * dk, (quantile - 1) * dk)
    return loss + 2.0 * (pinball * r).sum() / n_r


def train(labels: Labels, settings: TrainSettings | None = None, log: Any = None) -> tuple[HeadPropertyNet, dict]:
    """Train on the training texts (minus the validation texts); stop when the validation loss has
    not improved for `patience` epochs and keep the best epoch's weights. With `refit`, then train
    a fresh network on every training text for that many epochs (the held-out texts are still
    never seen). With `fit_block_sizes` the targets are refitted first (`training_targets`); a
    `streaming_threshold` other than 0.5 is folded into the returned network's streaming bias (the
    validation metrics in the report are the unfolded network's, at 0.5). Seeded: the same data
    and settings give the same network on the same machine."""
    st = settings or TrainSettings()
    st.check()
    threads = torch.get_num_threads()
    if st.threads:
        torch.set_num_threads(st.threads)
    try:
        model, info = _train(training_targets(labels, st), st, log)
    finally:
        torch.set_num_threads(threads)
    if st.streaming_threshold != 0.5:
        fold_streaming_threshold(model, st.streaming_threshold)
    return model, info


def training_targets(labels: Labels, settings: TrainSettings) -> Labels:
    """The labels with the Eq. 1 targets the settings train on: refitted over `fit_block_sizes` when given."""
    return refit_budget_law(labels, settings.fit_block_sizes, settings.fit_method) if settings.fit_block_sizes else labels


def _fit(fit: Labels, val: Labels | None, st: TrainSettings, epochs: int, log: Any) -> tuple[HeadPropertyNet, dict]:
    """Adam on `fit` for up to `epochs` epochs; with `val`, early stopping on its loss (best
    weights kept), without it the last epoch's weights."""
    torch.manual_seed(st.seed)
    dev = torch.device(st.device)
    model = HeadPropertyNet(len(fit.feature_names), st.hidden).to(dev)
    retrieval = ~fit.streaming
    model.set_standardisation(torch.from_numpy(fit.features).to(dev), torch.from_numpy(fit.bgt0[retrieval]).to(dev),
                              torch.from_numpy(fit.k[retrieval]).to(dev))
    # Balance the classes: either kind of head may be a minority of the rows.
    n_s = float(fit.streaming.sum())
    pos_weight = torch.tensor((len(fit) - n_s) / n_s if n_s else 1.0, device=dev)
    x, tb, tk, ts = _tensors(fit, dev)
    val_tensors = _tensors(val, dev) if val is not None else None
    opt = torch.optim.Adam(model.parameters(), lr=st.lr, weight_decay=st.weight_decay)
    gen = torch.Generator(device="cpu").manual_seed(st.seed)
    best = (math.inf, epochs - 1, None)
    history = []
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(fit), generator=gen).to(dev)
        total = 0.0
        for i in range(0, len(fit), st.batch_size):
            idx = order[i : i + st.batch_size]
            loss = _loss(model, x[idx], tb[idx], tk[idx], ts[idx], pos_weight, st.quantile)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * idx.numel()
        model.eval()
        row = {"epoch": epoch, "train_loss": total / len(fit)}
        history.append(row)
        if val is None:
            continue
        with torch.no_grad():
            row["validation_loss"] = val_loss = float(_loss(model, *val_tensors, pos_weight, st.quantile))
        if log:
            log(f"epoch {epoch:3d}  train {row['train_loss']:.4f}  validation {val_loss:.4f}")
        if val_loss < best[0] - 1e-6:
            best = (val_loss, epoch, {k: v.detach().clone() for k, v in model.state_dict().items()})
        elif epoch - best[1] >= st.patience:
            break
    if best[2] is not None:
        model.load_state_dict(best[2])
    model.eval()
    return model, {"epochs_run": len(history), "best_epoch": best[1], "best_validation_loss": best[0],
                   "history": history, "fit_rows": len(fit)}


def _train(labels: Labels, st: TrainSettings, log: Any) -> tuple[HeadPropertyNet, dict]:
    t0 = time.perf_counter()
    is_train = labels.split == "train"
    if st.early_stop == "validation":
        val_texts = validation_texts(labels, st.validation_fraction, st.seed)
        is_val = is_train & np.isin(labels.text_id, val_texts)
    else:
        val_texts = np.unique(labels.text_id[~is_train])
        is_val = ~is_train
    fit, val = labels.rows(is_train & ~is_val), labels.rows(is_val)
    model, info = _fit(fit, val, st, st.max_epochs, log)
    info["validation"] = evaluate(model, val, fit)
    info["validation_texts"] = val_texts.tolist()
    info["validation_rows"] = len(val)
    if st.refit and st.early_stop == "validation":
        model, again = _fit(labels.rows(is_train), None, st, info["best_epoch"] + 1, log)
        info["refit_rows"] = again["fit_rows"]
        info["refit_epochs"] = again["epochs_run"]
    info["parameters"] = model.parameter_count()
    info["train_seconds"] = time.perf_counter() - t0
    return model, info


def describe_file(path: str) -> dict[str, Any]:
    """The data file as a checkpoint records it: its path as given (when relative) and its digest."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    name = path if not os.path.isabs(path) else os.path.basename(path)
    return {"file": name, "sha256": h.hexdigest(), "bytes": os.path.getsize(path)}


def run(data: str, out: str, settings: TrainSettings, note: str = "", log: Any = print,
        command: str = "") -> dict[str, Any]:
    """Load, train, evaluate on the held-out texts, write `out` (checkpoint) and `out` .json (metrics)."""
    if not out.endswith(".pt"):
        raise ValueError(f"--out must name a .pt file, got {out}")
    labels = load_labels(data)
    model, info = train(labels, settings, log=None)
    labels = training_targets(labels, settings)  # held-out metrics against the targets it was trained on
    train_rows = labels.rows(labels.split == "train")
    heldout = evaluate(model, labels.rows(labels.split == "heldout"), train_rows)
    validation = info["validation"]
    data_desc = {**describe_file(data), **labels.describe()}
    if note:
        data_desc["note"] = note
    training = {k: v for k, v in info.items() if k not in ("history", "validation")}
    training["settings"] = {**settings.__dict__, "hidden": list(settings.hidden),
                            "fit_block_sizes": list(settings.fit_block_sizes)}
    ckpt = Checkpoint(model.cpu(), labels.feature_names, labels.tau, data_desc, {"heldout": heldout}, training)
    ckpt.save(out)
    report = {
        "checkpoint": os.path.basename(out),
        "checkpoint_bytes": os.path.getsize(out),
        "command": command or "predictor.train.run",
        "tau": labels.tau,
        "data": data_desc,
        "heldout": heldout,
        "heldout_used_for_early_stopping": settings.early_stop == "heldout",
        "validation": validation,
        "training": {**training, "history": info["history"]},
    }
    with open(out[: -len(".pt")] + ".json", "w") as fh:
        json.dump(_json_safe(report), fh, indent=1)
        fh.write("\n")
    if log:
        log(f"{info['parameters']} parameters, {info['epochs_run']} epochs (best {info['best_epoch']}), "
            f"{info['train_seconds']:.1f} s; {len(labels)} rows, tau {labels.tau}")
        log("held-out: " + ", ".join(f"{k} {v:.4g}" for k, v in heldout.items()))
        log(f"wrote {out} ({report['checkpoint_bytes']} bytes) and {out[:-3]}.json")
    return report


def _json_safe(x: Any) -> Any:
    """NaN (a metric without rows to measure it on) as null: strict JSON has no NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _hidden(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden takes comma-separated layer widths such as 256,256,128, got {text!r}")
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"--hidden widths must be positive, got {text!r}")
    return widths


def _block_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fit-block-sizes takes comma-separated block sizes such as 16,32,64,128, "
                                         f"got {text!r}")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m predictor.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="labels .npz")
    ap.add_argument("--out", required=True, help="checkpoint path NAME.pt; metrics go to NAME.json")
    d = TrainSettings()
    ap.add_argument("--hidden", type=_hidden, default=d.hidden, help="backbone widths (default 256,256,128)")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--max-epochs", type=int, default=d.max_epochs)
    ap.add_argument("--patience", type=int, default=d.patience, help="epochs without validation improvement")
    ap.add_argument("--validation-fraction", type=float, default=d.validation_fraction,
                    help="fraction of training texts set aside for early stopping")
    ap.add_argument("--early-stop", choices=EARLY_STOP, default=d.early_stop,
                    help="stop on training texts set aside (default) or on the held-out texts (needs one training "
                         "text only; the held-out metrics are then optimistic)")
    ap.add_argument("--refit", action="store_true",
                    help="after early stopping, train again on all training texts for the best epoch count")
    ap.add_argument("--quantile", type=float, default=d.quantile,
                    help="quantile of bgt0 and k to predict (default 0.5, the absolute error; higher: fewer heads "
                         "under-budgeted, more bytes)")
    ap.add_argument("--fit-block-sizes", type=_block_sizes, default=d.fit_block_sizes,
                    help="fit the Eq. 1 targets to the labels' budgets at these block sizes only (e.g. 16,32,64,128; "
                         "default: the labels' own fit over every measured block size)")
    ap.add_argument("--fit-method", choices=FIT_METHODS, default=d.fit_method,
                    help="with --fit-block-sizes: least squares (default) or upper, the least law at or above every "
                         "budget")
    ap.add_argument("--streaming-threshold", type=float, default=d.streaming_threshold,
                    help="fold this p_streaming threshold into the streaming head's bias (default 0.5: none)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--device", default=d.device)
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads while training (0: torch's default)")
    ap.add_argument("--note", default="", help="free text stored with the data description")
    args = ap.parse_args(argv)
    settings = TrainSettings(hidden=args.hidden, lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size,
                             max_epochs=args.max_epochs, patience=args.patience,
                             validation_fraction=args.validation_fraction, early_stop=args.early_stop, refit=args.refit,
                             quantile=args.quantile, fit_block_sizes=args.fit_block_sizes, fit_method=args.fit_method,
                             streaming_threshold=args.streaming_threshold, seed=args.seed,
                             device=args.device, threads=args.threads)
    try:
        argv_used = list(sys.argv[1:] if argv is None else argv)
        run(args.data, args.out, settings, args.note, command="python -m predictor.train " + shlex.join(argv_used))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
