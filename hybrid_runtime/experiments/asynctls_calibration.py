"""Offline calibration of the AsyncTLS token index: which channels of each KV head it keeps.

    python -m hybrid_runtime.experiments.asynctls_calibration \\
        [--out hybrid_runtime/calibration/smollm2_channels.json] [--tokens 4096] [--text-offset 0]

One dense forward of SmolLM2-135M-Instruct over `--tokens` tokens of the quality corpus
(`pydoc_data.topics`) from `--text-offset`, capturing every layer's post-RoPE queries and keys
(the runtime stores post-RoPE keys). Per layer and KV head, Double Sparsity's channel importance
`score_i = mean_h max_t |q_h[i]| * max_t |k[i]|` (h over the group's query heads, t over the
tokens); the file ranks all channels by it, and the runtime's index keeps the first
`selection.index_channels` (16 at head dim 64, as AsyncTLS's 32 at 128).

The default text, corpus tokens 0..4095, lies before every window the quality experiments score
(they start at token 30000), so calibration never sees the evaluation text.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from hybrid_runtime.token_index import ChannelSets, channel_scores

DEFAULT_OUT = "hybrid_runtime/calibration/smollm2_channels.json"


@torch.no_grad()
def calibrate(model, tokenizer, tokens: int, text_offset: int) -> tuple[torch.Tensor, dict]:
    """Channel scores `[layers, Hkv, D]` of `model` over the corpus window, and what it ran on."""
    from hybrid_runtime.experiments.quality_measure import capture_attention
    from hybrid_runtime.experiments.quality_text import corpus_ids, text_window

    ids = text_window(corpus_ids(tokenizer), tokens, text_offset)[:, :tokens]
    with capture_attention(model, tokens) as rec:
        model(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=1)
    scores = torch.stack([
        channel_scores(q.abs().amax(0), k.abs().amax(0))  # q [T, Hq, D], k [T, Hkv, D]
        for q, k in zip(rec["q"], rec["k"])
    ]).cpu()
    return scores, {"text": "pydoc_data.topics (quality corpus)", "first_token": text_offset, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.asynctls_calibration",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"channel file to write (default {DEFAULT_OUT})")
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    parser.add_argument("--text-offset", type=int, default=0, help="first corpus token (default 0)")
    args = parser.parse_args(argv)
    if args.tokens < 16 or args.text_offset < 0:
        print("error: --tokens must be >= 16 and --text-offset >= 0", file=sys.stderr)
        return 2
    from hybrid_runtime.experiments.quality_settings import load_experiment_model
    from hybrid_runtime.experiments.quality_text import UnusableTextError

    t0 = time.perf_counter()
    model, tok = load_experiment_model(0, "float32")
    try:
        scores, calibration = calibrate(model, tok, args.tokens, args.text_offset)
    except UnusableTextError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    calibration["command"] = " ".join(["python -m hybrid_runtime.experiments.asynctls_calibration",
                                       *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    sets = ChannelSets.from_scores(scores, "smollm2-135m", calibration)
    path = sets.save(args.out)
    top = sets.channels(16)
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s: {sets.layers} layers x {sets.kv_heads} KV heads, "
          f"head dim {sets.head_dim}; layer 0 head 0 keeps channels {top[0, 0].tolist()} at d_c 16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
