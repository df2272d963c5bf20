"""Distil NOSA eviction heads for SmolLM2-135M with the model frozen, and write their checkpoint.

    python -m predictor.train_eviction_head --out predictor/checkpoints/smollm2_eviction.pt
        [--texts 7] [--length 4096] [--steps 1500] [--hidden 32] [--seed 0] [--threads 0]

**Data.** The first `texts` chunks of `length` tokens of the corpus (`pydoc_data.topics`, as
`predictor.labels` reads it); the last chunk is held out. They end before token 30000 of the
corpus, where the quality experiments' texts start. One dense forward per chunk captures, per
layer, the post-RoPE keys, the values and the queries of its last `span` (256) positions.

**Objective.** What NOSA's selection needs from the score is the ranking of CPU-resident tokens by
how much attention decode queries will give them. For a chunk whose last `span` positions are the
decode queries, the CPU-resident tokens are `[sink, P - local)` (`P = length - span`; sink 64,
local 256, the runtime's defaults). Per layer, KV head and such token `j`, the target is

    y_j = log(A_j + eps),  A_j = mean over the decode queries i and the group's heads h of
                                 a_{h,i,j} / sum_{j' in segment} a_{h,i,j'} * |segment|

(the attention token `j` receives, renormalised over the segment so that uniform attention is 1;
`eps` 0.05 keeps the many near-zero tokens from dominating the loss). Each head
`s_e = softplus(v W1) W2` regresses `y` from the token's value vector `v` alone (mean squared
error, Adam, minibatches of tokens), so the score is fixed once the token exists. Eq. 8's softmax
bias is not trained: the frozen model never attends with it.

**Report** (beside the checkpoint, `.json`): held-out loss, token-level Spearman correlation of
`s_e` with `A`, and the recall of the top quarter of 64-token blocks by `A` (pooled as the
executor pools: mean over 32-token sub-blocks every 16, max per block) among the top quarter by
`s_e` (0.25 for a random score), each averaged over layers and KV heads.
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

from predictor.eviction_head import EvictionHeads, save_eviction_heads
from predictor.labels import capture_qkv, corpus_text


@dataclass(frozen=True)
class EvictionSettings:
    texts: int = 7  # chunks of the corpus; the last is held out
    length: int = 4096
    span: int = 256  # decode queries at the end of each chunk
    sink: int = 64
    local: int = 256
    eps: float = 0.05
    hidden: int = 32
    steps: int = 1500
    batch_tokens: int = 4096  # tokens per (layer, KV head) per step
    lr: float = 3e-3
    seed: int = 0
    # Pooling of the block-recall metric (the executor's defaults).
    block_tokens: int = 64
    pool_kernel_tokens: int = 32
    pool_stride_tokens: int = 16

    def __post_init__(self) -> None:
        if self.texts < 2:
            raise ValueError(f"texts {self.texts}: at least 2 (one is held out)")
        if self.texts * self.length > 30000:
            raise ValueError(f"texts x length = {self.texts * self.length} tokens reach token 30000 of the corpus, where the "
                             "quality experiments' texts start; allowed: at most 30000")
        if self.length - self.span - self.local - self.sink < self.block_tokens:
            raise ValueError("length leaves no CPU-resident segment beside span, local and sink")


@torch.no_grad()
def capture_targets(model: Any, ids: torch.Tensor, st: EvictionSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: values `[L, Hkv, S, D]` and targets `A [L, Hkv, S]` of its CPU-resident segment of S tokens."""
    p = st.length - st.span
    rec = capture_qkv(model, ids, list(range(p, st.length)))
    lo, hi = st.sink, p - st.local
    vals, targets = [], []
    for layer in range(len(rec["k"])):
        k, v, q = rec["k"][layer], rec["v"][layer], rec["q"][layer]  # [T, Hkv, D], [n, Hq, D]
        hkv, d = k.shape[1], k.shape[2]
        g = q.shape[1] // hkv
        n = q.shape[0]
        qh = q.view(n, hkv, g, d)
        scores = torch.einsum("nhgd,thd->hgnt", qh, k) / d**0.5  # [Hkv, G, n, T]
        pos = torch.arange(p, st.length)
        causal = torch.arange(k.shape[0])[None, :] <= pos[:, None]  # [n, T]
        a = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)[..., lo:hi]  # the segment
        a = a / a.sum(-1, keepdim=True).clamp(min=1e-30) * (hi - lo)
        targets.append(a.mean(dim=(1, 2)))  # [Hkv, S]
        vals.append(v[lo:hi].transpose(0, 1))  # [Hkv, S, D]
    return torch.stack(vals), torch.stack(targets)


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Rank correlation along the last dimension."""
    rx = x.argsort(-1).argsort(-1).float()
    ry = y.argsort(-1).argsort(-1).float()
    rx, ry = rx - rx.mean(-1, keepdim=True), ry - ry.mean(-1, keepdim=True)
    return (rx * ry).sum(-1) / (rx.norm(dim=-1) * ry.norm(dim=-1)).clamp(min=1e-12)


def pooled_blocks(x: torch.Tensor, st: EvictionSettings) -> torch.Tensor:
    """Per-token scores `[..., S]` pooled per block as the executor pools (whole blocks only)."""
    nb = x.shape[-1] // st.block_tokens
    xb = x[..., : nb * st.block_tokens].reshape(*x.shape[:-1], nb, st.block_tokens)
    return xb.unfold(-1, st.pool_kernel_tokens, st.pool_stride_tokens).mean(-1).amax(-1)


def evaluate(heads: EvictionHeads, v: torch.Tensor, a: torch.Tensor, st: EvictionSettings) -> dict:
    """Held-out metrics of one chunk (`v [L, Hkv, S, D]`, `a [L, Hkv, S]`), means over layers and heads."""
    with torch.no_grad():
        s = heads.all_layers(v)
        loss = float(((s - torch.log(a + st.eps)) ** 2).mean())
        rho = spearman(s, a)
        bs, ba = pooled_blocks(s, st), pooled_blocks(a, st)
        top = max(1, ba.shape[-1] // 4)
        pick_s = torch.zeros_like(bs, dtype=torch.bool).scatter_(-1, bs.topk(top, -1).indices, True)
        pick_a = torch.zeros_like(ba, dtype=torch.bool).scatter_(-1, ba.topk(top, -1).indices, True)
        recall = (pick_s & pick_a).sum(-1).float() / top
    return {"loss": loss, "spearman_mean": float(rho.mean()), "spearman_min": float(rho.min()),
            "top_quarter_block_recall_mean": float(recall.mean()), "top_quarter_block_recall_min": float(recall.min()),
            "blocks_per_head": int(ba.shape[-1])}


def train(v: torch.Tensor, a: torch.Tensor, st: EvictionSettings, log: Any = print) -> EvictionHeads:
    """Fit heads to training data `v [L, Hkv, N, D]`, `a [L, Hkv, N]` (module docstring)."""
    torch.manual_seed(st.seed)
    layers, hkv, n, d = v.shape
    heads = EvictionHeads(layers, hkv, d, st.hidden)
    y = torch.log(a + st.eps)
    opt = torch.optim.Adam(heads.parameters(), lr=st.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, st.steps)
    gen = torch.Generator().manual_seed(st.seed)
    for i in range(st.steps):
        idx = torch.randint(0, n, (min(st.batch_tokens, n),), generator=gen)
        loss = ((heads.all_layers(v[:, :, idx]) - y[:, :, idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if i % 250 == 0 or i == st.steps - 1:
            log(f"step {i}: loss {float(loss):.4f}")
    return heads.eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m predictor.train_eviction_head", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the .pt to write (a .json report goes beside it)")
    defaults = EvictionSettings()
    for key in ("texts", "length", "steps", "hidden", "seed"):
        parser.add_argument(f"--{key}", type=int, default=getattr(defaults, key))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    try:
        st = EvictionSettings(texts=args.texts, length=args.length, steps=args.steps, hidden=args.hidden, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out)
    if out.suffix != ".pt":
        parser.error(f"--out must name a .pt file, got {out}")

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if args.threads:
        torch.set_num_threads(args.threads)
    from hybrid_runtime.models import load_smollm2  # the one place this touches the runtime's package

    t0 = time.perf_counter()
    model, tok = load_smollm2(dtype="float32", device="cpu")
    corpus = tok(corpus_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    data = []
    for i in range(st.texts):
        data.append(capture_targets(model, corpus[i * st.length : (i + 1) * st.length], st))
        progress(f"text {i}: tokens [{i * st.length}, {(i + 1) * st.length}) captured")
    t_capture = time.perf_counter() - t0
    v_train = torch.cat([x[0] for x in data[:-1]], 2)
    a_train = torch.cat([x[1] for x in data[:-1]], 2)
    heads = train(v_train, a_train, st, progress)
    held = evaluate(heads, *data[-1], st)
    train_metrics = evaluate(heads, data[0][0], data[0][1], st)
    progress(f"held-out: loss {held['loss']:.4f}, spearman {held['spearman_mean']:.3f}, top-quarter block recall "
             f"{held['top_quarter_block_recall_mean']:.3f} (0.25 at random)")
    info = {
        "command": " ".join(["python -m predictor.train_eviction_head", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
        "settings": asdict(st),
        "train_tokens": [0, (st.texts - 1) * st.length],
        "heldout_tokens": [(st.texts - 1) * st.length, st.texts * st.length],
        "heldout": held,
        "train_first_text": train_metrics,
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
