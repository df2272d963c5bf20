"""Layout of one layer's CPU-store arena, shared by the numba and the Triton kernels.

The arena of a layer is one tensor `[n_chunks, CHUNK_ROWS, head_dim]` (bf16 or fp32, pinned
when CUDA exists). A chunk is the allocation unit: 8 pages = 128 consecutive CPU-resident tokens
of one KV head of one sequence. Allocating 8 pages at a time keeps every block of every
granularity (16, 32, 64, 128 tokens) contiguous in memory, and the block metadata sits in the
same chunk, so one UVA view of the arena reaches everything a task reads.

Rows of a chunk:
    [0, 128)      keys of the chunk's 128 tokens
    [128, 256)    values
    [256, 286)    15 metadata entries, each two rows (key min, then key max, per dimension):
                  entries 0..7 for the 8 blocks of 16 tokens, 8..11 for blk 32,
                  12..13 for blk 64, 14 for blk 128

Rows of tokens past a sequence's CPU length are zero (kernels mask them by length; zeros keep
masked values finite). Metadata of blocks with no valid token is zero and is never read.
"""

PAGE_SIZE = 16
CHUNK_TOKENS = 128
PAGES_PER_CHUNK = CHUNK_TOKENS // PAGE_SIZE
K_ROW = 0
V_ROW = CHUNK_TOKENS
META_ROW = 2 * CHUNK_TOKENS
META_ENTRIES = 15
META_ROWS = 2 * META_ENTRIES  # metadata rows of a chunk; a GPU copy of them alone is `[n_chunks, META_ROWS, D]`
CHUNK_ROWS = META_ROW + META_ROWS
BLOCK_SIZES = (16, 32, 64, 128)
# First metadata entry of each granularity inside a chunk.
META_ENTRY_OFFSET = {16: 0, 32: 8, 64: 12, 128: 14}


def blocks_per_chunk(block_size: int) -> int:
    return CHUNK_TOKENS // block_size


def meta_entry_offset(block_size: int) -> int:
    try:
        return META_ENTRY_OFFSET[block_size]
    except KeyError:
        raise ValueError(f"block_size {block_size} is not one of {BLOCK_SIZES}") from None
