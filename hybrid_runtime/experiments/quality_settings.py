"""What the quality experiment measures: the policies it compares, its settings and their YAML.

The dense model (its own attention, no runtime) is the reference of every measurement and is
not a policy. Every policy runs through `HybridRuntime`; `runtime_full` is the runtime at
budget 1.0, which differs from dense by the bf16 store and the runtime's merge.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from hybrid_runtime.config import Config, config_from_dict

#: Policy slug -> `selection` section of the runtime config. A new policy is one entry here: every
#: measurement, metric name and table column iterates this table or `QualitySettings.policies`.
POLICIES: dict[str, dict] = {
    "runtime_full": {"name": "full"},
    "fixed16_005": {"name": "fixed", "block_size": 16, "budget": 0.05},
    "fixed16_002": {"name": "fixed", "block_size": 16, "budget": 0.02},
    "fixed32_005": {"name": "fixed", "block_size": 32, "budget": 0.05},
    "fixed32_002": {"name": "fixed", "block_size": 32, "budget": 0.02},
    "streaming": {"name": "streaming"},
}

#: The policy that `budget1_match` runs against dense `generate`.
BUDGET1_POLICY = "runtime_full"


@dataclass(frozen=True)
class QualitySettings:
    """What to measure. Lengths are total context at the last teacher-forced position."""

    lengths: tuple[int, ...] = (2048, 4096, 8192)
    positions: int = 256  # teacher-forced positions after the prompt
    error_positions: int = 0  # the first this many positions also measure Eq. 2; 0: all `positions`
    policies: tuple[str, ...] = tuple(POLICIES)
    model_dtype: str = "float32"
    store_dtype: str = "bf16"  # the KV store of the policies (bf16 is the runtime default)
    # First corpus token of every length's text. At 30000 no length's scored part repeats an 8-gram
    # of its context (measured: 0.000 at 2K, 4K and 8K with 256 positions); at 0 the 8K one is a
    # verbatim copy (the `augassign` topic repeats a section of `assignment`).
    text_offset: int = 30000
    passkey_lengths: tuple[int, ...] = (2048, 4096, 8192)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_new_tokens: int = 12  # "The pass key is 71532" is 9 tokens (digits are single tokens)
    passkey_seed: int = 0
    budget1_prompt_tokens: int = 2048
    budget1_new_tokens: int = 64
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    # Extra runtime config (kv_cache, scheduler, profiling sections); the selection is set per run.
    runtime: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ValueError(f"quality.policies: unknown {bad}; allowed: {', '.join(POLICIES)}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"quality.policies: {list(self.policies)} names a policy twice")
        if self.positions < 1:
            raise ValueError("quality.positions must be >= 1")
        for n in self.lengths:
            if n <= self.positions + 1:
                raise ValueError(f"quality.lengths: {n} must exceed positions + 1 = {self.positions + 1}")
        if self.error_positions > self.positions:
            raise ValueError("quality.error_positions must not exceed positions")
        if self.text_offset < 0:
            raise ValueError(f"quality.text_offset: {self.text_offset}; must be >= 0 (a token index of the corpus)")
        if self.store_dtype not in ("bf16", "fp32"):
            raise ValueError(f"quality.store_dtype: {self.store_dtype!r}; allowed: bf16, fp32")
        if not all(0.0 <= d <= 1.0 for d in self.passkey_depths):
            raise ValueError("quality.passkey_depths must lie in [0, 1]")

    @property
    def n_error(self) -> int:
        return self.error_positions or self.positions


def length_tag(n: int) -> str:
    """Metric suffix of a length: 2048 -> '2k', 8192 -> '8k', others as the number."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def runtime_config(settings: QualitySettings, policy: str, store_dtype: str | None = None) -> Config:
    """The runtime config of one policy: defaults suited to a small host, then `settings.runtime`."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: unknown; allowed: {', '.join(POLICIES)}")
    # One sequence is live at a time (each measurement releases its sequence before the next), so
    # the store is sized for the longest one, plus room for the chat template and chunk rounding:
    # zeroing a larger store costs seconds per policy on a small host.
    longest = max(max(settings.lengths or (0,)), max(settings.passkey_lengths or (0,)),
                  settings.budget1_prompt_tokens + settings.budget1_new_tokens)
    data: dict = {
        "kv_cache": {"dtype": store_dtype or settings.store_dtype, "max_sequences": 2,
                     "cpu_capacity_tokens": longest + 512},
        # One CPU worker beside the model's own threads; a GPU lane only where CUDA is (gpu_worker "auto").
        "scheduler": {"placement": "cpu_only" if not torch.cuda.is_available() else "fluxion",
                      "cpu_workers": 1, "pin_cores": False},
        "profiling": {"enabled": True, "chrome_trace": False},
    }
    for section, values in (settings.runtime or {}).items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    data["selection"] = dict(POLICIES[policy])
    return config_from_dict(data)


def load_section_settings(path: str | os.PathLike | None, overrides: dict | None, section: str, cls: type,
                          tuple_keys: tuple[str, ...]):
    """`cls` (a settings dataclass) from a YAML file's `section:` (and `runtime:` for the runtime
    config), with `overrides` (None values skipped) on top; unknown keys are refused by name."""
    data: dict = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(raw) - {section, "runtime"}
        if unknown:
            raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: {section}, runtime")
        data = dict(raw.get(section) or {})
        if raw.get("runtime"):
            data["runtime"] = raw["runtime"]
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    names = {f.name for f in dataclasses.fields(cls)}
    bad = set(data) - names
    if bad:
        raise ValueError(f"{section}: unknown keys {sorted(bad)}; allowed: {', '.join(sorted(names))}")
    for k in tuple_keys:
        if k in data:
            data[k] = tuple(data[k])
    return cls(**data)


def load_settings(path: str | os.PathLike | None, overrides: dict | None = None) -> QualitySettings:
    """Settings from a YAML file's `quality:` section (and `runtime:` for the runtime config)."""
    return load_section_settings(path, overrides, "quality", QualitySettings,
                                 ("lengths", "policies", "passkey_lengths", "passkey_depths"))


def timestamped_progress(msg: str) -> None:
    """The experiments' progress lines: wall-clock time, then the message."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_experiment_model(threads: int, model_dtype: str):
    """SmolLM2 (model, tokenizer) for an experiment, on CUDA where there is one; `threads` > 0 sets
    torch's intra-op threads first."""
    from hybrid_runtime.models import load_smollm2

    if threads:
        torch.set_num_threads(threads)
    return load_smollm2(dtype=model_dtype, device="cuda" if torch.cuda.is_available() else "cpu")


def run_and_write(module: str, argv: list[str] | None, settings: Any, run: Callable[[Any, Any], dict],
                  write: Callable[[dict, Path, Path | None, str], list[Path]], out: str, results_dir: str | None,
                  errors: tuple[type[BaseException], ...] = ()) -> int:
    """The second half of every quality experiment's `main`, after its settings validated: load the
    model, `run(model, tokenizer)`, and `write(results, out, results_dir, command)` with the command
    line that ran it. Returns the exit code: 2 (one `error:` line) for text the experiment cannot
    use or any of `errors`, else 0."""
    from hybrid_runtime.experiments.quality_text import UnusableTextError

    model, tok = load_experiment_model(settings.threads, settings.model_dtype)
    try:
        results = run(model, tok)
    except (UnusableTextError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = " ".join([f"python -m {module}", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    for p in write(results, Path(out), Path(results_dir) if results_dir else None, command):
        timestamped_progress(f"wrote {p}")
    return 0
