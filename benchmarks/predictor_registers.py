"""Registers and spills of the fused predictor's kernels, compiled offline for the H100 (sm_90).

No GPU needed: Triton compiles the two kernels of `gpu_kernels.head_predictor` for `cuda:90` with
its bundled ptxas at the Llama-3.1-8B head geometry (32 q heads, 8 KV heads, D 128, the runtime's
statistics layout, a 41-256-256-128-3 network) and prints, per kernel, the registers per thread,
the bytes spilled, the shared memory, the warps and, for the features kernel, its programs at
(8 sequences) and how many fit on one SM by registers (65,536 per SM, 132 SMs). Pointer
alignment is declared as the runtime's buffers have it (16 bytes; the queries' pointer is not
specialised, as in `run`).

    python benchmarks/predictor_registers.py [--parts 4] [--block-w 32] [--warps 4] [--precision split]
        [--predict-warps 4] [--predict-groups G] [--predict-block-n 32] [--predict-stages 3]
        [--features-stages 1] [--features-lean 1] [--features-pack 0] [--predict-out-width 32] [--q-by-ref]

Besides the resource usage it counts the SASS instructions (`cuobjdump -sass`): all of them, and
in the body of each loop (the code between a backward branch's target and the branch), with the
HMMA (tensor core) and BAR (barrier) instructions among them: the features kernel's first loop is
its window tile, the predict kernel's loops its layer pairs.

`--q-by-ref` compiles the kernels as the planner's graphs run them by default (the queries' address
read from a reference the host writes; `FusedHeadPredictor.run(q_ref=...)`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (the package would pick the interpreter without CUDA)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gpu_kernels import head_predictor as hp  # noqa: E402
from hybrid_runtime.config import config_from_dict  # noqa: E402
from hybrid_runtime.prefill_statistics import PrefillStatisticsCache  # noqa: E402
from predictor.features import FEATURE_NAMES  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM = 65536
SMS = 132
BATCH = 8

# Runtime argument types (pointers by name; ints and floats by name); the rest are constexprs.
POINTERS = {"q_ptr": "*bf16", "qref_ptr": "*i64", "idx_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16", "count_ptr": "*i32"}
FLOATS = {"layer_frac", "head_denom", "scale", "tau", "t_mean0", "t_std0", "t_mean1", "t_std1", "threshold"}
UNALIGNED = {"q_ptr"}  # do_not_specialize_on_alignment
SPECIALISED_INTS = {"stride_ks", "stride_kh", "stride_kn", "stats_width", "stride_idx"}  # multiples of 16 here


def plan(args) -> hp.FusedHeadPredictor:
    """The fused predictor at Llama heads, planned on the host (construction only, no launch)."""
    cfg = config_from_dict({"geometry": {"layers": 32, "q_heads": 32, "kv_heads": 8, "head_dim": 128},
                            "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512,
                                         "cpu_capacity_tokens": 1 << 16, "max_sequences": BATCH}})
    stats = PrefillStatisticsCache(cfg.geometry, cfg.kv_cache, 1, torch.device("cpu"), tau=0.1)
    widths = [41, 256, 256, 128, 3]
    linears = [(torch.zeros(o, i), torch.zeros(o)) for i, o in zip(widths[:-1], widths[1:])]
    interpreted = hp.interpreted
    hp.interpreted = lambda: True  # the constructor's device check: a plan on the CPU, never launched
    try:
        return hp.FusedHeadPredictor(
            q_heads=32, kv_heads=8, head_dim=128, max_sequences=BATCH, window_capacity=848,
            statistics_offsets=stats.field_offsets(), statistics_width=stats.width, feature_names=FEATURE_NAMES,
            linears=linears, feature_mean=torch.zeros(41), feature_std=torch.ones(41), target_mean=[0.0, 0.0],
            target_std=[1.0, 1.0], tau=0.1, block_sizes=(16, 32, 64, 128), streaming_threshold=0.5,
            skip_streaming=True, device="cpu", block_w=args.block_w, parts=args.parts, features_warps=args.warps,
            features_stages=args.features_stages,
            predict_warps=args.predict_warps, predict_groups=args.predict_groups, predict_block_n=args.predict_block_n,
            predict_stages=args.predict_stages, dot_precision=args.precision, features_lean=bool(args.features_lean),
            features_pack=bool(args.features_pack), predict_out_width=args.predict_out_width)
    finally:
        hp.interpreted = interpreted


def compile_kernel(fn, constexprs: dict, options: dict):
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*fp32")
            if name not in UNALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in SPECIALISED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=SM90, options=dict(options))


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and bytes spilled (stores to local memory), from the bundled cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    if regs is None:
        raise RuntimeError(f"no register count in cuobjdump's output: {text[:500]}")
    return int(regs.group(1)), int(stack.group(1)) if stack else 0


def sass_counts(cubin: bytes) -> tuple[int, list[tuple[int, int, int]]]:
    """(instructions, [(instructions, HMMA, BAR) per loop body]) of the kernel's SASS; a loop body is
    the span from a backward branch's target to the branch (innermost spans as they appear)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    instrs = []  # (address, opcode line)
    for line in text.splitlines():
        hit = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if hit:
            instrs.append((int(hit.group(1), 16), hit.group(2)))
    loops = []
    for addr, op in instrs:
        branch = re.fullmatch(r"(?:@!?U?P\w+\s+)?BRA\S*\s+(?:\S+\s+)*?0x([0-9a-f]+)", op.strip())
        if branch and int(branch.group(1), 16) <= addr:  # a backward branch: the loop's body ends here
            body = [o for a, o in instrs if int(branch.group(1), 16) <= a <= addr]
            loops.append((len(body), sum("HMMA" in o for o in body),
                          sum(re.search(r"\bBAR\b", o) is not None for o in body)))
    return len(instrs), loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--block-w", type=int, default=32)
    ap.add_argument("--warps", type=int, default=4, help="warps of the features kernel")
    ap.add_argument("--precision", default="split", choices=hp.DOT_PRECISIONS)
    ap.add_argument("--features-lean", type=int, default=1, help="the tile's reductions merged (1) or one each (0)")
    ap.add_argument("--features-pack", type=int, default=0,
                    help="the queries' / weights' tf32 high and low parts packed into a dot's 16 rows (1)")
    ap.add_argument("--predict-out-width", type=int, default=32, help="padded columns of the network's 3 outputs")
    ap.add_argument("--predict-warps", type=int, default=4, help="warps of the predict kernel")
    ap.add_argument("--predict-groups", type=int, default=None, help="KV groups per predict program (default: 4 rows)")
    ap.add_argument("--predict-block-n", type=int, default=32, help="hidden columns per step of a layer pair")
    ap.add_argument("--predict-stages", type=int, default=3, help="pipeline stages of the weight tiles")
    ap.add_argument("--features-stages", type=int, default=1, help="pipeline stages of the features kernel's window tiles")
    ap.add_argument("--q-by-ref", action="store_true", help="the queries by reference (the planner's graphs)")
    args = ap.parse_args()
    fused = plan(args)
    feats, pred = ({**c, "DOT_PRECISION": args.precision} for c in fused._launch_constexprs[args.q_by_ref])
    for name, fn, consts, options, programs in (
            ("features", hp._features_kernel, feats, fused._features_options, BATCH * fused.kv_heads * fused.parts),
            ("predict", hp._predict_kernel, pred, fused._predict_options, BATCH * fused._n_j)):
        k = compile_kernel(fn, consts, options)
        warps = options["num_warps"]
        regs, spills = resource_usage(k.asm["cubin"])
        shared = k.metadata.shared
        per_sm = REGISTERS_PER_SM // (regs * 32 * warps)
        n_sass, loops = sass_counts(k.asm["cubin"])
        print(f"{name:8s}: {regs} registers/thread, {spills} bytes stack (spills), {shared} bytes shared, {warps} warps; "
              f"{programs} programs at B={BATCH}, <= {per_sm} per SM by registers ({per_sm * SMS} resident); "
              f"{n_sass} SASS instructions, loop bodies (instructions / HMMA / BAR): "
              + ", ".join(f"{n} / {mma} / {bar}" for n, mma, bar in loops), flush=True)
    scratch = fused._parts_scratch.numel() * 4 + fused._vk_q.numel() * 4 + fused._arrivals.numel() * 4
    print(f"parts {fused.parts}, block_w {args.block_w}, precision {args.precision}: features scratch "
          f"{scratch} bytes at max_sequences={BATCH} (records {fused._part_record * 4} bytes per part)")
    c = fused._predict_constexprs
    print(f"predict: {c['GROUPS']} KV group(s) per program ({c['BLOCK_M']} dot rows), hidden blocks "
          f"{[c[f'BN{i}'] for i in range(fused.n_linear // 2)]}, {fused._predict_options['num_stages']} stages; "
          f"packed weights {fused._w.numel() * 4} bytes")


if __name__ == "__main__":
    main()
