"""The text the quality experiment feeds the model: windows of a real corpus, checked for novelty,
and the passkey prompts.

A scored token that completes an 8-gram already in its context can be copied, which needs the
model to retrieve the earlier occurrence: perplexity falls towards 1 and sparse attention is
judged on copying rather than on language. A window whose scored part repeats its context for
`MAX_REPEATED_8GRAM` or more of its tokens is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: Windows whose scored tokens complete an already-seen 8-gram this often or more are refused.
MAX_REPEATED_8GRAM = 0.05
NGRAM = 8

# The classic passkey filler (Mohtashami & Jaggi, 2023) and question.
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
# Asking for the number only: with an answer prefix ("The pass key is") or without this request the
# 135M model often answers with a definition of "pass key" even at 1K tokens (tried at 1K and 2K).
PASSKEY_QUESTION = "\n\nWhat is the pass key? Answer with the number only."


class UnusableTextError(ValueError):
    """The settings select text the experiment cannot measure on: beyond the corpus, or a scored
    part that repeats its context."""


# ---------------------------------------------------------------------------- corpus
def corpus_text() -> str:
    """~460k characters of English: the distinct topics of `pydoc_data.topics`, in key order.

    Two keys (`if`, `else`) hold the same text; it appears once.
    """
    from pydoc_data import topics

    texts = dict.fromkeys(topics.topics[k] for k in sorted(topics.topics))
    return "\n\n".join(texts)


def corpus_ids(tokenizer: Any) -> torch.Tensor:
    """The corpus as token ids `[1, T]` (no special tokens)."""
    return tokenizer(corpus_text(), add_special_tokens=False, return_tensors="pt").input_ids


def text_window(corpus: torch.Tensor, length: int, offset: int) -> torch.Tensor:
    """Tokens `[1, length + 1]` of `corpus` from `offset`: `length` inputs and the last target."""
    if offset < 0 or offset + length + 1 > corpus.shape[1]:
        raise UnusableTextError(f"quality.text_offset {offset}: a window of {length} + 1 tokens must lie within the "
                         f"corpus's {corpus.shape[1]} tokens; allowed offsets 0 .. {corpus.shape[1] - length - 1}")
    return corpus[:, offset : offset + length + 1]


# ---------------------------------------------------------------------------- novelty
def repeated_fraction(ids: torch.Tensor | np.ndarray, first_target: int, n: int = NGRAM) -> float:
    """Fraction of the tokens `ids[first_target:]` that complete an `n`-gram already ending earlier in `ids`.

    Only tokens with `n - 1` predecessors are counted; NaN when none is.
    """
    toks = np.asarray(ids, dtype=np.int64).reshape(-1)
    if toks.size < n:
        return float("nan")
    grams = np.lib.stride_tricks.sliding_window_view(toks, n)  # row i ends at token i + n - 1
    _, first, inverse = np.unique(grams, axis=0, return_index=True, return_inverse=True)
    seen = first[inverse.reshape(-1)] < np.arange(grams.shape[0])
    scored = seen[max(first_target - (n - 1), 0):]
    return float(scored.mean()) if scored.size else float("nan")


def scored_repeat(corpus: torch.Tensor, length: int, positions: int, offset: int) -> float:
    """`repeated_fraction` of the scored tokens of the window of `length` at `offset`.

    The targets are the window's last `positions` tokens (the prompt is `length - positions`).
    """
    return repeated_fraction(text_window(corpus, length, offset), length - positions + 1)


def novel_offsets(corpus: torch.Tensor, lengths: tuple[int, ...], positions: int, step: int = 1000,
                  limit: int = 5) -> list[int]:
    """Up to `limit` offsets (multiples of `step`) at which every length's scored part is novel."""
    found = []
    for offset in range(0, corpus.shape[1] - max(lengths), step):
        if all(scored_repeat(corpus, n, positions, offset) < MAX_REPEATED_8GRAM for n in lengths):
            found.append(offset)
            if len(found) == limit:
                break
    return found


def check_novel(corpus: torch.Tensor, lengths: tuple[int, ...], positions: int, offset: int) -> dict[int, float]:
    """Per length, the repeat fraction of its scored part; `UnusableTextError` if any is >= the limit."""
    fractions = {n: scored_repeat(corpus, n, positions, offset) for n in lengths}
    bad = {n: f for n, f in fractions.items() if not f < MAX_REPEATED_8GRAM}
    if bad:
        where = ", ".join(f"length {n}: {f:.3f}" for n, f in bad.items())
        good = novel_offsets(corpus, lengths, positions)
        hint = (f"offsets where every length is below it: {', '.join(map(str, good))}" if good
                else "no offset (multiple of 1000) is below it for these lengths and positions")
        raise UnusableTextError(
            f"quality.text_offset {offset}: the scored {positions} tokens repeat an {NGRAM}-gram of their context "
            f"({where}); allowed: below {MAX_REPEATED_8GRAM} (copied text measures retrieval, not language); {hint}")
    return fractions


# ---------------------------------------------------------------------------- passkey
def passkey_prompt(tokenizer: Any, target_tokens: int, depth: float, key: int) -> torch.Tensor:
    """Chat-template prompt `[1, T]` of about `target_tokens` tokens with the key at `depth` of the filler."""
    def n_tokens(n_fill: int) -> int:
        return _passkey_ids(tokenizer, n_fill, depth, key).shape[1]

    per = len(tokenizer(PASSKEY_FILLER, add_special_tokens=False).input_ids)
    n_fill = max(1, (target_tokens - n_tokens(0)) // per)
    # The filler tokenizes almost additively; settle on the largest count that fits the target.
    while n_fill > 1 and n_tokens(n_fill) > target_tokens:
        n_fill -= 1
    return _passkey_ids(tokenizer, n_fill, depth, key)


def _passkey_ids(tokenizer: Any, n_fill: int, depth: float, key: int) -> torch.Tensor:
    at = int(round(depth * n_fill))
    body = PASSKEY_FILLER * at + PASSKEY_NEEDLE.format(key=key) + PASSKEY_FILLER * (n_fill - at)
    msgs = [{"role": "user", "content": PASSKEY_INTRO + body + PASSKEY_QUESTION}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def budget1_prompt(tokenizer: Any, corpus: torch.Tensor, n_tokens: int, offset: int) -> torch.Tensor:
    """A chat prompt `[1, T]` of about `n_tokens`: a corpus excerpt and a request to summarize it."""
    if offset + n_tokens > corpus.shape[1]:
        raise UnusableTextError(f"quality.budget1_prompt_tokens {n_tokens} from text_offset {offset} exceed the corpus's "
                         f"{corpus.shape[1]} tokens")
    doc = tokenizer.decode(corpus[0, offset : offset + n_tokens])
    msgs = [{"role": "user", "content": doc + "\n\nSummarize the text above."}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
