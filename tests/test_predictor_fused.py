"""The fused predictor kernels against the torch reference: features (`decode_features`), network
(`HeadPropertyNet.predict`) and selector (`DeviceSelector`) at small shapes (GQA groups of 1, 3 and
4, windows short of full, empty CPU segments, padding rows left alone) on `DEV` (compiled on CUDA,
under Triton's interpreter without it), and on CUDA (gpu-marked) at the Llama-3.1-8B head geometry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import gpu_kernels  # noqa: F401  (sets TRITON_INTERPRET without CUDA, before the kernel module)
from gpu_kernels import head_predictor
from gpu_kernels.head_predictor import FEATURE_COLUMNS, INDEX_ROWS, FusedHeadPredictor
from hybrid_runtime.config import config_from_dict
from hybrid_runtime.kvcache import KVStore
from hybrid_runtime.predicted_plans import PredictedHeadPlanner, network_linears
from hybrid_runtime.prefill_statistics import PrefillStatisticsCache
from hybrid_runtime.selector import GranularitySelector
from predictor.features import FEATURE_NAMES, decode_features
from predictor.model import Checkpoint, HeadPropertyNet
from tests.helpers import CUDA, DEV, random_kv


def random_network(hidden: tuple[int, ...], seed: int) -> HeadPropertyNet:
    """Random weights and a non-trivial standardisation (so every buffer matters)."""
    torch.manual_seed(seed)
    net = HeadPropertyNet(len(FEATURE_NAMES), hidden)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(256, len(FEATURE_NAMES), generator=gen) * 3 + 1
    net.set_standardisation(rows, torch.rand(256, generator=gen) * 0.3, torch.randn(256, generator=gen) * 0.02)
    with torch.no_grad():
        net.streaming_head.bias.fill_(0.2)  # p_streaming around 0.5: both kinds of heads occur
        net.bgt0_head.bias.fill_(1.0)
    return net.eval()


class Case:
    """A layer's statistics rows, previous queries and window for `max_sequences` slots, and one step."""

    def __init__(self, hkv: int, g: int, d: int, device: torch.device | str, *, window: int, prompts: list[int],
                 window_lens: list[int], slots: list[int], max_sequences: int, sink: int = 4, local: int = 16,
                 kv_dtype: torch.dtype = torch.float32, seed: int = 0):
        self.hq, self.hkv, self.d = hkv * g, hkv, d
        cfg = config_from_dict({"geometry": {"layers": 3, "q_heads": self.hq, "kv_heads": hkv, "head_dim": d},
                                "kv_cache": {"sink": sink, "local": local, "generated_cap": 16,
                                             "cpu_capacity_tokens": 4096, "max_sequences": max_sequences}})
        self.cache = PrefillStatisticsCache(cfg.geometry, cfg.kv_cache, 1, torch.device(device), tau=0.1)
        gen = torch.Generator().manual_seed(seed)
        for row, length in enumerate(prompts):
            k, v = random_kv(length, hkv, d, seed=seed + 10 * row)
            self.cache.store_prompt(0, row, k.to(device), v.to(device), torch.randn(self.hq, d, generator=gen).to(device))
        b = len(slots)
        self.slots = slots
        self.window_k = torch.randn(max_sequences, hkv, window, d, generator=gen).to(device, kv_dtype)
        self.window_v = torch.randn(max_sequences, hkv, window, d, generator=gen).to(device, kv_dtype)
        self.q = torch.randn(b, self.hq, d, generator=gen).to(device)
        prev = self.cache.previous_queries(0)
        prev[: len(prompts)] += 0.5 * torch.randn(len(prompts), self.hq, d, generator=gen).to(device)  # not the anchor
        self.prev_before = prev.clone()
        self.idx = torch.zeros(INDEX_ROWS, max_sequences, dtype=torch.int64)
        self.idx[0, :b] = torch.tensor(slots)
        self.idx[1, :b] = torch.tensor(slots)
        self.idx[2, :b] = torch.tensor(window_lens)
        n_cpu = self.cache.gather(0, torch.tensor(slots, device=device)).n_cpu
        self.idx[3, :b] = n_cpu.round().long().cpu()
        self.idx = self.idx.to(device)
        self.window_lens = torch.tensor(window_lens, device=device)

    def reference(self, layer: int, n_layers: int) -> torch.Tensor:
        rows = torch.tensor(self.slots, device=self.q.device)
        stats = self.cache.unpack(self.cache.layer_rows(0).index_select(0, rows))
        return decode_features(stats, self.q, self.prev_before.index_select(0, rows), self.window_k[rows],
                               self.window_v[rows], self.window_lens, layer, n_layers)


def fused_for(case: Case, net: HeadPropertyNet, max_sequences: int, block_sizes=(16, 32, 64, 128),
              skip_streaming: bool = True, window: int = 0) -> FusedHeadPredictor:
    return FusedHeadPredictor(
        q_heads=case.hq, kv_heads=case.hkv, head_dim=case.d, max_sequences=max_sequences,
        window_capacity=window or case.window_k.shape[2], statistics_offsets=case.cache.field_offsets(),
        statistics_width=case.cache.width, feature_names=FEATURE_NAMES, linears=network_linears(net),
        feature_mean=net.feature_mean, feature_std=net.feature_std, target_mean=net.target_mean.tolist(),
        target_std=net.target_std.tolist(), tau=0.1, block_sizes=block_sizes, streaming_threshold=0.5,
        skip_streaming=skip_streaming, device=case.q.device)


def queries_by_reference(q: torch.Tensor, grid_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`q`'s values in a strided view (rows and heads further apart than contiguous), a reference to
    it and a template of `grid_rows` rows (zero-stride, d elements): what `run(q_ref=...)` takes.
    Returns (template, reference, the view, to keep alive)."""
    b, hq, d = q.shape
    wide = torch.full((b, hq + 1, 2 * d), float("nan"), dtype=q.dtype, device=q.device)  # NaN: any stray read shows
    view = wide[:, 1:, d:]
    view.copy_(q)
    ref = torch.tensor([view.data_ptr(), view.stride(0), view.stride(1), b], dtype=torch.int64, device=q.device)
    template = torch.zeros(1, 1, d, dtype=q.dtype, device=q.device).expand(grid_rows, hq, d)
    return template, ref, view


def check_against_reference(case: Case, net: HeadPropertyNet, fused: FusedHeadPredictor, layer: int, n_layers: int,
                            tol: dict, block_sizes=(16, 32, 64, 128), skip_streaming: bool = True,
                            by_reference: bool = False) -> None:
    m, hq, hkv = fused.max_sequences, case.hq, case.hkv
    b = len(case.slots)
    out = torch.full((fused.out_size,), -7.0, device=case.q.device)
    prev = case.cache.previous_queries(0)
    if by_reference:  # the grid spans max_sequences rows; those past the batch must do nothing
        template, ref, kept = queries_by_reference(case.q, m)
        fused.run(template, case.idx, case.cache.layer_rows(0), prev, case.window_k, case.window_v,
                  layer / (n_layers - 1), out, q_ref=ref)
    else:
        fused.run(case.q, case.idx, case.cache.layer_rows(0), prev, case.window_k, case.window_v,
                  layer / (n_layers - 1), out)
    ref = case.reference(layer, n_layers)
    got = fused.features[: b * hq]
    for j, name in enumerate(FEATURE_NAMES):
        torch.testing.assert_close(got[:, j], ref[:, j], **tol, msg=lambda s, name=name: f"feature {name}: {s}")
    bgt0, k, p = net.to(case.q.device).predict(ref)
    n = m * hq
    torch.testing.assert_close(out[:b * hq], bgt0, **tol)
    torch.testing.assert_close(out[n : n + b * hq], k, **tol)
    torch.testing.assert_close(out[2 * n : 2 * n + b * hq], p, **tol)
    # The selector on the kernel's own predictions: the same choice, to the last bit of Eq. 3.
    sel = GranularitySelector(case.hq // case.hkv, case.d, 2, block_sizes).on_device(case.q.device)
    shape = (b, hq)
    blk, budgets, _ = sel(out[:b * hq].view(shape), out[n : n + b * hq].view(shape),
                          out[2 * n : 2 * n + b * hq].view(shape), case.idx[3, :b], skip_streaming)
    np.testing.assert_array_equal(out[4 * n : 4 * n + b * hkv].view(b, hkv).cpu().numpy(), blk.float().cpu().numpy())
    torch.testing.assert_close(out[3 * n : 3 * n + b * hq].view(shape), budgets, atol=1e-6, rtol=0)
    # Padding rows of the layout are left alone; the batch's previous queries are now this step's.
    assert (out[b * hq : n] == -7.0).all() and (out[4 * n + b * hkv :] == -7.0).all()
    rows = torch.tensor(case.slots, device=case.q.device)
    torch.testing.assert_close(prev.index_select(0, rows), case.q.float(), atol=0, rtol=0)
    others = [r for r in range(prev.shape[0]) if r not in case.slots]
    torch.testing.assert_close(prev[others], case.prev_before[others], atol=0, rtol=0)


INTERP_TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("hkv, g, d", [(2, 4, 32), (2, 3, 16), (3, 1, 16)])
def test_fused_kernels_match_the_reference(hkv, g, d):
    # Prompts: 12 tokens (all in the window: empty CPU segment), 150 and 60; windows full, short, 1 row.
    case = Case(hkv, g, d, DEV, window=40, prompts=[12, 150, 60], window_lens=[7, 40, 25], slots=[0, 2, 1],
                max_sequences=4, seed=hkv * 10 + g)
    assert case.idx[3, :3].tolist() == [0, 40, 130]
    net = random_network((40, 24), seed=g)
    check_against_reference(case, net, fused_for(case, net, 4), layer=1, n_layers=3, tol=INTERP_TOL)


@pytest.mark.parametrize("hkv, g, parts", [(2, 4, 4), (3, 1, 2)])
def test_fused_kernels_read_the_queries_by_reference(hkv, g, parts):
    # The queries through `q_ref` (a strided view, its address and strides read by the kernels) on a
    # grid of max_sequences = 4 rows for a batch of 3: the same features, predictions and plan as the
    # queries passed as the tensor; the fourth row's programs write nothing (output, previous
    # queries, arrival counts).
    case = Case(hkv, g, 32, DEV, window=40, prompts=[12, 150, 60, 90], window_lens=[7, 40, 25], slots=[0, 2, 1],
                max_sequences=4, seed=hkv * 10 + g + 5)
    net = random_network((40, 24), seed=g + 1)
    fused = FusedHeadPredictor(**{**plan_kwargs(case, net), "max_sequences": 4, "parts": parts,
                                  "target_mean": net.target_mean.tolist(), "target_std": net.target_std.tolist(),
                                  "block_sizes": (16, 32, 64, 128)})
    check_against_reference(case, net, fused, layer=1, n_layers=3, tol=INTERP_TOL, by_reference=True)
    assert (fused._arrivals == 0).all()
    with pytest.raises(ValueError, match=r"q_ref has shape \(3,\)"):
        fused.run(case.q, case.idx, case.cache.layer_rows(0), case.cache.previous_queries(0), case.window_k,
                  case.window_v, 0.5, torch.zeros(fused.out_size, device=DEV),
                  q_ref=torch.zeros(3, dtype=torch.int64, device=DEV))


# The launch choices of the two kernels, old and new (`dot_precision`, `features_lean`,
# `predict_out_width`): each matches the reference. Under the interpreter "tf32x3" runs as fp32 dots
# while "split" runs its own path (the operands split by bit masks, two or three dots).
LAUNCH_VARIANTS = {
    "default": {},
    "previous": {"dot_precision": "tf32x3", "features_lean": False, "predict_out_width": 16},
    "split_unmerged": {"dot_precision": "split", "features_lean": False},
    "lean_tf32x3_out16": {"dot_precision": "tf32x3", "features_lean": True, "predict_out_width": 16},
    "packed": {"features_pack": True},
    "packed_unmerged": {"features_pack": True, "features_lean": False},
    # One tf32 pass per dot (not fp32-accurate: compiled, within a tf32 tolerance; interpreted, fp32 dots),
    # in both kernels or in the network's alone.
    "tf32": {"dot_precision": "tf32"},
    "tf32_network": {"predict_precision": "tf32"},
}
# Inputs rounded to a 10-bit mantissa: features and outputs within ~1e-3 of the fp32 reference.
TF32_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("variant", sorted(LAUNCH_VARIANTS))
@pytest.mark.parametrize("kv_dtype, hidden", [(torch.float32, (24,)), (torch.bfloat16, (24, 20))])
def test_fused_launch_variants_match_the_reference(variant, kv_dtype, hidden):
    # bf16 window rows are exact in tf32: under "split" they enter the window dots unsplit (two dots, not
    # three); fp32 rows take the three-dot path. One and two hidden layers: the output layer in a pair and
    # alone, at 16 and 32 padded output columns. 16-row tiles, 2 parts: several tiles per part, the sink
    # rows over two tiles.
    case = Case(2, 4, 32, DEV, window=64, prompts=[300, 40, 20], window_lens=[60, 7, 33], slots=[0, 2, 1],
                max_sequences=3, sink=20, local=32, kv_dtype=kv_dtype, seed=21)
    net = random_network(hidden, seed=22)
    fused = FusedHeadPredictor(**{**plan_kwargs(case, net), "max_sequences": 3, "block_w": 16, "parts": 2,
                                  "target_mean": net.target_mean.tolist(), "target_std": net.target_std.tolist(),
                                  "block_sizes": (16, 32, 64, 128), **LAUNCH_VARIANTS[variant]})
    rounded = CUDA and "tf32" in LAUNCH_VARIANTS[variant].values()
    check_against_reference(case, net, fused, layer=1, n_layers=3, tol=TF32_TOL if rounded else INTERP_TOL)


@pytest.mark.parametrize("hkv, g, kv_dtype, by_reference", [(3, 1, torch.bfloat16, False), (1, 8, torch.float32, True),
                                                             (2, 3, torch.bfloat16, True)])
def test_fused_packed_rows_match_the_reference(hkv, g, kv_dtype, by_reference):
    # `features_pack`: the queries' (and the softmax weights') tf32 high parts in rows 0-7 of the dots'
    # operand and their low parts in rows 8-15, one MMA pass against a bf16 tile (two against fp32 rows,
    # and for the covariances). A group of 1 (7 padding rows in each half), of 8 (no padding rows) and of
    # 3; 16-row tiles over 2 parts, so a part walks several tiles and the halves' rescaling is exercised.
    case = Case(hkv, g, 32, DEV, window=64, prompts=[300, 40, 20], window_lens=[60, 7, 33], slots=[0, 2, 1],
                max_sequences=4, sink=20, local=32, kv_dtype=kv_dtype, seed=31 + g)
    net = random_network((24,), seed=32)
    fused = FusedHeadPredictor(**{**plan_kwargs(case, net), "max_sequences": 4, "block_w": 16, "parts": 2,
                                  "target_mean": net.target_mean.tolist(), "target_std": net.target_std.tolist(),
                                  "block_sizes": (16, 32, 64, 128), "features_pack": True})
    check_against_reference(case, net, fused, layer=1, n_layers=3, tol=INTERP_TOL, by_reference=by_reference)
    assert (fused._arrivals == 0).all()


@triton.jit
def _split_kernel(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    hi, lo = head_predictor._tf32_split(tl.load(x_ptr + i))
    tl.store(hi_ptr + i, hi)
    tl.store(lo_ptr + i, lo)


def test_tf32_split_gives_two_exact_tf32_parts():
    # `_tf32_split` (the "split" dots' operands): both parts have their 13 low mantissa bits clear (exact
    # tf32: a tensor core reads them as they are), x - hi - lo within 2^-20 |x|, and the three products
    # the dots sum (lo hi + hi lo + hi hi) give a dot product within 2^-19 of its float64 value.
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(500, generator=gen) * 10.0 ** torch.randint(-6, 6, (500,), generator=gen),
                   torch.tensor([0.0, -0.0, 1.0, -3.0, 1e-30, 3e30] + [0.0] * 6)])
    hi, lo = torch.empty_like(x, device=DEV), torch.empty_like(x, device=DEV)
    _split_kernel[(1,)](x.to(DEV), hi, lo, N=x.numel())  # compiled on CUDA, interpreted on the host
    hi, lo = hi.cpu(), lo.cpu()
    for part in (hi, lo):
        assert (part.view(torch.int32) & 0x1FFF == 0).all()
    err = (x.double() - hi.double() - lo.double()).abs()
    assert (err <= 2.0 ** -20 * x.double().abs()).all()
    a, b = x[:256].view(16, 16), x[256:512].view(16, 16)
    a_hi, a_lo, b_hi, b_lo = hi[:256].view(16, 16), lo[:256].view(16, 16), hi[256:512].view(16, 16), lo[256:512].view(16, 16)
    three = (a_lo.double() @ b_hi.double() + a_hi.double() @ b_lo.double() + a_hi.double() @ b_hi.double())
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    assert ((three - exact).abs() <= 2.0 ** -19 * scale).all()


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_fused_features_split_over_parts(parts):
    # 16-row tiles: a 90-row window is 6 tiles, several per part; the 20 sink rows span two tiles
    # (two parts); a 5-row window has one tile, so the other parts are empty; D 32 in 16-row
    # covariance blocks: at 4 parts two of them have no rows. Parts merge in any order of arrival.
    case = Case(2, 4, 32, DEV, window=96, prompts=[400, 150, 30], window_lens=[90, 5, 30], slots=[0, 2, 1],
                max_sequences=3, sink=20, local=64, seed=11)
    net = random_network((16,), seed=12)
    fused = FusedHeadPredictor(**{**plan_kwargs(case, net), "max_sequences": 3, "block_w": 16, "parts": parts,
                                  "target_mean": net.target_mean.tolist(), "target_std": net.target_std.tolist(),
                                  "block_sizes": (16, 32, 64, 128)})
    check_against_reference(case, net, fused, layer=2, n_layers=3, tol=INTERP_TOL)
    assert (fused._arrivals == 0).all()  # every (sequence, KV head)'s count is back at 0 for the next launch


def test_fused_selector_settings_and_a_one_layer_network():
    case = Case(2, 4, 16, DEV, window=24, prompts=[80, 9], window_lens=[24, 1], slots=[1, 0], max_sequences=2,
                sink=0, local=16, seed=3)
    net = random_network((8,), seed=4)
    fused = fused_for(case, net, 2, block_sizes=(32, 128), skip_streaming=False)
    check_against_reference(case, net, fused, layer=0, n_layers=3, tol=INTERP_TOL, block_sizes=(32, 128),
                            skip_streaming=False)


@pytest.mark.parametrize("hidden", [(96, 200, 70), (40, 300, 20), (96, 200), (20,) * 6, (20,) * 7])
def test_fused_network_of_any_depth_and_width(hidden):
    # The predict kernel's network: pairs of layers in registers, the first dot of a pair over 64-column
    # chunks of its input (200 -> 256 padded: 4 chunks; 300 -> 512: 8), the output layer alone after an
    # odd count (3 and 7 Linears), up to 8 Linears (4 pairs).
    case = Case(2, 4, 16, DEV, window=24, prompts=[80, 30], window_lens=[24, 9], slots=[1, 0], max_sequences=2,
                sink=4, local=16, seed=21)
    net = random_network(hidden, seed=22)
    check_against_reference(case, net, fused_for(case, net, 2), layer=1, n_layers=3, tol=INTERP_TOL)


def test_fused_network_of_the_output_layer_alone():
    # One Linear (41 -> 3, no hidden layer): the odd-count path with nothing before it.
    case = Case(2, 4, 16, DEV, window=24, prompts=[80, 30], window_lens=[24, 9], slots=[1, 0], max_sequences=2,
                sink=4, local=16, seed=41)
    gen = torch.Generator().manual_seed(42)
    weight, bias = torch.randn(3, len(FEATURE_NAMES), generator=gen).to(DEV), torch.randn(3, generator=gen).to(DEV)
    mean = torch.randn(len(FEATURE_NAMES), generator=gen).to(DEV)
    std = (torch.rand(len(FEATURE_NAMES), generator=gen) + 0.5).to(DEV)
    net = random_network((8,), seed=0)
    fused = FusedHeadPredictor(**{**plan_kwargs(case, net), "max_sequences": 2, "linears": [(weight, bias)],
                                  "feature_mean": mean, "feature_std": std, "target_mean": [0.3, -0.2],
                                  "target_std": [2.0, 0.5]})
    out = torch.zeros(fused.out_size, device=DEV)
    fused.run(case.q, case.idx, case.cache.layer_rows(0), case.cache.previous_queries(0), case.window_k,
              case.window_v, 0.5, out)
    n = 2 * case.hq
    y = ((fused.features[:n] - mean) / std) @ weight.t() + bias
    torch.testing.assert_close(out[:n], y[:, 0] * 2.0 + 0.3, **INTERP_TOL)
    torch.testing.assert_close(out[n : 2 * n], y[:, 1] * 0.5 - 0.2, **INTERP_TOL)
    torch.testing.assert_close(out[2 * n : 3 * n], torch.sigmoid(y[:, 2]), **INTERP_TOL)


@pytest.mark.parametrize("hkv, g, groups, batch", [(3, 1, 1, 2), (3, 1, 2, 1), (3, 2, 2, 2), (2, 4, 1, 1)])
def test_fused_predict_programs_over_kv_groups(hkv, g, groups, batch):
    # Programs of `groups` whole KV groups: 3 KV heads in blocks of 2 (the last block half empty), one
    # group per program, a single sequence; the per-sequence maxima still span every head.
    slots = [1, 0][:batch]
    case = Case(hkv, g, 16, DEV, window=24, prompts=[80, 30], window_lens=[24, 9][:batch], slots=slots,
                max_sequences=2, sink=4, local=16, seed=31 + hkv + g)
    net = random_network((24, 40), seed=32)
    fused = FusedHeadPredictor(**{**plan_kwargs(case, net), "max_sequences": 2, "predict_groups": groups,
                                  "target_mean": net.target_mean.tolist(), "target_std": net.target_std.tolist(),
                                  "block_sizes": (16, 32, 64, 128)})
    assert fused._n_j == -(-hkv // groups)
    check_against_reference(case, net, fused, layer=1, n_layers=3, tol=INTERP_TOL)


def test_plan_refuses_what_it_cannot_run():
    case = Case(2, 4, 16, DEV, window=16, prompts=[40], window_lens=[16], slots=[0], max_sequences=1)
    net = random_network((8,), seed=0)
    fused_for(case, net, 1)  # the valid plan
    names = list(FEATURE_NAMES)
    names[0], names[1] = names[1], names[0]
    with pytest.raises(ValueError, match="order"):
        FusedHeadPredictor(**{**plan_kwargs(case, net), "feature_names": names})
    with pytest.raises(ValueError, match="statistics_offsets lacks"):
        FusedHeadPredictor(**{**plan_kwargs(case, net), "statistics_offsets": {"n_cpu": 0}})
    with pytest.raises(ValueError, match="last Linear must give 3"):
        FusedHeadPredictor(**{**plan_kwargs(case, net), "linears": network_linears(net)[:-1]})
    with pytest.raises(ValueError, match="block_sizes"):
        FusedHeadPredictor(**{**plan_kwargs(case, net), "block_sizes": (16, 16)})
    for parts in (0, 3, 128):
        with pytest.raises(ValueError, match="parts must be a power of two"):
            FusedHeadPredictor(**{**plan_kwargs(case, net), "parts": parts})
    with pytest.raises(ValueError, match="up to 8 Linear layers"):
        FusedHeadPredictor(**{**plan_kwargs(case, random_network((8,) * 8, seed=0)),
                              "linears": network_linears(random_network((8,) * 8, seed=0))})
    wide = random_network((600,), seed=0)
    with pytest.raises(ValueError, match="hidden widths up to 512"):
        FusedHeadPredictor(**{**plan_kwargs(case, wide), "linears": network_linears(wide)})
    for name, bad in (("predict_groups", 0), ("predict_block_n", 24), ("predict_stages", 0)):
        with pytest.raises(ValueError, match=name):
            FusedHeadPredictor(**{**plan_kwargs(case, net), name: bad})
    with pytest.raises(ValueError, match="features_pack must be a bool"):
        FusedHeadPredictor(**{**plan_kwargs(case, net), "features_pack": 2})
    with pytest.raises(ValueError, match="it needs dot_precision 'split' and a group of <= 8 heads, got 'tf32x3'"):
        FusedHeadPredictor(**{**plan_kwargs(case, net), "features_pack": True, "dot_precision": "tf32x3"})
    wide_group = Case(1, 16, 16, DEV, window=16, prompts=[40], window_lens=[16], slots=[0], max_sequences=1)
    with pytest.raises(ValueError, match="a group of <= 8 heads, got 'split' and 16 heads"):
        FusedHeadPredictor(**{**plan_kwargs(wide_group, net), "features_pack": True})
    fused = fused_for(case, net, 1)
    out = torch.zeros(fused.out_size, device=DEV)
    args = (case.cache.layer_rows(0), case.cache.previous_queries(0), case.window_k, case.window_v)
    with pytest.raises(ValueError, match="1 <= B <= 1"):
        fused.run(torch.zeros(2, case.hq, case.d, device=DEV), case.idx, *args, 0.0, out)
    with pytest.raises(ValueError, match="out has shape"):
        fused.run(case.q, case.idx, *args, 0.0, out[:-1])
    assert tuple(FEATURE_COLUMNS) == tuple(FEATURE_NAMES)


def plan_kwargs(case: Case, net: HeadPropertyNet) -> dict:
    return dict(q_heads=case.hq, kv_heads=case.hkv, head_dim=case.d, max_sequences=1,
                window_capacity=case.window_k.shape[2], statistics_offsets=case.cache.field_offsets(),
                statistics_width=case.cache.width, feature_names=FEATURE_NAMES, linears=network_linears(net),
                feature_mean=net.feature_mean, feature_std=net.feature_std, target_mean=[0.0, 0.0],
                target_std=[1.0, 1.0], tau=0.1, block_sizes=(16, 32), streaming_threshold=0.5, skip_streaming=True,
                device=case.q.device)


# ---------------------------------------------------------------------------- through the planner
def planner_pair(kv_dtype: str, hidden: tuple[int, ...], other_path: str):
    """A store (its window on CUDA when there is one), the fused planner over it and one on `other_path`."""
    cfg = config_from_dict({
        "geometry": {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32},
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 4,
                     "dtype": kv_dtype},
        "selection": {"name": "predicted"},
    })
    store = KVStore(cfg.kv_cache, cfg.geometry)  # the window on CUDA when there is one
    ckpt = Checkpoint(random_network(hidden, seed=5), list(FEATURE_NAMES), tau=0.1)
    fused = PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=ckpt, path="fused")
    other = PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=ckpt, path=other_path)
    return cfg, store, fused, other


def prefill_planners(store, planners, device: torch.device | str, seed: int) -> None:
    """Three sequences at layers 0 and 1 into the store and every planner (sequence 1: no CPU segment)."""
    for s, n in ((0, 300), (1, 20), (2, 120)):
        for layer in (0, 1):
            k, v = (x.to(device) for x in random_kv(n, 2, 32, seed=seed + s + layer))
            q_last = torch.randn(8, 32, generator=torch.Generator().manual_seed(s)).to(device)
            store.prefill(s, layer, k, v)
            for planner in planners:
                planner.prefill(s, layer, k, v, q_last)


def run_planners(store, fused, other, device: torch.device | str, budget_tol: float) -> None:
    prefill_planners(store, (fused, other), device, seed=40)
    gen = torch.Generator().manual_seed(41)
    for step in range(3):
        for ids in ([0, 1, 2], [2], [1, 0]):
            for layer in (0, 1):
                q = torch.randn(len(ids), 8, 32, generator=gen).to(device)
                store.append(layer, ids, *(torch.randn(len(ids), 2, 32, generator=gen).to(device) for _ in range(2)))
                a, b = fused(layer, ids, store, q), other(layer, ids, store, q)
                np.testing.assert_array_equal(a.block_size, b.block_size)
                np.testing.assert_allclose(a.budgets, b.budgets, atol=budget_tol)
                np.testing.assert_allclose(fused.predictions(fused.buckets[-1], len(ids)),
                                           other.predictions(next(n for n in other.buckets if n >= len(ids)), len(ids)),
                                           atol=budget_tol, rtol=budget_tol)


def test_fused_planner_queries_by_reference_equal_static_queries():
    """The fused planner's two ways of handing the kernels the queries (`fused_queries`) plan alike,
    step after step (previous queries included), with bf16 and fp32 queries and batches below their
    bucket; neither keeps the caller's tensor past the call."""
    cfg, store, by_ref, _ = planner_pair("fp32", (16, 16), "eager")
    ckpt = Checkpoint(by_ref.model, list(FEATURE_NAMES), tau=0.1)
    static = PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=ckpt, path="fused",
                                  fused_queries="static")
    try:
        assert by_ref.fused_queries == "reference" and static.fused_queries == "static"
        prefill_planners(store, (by_ref, static), DEV, seed=60)
        gen = torch.Generator().manual_seed(61)
        m = by_ref.buckets[-1]
        for step in range(2):
            for ids in ([0, 1, 2], [2], [1, 0]):
                for layer in (0, 1):
                    q = torch.randn(len(ids), 8, 32, generator=gen).to(DEV, torch.bfloat16 if step else torch.float32)
                    store.append(layer, ids, *(torch.randn(len(ids), 2, 32, generator=gen).to(DEV) for _ in range(2)))
                    a, b = by_ref(layer, ids, store, q), static(layer, ids, store, q)
                    assert by_ref._fused_q is None and static._fused_q is None
                    np.testing.assert_array_equal(a.block_size, b.block_size)
                    np.testing.assert_array_equal(a.budgets, b.budgets)
                    np.testing.assert_array_equal(by_ref.predictions(m, len(ids)), static.predictions(m, len(ids)))
        with pytest.raises(ValueError, match="fused_queries 'copy' is not one of"):
            PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=ckpt, path="fused", fused_queries="copy")
    finally:
        store.close()


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_fused_planner_with_packed_rows_equals_the_eager_planner(kv_dtype):
    # The planner's `fused_options` reach the kernels: `features_pack` plans as the eager (torch) path
    # does, over a bf16 window (one MMA pass per window dot) and an fp32 one (two).
    cfg, store, _, eager = planner_pair(kv_dtype, (16, 16), "eager")
    ckpt = Checkpoint(eager.model, list(FEATURE_NAMES), tau=0.1)
    packed = PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=ckpt, path="fused",
                                  fused_options={"features_pack": True})
    try:
        assert packed._fused._features_constexprs["PACK_ROWS"] is True
        run_planners(store, packed, eager, DEV, 1e-5)
    finally:
        store.close()


def test_fused_planner_equals_the_eager_planner():
    cfg, store, fused, eager = planner_pair("fp32", (16, 16), "eager")
    try:
        assert fused.path == "fused" and eager.path == "eager" and not fused._graphs
        assert store.device.type == DEV.type  # the planners run where the store's window is
        run_planners(store, fused, eager, DEV, 1e-5)
    finally:
        store.close()


def test_planner_refuses_unknown_paths():
    cfg = config_from_dict({"geometry": {"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32},
                            "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 1024,
                                         "max_sequences": 2}, "selection": {"name": "predicted"}})
    store = KVStore(cfg.kv_cache, cfg.geometry)
    ckpt = Checkpoint(random_network((4,), seed=0), list(FEATURE_NAMES), tau=0.1)
    try:
        with pytest.raises(ValueError, match="not one of"):
            PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=ckpt, path="graphs")
        if not CUDA:
            with pytest.raises(ValueError, match="captures CUDA graphs"):
                PredictedHeadPlanner(cfg.selection, cfg.geometry, store, checkpoint=ckpt, path="graph")
    finally:
        store.close()


# ---------------------------------------------------------------------------- CUDA
GPU_TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_fused_kernels_match_the_reference_on_cuda_at_llama_heads(kv_dtype):
    # Llama-3.1-8B heads (Hq 32, Hkv 8, D 128), the runtime's window (64 + 256 + 512 + 16 rows),
    # 8 sequences: full, short and nearly empty windows, one without a CPU segment.
    case = Case(8, 4, 128, "cuda", window=848, prompts=[3000, 200, 900, 5000, 330, 1200, 700, 2500],
                window_lens=[848, 321, 500, 64, 330, 1, 700, 400], slots=[3, 1, 0, 2, 7, 6, 5, 4], max_sequences=8,
                sink=64, local=256, kv_dtype=kv_dtype, seed=7)
    net = random_network((256, 256, 128), seed=8).cuda()
    fused = fused_for(case, net, 8)
    check_against_reference(case, net, fused, layer=5, n_layers=32, tol=GPU_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fused_planner_equals_the_graph_planner_on_cuda():
    cfg, store, fused, graph = planner_pair("bf16", (256, 256, 128), "graph")
    try:
        run_planners(store, fused, graph, "cuda", 1e-4)
    finally:
        store.close()
