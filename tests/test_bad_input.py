"""Bad input, nothing changed: property-based tests over prefill, decode, release and the config.

Every bad call must raise an error that names what was wrong and what is allowed, and leave the
store exactly as it was: per sequence its lengths and chunk tables, the free chunks per layer, and
a checksum of the arena rows and window rows the sequences own. One runtime per module (small
geometry, one CPU worker plus the torch-reference GPU lane) keeps hypothesis fast on 2 cores.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybrid_runtime.config import ConfigError, config_from_dict, load_config
from hybrid_runtime.kvcache import CapacityError
from hybrid_runtime.runtime import HybridRuntime

GEOM = {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
HKV, HQ, D = GEOM["kv_heads"], GEOM["q_heads"], GEOM["head_dim"]
SINK, LOCAL, GEN_CAP, CAPACITY, MAX_SEQS = 4, 32, 16, 1024, 3
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def make_config(**over):
    data = {
        "geometry": GEOM,
        "kv_cache": {"sink": SINK, "local": LOCAL, "generated_cap": GEN_CAP, "cpu_capacity_tokens": CAPACITY,
                     "max_sequences": MAX_SEQS},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.2},
        # "sync": every bad input refused by its own call, on a machine with CUDA too (where "auto"
        # defers the check of steps whose CPU lane starts on the device's word).
        "scheduler": {"placement": "fluxion", "cpu_workers": 1, "pin_cores": False, "step_timeout_s": 30.0,
                      "finite_check": "sync"},
        "profiling": {"enabled": False},
    }
    data.update(over)
    return config_from_dict(data)


def kv(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HKV, D, generator=g).to(dtype), torch.randn(n, HKV, D, generator=g).to(dtype))


def step_inputs(b, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))


def _bytes(x: torch.Tensor) -> bytes:
    x = x.contiguous().cpu()
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
    return x.numpy().tobytes()


def snapshot(rt: HybridRuntime) -> dict:
    """Everything a bad call must leave alone."""
    store = rt.store
    seqs = sorted(store.sequences())
    snap = {
        "seqs": seqs,
        "slots": [store.slot(s) for s in seqs],
        "free_chunks": [store.free_chunks(layer) for layer in range(store.layers)],
        "cpu_tokens": [store.cpu_tokens(layer) for layer in range(store.layers)],
    }
    h = hashlib.sha256()
    for s in seqs:
        slot = store.slot(s)
        for layer in range(store.layers):
            table = store.chunk_table(s, layer)
            wl = store.window_len(s, layer)
            snap[(s, layer)] = (store.cpu_len(s, layer), wl, table.tolist())
            h.update(store.arena_numpy(layer)[table.reshape(-1)].tobytes())  # data and block metadata rows
            win_k, win_v = store.window(layer)
            h.update(_bytes(win_k[slot, :, :wl]))
            h.update(_bytes(win_v[slot, :, :wl]))
    snap["checksum"] = h.hexdigest()
    return snap


def expect_refused(rt, call, exc, fragments):
    """`call()` raises `exc` whose message holds every fragment; the store is unchanged."""
    before = snapshot(rt)
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    assert snapshot(rt) == before, f"state changed by a refused call ({msg})"
    return msg


# ---------------------------------------------------------------------------- the module's runtime
@pytest.fixture(scope="module")
def rt():
    """Sequences 0 and 1 on both layers, 2 on layer 0 only (all MAX_SEQS slots taken); at layer 0
    sequences 0 and 1 have a full window, so their next decode step spills first."""
    runtime = HybridRuntime(make_config())
    try:
        for s, n, layers in ((0, 300, (0, 1)), (1, 40, (0, 1)), (2, 200, (0,))):
            for layer in layers:
                runtime.prefill(s, layer, *kv(n, seed=10 * s + layer))
        for i in range(GEN_CAP):
            runtime.decode(0, [0, 1], *step_inputs(2, seed=i))
        assert runtime._will_spill(0, [0, 1])
        yield runtime
    finally:
        runtime.close()


NON_INTS = st.sampled_from([1.0, 0.5, "0", None, True, b"1", [0]])
BAD_DTYPES = st.sampled_from([torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64])
GOOD_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])


def wrong_shape(draw, right):
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=4)))
    return shape if shape != tuple(right) else shape + (1,)


TENSOR_FAULTS = ("dtype", "meta", "not_tensor", "non_finite")


def tensor_fault(draw, args: dict, name: str, kind: str) -> tuple:
    """`args[name]` made wrong in one of the ways any tensor argument can be (`TENSOR_FAULTS`);
    returns (arguments, expected error, message fragments)."""
    if kind == "dtype":
        args[name] = args[name].to(draw(BAD_DTYPES))
        return args, ValueError, [f"{name} has dtype", "expected a floating-point tensor"]
    if kind == "meta":
        args[name] = args[name].to("meta")
        return args, ValueError, [f"{name} is on device meta", "expected a tensor on CPU"]
    if kind == "not_tensor":
        args[name] = draw(st.sampled_from([args[name].float().numpy(), args[name].tolist(), None]))
        return args, TypeError, [f"{name} is a", "expected a torch.Tensor"]
    if kind == "non_finite":
        x = args[name].clone()
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(NON_FINITE)
        args[name] = x
        return args, ValueError, [f"{name} has 1 NaN/inf value", "expected finite values"]
    raise AssertionError(f"not a tensor fault: {kind}")


@st.composite
def bad_decodes(draw):
    """(call arguments, expected error, message fragments) of one decode call with one thing wrong."""
    layer = draw(st.sampled_from([0, 1]))
    pool = [0, 1, 2] if layer == 0 else [0, 1]
    seq_ids = draw(st.permutations(pool).map(lambda p: list(p)).flatmap(
        lambda p: st.integers(1, len(p)).map(lambda n: p[:n])))
    if layer == 0 and draw(st.booleans()):
        seq_ids = [0] + [s for s in seq_ids if s != 0]  # a spilling sequence in the batch
    dtype = draw(GOOD_DTYPES)
    args = {"layer": layer, "seq_ids": seq_ids}
    args["q"], args["k"], args["v"] = step_inputs(len(seq_ids), seed=draw(st.integers(0, 99)), dtype=dtype)
    name = draw(st.sampled_from(["q", "k", "v"]))
    heads = HQ if name == "q" else HKV
    kind = draw(st.sampled_from(["shape", "dtype", "meta", "not_tensor", "non_finite", "unknown_seq", "repeat",
                                 "seq_type", "empty", "layer_range", "layer_type", "unprefilled", "seq_ids_type"]))
    if kind == "shape":
        args[name] = torch.randn(*wrong_shape(draw, (len(seq_ids), heads, D)))
        return args, ValueError, [f"{name} has shape", f"expected [{len(seq_ids)}, {heads}, {D}]"]
    if kind in TENSOR_FAULTS:
        return tensor_fault(draw, args, name, kind)
    if kind == "unknown_seq":
        bad = draw(st.integers(-5, 10**6).filter(lambda s: s not in (0, 1, 2)))
        args["seq_ids"] = seq_ids[:-1] + [bad]
        return args, KeyError, [f"sequence {bad} is not in the store", "prefill it first"]
    if kind == "repeat":
        args["seq_ids"] = seq_ids + [seq_ids[0]]
        args["q"], args["k"], args["v"] = step_inputs(len(seq_ids) + 1)
        return args, ValueError, ["repeat a sequence"]
    if kind == "seq_type":
        args["seq_ids"] = seq_ids[:-1] + [draw(NON_INTS)]
        return args, TypeError, ["a sequence id in seq_ids is", "expected an integer"]
    if kind == "seq_ids_type":
        args["seq_ids"] = draw(st.sampled_from([0, None, "012", 1.0]))
        return args, TypeError, ["seq_ids is", "expected a sequence of integer"]
    if kind == "empty":
        args["seq_ids"] = []
        args["q"], args["k"], args["v"] = step_inputs(0)
        return args, ValueError, ["seq_ids is empty", "at least one"]
    if kind == "layer_range":
        args["layer"] = draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=2)))
        return args, IndexError, [f"layer {args['layer']} out of range", "layers 0..1"]
    if kind == "layer_type":
        args["layer"] = draw(NON_INTS)
        return args, TypeError, ["layer is", "expected an integer"]
    # unprefilled: sequence 2 has layer 0 only
    args["layer"], args["seq_ids"] = 1, [2]
    args["q"], args["k"], args["v"] = step_inputs(1)
    return args, ValueError, ["sequence 2 has no KV at layer 1", "prefill every layer"]


@FAST
@given(case=bad_decodes())
def test_bad_decode_is_refused_and_changes_nothing(rt, case):
    args, exc, fragments = case
    expect_refused(rt, lambda: rt.decode(**args), exc, fragments)


@st.composite
def bad_prefills(draw):
    """(arguments, error, fragments) of one prefill with one thing wrong. Valid target: sequence 2,
    layer 1 (free); every slot is taken, so a new sequence id is a capacity error."""
    n = draw(st.integers(1, 300))
    dtype = draw(GOOD_DTYPES)
    args = {"seq_id": 2, "layer": 1}
    args["k"], args["v"] = kv(n, seed=draw(st.integers(0, 99)), dtype=dtype)
    name = draw(st.sampled_from(["k", "v"]))
    kind = draw(st.sampled_from(["shape", "length_mismatch", "dtype", "meta", "not_tensor", "non_finite", "empty",
                                 "seq_type", "layer_range", "layer_type", "again", "no_slot", "over_capacity"]))
    if kind == "shape":
        shape = wrong_shape(draw, (n, HKV, D))
        if len(shape) == 3 and shape[1:] == (HKV, D):
            shape = (shape[0], HKV + 1, D)
        args[name] = torch.randn(*shape)
        return args, ValueError, [f"{name} has shape", f"expected [L, {HKV}, {D}]"]
    if kind == "length_mismatch":
        args[name] = torch.randn(n + draw(st.integers(1, 5)), HKV, D)
        return args, ValueError, ["must have the same shape"]
    if kind in TENSOR_FAULTS:
        return tensor_fault(draw, args, name, kind)
    if kind == "empty":
        args["k"], args["v"] = kv(0)
        return args, ValueError, ["no tokens", "at least one"]
    if kind == "seq_type":
        args["seq_id"] = draw(NON_INTS)
        return args, TypeError, ["seq_id is", "expected an integer"]
    if kind == "layer_range":
        args["layer"] = draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=2)))
        return args, IndexError, [f"layer {args['layer']} out of range", "layers 0..1"]
    if kind == "layer_type":
        args["layer"] = draw(NON_INTS)
        return args, TypeError, ["layer is", "expected an integer"]
    if kind == "again":
        args["seq_id"], args["layer"] = draw(st.sampled_from([(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]))
        return args, ValueError, [f"already has layer {args['layer']}", "release it before prefilling again"]
    if kind == "no_slot":
        args["seq_id"] = draw(st.integers(3, 10**6))
        return args, CapacityError, [f"kv_cache.max_sequences={MAX_SEQS} slots are in use", "release a sequence"]
    # over_capacity: layer 1 holds 264 + 4 CPU-resident tokens; the prompt's CPU part overflows it
    free = CAPACITY - 268
    args["k"], args["v"] = kv(draw(st.integers(free + SINK + LOCAL + 1, 2000)))
    return args, CapacityError, [f"only {free} of the kv_cache.cpu_capacity_tokens={CAPACITY}", "release sequences"]


@FAST
@given(case=bad_prefills())
def test_bad_prefill_is_refused_and_changes_nothing(rt, case):
    args, exc, fragments = case
    expect_refused(rt, lambda: rt.prefill(**args), exc, fragments)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_id=st.one_of(st.integers().filter(lambda s: s not in (0, 1, 2)), NON_INTS))
def test_bad_release_is_refused_and_changes_nothing(rt, seq_id):
    if isinstance(seq_id, int) and not isinstance(seq_id, bool):
        fragments = [f"sequence {seq_id} is not in the store", "already released", "sequences in the store: [0, 1, 2]"]
        expect_refused(rt, lambda: rt.release(seq_id), KeyError, fragments)
    else:
        expect_refused(rt, lambda: rt.release(seq_id), TypeError, ["seq_id is", "expected an integer"])


def test_good_calls_still_work_after_the_refusals(rt):
    """The refusals above left a usable runtime: a spilling decode step runs and matches shapes."""
    out = rt.decode(0, [0, 1, 2], *step_inputs(3, seed=7))
    assert out.shape == (3, HQ, D) and torch.isfinite(out).all()


def test_integer_scalars_are_accepted_as_ids():
    """numpy and 0-d tensor integers are integers; they are normalised, not refused."""
    with HybridRuntime(make_config()) as rt:
        rt.prefill(np.int64(5), torch.tensor(0), *kv(50))
        assert rt.store.sequences() == [5] and type(rt.store.sequences()[0]) is int
        out = rt.decode(np.int32(0), [np.int64(5)], *step_inputs(1))
        assert out.shape == (1, HQ, D)
        rt.release(torch.tensor(5))
        assert rt.store.sequences() == []


def test_prompt_held_wholly_on_the_cpu_cannot_be_prefilled_twice():
    """With sink = local = 0 the window is empty after a prefill; a second prefill of the layer
    must still be refused (it would overwrite the chunk table and lose the first prompt's chunks)."""
    with HybridRuntime(make_config(kv_cache={"sink": 0, "local": 0, "generated_cap": GEN_CAP,
                                             "cpu_capacity_tokens": CAPACITY, "max_sequences": MAX_SEQS})) as rt:
        rt.prefill(0, 0, *kv(200))
        assert rt.store.window_len(0, 0) == 0 and rt.store.cpu_len(0, 0) == 200
        expect_refused(rt, lambda: rt.prefill(0, 0, *kv(100)), ValueError, ["already has layer 0"])


# ---------------------------------------------------------------------------- a stateful mix
class Lifecycle(RuleBasedStateMachine):
    """Good and bad calls interleaved on one runtime: every refused call changes nothing, every
    accepted one changes what it should; release twice, decode after release, capacity exhaustion."""

    runtime: HybridRuntime | None = None  # one per module, emptied between runs

    def __init__(self):
        super().__init__()
        if Lifecycle.runtime is None or Lifecycle.runtime._closed:
            Lifecycle.runtime = HybridRuntime(make_config())
        self.rt = Lifecycle.runtime
        for s in list(self.rt.store.sequences()):
            self.rt.release(s)
        self.layers: dict[int, set[int]] = {}  # live sequence -> prefilled layers
        self.released: set[int] = set()

    def teardown(self):
        for s in list(self.rt.store.sequences()):
            self.rt.release(s)

    @rule(seq=st.integers(0, 4), layer=st.integers(0, 1), n=st.sampled_from([1, 20, 36, 37, 200, 500, 900, 1200]))
    def prefill(self, seq, layer, n):
        store = self.rt.store
        cpu = max(0, n - SINK - LOCAL)
        if seq in self.layers and layer in self.layers[seq]:
            expect_refused(self.rt, lambda: self.rt.prefill(seq, layer, *kv(n)), ValueError, ["already has layer"])
        elif seq not in self.layers and len(self.layers) == MAX_SEQS:
            expect_refused(self.rt, lambda: self.rt.prefill(seq, layer, *kv(n)), CapacityError, ["max_sequences"])
        elif cpu > CAPACITY - store.cpu_tokens(layer):
            expect_refused(self.rt, lambda: self.rt.prefill(seq, layer, *kv(n)), CapacityError,
                           ["cpu_capacity_tokens"])
        else:
            free = store.free_chunks(layer)
            self.rt.prefill(seq, layer, *kv(n, seed=seq))
            self.layers.setdefault(seq, set()).add(layer)
            self.released.discard(seq)
            assert store.seq_len(seq, layer) == n and store.cpu_len(seq, layer) == cpu
            assert store.free_chunks(layer) == free - math.ceil(cpu / 128) * HKV

    @precondition(lambda self: self.layers)
    @rule(data=st.data(), layer=st.integers(0, 1), bad=st.sampled_from([None, "q", "k", "v"]))
    def decode(self, data, layer, bad):
        ready = sorted(s for s, ls in self.layers.items() if layer in ls)
        if not ready:
            return
        seqs = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        q, k, v = step_inputs(len(seqs), seed=len(seqs))
        if bad is not None:
            x = {"q": q, "k": k, "v": v}[bad]
            x[0, 0, 0] = float("nan")
            expect_refused(self.rt, lambda: self.rt.decode(layer, seqs, q, k, v), ValueError, [f"{bad} has 1 NaN"])
            return
        before = [self.rt.store.seq_len(s, layer) for s in seqs]
        try:
            out = self.rt.decode(layer, seqs, q, k, v)
        except CapacityError:  # a spill past the capacity: refused before anything changed
            assert [self.rt.store.seq_len(s, layer) for s in seqs] == before
            return
        assert out.shape == (len(seqs), HQ, D) and torch.isfinite(out).all()
        assert [self.rt.store.seq_len(s, layer) for s in seqs] == [n + 1 for n in before]

    @precondition(lambda self: self.layers)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(sorted(self.layers)))
        self.rt.release(seq)
        del self.layers[seq]
        self.released.add(seq)

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def use_after_release(self, data):
        seq = data.draw(st.sampled_from(sorted(self.released)))
        expect_refused(self.rt, lambda: self.rt.release(seq), KeyError, [f"sequence {seq} is not in the store",
                                                                          "already released"])
        q, k, v = step_inputs(1)
        expect_refused(self.rt, lambda: self.rt.decode(0, [seq], q, k, v), KeyError, ["prefill it first"])

    @invariant()
    def store_matches_the_model(self):
        store = self.rt.store
        assert sorted(store.sequences()) == sorted(self.layers)
        for layer in range(store.layers):
            used = sum(math.ceil(store.cpu_len(s, layer) / 128) * HKV for s in self.layers)
            assert store.free_chunks(layer) == store.n_chunks - used
            assert store.cpu_tokens(layer) == sum(store.cpu_len(s, layer) for s in self.layers)


Lifecycle.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
TestLifecycle = Lifecycle.TestCase


@pytest.fixture(scope="module", autouse=True)
def _close_lifecycle_runtime():
    yield
    if Lifecycle.runtime is not None:
        Lifecycle.runtime.close()
        Lifecycle.runtime = None


# ---------------------------------------------------------------------------- config
VALID = {
    "geometry": dict(GEOM),
    "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 1024, "max_sequences": 3,
                 "dtype": "bf16", "max_host_memory_fraction": 0.5, "block_sizes": [16, 32]},
    "selection": {"name": "fixed", "block_size": 16, "budget": 0.2, "streaming_heads": {0: [1, 2]}},
    "scheduler": {"placement": "fluxion", "cpu_workers": 1, "gpu_worker": True, "pin_cores": False,
                  "step_timeout_s": 30.0, "gpu_share": 0.0, "spin_us": 100.0},
    "profiling": {"enabled": False},
    "workload": {"batch": 2, "context": 512},
}
LEAVES = [(section, key) for section, body in VALID.items() for key in body]
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-10**12, 10**12), st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5), st.lists(st.integers(-3, 300), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _acceptable(cfg, section, key, value) -> bool:
    """An accepted value must be stored as given and be a finite, in-range value."""
    got = getattr(getattr(cfg, section), key)
    if isinstance(got, float):
        return math.isfinite(got) and got == value
    if isinstance(got, tuple):
        return list(got) == list(value)
    if isinstance(got, dict):
        return {k: list(v) for k, v in got.items()} == value
    return got == value and type(got) is type(value)


@settings(max_examples=60, deadline=None)
@given(leaf=st.sampled_from(LEAVES), value=JUNK)
def test_config_refuses_bad_values_with_the_key_named(leaf, value):
    section, key = leaf
    data = {s: dict(b) for s, b in VALID.items()}
    data[section][key] = value
    try:
        cfg = config_from_dict(data)
    except ConfigError as exc:
        msg = str(exc)
        # The key itself, or (cross-field checks) its section or the key it conflicts with.
        assert msg.startswith((f"{section}.{key}", f"{section}:", "selection.block_size", "selection.streaming_heads",
                               "kv_cache:", "geometry.q_heads")), msg  # q_heads must be a multiple of kv_heads
        assert "allowed" in msg or "expected" in msg or "must be" in msg, msg
        return
    assert _acceptable(cfg, section, key, value), (leaf, value)


@settings(max_examples=30, deadline=None)
@given(data=st.one_of(st.lists(st.integers(), max_size=3), st.text(min_size=1, max_size=5), st.integers(),
                      st.dictionaries(st.text(max_size=4).filter(lambda k: k not in VALID), st.integers(),
                                      min_size=1, max_size=2)))
def test_config_refuses_bad_top_level(data):
    with pytest.raises(ConfigError, match="top level|top-level keys"):
        config_from_dict(data)


@pytest.mark.parametrize("text, where", [
    ("selection: {budget: .nan}\n", "selection.budget: nan"),
    ("scheduler: {step_timeout_s: .inf}\n", "scheduler.step_timeout_s: inf"),
    ("scheduler: {spin_us: .inf}\n", "scheduler.spin_us: inf"),
    ("kv_cache: {max_host_memory_fraction: .nan}\n", "kv_cache.max_host_memory_fraction: nan"),
    ("- 1\n- 2\n", "expected a mapping at the top level"),
    ("kv_cache: {sink: 4, sink: 8, local: [\n", "not valid YAML"),
])
def test_load_config_names_the_bad_key(tmp_path, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="allowed|expected|not valid YAML") as info:
        load_config(path)
    assert where in str(info.value)


# ---------------------------------------------------------------------------- HybridCache after disable
def test_hybrid_cache_refuses_use_after_disable():
    pytest.importorskip("transformers", reason="the transformers backend needs the `models` extra")
    from transformers import DynamicCache

    from hybrid_runtime.integrations.transformers import HybridCache, disable_hybrid_attention, enable_hybrid_attention
    from tests.test_transformers_integration import hybrid_cfg, left_padded, tiny_model

    model = tiny_model("llama")
    ids, mask = left_padded([60, 40])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    nxt = torch.tensor([[5], [7]])
    mask2 = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    with torch.no_grad():
        dense = DynamicCache(config=model.config)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=dense)
        ref = model(input_ids=nxt, attention_mask=mask2, position_ids=pos[:, -1:] + 1, past_key_values=dense).logits

        rt = enable_hybrid_attention(model, hybrid_cfg())
        cache = HybridCache(model)  # prefilled while enabled
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        unused = HybridCache(model)  # never used while enabled
        disable_hybrid_attention(model)
        assert rt._closed
        for c in (cache, unused):
            with pytest.raises(RuntimeError, match="disable_hybrid_attention.*cannot be used any more.*make a new cache"):
                model(input_ids=nxt, attention_mask=mask2, position_ids=pos[:, -1:] + 1, past_key_values=c)
        # Without a mask the dense model used to attend over the new token only: wrong logits, silently.
        with pytest.raises(RuntimeError, match="disable_hybrid_attention"):
            model(input_ids=nxt[:1], position_ids=pos[:1, -1:] + 1, past_key_values=cache)
        with pytest.raises(RuntimeError, match="disable_hybrid_attention"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                           past_key_values=unused)
        # Re-enabling the model does not revive a cache of the earlier enablement.
        enable_hybrid_attention(model, hybrid_cfg())
        try:
            with pytest.raises(RuntimeError, match="disable_hybrid_attention"):
                model(input_ids=nxt, attention_mask=mask2, position_ids=pos[:, -1:] + 1, past_key_values=cache)
            fresh = HybridCache(model)
            model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=fresh)
            got = model(input_ids=nxt, attention_mask=mask2, position_ids=pos[:, -1:] + 1, past_key_values=fresh).logits
        finally:
            disable_hybrid_attention(model)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)  # a new cache is exact (budget 1.0, fp32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bad", ["q", "k", "v"])
def test_nan_refused_on_cuda_by_the_check_riding_on_the_q_copy(bad):
    """On CUDA with a CPU lane the NaN/inf check reads the host copies made for the CPU workers;
    it still refuses before anything changes and names the tensor."""
    runtime = HybridRuntime(make_config(kv_cache={"sink": SINK, "local": LOCAL, "generated_cap": GEN_CAP,
                                                  "cpu_capacity_tokens": CAPACITY, "max_sequences": MAX_SEQS,
                                                  "device": "cuda"}))
    try:
        for s in (0, 1):
            runtime.prefill(s, 0, *(x.cuda() for x in kv(300, seed=s)))
        assert not runtime._will_spill(0, [0, 1])  # the deferred path, not the spill's upfront check
        q, k, v = (x.cuda() for x in step_inputs(2, seed=3))
        {"q": q, "k": k, "v": v}[bad][1, 0, 2] = float("inf")
        expect_refused(runtime, lambda: runtime.decode(0, [0, 1], q, k, v), ValueError, [f"{bad} has 1 NaN/inf"])
        q, k, v = (x.cuda() for x in step_inputs(2, seed=3))
        out = runtime.decode(0, [0, 1], q, k, v)  # usable after the refusal
        assert torch.isfinite(out).all()
    finally:
        runtime.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_host_nonfinite_mask_reads_16_bit_floats_by_their_bits(dtype):
    from hybrid_runtime.input_check import nonfinite_mask as _nonfinite_mask

    info = torch.finfo(dtype)
    x = torch.tensor([0.0, info.max, -info.max, info.tiny, 1.5, float("nan"), float("inf"), -float("inf")], dtype=dtype)
    assert _nonfinite_mask(x).tolist() == [False] * 5 + [True] * 3
