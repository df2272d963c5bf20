"""Distil NOSA eviction heads for SmolLM2-135M with the model frozen, and write their checkpoint.

    python -m predictor.train_eviction_head --out predictor/checkpoints/smollm2_eviction.pt
        [--source key|value] [--texts 20] [--long-texts 2] [--steps 800] [--hidden 32] [--seed 0]
        [--threads 0] [--capture-dir DIR]
    python -m predictor.train_eviction_head --evaluate CHECKPOINT --out REPORT.json [--capture-dir DIR]

**Data.** Windows of the quality experiments' corpus (`hybrid_runtime.experiments.quality_text`),
none overlapping their scored text (tokens `[30000, 38400)`: the offset 30000 plus the longest
context and its target) nor the held-out windows: `texts` windows of 4096 tokens on a grid of
4096 from token 0 and from token 38400, and `long_texts` of 8192 (so that keys at positions up to
8K are seen) on a grid of 16384 from the same two starts. Held out: 4096 tokens at 24576 and at
38400, and 8192 at 104000. One dense forward per window captures, per layer, the post-RoPE keys
and the values of its CPU-resident segment and the queries of its last `span` (256) positions;
`--capture-dir` keeps them (fp16, as used) so that another run reads them instead of the model.

**Objective.** What NOSA's selection needs from the score is the ranking of CPU-resident tokens by
how much attention decode queries will give them. For a window whose last `span` positions are the
decode queries, the CPU-resident tokens are `[sink, P - local)` (`P = length - span`; sink 64,
local 256, the runtime's defaults). Per layer, KV head and such token `j`, the target is

    y_j = log(A_j + eps),  A_j = mean over the decode queries i and the group's heads h of
                                 a_{h,i,j} / sum_{j' in segment} a_{h,i,j'} * |segment|

(the attention token `j` receives, renormalised over the segment so that uniform attention is 1;
`eps` 0.05 keeps the many near-zero tokens from dominating the loss). Each head
`s_e = softplus(x W1) W2` regresses `y` from the token's own vector `x` alone (mean squared error,
Adam, minibatches of tokens), so the score is fixed once the token exists. `x` is the post-RoPE
key by default (`--source key`); NOSA's head reads the value (`--source value`), which a model
trained with the head shapes to carry the score, but which in the frozen model predicts the
attention a token receives barely better than chance (benchmarks/notes/nosa.md, section 6).
Eq. 8's softmax bias is not trained: the frozen model never attends with it.

**Report** (beside the checkpoint, `.json`), per held-out window and their mean, each averaged over
layers and KV heads: held-out loss, token-level Spearman correlation of `s_e` with `A`, the recall
of the top quarter of 64-token blocks by `A` (pooled as the executor pools: mean over 32-token
sub-blocks every 16, max per block) among the top quarter by `s_e` (0.25 for a random score), and
a replay of the selection over the window's decode queries (`replay_selection`): NOSA's misses per
task-step at `k_q` 4 of a 10-block cache against the query-aware-only selector's, and the share of
the segment's attention the selected blocks hold.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from predictor.eviction_head import SOURCES, EvictionHeads, load_eviction_heads, save_eviction_heads

#: The quality experiments' scored text: offset 30000, the longest context (8192) and its target,
#: rounded up to the 4096-token grid's next start.
QUALITY_TEXT = (30000, 38400)


@dataclass(frozen=True)
class EvictionSettings:
    source: str = "key"  # what the heads read: "key" (post-RoPE) or "value" (NOSA's head)
    texts: int = 20  # training windows of `length` tokens
    long_texts: int = 2  # training windows of `long_length` tokens
    length: int = 4096
    long_length: int = 8192
    heldout: tuple[tuple[int, int], ...] = ((24576, 4096), (38400, 4096), (104000, 8192))  # (start, tokens)
    span: int = 256  # decode queries at the end of each window
    sink: int = 64
    local: int = 256
    eps: float = 0.05
    hidden: int = 32
    steps: int = 800
    batch_tokens: int = 4096  # tokens per (layer, KV head) per step
    lr: float = 3e-3
    seed: int = 0
    # Pooling of the block metrics (the executor's defaults) and the replayed selection.
    block_tokens: int = 64
    pool_kernel_tokens: int = 32
    pool_stride_tokens: int = 16
    replay_cache_blocks: int = 10  # the quality experiment's cache: k 16 blocks less 6 sink and window
    replay_query_aware_blocks: int = 4  # k_q / k = 0.25

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source {self.source!r}; allowed: {', '.join(SOURCES)}")
        if self.texts + self.long_texts < 1:
            raise ValueError("texts + long_texts: at least one training window")
        for n in (self.length, self.long_length):
            if n - self.span - self.local - self.sink < self.block_tokens:
                raise ValueError(f"a window of {n} tokens leaves no CPU-resident segment beside span, local and sink")
        for start, n in self.heldout:
            if overlaps((start, start + n), QUALITY_TEXT):
                raise ValueError(f"held-out window ({start}, {n}) overlaps the quality experiments' text {QUALITY_TEXT}")


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether token ranges `[a0, a1)` and `[b0, b1)` share a token."""
    return a[0] < b[1] and b[0] < a[1]


def training_windows(corpus_tokens: int, st: EvictionSettings) -> list[tuple[int, int]]:
    """The (start, tokens) training windows (module docstring): on grids of `length` and of
    `2 * long_length` from tokens 0 and `QUALITY_TEXT[1]`, skipping any that overlaps the quality
    text or a held-out window. ValueError when the corpus has fewer than asked for."""
    held = [(s, s + n) for s, n in st.heldout]
    out = []
    for n, step, want in ((st.length, st.length, st.texts), (st.long_length, 2 * st.long_length, st.long_texts)):
        starts = [*range(0, QUALITY_TEXT[0], step), *range(QUALITY_TEXT[1], corpus_tokens, step)]
        free = [s for s in starts if s + n <= corpus_tokens and not overlaps((s, s + n), QUALITY_TEXT)
                and not any(overlaps((s, s + n), h) for h in held)]
        if len(free) < want:
            raise ValueError(f"{want} windows of {n} tokens asked for; the corpus of {corpus_tokens} tokens has {len(free)} "
                             "outside the quality text and the held-out windows")
        out += [(s, n) for s in free[:want]]
    return out


@torch.no_grad()
def capture_window(model: Any, ids: torch.Tensor, st: EvictionSettings) -> dict:
    """One window `ids [T]`: fp16 keys, values `[L, Hkv, S, D]` of its CPU-resident segment (S
    tokens) and queries `[L, span, Hq, D]` of its last `span` positions (unscaled, post-RoPE)."""
    from predictor.labels import capture_qkv

    n = ids.shape[0]
    p = n - st.span
    rec = capture_qkv(model, ids, list(range(p, n)))
    lo, hi = st.sink, p - st.local
    layers = range(len(rec["k"]))
    return {"k": torch.stack([rec["k"][la][lo:hi].transpose(0, 1) for la in layers]).half(),
            "v": torch.stack([rec["v"][la][lo:hi].transpose(0, 1) for la in layers]).half(),
            "q": torch.stack([rec["q"][la] for la in layers]).half()}


def segment_attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention `[Hkv, G, n, S]` of queries `q [n, Hq, D]` (unscaled) over a segment's keys
    `k [Hkv, S, D]` alone: the full softmax renormalised over the segment (every decode query sees
    the whole segment)."""
    n, hq, d = q.shape
    hkv = k.shape[0]
    qh = q.float().view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3) / d**0.5
    return torch.softmax(torch.einsum("hgnd,hsd->hgns", qh, k.float()), -1)


def attention_targets(window: dict) -> torch.Tensor:
    """`A [L, Hkv, S]` of a captured window (module docstring), one layer at a time."""
    out = []
    for q, k in zip(window["q"], window["k"]):
        a = segment_attention(q, k)
        out.append(a.mean(dim=(1, 2)) * k.shape[1])
    return torch.stack(out)


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Rank correlation along the last dimension."""
    rx = x.argsort(-1).argsort(-1).float()
    ry = y.argsort(-1).argsort(-1).float()
    rx, ry = rx - rx.mean(-1, keepdim=True), ry - ry.mean(-1, keepdim=True)
    return (rx * ry).sum(-1) / (rx.norm(dim=-1) * ry.norm(dim=-1)).clamp(min=1e-12)


def sub_block_rows(x: torch.Tensor, st: EvictionSettings) -> torch.Tensor:
    """Rows `[..., S, F]` averaged over each whole block's sub-blocks: `[..., NB, sub-blocks per block, F]`."""
    nb = x.shape[-2] // st.block_tokens
    xb = x[..., : nb * st.block_tokens, :].reshape(*x.shape[:-2], nb, st.block_tokens, x.shape[-1])
    return xb.unfold(-2, st.pool_kernel_tokens, st.pool_stride_tokens).mean(-1)


def pooled_blocks(x: torch.Tensor, st: EvictionSettings) -> torch.Tensor:
    """Per-token scores `[..., S]` pooled per block as the executor pools (whole blocks only)."""
    return sub_block_rows(x[..., None], st)[..., 0].amax(-1)


def replay_selection(q: torch.Tensor, k: torch.Tensor, s_e_blocks: torch.Tensor, st: EvictionSettings) -> dict:
    """The NOSA selection of one layer's window replayed over its decode queries (the segment fixed).

    `q [n, Hq, D]` (unscaled), `k [Hkv, S, D]`, `s_e_blocks [Hkv, NB]` (pooled importance). Each
    step selects `replay_cache_blocks` blocks, `replay_query_aware_blocks` of them by the pooled
    query-aware score (`hybrid_runtime.nosa_selection`, as the executor does); the cache holds the
    last selection, so a step's misses are its selected blocks the step before did not select.
    Returns per (KV head) misses per step (the first excluded) of NOSA and of the query-aware-only
    selector (every block query-aware), and the share of the segment's attention each selection holds.
    """
    from hybrid_runtime.nosa_selection import query_aware_scores, select_blocks

    n, hq, d = q.shape
    hkv, _, _ = k.shape
    g = hq // hkv
    sub_keys = sub_block_rows(k.float(), st)  # [Hkv, NB, spb, D]
    nb, spb = sub_keys.shape[1], sub_keys.shape[2]
    qh = (q.float().view(n, hkv, g, d) / d**0.5).permute(1, 0, 2, 3).reshape(hkv * n, g, d)
    keys = sub_keys.reshape(hkv, 1, nb * spb, d).expand(hkv, n, -1, -1).reshape(hkv * n, nb * spb, d)
    valid = torch.ones(hkv * n, nb * spb, dtype=torch.bool)
    s_q = query_aware_scores(qh, keys, valid).view(hkv * n, nb, spb).amax(-1)
    block_valid = torch.ones(hkv * n, nb, dtype=torch.bool)
    s_e = s_e_blocks.float()[:, None, :].expand(hkv, n, nb).reshape(hkv * n, nb)
    c, c_q = min(st.replay_cache_blocks, nb), min(st.replay_query_aware_blocks, nb)
    mass = segment_attention(q, k).mean(1)  # [Hkv, n, S]: the group's mean attention
    block_mass = mass[..., : nb * st.block_tokens].reshape(hkv, n, nb, st.block_tokens).sum(-1)
    out = {}
    for name, (kq, score) in {"nosa": (c_q, s_e), "query_aware": (c, torch.zeros_like(s_e))}.items():
        selected, _ = select_blocks(s_q, score, block_valid, kq, c)
        picked = torch.zeros(hkv * n, nb, dtype=torch.bool).scatter_(1, selected, True).view(hkv, n, nb)
        out[f"misses_{name}"] = (picked[:, 1:] & ~picked[:, :-1]).sum(-1).float().mean(-1)  # [Hkv]
        out[f"mass_{name}"] = (block_mass * picked).sum(-1).mean(-1)
    return out


def evaluate(heads: EvictionHeads | None, window: dict, a: torch.Tensor, st: EvictionSettings,
             scores: torch.Tensor | None = None) -> dict:
    """Held-out metrics of one captured window and its targets `a [L, Hkv, S]`, means over layers and
    heads; of `heads`, or of given per-token `scores [L, Hkv, S]` (the references of `--evaluate`)."""
    with torch.no_grad():
        s = heads.all_layers(heads.pick(window["k"], window["v"])) if scores is None else scores
        loss = float(((s - torch.log(a + st.eps)) ** 2).mean())
        rho = spearman(s, a)
        bs, ba = pooled_blocks(s, st), pooled_blocks(a, st)
        top = max(1, ba.shape[-1] // 4)
        pick_s = torch.zeros_like(bs, dtype=torch.bool).scatter_(-1, bs.topk(top, -1).indices, True)
        pick_a = torch.zeros_like(ba, dtype=torch.bool).scatter_(-1, ba.topk(top, -1).indices, True)
        recall = (pick_s & pick_a).sum(-1).float() / top
        replay = [replay_selection(q, k, b, st) for q, k, b in zip(window["q"], window["k"], bs)]
        r = {key: torch.stack([x[key] for x in replay]) for key in replay[0]}  # [L, Hkv]
    return {"loss": loss, "spearman_mean": float(rho.mean()), "spearman_min": float(rho.min()),
            "top_quarter_block_recall_mean": float(recall.mean()), "top_quarter_block_recall_min": float(recall.min()),
            "blocks_per_head": int(ba.shape[-1]),
            "replay_misses_per_task_step_nosa": float(r["misses_nosa"].mean()),
            "replay_misses_per_task_step_query_aware": float(r["misses_query_aware"].mean()),
            "replay_miss_ratio": float(r["misses_nosa"].mean() / r["misses_query_aware"].mean().clamp(min=1e-12)),
            "replay_attention_share_nosa": float(r["mass_nosa"].mean()),
            "replay_attention_share_query_aware": float(r["mass_query_aware"].mean())}


def mean_metrics(per_window: dict[str, dict]) -> dict:
    """The mean over held-out windows of each metric (the minimum of the `_min` ones)."""
    rows = list(per_window.values())
    return {key: (min if key.endswith("_min") else lambda v: sum(v) / len(v))([r[key] for r in rows]) for key in rows[0]}


def train(x: torch.Tensor, a: torch.Tensor, st: EvictionSettings, log: Any = print) -> EvictionHeads:
    """Fit heads to training inputs `x [L, Hkv, N, D]` (keys or values, any float dtype) and targets
    `a [L, Hkv, N]` (module docstring)."""
    torch.manual_seed(st.seed)
    layers, hkv, n, d = x.shape
    heads = EvictionHeads(layers, hkv, d, st.hidden, st.source)
    y = torch.log(a + st.eps)
    opt = torch.optim.Adam(heads.parameters(), lr=st.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, st.steps)
    gen = torch.Generator().manual_seed(st.seed)
    for i in range(st.steps):
        idx = torch.randint(0, n, (min(st.batch_tokens, n),), generator=gen)
        loss = ((heads.all_layers(x[:, :, idx]) - y[:, :, idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if i % 100 == 0 or i == st.steps - 1:
            log(f"step {i}: loss {float(loss.detach()):.4f}")
    return heads.eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m predictor.train_eviction_head", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the .pt to write (a .json report goes beside it)")
    defaults = EvictionSettings()
    parser.add_argument("--source", choices=SOURCES, default=defaults.source)
    for key in ("texts", "long_texts", "steps", "hidden", "seed"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=getattr(defaults, key))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--evaluate", metavar="CHECKPOINT", help="only evaluate this checkpoint on the held-out "
                        "windows, beside two references: a seeded random score and the window's own attention "
                        "target log(A + eps) (what a perfect fit of the objective would score); writes the metrics to --out (.json)")
    parser.add_argument("--capture-dir", help="keep each window's capture here (w<start>_<tokens>.pt) and read it "
                        "back instead of running the model when present")
    args = parser.parse_args(argv)
    try:
        st = EvictionSettings(source=args.source, texts=args.texts, long_texts=args.long_texts, steps=args.steps,
                              hidden=args.hidden, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out)
    if out.suffix != (".json" if args.evaluate else ".pt"):
        parser.error(f"--out must name a {'.json' if args.evaluate else '.pt'} file, got {out}")

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if args.threads:
        torch.set_num_threads(args.threads)
    # The runtime's package: the model, and the corpus the quality experiments read (so that the
    # training text provably avoids theirs).
    from hybrid_runtime.experiments.quality_text import corpus_ids
    from hybrid_runtime.models import load_smollm2

    t0 = time.perf_counter()
    model, tok = load_smollm2(dtype="float32", device="cpu")
    corpus = corpus_ids(tok)[0]
    try:
        windows = training_windows(corpus.shape[0], st)
    except ValueError as e:
        parser.error(str(e))
    cache = Path(args.capture_dir) if args.capture_dir else None

    def captured(start: int, n: int) -> dict:
        path = cache / f"w{start}_{n}.pt" if cache else None
        if path is not None and path.exists():
            return torch.load(path, weights_only=True)
        window = capture_window(model, corpus[start : start + n], st)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(window, path)
        progress(f"window [{start}, {start + n}) captured")
        return window

    if args.evaluate:
        heads = load_eviction_heads(args.evaluate)
        report: dict = {"checkpoint": args.evaluate, "source": heads.source, "settings": asdict(st), "windows": {}}
        gen = torch.Generator().manual_seed(st.seed)
        for start, n in st.heldout:
            w = captured(start, n)
            a = attention_targets(w)
            report["windows"][f"{start}_{n}"] = {
                "heads": evaluate(heads, w, a, st),
                "random": evaluate(None, w, a, st, scores=torch.rand(a.shape, generator=gen)),
                "own_target": evaluate(None, w, a, st, scores=torch.log(a + st.eps)),
            }
            progress(f"[{start}, {start + n}): " + "; ".join(
                f"{name} recall {m['top_quarter_block_recall_mean']:.3f}, replayed miss ratio {m['replay_miss_ratio']:.3f}, "
                f"attention share {m['replay_attention_share_nosa']:.3f} (query-aware {m['replay_attention_share_query_aware']:.3f})"
                for name, m in report["windows"][f"{start}_{n}"].items()))
        report["mean"] = {name: mean_metrics({w: r[name] for w, r in report["windows"].items()})
                          for name in ("heads", "random", "own_target")}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {out}")
        return 0

    xs, ys = [], []
    for start, n in windows:
        w = captured(start, n)
        xs.append(w["k"] if st.source == "key" else w["v"])
        ys.append(attention_targets(w))
    t_capture = time.perf_counter() - t0
    progress(f"{len(windows)} training windows, {sum(x.shape[2] for x in xs)} tokens per (layer, KV head)")
    heads = train(torch.cat(xs, 2), torch.cat(ys, 2), st, progress)
    del xs, ys
    held = {}
    for start, n in st.heldout:
        w = captured(start, n)
        held[f"{start}_{n}"] = evaluate(heads, w, attention_targets(w), st)
        progress(f"held-out [{start}, {start + n}): " + ", ".join(f"{k} {v:.3f}" for k, v in held[f"{start}_{n}"].items()
                                                                  if k.startswith(("top_quarter_block_recall_mean", "replay_"))))
    heldout = mean_metrics(held)
    progress(f"held-out mean: spearman {heldout['spearman_mean']:.3f}, top-quarter block recall "
             f"{heldout['top_quarter_block_recall_mean']:.3f} (0.25 at random), replayed miss ratio "
             f"{heldout['replay_miss_ratio']:.3f}")
    info = {
        "command": " ".join(["python -m predictor.train_eviction_head", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
        "settings": asdict(st),
        "corpus": "hybrid_runtime.experiments.quality_text.corpus_text",
        "train_windows": windows,
        "heldout": heldout,
        "heldout_windows": held,
        "seconds_capture": t_capture,
        "seconds_total": time.perf_counter() - t0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_eviction_heads(heads, out, info)
    out.with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    progress(f"wrote {out} ({info['seconds_total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
