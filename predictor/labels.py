"""Offline labels for the head-property predictor: SmolLM2-135M on real text, exact budgets per head.

    python -m predictor.labels --out runs/predictor/smollm2_labels.npz
        [--lengths 2048,4096,8192] [--positions 8] [--texts 8] [--tau 0.1[,0.125,...]] [--criterion output] [--threads 1]

**Texts.** The corpus is `pydoc_data.topics` (every topic, in key order), cut into disjoint
chunks of `max(lengths)` tokens. For a chunk and a length `L` the prompt is its first
`P = L - span` tokens and the decode positions are `[P, L)`; the pair is used only when under
`max_repeat` (5%) of the tokens of `[P, L)` complete an 8-gram already seen before them (text
that repeats its context is copied by retrieval heads and says little about ordinary decoding).
One dense forward per chunk, up to its longest usable length, serves every length of it (the
model is causal, so the first `L` tokens of a longer forward are the forward of those `L`).

**Where the tokens live**, as in the runtime's KV store (sink 64, local 256, generated tokens
kept on the GPU while they fit `generated_cap`, 512 by default, so no spill within a 256-token
span): the window holds the first `sink` tokens and every token from `P - local` on; the CPU
segment is `[sink, P - local)` and is the same for every position of the pair, so the prefill
statistics of the prompt describe it exactly.

**Labels**, per sampled position `p`, layer and query head, from the model's own post-RoPE
q/K/V (fp32): the exact attention output `o` over `[0, p]`; for every `blk` in
`BLOCK_SIZES` the smallest budget `bgt(blk)` (fraction of the CPU segment, whole blocks; blocks
ranked by Quest min/max scores, exact top-k tokens for blk = 1) from which every larger budget
meets `||o(bgt, blk) - o|| / max_h' ||o_h'|| <= tau` (Fluxion Eq. 2, `h'` over the layer's
query heads at that position; `predictor.budget_search`), searched over every block count (for
blk = 1: every count up to 64 tokens, then steps of at most 5%); the least-squares fit
`bgt(blk) = bgt0 + k * log2(blk)`; `streaming` when the window alone meets `tau`. `--criterion`
replaces Eq. 2 by one of the ablation's criteria (`predictor.budget_criteria`). Features: `predictor.features`
from the prompt's prefill statistics (anchor = the prompt's last query), the window K/V and q.

**Saved** (`np.load`): `features` float32 [N, 41], `feature_names` str [41], `bgt0` float32 [N],
`k` float32 [N], `streaming` bool [N], `split` str [N] ("train"/"heldout", by text: the text
used second, sixth, ... i.e. `i % heldout_every == 1`), int32 [N] `text_id` (chunk index),
`layer`, `head`, `position` (token index in the chunk), scalar `tau`, and the smallest budgets
before the fit, `budgets` float32 [N, 5] at `budget_block_sizes` int32 [5] (1, 16, 32, 64, 128).
Several taus (`--tau 0.1,0.125`) are labelled in one pass, one file each (`--out` holds `{tau}`):
the forward passes and error curves are shared. The file is rewritten after
every text, so a partial dataset is usable while the build runs; a JSON summary (texts, repeat
fractions, label statistics, timings, the check against the model's own attention outputs) is
written beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from predictor.budget_criteria import CRITERIA, criterion_curve, prefix_mass
from predictor.budget_search import (
    BLOCK_SIZES,
    all_counts,
    block_bounds,
    error_curves,
    fit_budget_law,
    geometric_counts,
    smallest_budget,
)
from predictor.features import FEATURE_NAMES, compute_prefill_statistics, decode_features, window_attention

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LabelSettings:
    """What to label. Defaults: Fluxion's sink/local and tau, the quality harness's 256-token span."""

    lengths: tuple[int, ...] = (2048, 4096, 8192)
    positions: int = 8  # sampled decode positions per (text, length)
    texts: int = 8  # chunks used at most
    tau: float = 0.10
    span: int = 256  # decode positions after the prompt
    sink: int = 64
    local: int = 256
    max_repeat: float = 0.05  # largest 8-gram repeat fraction of a usable span
    heldout_every: int = 4  # the i-th text used is held out when i % heldout_every == 1
    seed: int = 0
    position_batch: int = 8  # positions labelled at once (memory: ~ batch x Hq x L x D floats)
    # What "good enough" means (predictor.budget_criteria): Eq. 2 (`output`, Fluxion's), the same
    # without the head-contribution term, or 95% of the attention score (`score95`, tau unused).
    criterion: str = "output"

    def __post_init__(self) -> None:
        if not self.lengths or sorted(set(self.lengths)) != list(self.lengths):
            raise ValueError(f"lengths must be distinct and ascending, got {self.lengths}")
        shortest_prompt = self.lengths[0] - self.span
        if shortest_prompt - self.local - self.sink < max(BLOCK_SIZES):
            raise ValueError(f"lengths: {self.lengths[0]} leaves a CPU segment of {shortest_prompt - self.local - self.sink} "
                             f"tokens; it must be >= {max(BLOCK_SIZES)} (length > span + sink + local + {max(BLOCK_SIZES)})")
        if not 1 <= self.positions <= self.span:
            raise ValueError(f"positions must be in [1, span={self.span}], got {self.positions}")
        if self.texts < 1 or self.heldout_every < 2 or self.position_batch < 1:
            raise ValueError("texts and position_batch must be >= 1 and heldout_every >= 2")
        if not 0.0 < self.tau:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if self.sink < 0 or self.local < 0 or self.span < 1:
            raise ValueError("sink and local must be >= 0 and span >= 1")
        if not 0.0 < self.max_repeat <= 1.0:
            raise ValueError(f"max_repeat must be in (0, 1], got {self.max_repeat}")
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion {self.criterion!r} is not one of {list(CRITERIA)}")


# ---------------------------------------------------------------------------- text
def corpus_text() -> str:
    """~465k characters of English: every topic of `pydoc_data.topics`, in key order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def repeated_fraction(ids: torch.Tensor, first: int, n: int = 8) -> float:
    """Fraction of the tokens `ids[first:]` that complete an `n`-gram already seen earlier in `ids`."""
    toks = ids.reshape(-1).tolist()
    seen: set = set()
    hits = total = 0
    for j in range(n - 1, len(toks)):
        gram = tuple(toks[j - n + 1 : j + 1])
        if j >= first:
            total += 1
            hits += gram in seen
        seen.add(gram)
    return hits / total if total else float("nan")


@dataclass(frozen=True)
class TextChoice:
    """One chunk of the corpus and the lengths whose decode span does not repeat its context."""

    text_id: int
    offset: int  # first token of the chunk in the corpus
    lengths: tuple[int, ...]
    repeat: dict  # length -> 8-gram repeat fraction of [L - span, L)
    split: str


def select_texts(ids: torch.Tensor, settings: LabelSettings) -> list[TextChoice]:
    """The first `settings.texts` chunks with at least one usable length, with their split."""
    chunk = max(settings.lengths)
    chosen: list[TextChoice] = []
    for text_id in range(ids.numel() // chunk):
        x = ids[text_id * chunk : (text_id + 1) * chunk]
        rep = {n: repeated_fraction(x[:n], n - settings.span) for n in settings.lengths}
        usable = tuple(n for n in settings.lengths if rep[n] < settings.max_repeat)
        if usable:
            split = "heldout" if len(chosen) % settings.heldout_every == 1 else "train"
            chosen.append(TextChoice(text_id, text_id * chunk, usable, rep, split))
        if len(chosen) == settings.texts:
            break
    return chosen


# ---------------------------------------------------------------------------- the model's own q/K/V
_CAPTURE_NAME = "predictor_labels_capture"
_capture_local = threading.local()


def _capture_forward(module, query, key, value, attention_mask, **kwargs):
    """sdpa, plus a copy of the layer's post-RoPE K/V and its queries and outputs at the recorded positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rec = getattr(_capture_local, "rec", None)
    if rec is not None:
        layer, pos = module.layer_idx, rec["positions"]
        rec["k"][layer] = key[0].transpose(0, 1).float().contiguous()  # [L, Hkv, D]
        rec["v"][layer] = value[0].transpose(0, 1).float().contiguous()
        rec["q"][layer] = query[0][:, pos].transpose(0, 1).float().contiguous()  # [n, Hq, D]
        rec["o"][layer] = out[0][pos].float().contiguous()  # out is [B, T, Hq, D]
    return out, weights


@contextlib.contextmanager
def _capturing(model: Any, positions: torch.Tensor) -> Iterator[dict]:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(_CAPTURE_NAME, _capture_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_CAPTURE_NAME, sdpa_mask)
    layers = model.config.num_hidden_layers
    rec = {"positions": positions, "k": [None] * layers, "v": [None] * layers, "q": [None] * layers, "o": [None] * layers}
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = _CAPTURE_NAME
    _capture_local.rec = rec
    try:
        yield rec
    finally:
        _capture_local.rec = None
        model.config._attn_implementation_internal = saved


@torch.no_grad()
def capture_qkv(model: Any, ids: torch.Tensor, positions: list[int]) -> dict:
    """Dense forward over `ids [T]`: per layer K/V `[T, Hkv, D]` and q/o `[n, Hq, D]` at `positions` (fp32)."""
    dev = next(model.parameters()).device
    pos = torch.tensor(sorted(set(positions)), device=dev)
    with _capturing(model, pos) as rec:
        model(input_ids=ids.view(1, -1).to(dev), use_cache=False, logits_to_keep=1)
    rec["index"] = {int(p): i for i, p in enumerate(pos.tolist())}
    return rec


# ---------------------------------------------------------------------------- labels of one (text, length)
def decode_positions(settings: LabelSettings, text_id: int, length: int) -> list[int]:
    """The sampled decode positions of a (text, length), ascending, in `[length - span, length)`."""
    rng = np.random.default_rng([settings.seed, text_id, length])
    first = length - settings.span
    return sorted(int(first + x) for x in rng.choice(settings.span, size=settings.positions, replace=False))


def text_ranges(ids: torch.Tensor, settings: LabelSettings) -> list[tuple[int, int]]:
    """Token ranges `[start, end)` of the corpus `ids` that a labels run with `settings` reads: each
    chosen text's chunk up to its last decode position. Computed without the model: the texts and
    positions depend on the corpus, lengths, span, texts, positions, max_repeat and seed only, never
    on tau or the criterion."""
    ranges = []
    for text in select_texts(ids, settings):
        last = max(max(decode_positions(settings, text.text_id, n)) for n in text.lengths)
        ranges.append((text.offset, text.offset + last + 1))
    return ranges


@torch.no_grad()
def label_layer(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, q_prev: torch.Tensor, q_anchor: torch.Tensor,
                positions: list[int], prompt_len: int, layer: int, n_layers: int, settings: LabelSettings
                ) -> dict[str, torch.Tensor]:
    """Labels and features of one layer at the decode `positions` of one (text, length).

    `k, v [T, Hkv, D]` (T > max(positions)): the sequence's keys/values; `q, q_prev [n, Hq, D]`: the
    queries at `positions` and at the positions before them; `q_anchor [Hq, D]`: the prompt's last
    query. Returns `features [n * Hq, F]`, `budgets [n * Hq, len(BLOCK_SIZES)]`, `streaming`,
    `o_full [n, Hq, D]` (rows position-major, then head).
    """
    return label_layer_taus(k, v, q, q_prev, q_anchor, positions, prompt_len, layer, n_layers, settings,
                            (settings.tau,))[0]


@torch.no_grad()
def label_layer_taus(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, q_prev: torch.Tensor, q_anchor: torch.Tensor,
                     positions: list[int], prompt_len: int, layer: int, n_layers: int, settings: LabelSettings,
                     taus: Sequence[float]) -> list[dict[str, torch.Tensor]]:
    """`label_layer` at several error bounds at once: one dict per tau of `taus`, in order.

    The error curves (the cost) are computed once; per tau only the budgets, the streaming flag
    and the features that depend on tau (the anchor budgets of the prefill statistics and the
    Gaussian budget estimate) are. `settings.tau` is not used.
    """
    sink, local = settings.sink, settings.local
    cpu_end = prompt_len - local
    dev = k.device
    k_cpu, v_cpu = k[sink:cpu_end], v[sink:cpu_end]
    n_cpu = k_cpu.shape[0]
    stats_of = [compute_prefill_statistics(k[:prompt_len], v[:prompt_len], q_anchor, sink=sink, local=local, tau=t)
                for t in taus]
    # The window buffer: sink rows, then every token from the prompt's local part on.
    win = torch.cat([torch.arange(sink, device=dev), torch.arange(cpu_end, max(positions) + 1, device=dev)])
    win_k, win_v = k[win].transpose(0, 1), v[win].transpose(0, 1)  # [Hkv, W, D]
    # Every block count for the runtime's block sizes; top-k tokens on a 5% grid (an exact curve
    # over every token count would cost a D-vector per token per position for one label column).
    counts = {blk: (geometric_counts(n_cpu, blk) if blk == 1 else all_counts(n_cpu, blk)).to(dev) for blk in BLOCK_SIZES}
    bounds = {blk: block_bounds(k_cpu, blk) for blk in BLOCK_SIZES if blk > 1}
    n, hq, _ = q.shape
    outs: list[dict[str, list]] = [{"features": [], "budgets": [], "streaming": [], "o_full": []} for _ in taus]
    for lo in range(0, n, settings.position_batch):
        hi = min(n, lo + settings.position_batch)
        b = hi - lo
        wl = torch.tensor([sink + p - cpu_end + 1 for p in positions[lo:hi]], device=dev)
        wk, wv = win_k.expand(b, -1, -1, -1), win_v.expand(b, -1, -1, -1)
        qb = q[lo:hi]
        out_w, lse_w = window_attention(qb, wk, wv, wl)
        errs, o_full = error_curves(qb, k_cpu, v_cpu, out_w, lse_w, counts, bounds=bounds)
        masses = ({blk: prefix_mass(qb, k_cpu, lse_w, blk)[..., counts[blk]] for blk in BLOCK_SIZES}
                  if settings.criterion == "score95" else {})  # mass at the same block counts as the error curves
        rows = torch.zeros(b, dtype=torch.long, device=dev)
        for tau, stats, out in zip(taus, stats_of, outs):
            if settings.criterion == "score95":
                curves = {blk: criterion_curve("score95", tau, mass=m) for blk, m in masses.items()}
            else:
                curves = {blk: criterion_curve(settings.criterion, tau, err=e, o_full=o_full) for blk, e in errs.items()}
            rel = {blk: c for blk, (c, _) in curves.items()}
            bound = curves[BLOCK_SIZES[0]][1]
            budgets = [smallest_budget(rel[blk], counts[blk], blk, n_cpu, bound) for blk in BLOCK_SIZES]
            out["streaming"].append((rel[BLOCK_SIZES[0]][..., 0] <= bound).reshape(-1))
            out["budgets"].append(torch.stack(budgets, -1).reshape(b * hq, -1))
            out["o_full"].append(o_full)
            out["features"].append(decode_features(stats.index(rows), qb, q_prev[lo:hi], wk, wv, wl, layer, n_layers))
    return [{key: torch.cat(val) for key, val in out.items()} for out in outs]


# ---------------------------------------------------------------------------- the dataset
def empty_columns() -> dict[str, list]:
    return {name: [] for name in ("features", "bgt0", "k", "streaming", "split", "text_id", "layer", "head",
                                  "position", "budgets")}


def assemble(cols: dict[str, list], tau: float) -> dict[str, np.ndarray]:
    """The saved arrays (the trainer's contract) from the accumulated columns."""
    if not cols["features"]:
        raise ValueError("no rows were labelled")
    return {
        "features": np.concatenate(cols["features"]).astype(np.float32),
        "feature_names": np.array(FEATURE_NAMES),
        "bgt0": np.concatenate(cols["bgt0"]).astype(np.float32),
        "k": np.concatenate(cols["k"]).astype(np.float32),
        "streaming": np.concatenate(cols["streaming"]).astype(bool),
        "split": np.concatenate(cols["split"]).astype(str),
        "text_id": np.concatenate(cols["text_id"]).astype(np.int32),
        "layer": np.concatenate(cols["layer"]).astype(np.int32),
        "head": np.concatenate(cols["head"]).astype(np.int32),
        "position": np.concatenate(cols["position"]).astype(np.int32),
        "tau": np.array(float(tau)),
        # The smallest budgets themselves, before the Eq. 1 fit (a trainer may refit over other block sizes).
        "budgets": np.concatenate(cols["budgets"]).astype(np.float32),
        "budget_block_sizes": np.array(BLOCK_SIZES, dtype=np.int32),
    }


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write atomically: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, path)


def label_statistics(arrays: dict[str, np.ndarray], budgets: np.ndarray) -> dict:
    """Fraction streaming, bgt0/k/budget distributions and the Eq. 1 fit's residual, per split and overall."""
    def dist(x: np.ndarray) -> dict:
        q = np.percentile(x, [1, 10, 50, 90, 99]) if x.size else [float("nan")] * 5
        return {"min": float(x.min()), "p1": float(q[0]), "p10": float(q[1]), "p50": float(q[2]), "p90": float(q[3]),
                "p99": float(q[4]), "max": float(x.max()), "mean": float(x.mean())} if x.size else {}

    x = np.log2(np.array(BLOCK_SIZES, dtype=np.float64))
    fit = arrays["bgt0"][:, None] + arrays["k"][:, None] * x[None]
    out = {"rows": int(arrays["bgt0"].size), "streaming_fraction": float(arrays["streaming"].mean()),
           "bgt0": dist(arrays["bgt0"]), "k": dist(arrays["k"]),
           "budget_mean": {str(b): float(budgets[:, i].mean()) for i, b in enumerate(BLOCK_SIZES)},
           "fit_residual_rms": float(np.sqrt(((fit - budgets) ** 2).mean())),
           "per_split": {}}
    for split in ("train", "heldout"):
        m = arrays["split"] == split
        out["per_split"][split] = {"rows": int(m.sum()), "texts": sorted(set(arrays["text_id"][m].tolist())),
                                   "streaming_fraction": float(arrays["streaming"][m].mean()) if m.any() else float("nan")}
    return out


@torch.no_grad()
def build(model: Any, corpus: torch.Tensor, settings: LabelSettings, out: Path | None = None,
          progress: Progress = print) -> tuple[dict[str, np.ndarray], dict]:
    """Label `settings.texts` chunks of `corpus [T]` (token ids); save to `out` after every text when given.

    Returns the arrays and a summary (texts, timings, label statistics).
    """
    return build_taus(model, corpus, [settings], None if out is None else [out], progress)[0]


@torch.no_grad()
def build_taus(model: Any, corpus: torch.Tensor, settings: Sequence[LabelSettings], outs: Sequence[Path] | None = None,
               progress: Progress = print) -> list[tuple[dict[str, np.ndarray], dict]]:
    """`build` for several settings that differ in `tau` only, in one pass: one labels file each.

    The forward passes and the error curves are shared; each file is what `build` with its
    settings would write. Returns `(arrays, summary)` per settings, in order.
    """
    if not settings:
        raise ValueError("no settings to label with")
    first = settings[0]
    others = [s for s in settings if dataclasses.replace(s, tau=first.tau) != first]
    if others:
        raise ValueError(f"settings labelled in one pass may differ in tau only; {others[0]} differs from {first} "
                         "in more")
    if len({s.tau for s in settings}) != len(settings):
        raise ValueError(f"taus {[s.tau for s in settings]} name one tau twice")
    if outs is not None and len(outs) != len(settings):
        raise ValueError(f"{len(outs)} output files for {len(settings)} settings")
    taus = [s.tau for s in settings]
    t_start = time.perf_counter()
    n_layers = model.config.num_hidden_layers
    texts = select_texts(corpus, first)
    if not texts:
        raise ValueError(f"no chunk of {max(first.lengths)} tokens has a decode span repeating under "
                         f"{first.max_repeat:.0%} of its 8-grams at lengths {first.lengths}")
    progress(f"{len(texts)} texts: " + "; ".join(
        f"{t.text_id} ({t.split}) " + ", ".join(f"{n}: {t.repeat[n]:.3f}" for n in first.lengths) for t in texts))
    cols = [empty_columns() for _ in taus]
    summaries: list[dict] = [{"settings": asdict(s), "texts": [], "block_sizes": list(BLOCK_SIZES)} for s in settings]
    max_o_dev = 0.0
    arrays: list[dict[str, np.ndarray]] = [{} for _ in taus]
    for text in texts:
        t0 = time.perf_counter()
        longest = max(text.lengths)
        plan = {n: decode_positions(first, text.text_id, n) for n in text.lengths}
        wanted = [p for n, ps in plan.items() for p in (*ps, *(x - 1 for x in ps), n - first.span - 1)]
        rec = capture_qkv(model, corpus[text.offset : text.offset + longest], wanted)
        t_forward = time.perf_counter() - t0
        for length, positions in plan.items():
            prompt_len = length - first.span
            at = rec["index"]
            for layer in range(n_layers):
                q = rec["q"][layer]
                results = label_layer_taus(rec["k"][layer], rec["v"][layer], q[[at[p] for p in positions]],
                                           q[[at[p - 1] for p in positions]], q[at[prompt_len - 1]], positions,
                                           prompt_len, layer, n_layers, first, taus)
                o_model = rec["o"][layer][[at[p] for p in positions]]
                o_full = results[0]["o_full"]
                dev = (o_full - o_model).norm(dim=-1).amax() / o_model.norm(dim=-1).amax().clamp_min(1e-30)
                max_o_dev = max(max_o_dev, float(dev))
                for res, col in zip(results, cols):
                    budgets = res["budgets"]
                    bgt0, kk = fit_budget_law(budgets)
                    rows = budgets.shape[0]
                    hq = rows // len(positions)
                    col["features"].append(res["features"].cpu().numpy())
                    col["budgets"].append(budgets.cpu().numpy())
                    col["bgt0"].append(bgt0.cpu().numpy())
                    col["k"].append(kk.cpu().numpy())
                    col["streaming"].append(res["streaming"].cpu().numpy())
                    col["split"].append(np.full(rows, text.split))
                    col["text_id"].append(np.full(rows, text.text_id))
                    col["layer"].append(np.full(rows, layer))
                    col["head"].append(np.tile(np.arange(hq), len(positions)))
                    col["position"].append(np.repeat(np.array(positions), hq))
        del rec
        for i, tau in enumerate(taus):
            arrays[i] = assemble(cols[i], tau)
            summaries[i]["texts"].append({"text_id": text.text_id, "offset": text.offset, "split": text.split,
                                          "lengths": list(text.lengths),
                                          "repeat_8gram": {str(n): r for n, r in text.repeat.items()},
                                          "seconds_forward": t_forward, "seconds": time.perf_counter() - t0})
            if outs is not None:
                save_npz(Path(outs[i]), arrays[i])
        progress(f"text {text.text_id} ({text.split}, lengths {list(text.lengths)}): forward {t_forward:.0f} s, "
                 f"labels {time.perf_counter() - t0 - t_forward:.0f} s; {arrays[0]['bgt0'].size} rows so far")
    if max_o_dev > 1e-3:
        raise RuntimeError(f"the labels' dense outputs differ from the model's own attention outputs by {max_o_dev:.2e} "
                           "of the largest head norm: the window or segment bookkeeping is wrong")
    for summary, arr in zip(summaries, arrays):
        summary["max_output_deviation_vs_model"] = max_o_dev
        summary["labels"] = label_statistics(arr, arr["budgets"])
        summary["seconds"] = time.perf_counter() - t_start
    return list(zip(arrays, summaries))


def output_paths(out: str, taus: Sequence[float]) -> list[Path]:
    """The labels file of each tau: `out` itself for one tau; for several, `out` must hold `{tau}`,
    replaced by each tau (`:g`), so that every file is named."""
    if len(taus) == 1 and "{tau}" not in out:
        return [Path(out)]
    if "{tau}" not in out:
        raise ValueError(f"--out {out!r}: with several taus it must contain {{tau}} (e.g. runs/labels_tau{{tau}}.npz)")
    paths = [Path(out.replace("{tau}", f"{t:g}")) for t in taus]
    if len(set(paths)) != len(paths):
        raise ValueError(f"--out {out!r} names one file for two taus: {[str(p) for p in paths]}")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m predictor.labels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the .npz to write (a .json summary goes beside it); with several "
                                                      "taus it must contain {tau}")
    parser.add_argument("--lengths", default="2048,4096,8192", help="context lengths, comma-separated (default 2048,4096,8192)")
    parser.add_argument("--positions", type=int, default=LabelSettings.positions, help="decode positions per (text, length)")
    parser.add_argument("--texts", type=int, default=LabelSettings.texts, help="chunks of the corpus used at most")
    parser.add_argument("--tau", default=str(LabelSettings.tau),
                        help="Eq. 2 error bound (default 0.1); several, comma-separated, label in one pass (one file each)")
    parser.add_argument("--span", type=int, default=LabelSettings.span, help="decode positions after each prompt")
    parser.add_argument("--seed", type=int, default=LabelSettings.seed)
    parser.add_argument("--criterion", choices=CRITERIA, default=LabelSettings.criterion,
                        help="budget criterion (default output: Fluxion's Eq. 2; see predictor.budget_criteria)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default; 1 is fastest on a host shared with other jobs)")
    args = parser.parse_args(argv)
    if args.threads < 0:
        parser.error(f"--threads must be >= 0, got {args.threads}")
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    try:
        taus = [float(x) for x in args.tau.split(",")]
    except ValueError:
        parser.error(f"--tau must be one or more comma-separated numbers, got {args.tau!r}")
    try:
        settings = [LabelSettings(lengths=lengths, positions=args.positions, texts=args.texts, tau=tau,
                                  span=args.span, seed=args.seed, criterion=args.criterion) for tau in taus]
        outs = output_paths(args.out, taus)
    except ValueError as e:
        parser.error(str(e))
    if any(out.suffix != ".npz" for out in outs):
        parser.error(f"--out must name a .npz file, got {args.out}")

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if args.threads:
        torch.set_num_threads(args.threads)
    # The one place predictor/ touches the runtime's package: the shipped model's loader.
    from hybrid_runtime.models import load_smollm2

    t0 = time.perf_counter()
    model, tok = load_smollm2(dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu")
    corpus = tok(corpus_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    progress(f"model and {corpus.numel()} corpus tokens loaded in {time.perf_counter() - t0:.0f} s")
    built = build_taus(model, corpus, settings, outs, progress)
    command = " ".join(["python -m predictor.labels", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    for out, (arrays, summary) in zip(outs, built):
        summary["command"] = command
        summary["seconds_with_model_load"] = time.perf_counter() - t0
        out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
        lab = summary["labels"]
        progress(f"wrote {out}: {lab['rows']} rows ({lab['per_split']['train']['rows']} train, "
                 f"{lab['per_split']['heldout']['rows']} heldout), streaming {lab['streaming_fraction']:.3f}, bgt0 "
                 f"p10/p50/p90 {lab['bgt0']['p10']:.3f}/{lab['bgt0']['p50']:.3f}/{lab['bgt0']['p90']:.3f}, k p10/p50/p90 "
                 f"{lab['k']['p10']:.4f}/{lab['k']['p50']:.4f}/{lab['k']['p90']:.4f}, "
                 f"{summary['seconds_with_model_load'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
