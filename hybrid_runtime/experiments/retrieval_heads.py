"""Retrieval-head detection on SmolLM2-135M-Instruct (EvoSparse's offline step, after Wu et al.).

    python -m hybrid_runtime.experiments.retrieval_heads \\
        --out hybrid_runtime/calibration/smollm2_retrieval_heads.json

A needle -- a sentence with a random code -- is hidden at several depths of corpus text
(`quality_text.corpus_text`, chunks of `pydoc_data.topics`) in prompts of up to `lengths` tokens,
and the model is asked to repeat it. The answer is teacher-forced: the needle's own tokens follow
the chat template's assistant prompt, so every answer token `a_k` is a copy of needle token `n_k`.
A query head **hits** at answer token `a_k` when its top attention (argmax over every key of the
causal row predicting `a_k`) lands on a needle token equal to `a_k`; its **retrieval score** is
hits over the answer tokens the model copies itself (its top-1 prediction there is `a_k`, as
Wu et al. score heads only while the model retrieves correctly). Scores pool every trial.

The attention rows come from a capturing attention function (sdpa for the output, plus the
answer rows' argmax per head), so a 5,000-token prompt costs one forward and no `[T, T]` matrix.

Writes JSON: the model's geometry, the trials, and `heads`: one entry per (layer, query head)
with its score, highest first. `EvoSparseConfig.head_file` names such a file; its
`retrieval_threshold` picks the heads.
Exit codes: 0 success, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from hybrid_runtime.experiments.quality_settings import timestamped_progress

NEEDLE = "The secret code of the {color} {animal} is {code}. "
QUESTION = "\n\nWhat is the secret code of the {color} {animal}? Repeat the sentence that states it."
INTRO = "Read the text below. A sentence with a secret code is hidden in it; you will be asked for it.\n\n"
COLORS = ("red", "blue", "green", "golden", "silver", "purple", "orange", "white")
ANIMALS = ("fox", "owl", "whale", "tiger", "heron", "badger", "lynx", "otter")

_CAPTURE = "hybrid_runtime_retrieval_heads"
_local = threading.local()


def _capture_forward(module, query, key, value, attention_mask, **kwargs):
    """sdpa, plus each query head's argmax key over the answer rows `_local.rows` (causal)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rows = rec["rows"]  # [A] query positions
        hq, hkv = query.shape[1], key.shape[1]
        q = query[0, :, rows].float()  # [Hq, A, D]
        k = key[0].float().repeat_interleave(hq // hkv, dim=0)  # [Hq, T, D]
        s = q @ k.transpose(1, 2)  # [Hq, A, T]; the scale does not move the argmax
        causal = torch.arange(k.shape[1])[None, :] > rows[:, None]
        rec["argmax"][module.layer_idx] = s.masked_fill(causal[None], float("-inf")).argmax(-1)  # [Hq, A]
    return out, weights


@contextlib.contextmanager
def capture_argmax(model: Any, rows: torch.Tensor) -> Iterator[dict]:
    """Within the block, a forward of batch 1 records per layer the argmax key `[Hq, A]` of `rows`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(_CAPTURE, _capture_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_CAPTURE, sdpa_mask)
    rec = {"rows": rows, "argmax": [None] * model.config.num_hidden_layers}
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = _CAPTURE
    _local.rec = rec
    try:
        yield rec
    finally:
        _local.rec = None
        model.config._attn_implementation_internal = saved


def needle_trial(tokenizer: Any, corpus: torch.Tensor, length: int, depth: float, offset: int,
                 rng: np.random.Generator) -> dict:
    """Token ids of one trial: `prompt + answer` (`ids [1, T]`), the needle's span and the answer's start."""
    color, animal = COLORS[rng.integers(len(COLORS))], ANIMALS[rng.integers(len(ANIMALS))]
    code = "-".join(str(int(x)) for x in rng.integers(100, 1000, size=3))
    template = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], add_generation_prompt=True,
                                             tokenize=False)
    pre, post = template.split("\x00")

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    head = enc(pre + INTRO)
    needle = enc(NEEDLE.format(color=color, animal=animal, code=code))
    tail = enc(QUESTION.format(color=color, animal=animal) + post)
    n_fill = length - len(head) - len(tail) - 2 * len(needle)  # the answer repeats the needle
    if n_fill < 16:
        raise ValueError(f"retrieval_heads: length {length} leaves no room for filler text; allowed: >= "
                         f"{len(head) + len(tail) + 2 * len(needle) + 16}")
    filler = corpus[0, offset : offset + n_fill].tolist()
    at = int(round(depth * n_fill))
    prompt = head + filler[:at] + needle + filler[at:] + tail
    start = len(head) + at
    return {"ids": torch.tensor([prompt + needle]), "needle": (start, start + len(needle)), "answer": len(prompt),
            "code": code}


@torch.no_grad()
def score_trial(model: Any, trial: dict) -> tuple[np.ndarray, int, int]:
    """Hits `[layers, Hq]` of one trial, the answer tokens the model copied itself, and all answer tokens."""
    ids, (n0, n1), a0 = trial["ids"], trial["needle"], trial["answer"]
    answer = ids[0, a0:]
    rows = torch.arange(a0 - 1, ids.shape[1] - 1)  # the row predicting answer token k is a0 - 1 + k
    with capture_argmax(model, rows) as rec:
        out = model(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=len(rows) + 1)
    copied = out.logits[0, :-1].argmax(-1).cpu() == answer  # [A]
    hits = np.zeros((len(rec["argmax"]), rec["argmax"][0].shape[0]), dtype=np.int64)
    tokens = ids[0]
    for layer, am in enumerate(rec["argmax"]):
        am = am.cpu()
        hit = (am >= n0) & (am < n1) & (tokens[am] == answer[None, :]) & copied[None, :]  # [Hq, A]
        hits[layer] = hit.sum(-1).numpy()
    return hits, int(copied.sum()), len(answer)


def detect(model: Any, tokenizer: Any, lengths: list[int], depths: list[float], seed: int, text_offset: int,
           progress=timestamped_progress) -> dict:
    from hybrid_runtime.experiments.quality_text import corpus_ids

    corpus = corpus_ids(tokenizer)
    rng = np.random.default_rng(seed)
    cfg = model.config
    hits = np.zeros((cfg.num_hidden_layers, cfg.num_attention_heads), dtype=np.int64)
    copied_total, trials = 0, []
    for i, length in enumerate(lengths):
        for j, depth in enumerate(depths):
            offset = text_offset + (i * len(depths) + j) * 997  # different filler per trial
            t0 = time.perf_counter()
            trial = needle_trial(tokenizer, corpus, length, depth, offset, rng)
            h, copied, n_answer = score_trial(model, trial)
            hits += h
            copied_total += copied
            trials.append({"length": int(trial["ids"].shape[1]), "depth": depth, "code": trial["code"],
                           "needle_tokens": trial["needle"][1] - trial["needle"][0], "answer_tokens": n_answer,
                           "copied_tokens": copied, "seconds": time.perf_counter() - t0})
            progress(f"needle at {depth:.2f} of {trial['ids'].shape[1]} tokens: model copied {copied} of {n_answer} "
                     f"answer tokens; best head so far {hits.max() / max(1, copied_total):.3f} "
                     f"({time.perf_counter() - t0:.1f} s)")
    if copied_total == 0:
        raise ValueError("retrieval_heads: the model copied no answer token in any trial; no head can be scored")
    scores = hits / copied_total
    order = np.argsort(-scores, axis=None, kind="stable")
    heads = [{"layer": int(i // scores.shape[1]), "head": int(i % scores.shape[1]), "score": float(scores.flat[i])}
             for i in order]
    return {"model": "SmolLM2-135M-Instruct",
            "geometry": {"layers": cfg.num_hidden_layers, "q_heads": cfg.num_attention_heads,
                         "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.hidden_size // cfg.num_attention_heads},
            "method": "argmax attention on the needle token being copied, over answer tokens the model copies (Wu et "
                      "al.); teacher-forced answer = the needle sentence",
            "settings": {"lengths": lengths, "depths": depths, "seed": seed, "text_offset": text_offset},
            "copied_tokens": copied_total, "trials": trials, "heads": heads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.retrieval_heads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON head list to write")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 3000, 4000, 5000],
                        help="prompt + answer tokens of the trials (up to ~5000, as the paper's needles)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                        help="where the needle sits in the filler (fraction)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-offset", type=int, default=0,
                        help="first corpus token of the filler (the quality text starts at 30000)")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.lengths or min(args.lengths) < 128 or any(not 0.0 <= d <= 1.0 for d in args.depths):
        print("error: --lengths must be >= 128 tokens and --depths within [0, 1]", file=sys.stderr)
        return 2
    from hybrid_runtime.experiments.quality_settings import load_experiment_model

    model, tok = load_experiment_model(args.threads, "float32")
    try:
        result = detect(model, tok, args.lengths, args.depths, args.seed, args.text_offset)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["command"] = " ".join(["python -m hybrid_runtime.experiments.retrieval_heads",
                                  *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    top = ", ".join(f"L{h['layer']}H{h['head']} {h['score']:.3f}" for h in result["heads"][:8])
    timestamped_progress(f"wrote {out}: top heads {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
