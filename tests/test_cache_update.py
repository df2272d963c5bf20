"""`gpu_kernels.cache_update`: the resident cache's table update in one kernel equals
`plan_update_aged` and the claim's torch counts (interpreter on CI, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from gpu_kernels.cache_update import update_cache_rows
from hybrid_runtime.resident_cache import block_tokens, plan_update_aged
from tests.helpers import DEV


def _expected(table, age, seq_slot, kv_head, chosen, cpu_len, keep_steps, blk, token_bytes):
    new, new_age, miss, dest = plan_update_aged(table[seq_slot, kv_head], age[seq_slot, kv_head], chosen, keep_steps)
    table, age = table.clone(), age.clone()
    table[seq_slot, kv_head], age[seq_slot, kv_head] = new, new_age
    moved = torch.where(miss, block_tokens(chosen, cpu_len, blk), 0).sum(1)
    counts = torch.stack([moved * token_bytes, (chosen >= 0).sum(1), miss.sum(1)])
    return table, age, dest, counts


@pytest.mark.parametrize("keep_steps, k, extra", [(1, 5, 1), (2, 5, 3), (3, 4, 0), (1, 13, 7), (2, 45, 4)])
def test_update_equals_plan_update_aged_over_many_steps(keep_steps, k, extra):
    """Rows in an order other than the table's, ids with many repeats between steps, -1 padding, more
    chosen blocks than one tile of the kernel (k 45: two tiles of 32, the misses' ranks carried over),
    partial last blocks, a row with nothing chosen: table, ages, dest and counts after every step
    equal the torch form's, and the tables carried across 12 steps stay equal."""
    gen = torch.Generator().manual_seed(11 * keep_steps + k)
    seqs, heads, blk, token_bytes = 3, 2, 16, 512
    s = keep_steps * k + extra
    table = torch.full((seqs, heads, s), -1, dtype=torch.int64)
    age = torch.zeros((seqs, heads, s), dtype=torch.int64)
    seq_slot = torch.tensor([2, 0, 1, 0, 2])
    kv_head = torch.tensor([1, 0, 1, 1, 0])
    r = len(seq_slot)
    ids = max(20, 2 * k)
    cpu_len = torch.tensor([16 * ids - 20, 16 * ids, 250, 17, 190])
    got_table, got_age = table.clone().to(DEV), age.clone().to(DEV)  # .to(DEV) is no copy on the host
    for step in range(12):
        chosen = torch.stack([torch.randperm(ids, generator=gen)[:k] for _ in range(r)])
        chosen[torch.rand(r, k, generator=gen) < 0.25] = -1
        if step == 5:
            chosen[2] = -1  # a row that chose nothing
        table, age, dest, counts = _expected(table, age, seq_slot, kv_head, chosen, cpu_len, keep_steps, blk,
                                             token_bytes)
        got_dest, got_counts = update_cache_rows(got_table, got_age, seq_slot.to(DEV), kv_head.to(DEV), chosen.to(DEV),
                                                 cpu_len.to(DEV), keep_steps, blk, token_bytes)
        assert torch.equal(got_table.cpu(), table), step
        assert torch.equal(got_age.cpu(), age), step
        assert torch.equal(got_dest.cpu(), dest), step
        assert torch.equal(got_counts.cpu(), counts), step


def test_rows_left_out_are_untouched_and_outputs_can_be_given():
    table = torch.arange(2 * 2 * 6, dtype=torch.int64).view(2, 2, 6) % 9
    age = torch.ones_like(table)
    before = table.clone()
    chosen = torch.tensor([[4, 40, -1]])
    dest = torch.full((1, 3), 7, dtype=torch.int64, device=DEV)
    counts = torch.zeros((3, 1), dtype=torch.int64, device=DEV)
    t, a = table.clone().to(DEV), age.clone().to(DEV)
    out = update_cache_rows(t, a, torch.tensor([1], device=DEV), torch.tensor([0], device=DEV), chosen.to(DEV),
                            torch.tensor([1000], device=DEV), 1, 16, 2, dest=dest, counts=counts)
    assert out[0] is dest and out[1] is counts
    want_table, want_age, want_dest, want_counts = _expected(table, age, torch.tensor([1]), torch.tensor([0]), chosen,
                                                             torch.tensor([1000]), 1, 16, 2)
    assert torch.equal(t.cpu(), want_table) and torch.equal(a.cpu(), want_age)
    assert torch.equal(dest.cpu(), want_dest) and torch.equal(counts.cpu(), want_counts)
    keep = torch.ones_like(before, dtype=torch.bool)
    keep[1, 0] = False
    assert torch.equal(t.cpu()[keep], before[keep])


def test_bad_inputs_are_refused_before_anything_changes():
    table = torch.full((1, 1, 4), -1, dtype=torch.int64, device=DEV)
    age = torch.zeros_like(table)
    one = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="at most its slots"):
        update_cache_rows(table, age, one, one, torch.zeros((1, 5), dtype=torch.int64, device=DEV), one, 1, 16, 2)
    with pytest.raises(ValueError, match="keep_steps 0"):
        update_cache_rows(table, age, one, one, torch.zeros((1, 2), dtype=torch.int64, device=DEV), one, 0, 16, 2)
    with pytest.raises(ValueError, match="chosen"):
        update_cache_rows(table, age, one, one, torch.zeros((1, 2), dtype=torch.int32, device=DEV), one, 1, 16, 2)
    with pytest.raises(ValueError, match="dest"):
        update_cache_rows(table, age, one, one, torch.zeros((1, 2), dtype=torch.int64, device=DEV), one, 1, 16, 2,
                          dest=torch.zeros((2, 2), dtype=torch.int64, device=DEV))
    assert bool((table == -1).all()) and bool((age == 0).all())
