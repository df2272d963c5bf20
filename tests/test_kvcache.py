import numpy as np
import psutil
import pytest
import torch

from cpu_kernels import layout
from hybrid_runtime.kvcache import CapacityError, KVStore
from tests.helpers import make_store, random_kv, small_config


def expected_metadata(k_cpu: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n_blocks, 2, D] min/max recomputed from the keys of one KV head."""
    blocks = torch.split(k_cpu.float(), block_size)
    return torch.stack([torch.stack([b.amin(0), b.amax(0)]) for b in blocks])


def check_store_matches(store: KVStore, seq_id: int, layer: int, k_all: torch.Tensor, v_all: torch.Tensor):
    k, v = store.full_kv(seq_id, layer)
    assert torch.equal(k, k_all.to(store.dtype)) and torch.equal(v, v_all.to(store.dtype))
    sink = store.cfg.sink
    cpu_len = store.cpu_len(seq_id, layer)
    for h in range(store.kv_heads if cpu_len else 0):
        k_cpu = k[sink : sink + cpu_len, h]
        for block_size in layout.BLOCK_SIZES:
            got = store.block_metadata(seq_id, layer, h, block_size).float()
            assert torch.equal(got, expected_metadata(k_cpu, block_size)), (h, block_size)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("length", [1, 30, 36, 37, 200, 1000, 1283])
def test_prefill_splits_and_metadata(dtype, length):
    store = make_store(dtype=dtype)
    k, v = random_kv(length, 2, 32, seed=length)
    store.prefill(5, 1, k, v)
    sink = min(4, length)
    recent = min(32, length - sink)
    assert store.window_len(5, 1) == sink + recent
    assert store.cpu_len(5, 1) == length - sink - recent
    check_store_matches(store, 5, 1, k, v)
    # Rows past the CPU length are zero, so kernels see finite values there.
    table = torch.from_numpy(store.chunk_table(5, 1)).long()
    if table.numel():
        last = store.arena(1)[table[:, -1]]
        tail = store.cpu_len(5, 1) % layout.CHUNK_TOKENS
        if tail:
            assert not last[:, tail : layout.CHUNK_TOKENS].any()
            assert not last[:, layout.V_ROW + tail : layout.V_ROW + layout.CHUNK_TOKENS].any()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_append_spills_whole_pages_and_keeps_window_bounded(dtype):
    store = make_store(dtype=dtype)
    seqs = [0, 1, 2]
    lengths = [40, 300, 10]  # variable lengths in one batch
    ks, vs = [], []
    for s, n in zip(seqs, lengths):
        k, v = random_kv(n, 2, 32, seed=s)
        store.prefill(s, 0, k, v)
        ks.append([k])
        vs.append([v])
    limit = 4 + 32 + 32  # sink + local + generated_cap
    for step in range(150):
        k, v = random_kv(3, 2, 32, seed=1000 + step)
        store.append(0, seqs, k, v)
        for i in range(3):
            ks[i].append(k[i : i + 1])
            vs[i].append(v[i : i + 1])
            assert store.window_len(seqs[i], 0) <= limit
    for i, s in enumerate(seqs):
        k_all, v_all = torch.cat(ks[i]), torch.cat(vs[i])
        assert store.seq_len(s, 0) == k_all.shape[0]
        check_store_matches(store, s, 0, k_all, v_all)
        # Spills move whole pages: the recent part keeps at least `local` tokens.
        assert store.window_len(s, 0) - min(4, lengths[i]) >= min(32, lengths[i] - min(4, lengths[i]))


def test_release_returns_chunks_and_slots_without_new_memory():
    store = make_store(cpu_capacity_tokens=2048, max_sequences=2)
    free0 = store.free_chunks(0)
    arena_ptr = store.arena(0).data_ptr()
    for round_ in range(3):
        for s in (10, 11):
            k, v = random_kv(900, 2, 32, seed=round_ * 10 + s)
            store.prefill(s, 0, k, v)
        assert store.free_chunks(0) < free0
        store.release(10)
        store.release(11)
        assert store.free_chunks(0) == free0
    assert store.arena(0).data_ptr() == arena_ptr
    with pytest.raises(KeyError, match="prefill it first"):
        store.cpu_len(10, 0)


def test_over_capacity_prefill_raises_and_changes_nothing():
    store = make_store(cpu_capacity_tokens=1024, max_sequences=2)
    k, v = random_kv(800, 2, 32)
    store.prefill(0, 0, k, v)
    free = store.free_chunks(0)
    big_k, big_v = random_kv(4000, 2, 32)
    with pytest.raises(CapacityError, match=r"needs \d+ chunks .* are free; raise kv_cache.cpu_capacity_tokens"):
        store.prefill(1, 0, big_k, big_v)
    assert store.free_chunks(0) == free
    assert store.sequences() == [0]
    small_k, small_v = random_kv(296, 2, 32)  # the rest of the capacity exactly
    store.prefill(1, 0, small_k, small_v)  # the slot was not taken by the failed call
    with pytest.raises(CapacityError, match="max_sequences=2"):
        store.prefill(2, 0, small_k, small_v)


def test_host_memory_check_before_allocating():
    available = psutil.virtual_memory().available
    cfg = small_config(cpu_capacity_tokens=int(available / (2 * 32 * 2 * 2 * 2)) * 4)
    with pytest.raises(CapacityError, match=r"GiB of .*host memory .* lower cpu_capacity_tokens"):
        KVStore(cfg.kv_cache, cfg.geometry)


def test_bad_shapes_are_rejected_before_any_change():
    store = make_store()
    with pytest.raises(ValueError, match=r"expected \[L, 2, 32\]"):
        store.prefill(0, 0, torch.randn(10, 3, 32), torch.randn(10, 3, 32))
    with pytest.raises(ValueError, match="no tokens"):
        store.prefill(0, 0, torch.randn(0, 2, 32), torch.randn(0, 2, 32))
    with pytest.raises(IndexError, match="layers 0..1"):
        store.prefill(0, 5, *random_kv(10, 2, 32))
    assert store.sequences() == []
    store.prefill(0, 0, *random_kv(10, 2, 32))
    with pytest.raises(ValueError, match=r"must both be \[2, Hkv, D\]"):
        store.append(0, [0, 0], *random_kv(1, 2, 32))
    with pytest.raises(ValueError, match="already has layer 0"):
        store.prefill(0, 0, *random_kv(10, 2, 32))


def test_host_available_bytes_returns_torchs_cached_pinned_blocks_first(monkeypatch):
    """A closed runtime's pinned arena stays in torch's host cache, invisible to psutil: the
    capacity checks hand it back before they read the available memory."""
    import psutil

    from hybrid_runtime.kvcache import host_available_bytes

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("emptied"), raising=False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 12345, "total": 99999})())
    assert host_available_bytes() == 12345 and calls == ["emptied"]


def check_gpu_metadata(store: KVStore, layer: int = 0) -> int:
    """The store's device copy of the metadata equals the arena's metadata rows for every chunk a
    sequence holds; returns how many chunks were compared."""
    meta = store.metadata_gpu(layer)
    ids = [store.chunk_table(s, layer).reshape(-1) for s in store.sequences()]
    ids = torch.from_numpy(np.concatenate(ids)).long() if ids else torch.zeros(0, dtype=torch.long)
    want = store.arena(layer)[ids, layout.META_ROW :]
    assert torch.equal(meta[ids.to(meta.device)].cpu(), want)
    return ids.numel()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_metadata_copy_follows_prefill_extend_spills_and_reuse(dtype):
    """`enable_gpu_metadata` copies what the arena holds, and every later write (a prompt, a
    prompt's next chunk, decode spills, chunks reused after a release) updates the copy."""
    store = make_store(dtype=dtype)
    assert store.metadata_gpu(0) is None and store.memory_stats()["gpu_metadata_bytes"] == 0
    k, v = random_kv(300, 2, 32, seed=1)
    store.prefill(0, 0, k, v)
    store.enable_gpu_metadata()
    assert check_gpu_metadata(store) > 0
    meta = store.metadata_gpu(0)
    assert meta.shape == (store.n_chunks, layout.META_ROWS, 32) and meta.dtype == store.dtype
    assert store.memory_stats()["gpu_metadata_bytes"] == 2 * meta.nbytes  # two layers
    k, v = random_kv(500, 2, 32, seed=2)
    store.prefill(1, 0, k[:200], v[:200])
    store.prefill(1, 0, k[200:], v[200:], extend=True)  # rebuilds a partly filled chunk
    check_gpu_metadata(store)
    for step in range(120):  # spills append to partly filled chunks, then new ones
        k, v = random_kv(2, 2, 32, seed=100 + step)
        store.append(0, [0, 1], k, v)
    check_gpu_metadata(store)
    store.release(0)
    k, v = random_kv(700, 2, 32, seed=3)
    store.prefill(2, 0, k, v)  # reuses the released chunks
    assert check_gpu_metadata(store) == store.chunk_table(1, 0).size + store.chunk_table(2, 0).size
    store.enable_gpu_metadata()  # idempotent: the copy stays
    assert store.metadata_gpu(0) is meta
    store.close()
