"""Evaluation of the `predicted` head-plan policy on SmolLM2-135M-Instruct.

    python -m hybrid_runtime.experiments.predictor_eval --config configs/predictor_smollm2.yaml \\
        --out runs/predictor_eval --results-dir benchmarks/results

**Predictor, held out.** Streaming-head accuracy and the MAE of `bgt0` and `k` of the shipped
checkpoint on the held-out texts of its labels file (the file the checkpoint names: its SHA-256
must match, or the file must be a remake of it with the same rows, texts and split, since labels
made with `predictor.labels` on another host's library versions differ in their low bits;
`labels_remade` says which), and the held-out metrics every other checkpoint recorded when it was
trained.

**Policies, end to end.** Per context length (4K and 8K) and policy, through `HybridRuntime`
and `HybridCache` exactly as the quality harness does (`quality_measure`: one dense reference
forward, then teacher-forced decoding of the last `positions` tokens, sparse attention at every
layer, errors compounding): next-token top-1 agreement with the dense model, KL(dense || sparse),
perplexity, and the CPU-resident KV bytes read per decode step (all layers), counted by the
executors and modeled by Eq. 3. The prompt's last query of every layer (captured in the same
reference forward) goes to the runtime's prefill, as `generate` through `HybridCache` hands it.
For predicted policies the plans are tallied per step: heads with a budget, groups with a task,
the block sizes chosen.

Policies (`POLICIES`): the fixed baselines (16, 0.05) and (32, 0.02); `predicted` (the shipped
checkpoint: tau 0.1, the upper Eq. 1 fit over blk 16-128, 11 texts x 16 positions; the previous
default, tau 0.1 with the labels' least-squares fit over blk 1-128 on 8 texts x 8 positions, is
`predicted_t8p8`); the upper fit at tau 0.125 and 0.15; the tau sweep; the ablations of Fluxion Fig. 10: dynamic granularity vs a
fixed block of 16 or 32 (`selection.block_sizes`), with and without streaming-head skipping
(`selection.skip_streaming`), and the three budget criteria of the labels (Eq. 2, Eq. 2 without the
head-contribution term, 95% attention score). The tau sweep cannot re-select with one predictor:
the selector has no tau -- the predictor outputs the budget law that met the tau of its labels,
and four of its features (the anchor budgets and the Gaussian budget) are computed at that tau --
so every tau (and every criterion) is its own checkpoint, trained on labels of the same texts and
positions made with that tau (or criterion); `checkpoint_commands` prints how each was made.

**Oracle** (`ORACLES`, `oracle_plans.py`, evaluation only): the same selector fed each step's exact labels (the
budget law fitted, by least squares over blk 1-128, to the smallest budgets meeting tau, and the streaming flag, computed like the
offline labels from the full KV the store holds) instead of the predictor's. It reads the whole
CPU-resident KV every step, which no serving policy may; it separates what the criterion and tau
cost (oracle vs fixed) from what the predictor's errors cost (predicted vs oracle).

**Text.** One window of the quality harness's corpus at `text_offset`, the same for every length
(a length's window is the first `L + 1` tokens), which must (a) not repeat its own context
(`quality_text.check_novel`, < 5% of the scored 8-grams) and (b) share no `overlap_ngram`-token
sequence (16) with any text the predictor's labels were made from: those texts are the label
file's (text, position) rows, chunks of `predictor.labels.corpus_text`, tokenised here (every
other checkpoint's labels use the same texts: same settings, only tau or the criterion differ).
Both are checked before the model runs; the run refuses an offset that fails and names ones that
pass.

**Validation runs** (`--validation-offset OFFSET`, `validation_offset`): the same measurement on
the window at another offset, which must not overlap the scored one, for choosing settings
(checkpoint, tau, thresholds) on text that is not reported; it skips the held-out predictor
metrics, records (does not refuse) n-grams shared with the labelled texts (every candidate was
trained on the same texts), and cannot write to `--results-dir`.

Writes `predictor_eval.json` and `.md` to `--out`; with `--results-dir`,
`predictor_smollm2-<device>.json` (`cpu` on a host without CUDA) and its table.
Exit codes: 0 success, 2 bad settings or text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hybrid_runtime.config import SelectionConfig, config_from_dict, resolve_checkpoint
from hybrid_runtime.experiments.quality_settings import (
    load_section_settings,
    run_and_write,
    timestamped_progress,
)
from hybrid_runtime.profiling.results import device_kind_slug, write_results

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

BASELINE = "fixed16_005"  # bytes ratios are against this policy
DEFAULT_CHECKPOINT = SelectionConfig().checkpoint  # what the `predicted` policy loads when none is named

#: Oracle slug -> the tau of its exact labels (Eq. 2, as the shipped checkpoint's labels).
ORACLES: dict[str, float] = {"oracle_tau010": 0.10, "oracle_tau015": 0.15}

#: Slug -> (`selection` section, what it is). Checkpoints of the tau sweep and the criteria are made by
#: `checkpoint_commands`.
POLICIES: dict[str, tuple[dict, str]] = {
    "fixed16_005": ({"name": "fixed", "block_size": 16, "budget": 0.05}, "fixed (16, 0.05)"),
    "fixed32_002": ({"name": "fixed", "block_size": 32, "budget": 0.02}, "fixed (32, 0.02)"),
    "predicted": ({"name": "predicted"}, "predicted, shipped checkpoint (tau 0.1, upper Eq. 1 fit, 11 texts x 16 positions)"),
    "predicted_t8p8": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_t8p8.pt"},
                       "predicted, tau 0.1, labels' own Eq. 1 fit, 8 texts x 8 positions (the previous default)"),
    "predicted_q80": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_q80.pt"},
                      "predicted, tau 0.1, budgets at the 0.8 quantile"),
    "predicted_tau002": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_tau0.02.pt"},
                         "predicted, tau 0.02"),
    "predicted_tau005": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_tau0.05.pt"},
                         "predicted, tau 0.05"),
    "predicted_tau015": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_tau0.15.pt"},
                         "predicted, tau 0.15"),
    "predicted_tau020": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_tau0.2.pt"},
                         "predicted, tau 0.2"),
    "predicted_blk16": ({"name": "predicted", "block_sizes": [16]}, "predicted budgets, block fixed at 16"),
    "predicted_blk32": ({"name": "predicted", "block_sizes": [32]}, "predicted budgets, block fixed at 32"),
    # The shipped checkpoint with each step's tasks built from the plan of the layer's step before
    # (selection.plan_lag 1: on CUDA the planner's device part then leaves the step's critical path).
    "predicted_lag1": ({"name": "predicted", "plan_lag": 1}, "predicted, each step on the plan of the step before"),
    "predicted_no_streaming": ({"name": "predicted", "skip_streaming": False},
                               "predicted, no streaming heads (every head its budget law)"),
    # 0.8: the threshold at which the previous default's held-out streaming precision reached 0.98 (0.948 at 0.5).
    "predicted_thr08": ({"name": "predicted", "streaming_threshold": 0.8},
                        "predicted, streaming only at p_streaming >= 0.8"),
    # Between the default 0.5 and 0.8: validation candidates for the shipped checkpoint's threshold.
    "predicted_thr06": ({"name": "predicted", "streaming_threshold": 0.6},
                        "predicted, streaming only at p_streaming >= 0.6"),
    "predicted_thr07": ({"name": "predicted", "streaming_threshold": 0.7},
                        "predicted, streaming only at p_streaming >= 0.7"),
    "predicted_no_head_contribution": (
        {"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_output_no_head_contribution.pt"},
        "predicted, criterion: Eq. 2 without the head-contribution term"),
    "predicted_score95": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_score95.pt"},
                          "predicted, criterion: 95% of the attention score"),
    "predicted_t11p16": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_t11p16.pt"},
                         "predicted, tau 0.1, trained on 11 texts x 16 positions"),
    # Operating points: a looser tau with the stricter streaming threshold.
    "predicted_tau015_thr08": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_tau0.15.pt",
                                "streaming_threshold": 0.8}, "predicted, tau 0.15, streaming at p >= 0.8"),
    "predicted_tau020_thr08": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_tau0.2.pt",
                                "streaming_threshold": 0.8}, "predicted, tau 0.2, streaming at p >= 0.8"),
    "predicted_t11p16_thr08": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_t11p16.pt",
                                "streaming_threshold": 0.8}, "predicted, 11 texts x 16 positions, streaming at p >= 0.8"),
    # Eq. 1 labels refitted as the least law at or above the smallest budgets of the runtime's block
    # sizes (16..128; `predictor.budget_search.fit_budget_law_upper`) instead of the least-squares
    # line over every measured size, exact top-k tokens (blk 1) included; 11 texts x 16 positions,
    # three taus labelled in one pass.
    "predicted_upper_tau0125": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_t11p16_tau0.125_upper.pt"},
                                "predicted, tau 0.125, upper Eq. 1 fit at blk 16-128, 11 texts x 16 positions"),
    "predicted_upper_tau015": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_t11p16_tau0.15_upper.pt"},
                               "predicted, tau 0.15, upper Eq. 1 fit at blk 16-128, 11 texts x 16 positions"),
    "predicted_upper_tau015_thr08": ({"name": "predicted", "checkpoint": "predictor/checkpoints/smollm2_t11p16_tau0.15_upper.pt",
                                      "streaming_threshold": 0.8},
                                     "predicted, tau 0.15, upper Eq. 1 fit, streaming at p >= 0.8 (a validation candidate)"),
}
#: How the labels of each checkpoint made here differ from the shipped checkpoint's (`predictor.labels` flags).
LABEL_FLAGS = {
    "predicted_tau002": "--tau 0.02", "predicted_tau005": "--tau 0.05", "predicted_tau015": "--tau 0.15",
    "predicted_tau020": "--tau 0.2", "predicted_no_head_contribution": "--criterion output_no_head_contribution",
    "predicted_score95": "--criterion score95", "predicted_t11p16": "--texts 11 --positions 16",
    "predicted_tau015_thr08": "--tau 0.15", "predicted_tau020_thr08": "--tau 0.2",
    "predicted_t11p16_thr08": "--texts 11 --positions 16",
    "predicted_upper_tau0125": "--texts 11 --positions 16 --tau 0.125", "predicted_upper_tau015": "--texts 11 --positions 16 --tau 0.15",
    "predicted_upper_tau015_thr08": "--texts 11 --positions 16 --tau 0.15",
    "predicted_t8p8": "", "predicted_q80": "",
}
#: Checkpoints trained with flags beyond the shipped checkpoint's (`predictor.train`), and their labels
#: file where it is not named after the checkpoint (several taus labelled in one pass).
UPPER_FIT = "--fit-block-sizes 16,32,64,128 --fit-method upper"
TRAIN_FLAGS = {"predicted_upper_tau0125": UPPER_FIT, "predicted_upper_tau015": UPPER_FIT,
               "predicted_upper_tau015_thr08": UPPER_FIT, "predicted_q80": "--quantile 0.8"}
LABEL_FILES = {"predicted_upper_tau0125": "runs/predictor/smollm2_labels_t11p16_tau0.125.npz",
               "predicted_upper_tau015": "runs/predictor/smollm2_labels_t11p16_tau0.15.npz",
               "predicted_upper_tau015_thr08": "runs/predictor/smollm2_labels_t11p16_tau0.15.npz",
               "predicted_t8p8": "runs/predictor/smollm2_labels.npz", "predicted_q80": "runs/predictor/smollm2_labels.npz"}
GROUPS = {
    "baselines": ("fixed16_005", "fixed32_002", "predicted", "predicted_t8p8", "predicted_q80", "predicted_t11p16"),
    "Eq. 1 fit and tau (11 texts x 16 positions)": ("predicted_t11p16", "predicted", "predicted_upper_tau0125",
                                                     "predicted_upper_tau015"),
    "tau sweep (labels' own fit, 8 texts x 8 positions)": ("predicted_tau002", "predicted_tau005", "predicted_t8p8",
                                                           "predicted_tau015", "predicted_tau020"),
    "granularity": ("predicted", "predicted_blk16", "predicted_blk32"),
    "plan lag": ("fixed16_005", "predicted", "predicted_lag1"),
    "predictor vs exact labels": ("predicted_t8p8", "oracle_tau010", "predicted_tau015", "oracle_tau015"),
    "streaming heads": ("predicted", "predicted_thr06", "predicted_thr07", "predicted_thr08", "predicted_no_streaming"),
    "operating points": ("predicted_tau015_thr08", "predicted_tau020_thr08", "predicted_t11p16_thr08"),
    "budget criterion": ("predicted_t8p8", "predicted_no_head_contribution", "predicted_score95"),
}


#: The `predictor.labels` flags (beyond the defaults) of the shipped checkpoint's labels file; its texts
#: and positions, which do not depend on tau, are what the text check needs when that file is absent.
SHIPPED_LABEL_FLAGS = "--texts 11 --positions 16 --tau 0.1"


def label_arguments(slug: str, flags: str | None = None) -> dict[str, str]:
    """The `python -m predictor.labels` flags of the labels a sweep or ablation checkpoint was trained
    on (`flags`, when given, instead of `LABEL_FLAGS[slug]`)."""
    args = {"--lengths": "2048,4096,8192", "--positions": "8", "--texts": "8", "--tau": "0.1"}
    given = (LABEL_FLAGS[slug] if flags is None else flags).split()
    args.update(zip(given[::2], given[1::2]))
    return args


def checkpoint_commands(slug: str) -> list[str]:
    """How the checkpoint of a predicted policy of the sweep or the ablations was made (labels, then training)."""
    if slug not in LABEL_FLAGS:
        return []
    ckpt = POLICIES[slug][0]["checkpoint"]
    data = LABEL_FILES.get(slug, f"runs/predictor/smollm2_labels_{Path(ckpt).stem.replace('smollm2_', '')}.npz")
    args = " ".join(f"{k} {v}" for k, v in label_arguments(slug).items())
    extra = f" {TRAIN_FLAGS[slug]}" if slug in TRAIN_FLAGS else ""
    return [f"python -m predictor.labels --out {data} {args} --threads 1",
            f"python -m predictor.train --data {data} --out {ckpt} --refit --threads 1 --hidden 256,256,128{extra}"]


def label_settings(slug: str, flags: str | None = None) -> Any:
    """`predictor.labels.LabelSettings` of the labels command of `slug`'s checkpoint (or of `flags`)."""
    from predictor.labels import LabelSettings

    args = label_arguments(slug, flags)
    return LabelSettings(lengths=tuple(int(x) for x in args["--lengths"].split(",")), positions=int(args["--positions"]),
                         texts=int(args["--texts"]), tau=float(args["--tau"]),
                         criterion=args.get("--criterion", LabelSettings.criterion))


@dataclass(frozen=True)
class EvalSettings:
    lengths: tuple[int, ...] = (4096, 8192)
    positions: int = 256  # teacher-forced positions after the prompt
    policies: tuple[str, ...] = tuple(POLICIES)
    # 16-gram-disjoint from every labelled text and novel at 4K and 8K (measured: 0 shared 16-grams,
    # 8-gram repeat 0.016 and 0.020); the quality harness's 30000 lies inside a training text.
    text_offset: int = 91750
    overlap_ngram: int = 16
    labels: str = "runs/predictor/smollm2_labels_t11p16_tau0.1.npz"  # the shipped checkpoint's labels (held-out metrics)
    model_dtype: str = "float32"
    store_dtype: str = "bf16"
    threads: int = 0
    runtime: dict = field(default_factory=dict)  # extra runtime sections (kv_cache, scheduler, profiling)
    # A validation run: the window at this offset instead of `text_offset`'s, which it must not
    # overlap, so that settings chosen on it are not chosen on the scored text; no held-out
    # predictor metrics (the labels file may be absent), never written to the results.
    validation_offset: int | None = None

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES and p not in ORACLES]
        if bad:
            raise ValueError(f"predictor_eval.policies: unknown {bad}; allowed: {', '.join([*POLICIES, *ORACLES])}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"predictor_eval.policies: {list(self.policies)} names a policy twice")
        if not self.lengths or self.positions < 1 or any(n <= self.positions + 1 for n in self.lengths):
            raise ValueError(f"predictor_eval.lengths {list(self.lengths)} must each exceed positions + 1 = {self.positions + 1}")
        if self.threads < 0:
            raise ValueError(f"predictor_eval.threads must be >= 0 (0: torch's default), got {self.threads}")
        if self.overlap_ngram < 4:
            raise ValueError(f"predictor_eval.overlap_ngram must be >= 4, got {self.overlap_ngram}")
        if self.validation_offset is not None:
            span = max(self.lengths) + 1
            if abs(self.validation_offset - self.text_offset) < span:
                raise ValueError(f"predictor_eval.validation_offset {self.validation_offset}: its window of {span} tokens "
                                 f"overlaps the scored window at text_offset {self.text_offset}; allowed: offsets at least "
                                 f"{span} tokens away from it")
        for slug in self.policies:
            ckpt = POLICIES.get(slug, ({}, ""))[0].get("checkpoint")
            if ckpt is not None and resolve_checkpoint(ckpt) is None:
                how = "; ".join(checkpoint_commands(slug)) or "it is shipped with the repository"
                raise ValueError(f"predictor_eval.policies: {slug} needs the checkpoint {ckpt}, which does not exist "
                                 f"(made by: {how})")


def load_settings(path: str | None, overrides: dict | None = None) -> EvalSettings:
    return load_section_settings(path, overrides, "predictor_eval", EvalSettings, ("lengths", "policies"))


def runtime_config(settings: EvalSettings, slug: str, longest: int):
    """One policy's runtime config: the quality harness's small-host defaults, then `settings.runtime`."""
    cuda = torch.cuda.is_available()
    data: dict = {
        "kv_cache": {"dtype": settings.store_dtype, "max_sequences": 2, "cpu_capacity_tokens": longest + 512},
        "scheduler": {"placement": "fluxion" if cuda else "cpu_only", "cpu_workers": 1, "gpu_worker": cuda, "pin_cores": False},
        "profiling": {"enabled": True, "chrome_trace": False},
    }
    for section, values in (settings.runtime or {}).items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    # An oracle's plans come from its own planner; the section only makes a valid config.
    data["selection"] = {"name": "full"} if slug in ORACLES else dict(POLICIES[slug][0])
    return config_from_dict(data)


def evaluated_offset(settings: EvalSettings) -> int:
    """The first token of the evaluated window: the validation text's in a validation run, else the scored one."""
    return settings.text_offset if settings.validation_offset is None else settings.validation_offset


def describe(slug: str) -> str:
    return POLICIES[slug][1] if slug in POLICIES else f"oracle: exact tau {ORACLES[slug]:g} labels every step"


# ---------------------------------------------------------------------------- the predictor alone
# What a labels file must share with the checkpoint's record to count as a remake of it.
SPLIT_IDENTITY = ("rows", "features", "tau", "layers", "heads", "train_rows", "train_texts", "heldout_rows",
                  "heldout_texts")


def heldout_metrics(labels_path: str) -> dict:
    """The shipped checkpoint on the held-out texts of its labels file (checked by SHA-256)."""
    from predictor.model import load_checkpoint
    from predictor.train import describe_file, evaluate, load_labels, refit_budget_law

    ckpt_path = resolve_checkpoint(POLICIES["predicted"][0].get("checkpoint", DEFAULT_CHECKPOINT))
    ckpt = load_checkpoint(ckpt_path)
    path = Path(labels_path)
    if not path.is_file():
        raise FileNotFoundError(f"predictor_eval.labels: no labels file at {labels_path}; it is made by "
                                f"{ckpt.data.get('file', 'python -m predictor.labels')} (see predictor/labels.py)")
    digest = describe_file(str(path))["sha256"]
    recorded = str(ckpt.data.get("sha256"))
    labels = load_labels(path)
    remade = digest != recorded
    if remade:
        # The labels are not bit-reproducible across library versions (a file remade with its
        # command on another host differed in its digest), but the split is by text and set by the
        # labelling settings: the same texts, positions and split keep the held-out texts unseen
        # by the checkpoint. Anything else is another file.
        ours, theirs = labels.describe(), ckpt.data
        differ = [f"{key} {ours.get(key)} (checkpoint's: {theirs.get(key)})" for key in SPLIT_IDENTITY
                  if ours.get(key) != theirs.get(key)]
        if differ:
            raise ValueError(f"predictor_eval.labels: {labels_path} (sha256 {digest[:12]}) is not the file the "
                             f"checkpoint was trained on (sha256 {recorded[:12]}) nor a remake of it: "
                             + "; ".join(differ))
        log.warning("predictor_eval.labels: %s is a remake of the checkpoint's labels (sha256 %s, recorded %s): "
                    "same texts, rows and split; held-out metrics are on the remade labels",
                    labels_path, digest[:12], recorded[:12])
    trained = ckpt.training.get("settings", {})
    if trained.get("fit_block_sizes"):  # held out against the targets it was trained on
        labels = refit_budget_law(labels, trained["fit_block_sizes"], trained.get("fit_method", "least_squares"))
    ckpt.check_feature_names(labels.feature_names)
    out = evaluate(ckpt.model, labels.rows(labels.split == "heldout"), labels.rows(labels.split == "train"))
    out["heldout_texts"] = sorted(set(labels.text_id[labels.split == "heldout"].tolist()))
    out["labels_sha256"] = digest
    out["labels_remade"] = remade  # not the digest the checkpoint records: a remake with the same split
    out["checkpoint"] = str(POLICIES["predicted"][0].get("checkpoint", DEFAULT_CHECKPOINT))
    out["tau"] = ckpt.tau
    return out


# ---------------------------------------------------------------------------- the text
def labelled_ranges(labels_path: str) -> list[tuple[int, int]]:
    """Token ranges `[start, end)` of `predictor.labels.corpus_text` that the labels file's texts used."""
    from predictor.labels import LabelSettings

    with np.load(labels_path, allow_pickle=False) as z:
        text_id, position = z["text_id"], z["position"]
    summary = Path(labels_path).with_suffix(".json")
    lengths = json.loads(summary.read_text())["settings"]["lengths"] if summary.is_file() else LabelSettings().lengths
    chunk = max(lengths)  # a text is chunk `text_id`; its positions count from the chunk's start
    return [(int(t) * chunk, int(t) * chunk + int(position[text_id == t].max()) + 1) for t in np.unique(text_id)]


def _ngrams(ids: np.ndarray, n: int) -> set:
    if ids.size < n:
        return set()
    return set(map(bytes, np.lib.stride_tricks.sliding_window_view(ids.astype(np.int64), n)))


def training_overlap(window: np.ndarray, labelled: np.ndarray, ranges: list[tuple[int, int]], n: int) -> float:
    """Fraction of the window's `n`-grams that occur in any labelled range of `labelled` (token ids)."""
    seen: set = set()
    for a, b in ranges:
        seen |= _ngrams(labelled[a:b], n)
    grams = _ngrams(window, n)
    return len(grams & seen) / max(1, len(grams))


def labelled_text(settings: EvalSettings, labelled: np.ndarray) -> tuple[list[tuple[int, int]], list[dict]]:
    """The corpus ranges every checkpoint of the evaluation was trained on, and where each came from.

    Every labels file is read when present; when absent its ranges are recomputed from the labels
    command that made it (`predictor.labels.text_ranges`: texts and positions do not depend on tau
    or the criterion), so the evaluation does not need 18-35 CPU-minutes per file: a sweep or
    ablation checkpoint's from `LABEL_FLAGS`, the shipped checkpoint's (`settings.labels`, when it
    is the file that checkpoint names) from `SHIPPED_LABEL_FLAGS`. A scored run still reads the
    shipped checkpoint's file for the held-out metrics (`heldout_metrics`)."""
    from predictor.labels import text_ranges
    from predictor.model import load_checkpoint

    if Path(settings.labels).is_file():
        ranges: set = set(labelled_ranges(settings.labels))
        sources = [{"labels": settings.labels, "ranges_from": "file"}]
    elif settings.labels == load_checkpoint(resolve_checkpoint(DEFAULT_CHECKPOINT)).data.get("file"):
        shipped = label_settings("predicted", SHIPPED_LABEL_FLAGS)
        ranges = set(text_ranges(torch.as_tensor(labelled), shipped))
        args = " ".join(f"{k} {v}" for k, v in label_arguments("predicted", SHIPPED_LABEL_FLAGS).items())
        sources = [{"labels": settings.labels, "ranges_from": f"python -m predictor.labels --out {settings.labels} {args}"}]
    else:
        raise FileNotFoundError(f"predictor_eval.labels: no labels file at {settings.labels}, and it is not the file "
                                f"the shipped checkpoint names, whose texts could be recomputed; allowed: an existing "
                                f"labels file or the shipped checkpoint's")
    seen = {settings.labels}
    for slug in settings.policies:
        section = POLICIES.get(slug, ({}, ""))[0]
        if section.get("name") != "predicted":
            continue
        ckpt = section.get("checkpoint", DEFAULT_CHECKPOINT)
        data = load_checkpoint(resolve_checkpoint(ckpt)).data.get("file")
        if data is None:
            raise ValueError(f"{ckpt} does not record its labels file; the evaluation cannot check its texts")
        if data in seen:
            continue
        seen.add(data)
        if Path(data).is_file():
            ranges.update(labelled_ranges(data))
            sources.append({"labels": data, "ranges_from": "file"})
        elif slug in LABEL_FLAGS:
            ranges.update(text_ranges(torch.as_tensor(labelled), label_settings(slug)))
            sources.append({"labels": data, "ranges_from": checkpoint_commands(slug)[0]})
        else:
            raise FileNotFoundError(f"{ckpt} was trained on {data}, which is not here and was not made by a known "
                                    "labels command; the evaluation needs it to check that its text is not one the "
                                    "predictor was trained on")
    return sorted(ranges), sources


def check_text(tokenizer: Any, corpus: torch.Tensor, settings: EvalSettings) -> dict:
    """Novelty and training overlap of the evaluation window; `UnusableTextError` naming passing offsets."""
    from hybrid_runtime.experiments.quality_text import UnusableTextError, check_novel, scored_repeat, text_window
    from predictor.labels import corpus_text as labels_corpus_text

    longest = max(settings.lengths)
    offset = evaluated_offset(settings)
    repeated = check_novel(corpus, settings.lengths, settings.positions, offset)
    labelled = tokenizer(labels_corpus_text(), add_special_tokens=False, return_tensors="np").input_ids[0]
    ranges, sources = labelled_text(settings, labelled)
    window = text_window(corpus, longest, offset)[0].numpy()
    overlap = training_overlap(window, labelled, ranges, settings.overlap_ngram)
    # A validation window only chooses among checkpoints trained on the same texts, so a shared
    # n-gram favours none of them: recorded, not refused (the scored window must share none).
    if overlap > 0 and settings.validation_offset is None:
        passing = []
        for off in range(0, corpus.shape[1] - longest - 1, 250):
            w = corpus[0, off : off + longest + 1].numpy()
            if training_overlap(w, labelled, ranges, settings.overlap_ngram) == 0 and all(
                    scored_repeat(corpus, n, settings.positions, off) < 0.05 for n in settings.lengths):
                passing.append(off)
                if len(passing) == 5:
                    break
        raise UnusableTextError(
            f"predictor_eval text at {offset}: {overlap:.2%} of the window's {settings.overlap_ngram}-grams "
            f"occur in the predictor's labelled texts (ranges {ranges}); allowed: none; offsets that pass: {passing}")
    return {"first_token": offset, "validation": settings.validation_offset is not None, "repeated_8gram": {str(n): r for n, r in repeated.items()},
            f"labelled_{settings.overlap_ngram}gram_overlap": overlap,
            "labelled_8gram_overlap": training_overlap(window, labelled, ranges, 8),
            "labelled_ranges": ranges, "label_files": sources}


# ---------------------------------------------------------------------------- plans of a predicted run
class PlanTally:
    """Per step and layer, what the predicted plans asked for (the planner's `on_selection` hook)."""

    def __init__(self) -> None:
        self.heads = self.heads_with_budget = self.groups = self.groups_with_task = 0
        self.budget_sum = 0.0
        self.block_sizes: dict[int, int] = {}

    def __call__(self, layer: int, seq_ids: list, selection: Any) -> None:
        budgets, has_task = selection.plan.budgets, selection.has_task
        self.heads += budgets.size
        self.heads_with_budget += int((budgets > 0).sum())
        self.budget_sum += float(budgets.sum())
        self.groups += has_task.size
        self.groups_with_task += int(has_task.sum())
        for blk, n in zip(*np.unique(selection.plan.block_size[has_task], return_counts=True)):
            self.block_sizes[int(blk)] = self.block_sizes.get(int(blk), 0) + int(n)

    def summary(self) -> dict:
        return {"heads_with_budget": self.heads_with_budget / max(1, self.heads),
                "groups_with_task": self.groups_with_task / max(1, self.groups),
                "mean_budget_of_budgeted_heads": self.budget_sum / max(1, self.heads_with_budget),
                "block_sizes": {str(k): v / max(1, self.groups_with_task) for k, v in sorted(self.block_sizes.items())}}


# ---------------------------------------------------------------------------- the run
def run_eval(model: Any, tokenizer: Any, settings: EvalSettings, progress: Progress = print) -> dict:
    from hybrid_runtime.experiments.quality_measure import compare_logits, reference_pass, step_bytes, teacher_forced
    from hybrid_runtime.experiments.quality_text import corpus_ids, text_window
    from hybrid_runtime.integrations.transformers import (
        cores_for_runtime,
        disable_hybrid_attention,
        enable_hybrid_attention,
        model_geometry,
    )
    from hybrid_runtime.experiments.oracle_plans import OraclePlanner
    from hybrid_runtime.runtime import HybridRuntime
    from predictor.model import load_checkpoint

    t_start = time.perf_counter()
    corpus = corpus_ids(tokenizer)
    text = check_text(tokenizer, corpus, settings)
    progress(f"{'validation ' if settings.validation_offset is not None else ''}text at {text['first_token']}: 8-gram repeat {text['repeated_8gram']}, "
             f"{text[f'labelled_{settings.overlap_ngram}gram_overlap']:.4f} of its {settings.overlap_ngram}-grams in the "
             f"predictor's labelled texts ({text['labelled_8gram_overlap']:.4f} of its 8-grams)")
    heldout: dict = {}
    if settings.validation_offset is None:
        heldout = heldout_metrics(settings.labels)
        progress(f"held out: streaming accuracy {heldout['streaming_accuracy']:.3f}, bgt0 MAE {heldout['bgt0_mae']:.4f}, "
                 f"k MAE {heldout['k_mae']:.4f}")
    checkpoints = {}
    for slug in settings.policies:
        if slug in ORACLES:
            continue
        ckpt = POLICIES[slug][0].get("checkpoint", POLICIES["predicted"][0].get("checkpoint"))
        if POLICIES[slug][0]["name"] == "predicted":
            c = load_checkpoint(resolve_checkpoint(ckpt or DEFAULT_CHECKPOINT))
            checkpoints[slug] = {"checkpoint": ckpt or DEFAULT_CHECKPOINT, "tau": c.tau,
                                 "heldout": c.metrics.get("heldout", {}), "data": c.data}
    if settings.threads:
        torch.set_num_threads(settings.threads)
    n = settings.positions
    longest = max(settings.lengths)
    results: dict = {"settings": dataclasses.asdict(settings), "text": text, "heldout": heldout,
                     "checkpoints": checkpoints, "lengths": {}}
    for length in settings.lengths:
        prompt_len = length - n
        ids = text_window(corpus, length, text["first_token"])
        targets = ids[0, prompt_len + 1 : length + 1]
        t0 = time.perf_counter()
        # One more position than scored: the prompt's last query, which predicted policies prefill with.
        ref = reference_pass(model, ids[:, :length].to(model.device), n + 1)
        last_queries = [q[0] for q in ref["q"]]
        ref_logits = ref["logits"][1:]
        dense_ppl = compare_logits(ref_logits, ref_logits, targets)["ppl"]
        entry: dict = {"prompt_tokens": prompt_len, "positions": n, "dense": {"ppl": dense_ppl,
                       "seconds": time.perf_counter() - t0}, "policies": {}}
        progress(f"{length}: dense reference in {entry['dense']['seconds']:.0f} s, ppl {dense_ppl:.3f}")
        for slug in settings.policies:
            t0 = time.perf_counter()
            cfg = runtime_config(settings, slug, longest)
            own = None
            if slug in ORACLES:
                geometry = model_geometry(model)
                own = HybridRuntime(dataclasses.replace(cfg, geometry=geometry), geometry, head_planner=None)
                own.planner = OraclePlanner(own.store, ORACLES[slug], cfg.selection.block_sizes)
            rt = enable_hybrid_attention(model, cfg, runtime=own)
            tally = None
            if slug in ORACLES or rt.cfg.selection.name == "predicted":
                tally = rt.planner.on_selection = PlanTally()
            try:
                with cores_for_runtime(rt):
                    logits, cpu_tokens = teacher_forced(model, ref, ids, prompt_len, n, last_queries=last_queries)
                nbytes = step_bytes(rt, n)
            finally:
                disable_hybrid_attention(model)
                if own is not None:
                    own.close()
            m = compare_logits(logits, ref_logits, targets)
            r = {**m, "bytes_per_step_counted": nbytes["counted"], "bytes_per_step_modeled": nbytes["modeled"],
                 "tasks_per_step": nbytes["tasks"], "cpu_tokens_per_layer": cpu_tokens,
                 "seconds": time.perf_counter() - t0}
            if tally is not None:
                r["plans"] = tally.summary()
            entry["policies"][slug] = r
            progress(f"{length} {slug}: agreement {m['agreement']:.3f}, KL {m['kl']:.4f}, ppl {m['ppl']:.3f}, "
                     f"{nbytes['counted'] / 1e6:.3f} MB/step counted ({nbytes['modeled'] / 1e6:.3f} modeled)"
                     + (f", heads with budget {r['plans']['heads_with_budget']:.2f}, groups with a task "
                        f"{r['plans']['groups_with_task']:.2f}, blocks {r['plans']['block_sizes']}" if tally else "")
                     + f", {r['seconds']:.0f} s")
        base = entry["policies"].get(BASELINE)
        for slug, r in entry["policies"].items():
            if base is not None and base["bytes_per_step_counted"] > 0:
                r[f"bytes_ratio_vs_{BASELINE}"] = r["bytes_per_step_counted"] / base["bytes_per_step_counted"]
        results["lengths"][str(length)] = entry
        del ref
    results["seconds"] = time.perf_counter() - t_start
    return results


# ---------------------------------------------------------------------------- reports
def metrics_of(results: dict) -> dict:
    """The results contract's metrics: held-out predictor figures and, per length and policy,
    agreement, KL, perplexity, counted bytes per step and their ratio to fixed (16, 0.05)."""
    h = results["heldout"]
    out = {"streaming_accuracy": h["streaming_accuracy"], "bgt0_mae": h["bgt0_mae"], "k_mae": h["k_mae"]}
    for length, entry in results["lengths"].items():
        for slug, r in entry["policies"].items():
            out[f"agreement_{slug}_{length}"] = r["agreement"]
            out[f"kl_{slug}_{length}"] = r["kl"]
            out[f"ppl_{slug}_{length}"] = r["ppl"]
            out[f"bytes_per_step_{slug}_{length}"] = r["bytes_per_step_counted"]
            if f"bytes_ratio_vs_{BASELINE}" in r:
                out[f"bytes_ratio_{slug}_vs_{BASELINE}_{length}"] = r[f"bytes_ratio_vs_{BASELINE}"]
    return out


def markdown(results: dict) -> str:
    h, text = results["heldout"], results["text"]
    s = results["settings"]
    ngram = s["overlap_ngram"]
    lines = ["# SmolLM2-135M-Instruct: the predicted head-plan policy", ""]
    if "meta" in results:
        m = results["meta"]
        lines += [f"{m['device']}; commit {m['commit']}; {m['created']}", "", f"`{m['command']}`", ""]
    if text.get("validation"):
        lines += [f"**Validation run** (not the scored text at {s['text_offset']}): settings are chosen here.", ""]
    lines += [f"Text: corpus tokens from {text['first_token']}, {s['positions']} teacher-forced positions per length; "
              f"8-gram repeat of the scored part {text['repeated_8gram']}; "
              f"{text[f'labelled_{ngram}gram_overlap']:.4f} of its {ngram}-grams and "
              f"{text['labelled_8gram_overlap']:.4f} of its 8-grams occur in the predictor's labelled texts.", "",
              "## Predictor on held-out texts", "",
              "| checkpoint | tau | streaming accuracy | majority baseline | bgt0 MAE | k MAE |", "| --- | --- | --- | --- | --- | --- |"]
    if h:
        where = (f"recomputed here, on labels remade with their command (sha256 {h['labels_sha256'][:12]})"
                 if h.get("labels_remade") else "recomputed here")
        lines.append(f"| {Path(h.get('checkpoint', DEFAULT_CHECKPOINT)).name} ({where}) | {h.get('tau', 0.1):g} | "
                     f"{h['streaming_accuracy']:.3f} | {h['streaming_accuracy_majority_baseline']:.3f} | {h['bgt0_mae']:.4f} | "
                     f"{h['k_mae']:.4f} |")
    shown = set()
    for slug, c in results["checkpoints"].items():
        ho = c["heldout"]
        if ho and c["checkpoint"] not in shown:
            shown.add(c["checkpoint"])
            lines.append(f"| {Path(c['checkpoint']).name} | {c['tau']:g} | {ho.get('streaming_accuracy', float('nan')):.3f} | "
                         f"{ho.get('streaming_accuracy_majority_baseline', float('nan')):.3f} | "
                         f"{ho.get('bgt0_mae', float('nan')):.4f} | {ho.get('k_mae', float('nan')):.4f} |")
    for length, entry in results["lengths"].items():
        lines += ["", f"## {length} tokens (dense ppl {entry['dense']['ppl']:.3f})", "",
                  "| policy | agreement | KL | ppl | MB/step counted | MB/step modeled | bytes vs fixed (16, 0.05) "
                  "| heads with budget | groups with task | blocks (16/32/64/128) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for slug, r in entry["policies"].items():
            p = r.get("plans")
            blocks = "/".join(f"{p['block_sizes'].get(str(b), 0.0):.2f}" for b in (16, 32, 64, 128)) if p else "-"
            ratio = r.get(f"bytes_ratio_vs_{BASELINE}")
            lines.append(f"| {describe(slug)} | {r['agreement']:.3f} | {r['kl']:.4f} | {r['ppl']:.3f} | "
                         f"{r['bytes_per_step_counted'] / 1e6:.3f} | {r['bytes_per_step_modeled'] / 1e6:.3f} | "
                         + ("-" if ratio is None else f"{ratio:.3f}") + " | "
                         + (f"{p['heads_with_budget']:.2f} | {p['groups_with_task']:.2f} | {blocks} |" if p else "- | - | - |"))
    lines += ["", "## Target: agreement at least fixed (16, 0.05)'s at no more than half its bytes", ""]
    for length, entry in results["lengths"].items():
        pol = entry["policies"]
        for slug in (x for x in pol if x.startswith(("predicted", "oracle")) and BASELINE in pol):
            r, base = pol[slug], pol[BASELINE]
            ratio = r.get(f"bytes_ratio_vs_{BASELINE}", float("nan"))
            met = r["agreement"] >= base["agreement"] and ratio <= 0.5
            lines.append(f"- {length}, {slug}: agreement {r['agreement']:.3f} vs {base['agreement']:.3f} "
                         f"({r['agreement'] - base['agreement']:+.3f}), bytes {ratio:.3f}x: {'met' if met else 'missed'}")
    lines += ["", "Groups: " + "; ".join(f"{g}: {', '.join(v)}" for g, v in GROUPS.items()), ""]
    return "\n".join(lines)


def write_outputs(results: dict, out: Path, results_dir: Path | None, command: str) -> list[Path]:
    if results_dir is not None and results["text"].get("validation"):
        raise ValueError("a validation run (validation_offset) is not a result: leave out --results-dir")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if results_dir is not None:
        points = [{"length": int(n), "policy": slug, **r} for n, e in results["lengths"].items()
                  for slug, r in e["policies"].items()]
        extra = {"command": command, "settings": results["settings"], "text": results["text"],
                 "heldout": results["heldout"], "checkpoints": results["checkpoints"]}
        final = write_results("predictor_smollm2", metrics_of(results), points,
                              out_path=results_dir / f"predictor_smollm2-{device_kind_slug()}.json", extra=extra)
        record = json.loads(final.read_text())
        results["meta"] = {k: record[k] for k in ("device", "commit", "command", "created")}
        final.with_suffix(".md").write_text(markdown(results))
        written += [final, final.with_suffix(".md")]
    (out / "predictor_eval.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    (out / "predictor_eval.md").write_text(markdown(results))
    return written + [out / "predictor_eval.json", out / "predictor_eval.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.predictor_eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for predictor_eval.json and .md")
    parser.add_argument("--config", help="YAML with `predictor_eval:` and `runtime:` sections")
    parser.add_argument("--results-dir", help="also write predictor_smollm2-<device>.json here (benchmarks/results)")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--positions", type=int)
    parser.add_argument("--text-offset", type=int)
    parser.add_argument("--policies", nargs="+", choices=[*POLICIES, *ORACLES])
    parser.add_argument("--threads", type=int, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--validation-offset", type=int,
                        help="a validation run on the window at this corpus offset (disjoint from the scored one): "
                             "for choosing settings; no held-out metrics, no --results-dir")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, {"lengths": args.lengths, "positions": args.positions,
                                               "text_offset": args.text_offset, "policies": args.policies,
                                               "validation_offset": args.validation_offset, "threads": args.threads})
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if settings.validation_offset is not None and args.results_dir:
        print("error: a validation run (--validation-offset) is not a result: leave out --results-dir", file=sys.stderr)
        return 2
    return run_and_write("hybrid_runtime.experiments.predictor_eval", argv, settings,
                         lambda model, tok: run_eval(model, tok, settings, timestamped_progress),
                         write_outputs, args.out, args.results_dir, errors=(FileNotFoundError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
