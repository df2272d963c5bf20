"""EvoSparse's block selection and heat, vectorised over the tasks of one layer step (torch, any device).

Every function takes the tasks' padded chunk tables `chunks [T, C]` (arena chunk ids in position
order, padding reads chunk 0 and is masked), CPU lengths `cpu_len [T]` and pre-scaled queries
`q [T, G, D]` (fp32), and reads the arena `[n_chunks, CHUNK_ROWS, D]` in place (a host tensor, or
the UVA view of the pinned arena on CUDA). Blocks are numbered from the start of the CPU segment,
`n_blocks = ceil(cpu_len / block_size)`; padding blocks score -inf and are never selected.

* `quest_scores`: the group's summed Quest bound per block (two products with the block min/max
  metadata), the score of the layers before the first retrieval layer and of the Quest baseline.
* `retrieval_mass`: the retrieval heads' exact softmax over every CPU-resident key, pooled onto
  blocks and summed over the group's retrieval heads (each head's mass sums to 1).
* `select_blocks`: `k_r` blocks by score, then `k_h` blocks by heat among the rest (ties in heat,
  e.g. blocks never attended, go to the higher score).
* `attend_blocks`: exact attention of the group over the selected blocks' K and V, giving
  `(out, lse)` for the runtime's merge and each head's softmax mass per selected block,
  normalised by the task's own lse (the runtime's merge gives the final lse: `heat_increment`).
* `heat_increment` / `decay_and_add`: `h <- lambda * h + s`, with `s` the post-softmax mass of the
  group's heads on the block in this step's attention (0 where not attended).
"""

from __future__ import annotations

import torch

from cpu_kernels import layout


def block_count(cpu_len: torch.Tensor, block_size: int) -> torch.Tensor:
    return (cpu_len + block_size - 1) // block_size


def _block_valid(cpu_len: torch.Tensor, block_size: int, nb: int) -> torch.Tensor:
    """`[T, nb]` True for the blocks that hold CPU-resident tokens."""
    return torch.arange(nb, device=cpu_len.device)[None, :] < block_count(cpu_len, block_size)[:, None]


def quest_scores(arena: torch.Tensor, chunks: torch.Tensor, cpu_len: torch.Tensor, block_size: int, q: torch.Tensor,
                 nb: int) -> torch.Tensor:
    """`[T, nb]` sum over the group's heads of the Quest bound `sum_d max(q_d min_d, q_d max_d)`."""
    t, c = chunks.shape
    per_chunk, off = layout.blocks_per_chunk(block_size), layout.meta_entry_offset(block_size)
    meta = arena[chunks, layout.META_ROW:].view(t, c, layout.META_ENTRIES, 2, -1)[:, :, off : off + per_chunk]
    meta = meta.reshape(t, c * per_chunk, 2, -1)[:, :nb].float()  # [T, nb, 2, D]
    q_pos, q_neg = q.clamp(min=0).sum(1), q.clamp(max=0).sum(1)  # [T, D]
    s = torch.einsum("tbd,td->tb", meta[:, :, 1], q_pos) + torch.einsum("tbd,td->tb", meta[:, :, 0], q_neg)
    return s.masked_fill(~_block_valid(cpu_len, block_size, nb), float("-inf"))


def retrieval_mass(arena: torch.Tensor, chunks: torch.Tensor, cpu_len: torch.Tensor, block_size: int, q: torch.Tensor,
                   heads: torch.Tensor, nb: int) -> torch.Tensor:
    """`[T, nb]` the softmax mass of the retrieval heads (`heads [T, G]` bool) over every CPU key,
    pooled per block and summed over those heads; 0 for a task without retrieval heads."""
    t, c = chunks.shape
    keys = arena[chunks, layout.K_ROW : layout.K_ROW + layout.CHUNK_TOKENS].reshape(t, c * layout.CHUNK_TOKENS, -1)
    s = torch.einsum("tgd,tnd->tgn", q, keys.float())
    tok_ok = torch.arange(s.shape[-1], device=s.device)[None, :] < cpu_len[:, None]
    p = torch.softmax(s.masked_fill(~tok_ok[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    p = p * heads[:, :, None]
    pad = nb * block_size - p.shape[-1]
    p = torch.nn.functional.pad(p, (0, pad)) if pad > 0 else p[..., : nb * block_size]
    return p.view(t, -1, nb, block_size).sum((1, 3))


def select_blocks(score: torch.Tensor, heat: torch.Tensor | None, k_r: torch.Tensor, k_h: torch.Tensor, kr_max: int,
                  kh_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `idx [T, kr_max + kh_max]` and `valid` of the same shape: per task its top `k_r` blocks by
    `score [T, nb]` (-inf: not a block), then its `k_h` hottest blocks (`heat [T, nb]`) among the rest,
    ties in heat to the higher score. `k_r`, `k_h [T]` never ask for more blocks than a task has."""
    t, nb = score.shape
    ar_r = torch.arange(kr_max, device=score.device)
    top = torch.topk(score, kr_max, dim=1).indices if kr_max else score.new_zeros((t, 0), dtype=torch.long)
    valid_r = ar_r[None, :] < k_r[:, None]
    if not kh_max:
        return top, valid_r
    taken = torch.zeros((t, nb), dtype=torch.bool, device=score.device)
    taken.scatter_(1, top, valid_r)
    by_score = torch.sort(score, dim=1, descending=True, stable=True).indices
    h = heat.gather(1, by_score).masked_fill((taken | torch.isinf(score)).gather(1, by_score), float("-inf"))
    hot = by_score.gather(1, torch.sort(h, dim=1, descending=True, stable=True).indices[:, :kh_max])
    valid_h = torch.arange(kh_max, device=score.device)[None, :] < k_h[:, None]
    return torch.cat([top, hot], 1), torch.cat([valid_r, valid_h], 1)


def attend_blocks(arena: torch.Tensor, chunks: torch.Tensor, cpu_len: torch.Tensor, block_size: int, q: torch.Tensor,
                  idx: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`out [T, G, D]`, `lse [T, G]` of the group over the selected blocks (lse -inf, out 0 without
    any), and `mass [T, G, S]`: each head's softmax mass on each selected block, over this task's keys."""
    t, s_blocks = idx.shape
    tok = idx[:, :, None] * block_size + torch.arange(block_size, device=idx.device)  # [T, S, blk]
    ok = valid[:, :, None] & (tok < cpu_len[:, None, None])
    tok = tok.reshape(t, -1)
    chunk = chunks.gather(1, (tok // layout.CHUNK_TOKENS).clamp(max=chunks.shape[1] - 1))
    row = tok % layout.CHUNK_TOKENS
    k = arena[chunk, layout.K_ROW + row].float()  # [T, S*blk, D]
    v = arena[chunk, layout.V_ROW + row].float()
    s = torch.einsum("tgd,tnd->tgn", q, k).masked_fill(~ok.reshape(t, 1, -1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [T, G]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows without keys: lse -inf, p 0
    out = torch.einsum("tgn,tnd->tgd", p, v)
    return out, lse, p.view(t, q.shape[1], s_blocks, block_size).sum(-1)


def heat_increment(mass: torch.Tensor, lse_task: torch.Tensor, lse_final: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
    """`[T, S]` post-softmax mass per selected block, summed over the group's heads: `mass [T, G, S]`
    is over the task's own keys; `exp(lse_task - lse_final)` puts it on the softmax over the union
    the head attended (window included)."""
    w = torch.exp(lse_task - lse_final).nan_to_num(0.0)  # [T, G]; a head without keys: 0
    return (mass * w[..., None]).sum(1) * valid


def decay_and_add(heat: torch.Tensor, rows: tuple[torch.Tensor, ...], idx: torch.Tensor, inc: torch.Tensor,
                  decay: float) -> None:
    """In place: `heat[rows] <- decay * heat[rows]`, then `heat[rows][idx] += inc` (`rows` index the
    leading dims, one row per task; every block of a row decays, the attended ones gain their mass)."""
    heat[rows] = heat[rows] * decay
    t, s = idx.shape
    lead = tuple(r[:, None].expand(t, s) for r in rows)
    heat.index_put_((*lead, idx), inc, accumulate=True)


__all__ = ["attend_blocks", "block_count", "decay_and_add", "heat_increment", "quest_scores", "retrieval_mass",
           "select_blocks"]
