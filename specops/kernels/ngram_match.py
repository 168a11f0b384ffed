"""Triton kernels for `specops::ngram_match`: context n-gram lookup for drafting (paper 001, section 4.2).

Four launches, a torch.cumsum and a torch.topk, no host syncs; each grid is one flat axis of (row, tile)
programs, so a row may hold up to 2**28 tokens:

1. `_match_length_kernel`, per tile of end positions e: m(e), the longest common suffix of ctx[:e+1]
   and ctx capped at max_ngram, and the tile's number of occurrences (m >= min_ngram); O(n * average
   match length). torch.cumsum over each row's tile counts then places every tile's occurrences.
2. `_compact_kernel`, per tile: lists the row's M occurrences densely in order of e, with m(e) and a
   hash of their continuations.
3. `_group_kernel`, per tile of occurrences i: scans the row's occurrences j, latest first, comparing
   continuations (hash, then token by token where hashes agree); only the leader of each group of equal
   continuations, its largest (m, e), stores a key (L << 56) | (N << 28) | R, the others 0. At most M^2
   pair tests per row, but a tile stops scanning once none of its occurrences can lead a group.
4. torch.topk over each row's keys, then `_decode_kernel`, per tile of the [k, width] output: L, N and
   R decoded from the key and the continuation ctx[R+1 : R+1+width] gathered, -1 past the context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.ops._checks import guarded
from specops.ops.ngram import check_ngram_match

__all__ = ["ngram_match_triton"]

# As specops.reference.NGRAM_KEY_BITS: key = (level << 56) | (count << 28) | recency.
_KEY_BITS: tl.constexpr = tl.constexpr(28)
_KEY_MASK: tl.constexpr = tl.constexpr((1 << 28) - 1)
# FNV-1a (Fowler, Noll, Vo) 32-bit offset basis and prime, for the continuation hashes.
_FNV_BASIS: tl.constexpr = tl.constexpr(0x811C9DC5)
_FNV_PRIME: tl.constexpr = tl.constexpr(0x01000193)

_BLOCK_E = 1024  # end positions per program of launches 1 and 2
_BLOCK_I = 64  # occurrences per program of launch 3
_BLOCK_J = 32  # occurrences per step of its scan
_BLOCK_D = 256  # output tokens per program of launch 4


@triton.jit
def _context_length(lengths_ptr, b64, L):
    """Row b's context length clamped to [0, L], so that invalid lengths never read out of bounds."""
    n = tl.load(lengths_ptr + b64).to(tl.int64)
    return tl.minimum(tl.maximum(n, 0), L).to(tl.int32)


@triton.jit(do_not_specialize=["stride_tb", "L", "n_tiles", "min_ngram", "max_ngram"])
def _match_length_kernel(tokens_ptr, lengths_ptr, match_ptr, tile_count_ptr,
                         stride_tb,
                         L, n_tiles,
                         min_ngram, max_ngram,
                         BLOCK: tl.constexpr):
    """m(e) = max q <= max_ngram with ctx[e-q+1 : e+1] == ctx[n-q : n], for e < n - 1 (the query, the
    last q tokens, may overlap the match), found by comparing backwards with an early exit."""
    pid = tl.program_id(0)
    b64 = (pid // n_tiles).to(tl.int64)
    tile = pid % n_tiles
    n = _context_length(lengths_ptr, b64, L)
    row_ptr = tokens_ptr + b64 * stride_tb
    ends = tile * BLOCK + tl.arange(0, BLOCK)
    alive = ends < n - 1
    match = tl.zeros([BLOCK], tl.int32)
    j = tl.zeros([], tl.int32)
    while (j < max_ngram) & (tl.max(alive.to(tl.int32), 0) > 0):
        # Some end is alive, so n - 1 - j > ends - j >= 0: the query token is in the context.
        query = tl.load(row_ptr + (n - 1 - j), mask=n - 1 - j >= 0, other=-1)
        alive = alive & (ends >= j)
        token = tl.load(row_ptr + (ends - j), mask=alive, other=-1)
        alive = alive & (token == query)
        match += alive.to(tl.int32)
        j += 1
    occurs = (ends < n - 1) & (match >= min_ngram)
    tl.store(match_ptr + b64 * L + ends, match.to(tl.int8), mask=ends < L)
    tl.store(tile_count_ptr + pid, tl.sum(occurs.to(tl.int32), 0))


@triton.jit(do_not_specialize=["stride_tb", "L", "n_tiles", "width", "min_ngram"])
def _compact_kernel(tokens_ptr, lengths_ptr, match_ptr, tile_end_ptr, occ_end_ptr, occ_level_ptr,
                    occ_hash_ptr,
                    stride_tb,
                    L, n_tiles,
                    width, min_ngram,
                    BLOCK: tl.constexpr):
    """Lists the row's occurrences in order of e: e, m(e) and a hash of the continuation
    ctx[e+1 : e+1+width] (-1 past n); list order is then recency order."""
    pid = tl.program_id(0)
    b64 = (pid // n_tiles).to(tl.int64)
    tile = pid % n_tiles
    n = _context_length(lengths_ptr, b64, L)
    ends = tile * BLOCK + tl.arange(0, BLOCK)
    match = tl.load(match_ptr + b64 * L + ends, mask=ends < L, other=0).to(tl.int32)
    occurs = (ends < n - 1) & (match >= min_ngram)
    occurs_i = occurs.to(tl.int32)
    count = tl.sum(occurs_i, 0)
    if count > 0:
        row_ptr = tokens_ptr + b64 * stride_tb
        # tile_end holds the inclusive running count of the row's occurrences, tile by tile.
        slots = tl.load(tile_end_ptr + pid) - count + tl.cumsum(occurs_i, 0) - 1
        hashes = tl.full([BLOCK], _FNV_BASIS, tl.uint32)
        # Past n every continuation is -1, so positions t >= n never tell two continuations apart.
        # A while loop: Triton 3.6's interpreter cannot take a loaded value as a `range` bound.
        t = tl.zeros([], tl.int32)
        while t < tl.minimum(width, n):
            pos = ends + 1 + t
            token = tl.load(row_ptr + pos, mask=occurs & (pos < n), other=-1).to(tl.int64)
            hashes = (hashes ^ token.to(tl.uint32)) * _FNV_PRIME
            hashes = (hashes ^ (token >> 32).to(tl.uint32)) * _FNV_PRIME
            t += 1
        tl.store(occ_end_ptr + b64 * L + slots, ends, mask=occurs)
        tl.store(occ_level_ptr + b64 * L + slots, match.to(tl.int8), mask=occurs)
        tl.store(occ_hash_ptr + b64 * L + slots, hashes.to(tl.int32, bitcast=True), mask=occurs)


@triton.jit(do_not_specialize=["stride_tb", "L", "n_tiles_e", "n_tiles", "width"])
def _group_kernel(tokens_ptr, lengths_ptr, tile_end_ptr, occ_end_ptr, occ_level_ptr, occ_hash_ptr, key_ptr,
                  stride_tb,
                  L, n_tiles_e, n_tiles,
                  width,
                  BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Occurrence i leads its group of equal continuations iff no j in it has a larger (m, e); the
    leader's key is (m << 56) | (N << 28) | e, N = #{j in the group: m(j) = m(i)}. Others store 0."""
    pid = tl.program_id(0)
    b64 = (pid // n_tiles).to(tl.int64)
    tile = pid % n_tiles
    n = _context_length(lengths_ptr, b64, L)
    num_occ = tl.load(tile_end_ptr + b64 * n_tiles_e + n_tiles_e - 1)
    row_ptr = tokens_ptr + b64 * stride_tb
    occ_row = b64 * L
    w_eff = tl.minimum(width, n)
    idx_i = tile * BLOCK_I + tl.arange(0, BLOCK_I)
    valid_i = idx_i < num_occ
    end_i = tl.load(occ_end_ptr + occ_row + idx_i, mask=valid_i, other=0)
    level_i = tl.load(occ_level_ptr + occ_row + idx_i, mask=valid_i, other=0).to(tl.int32)
    hash_i = tl.load(occ_hash_ptr + occ_row + idx_i, mask=valid_i, other=0)
    leads = valid_i
    count = tl.zeros([BLOCK_I], tl.int32)
    n_steps = tl.cdiv(num_occ, BLOCK_J)
    step = tl.zeros([], tl.int32)
    # Latest occurrences first: they outrank the earlier ones of their level, so a tile stops scanning
    # soon once none of its occurrences can lead (tiles past the list's end never start).
    while (step < n_steps) & (tl.max(leads.to(tl.int32), 0) > 0):
        idx_j = (n_steps - 1 - step) * BLOCK_J + tl.arange(0, BLOCK_J)
        valid_j = idx_j < num_occ
        hash_j = tl.load(occ_hash_ptr + occ_row + idx_j, mask=valid_j, other=0)
        same = (hash_i[:, None] == hash_j[None, :]) & leads[:, None] & valid_j[None, :]
        if tl.max(same.to(tl.int32)) > 0:
            # Equal hashes: confirm token by token (tokens past n read as -1, as in the reference).
            end_j = tl.load(occ_end_ptr + occ_row + idx_j, mask=valid_j, other=0)
            t = tl.zeros([], tl.int32)
            while (t < w_eff) & (tl.max(same.to(tl.int32)) > 0):
                pos_i = end_i + 1 + t
                pos_j = end_j + 1 + t
                token_i = tl.load(row_ptr + pos_i, mask=leads & (pos_i < n), other=-1)
                token_j = tl.load(row_ptr + pos_j, mask=valid_j & (pos_j < n), other=-1)
                same = same & (token_i[:, None] == token_j[None, :])
                t += 1
            level_j = tl.load(occ_level_ptr + occ_row + idx_j, mask=valid_j, other=0).to(tl.int32)
            # The list is in order of e, so list positions compare like end positions.
            above = level_j[None, :] > level_i[:, None]
            same_level = level_j[None, :] == level_i[:, None]
            outranked = same & (above | (same_level & (idx_j[None, :] > idx_i[:, None])))
            leads = leads & (tl.max(outranked.to(tl.int32), 1) == 0)
            at_level = same & same_level
            count += tl.sum(at_level.to(tl.int32), 1)
        step += 1
    key = ((level_i.to(tl.int64) << (2 * _KEY_BITS)) | (count.to(tl.int64) << _KEY_BITS)
           | end_i.to(tl.int64))
    tl.store(key_ptr + occ_row + idx_i, tl.where(leads, key, 0), mask=idx_i < L)


@triton.jit(do_not_specialize=["stride_tb", "L", "n_tiles", "num_candidates", "num_keys", "width"])
def _decode_kernel(tokens_ptr, lengths_ptr, top_key_ptr, candidates_ptr, counts_ptr, ngram_ptr,
                   stride_tb,
                   L, n_tiles,
                   num_candidates, num_keys, width,
                   BLOCK: tl.constexpr):
    """Candidate s of row b: key = top_key[b, s] (s < num_keys), 0 for none; L = key >> 56,
    N = (key >> 28) & mask, continuation ctx[R+1 : R+1+width], R = key & mask, -1 past n."""
    pid = tl.program_id(0)
    b64 = (pid // n_tiles).to(tl.int64)
    tile = pid % n_tiles
    n = _context_length(lengths_ptr, b64, L)
    row_size = num_candidates.to(tl.int64) * width
    flat = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_out = flat < row_size
    slot = flat // width
    t = flat % width
    key = tl.load(top_key_ptr + b64 * num_keys + slot, mask=in_out & (slot < num_keys), other=0)
    found = key > 0
    pos = (key & _KEY_MASK) + 1 + t
    token = tl.load(tokens_ptr + b64 * stride_tb + pos, mask=found & (pos < n), other=-1).to(tl.int64)
    tl.store(candidates_ptr + b64 * row_size + flat, token, mask=in_out)
    first = in_out & (t == 0)
    out = b64 * num_candidates + slot
    tl.store(counts_ptr + out, tl.where(found, (key >> _KEY_BITS) & _KEY_MASK, 0), mask=first)
    tl.store(ngram_ptr + out, tl.where(found, key >> (2 * _KEY_BITS), 0), mask=first)


def ngram_match_triton(tokens: torch.Tensor, lengths: torch.Tensor, min_ngram: int, max_ngram: int,
                       num_candidates: int, width: int, validate: bool = True,
                       block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton implementation of `specops::ngram_match` on the op's normalized arguments (see
    `specops.ops.ngram_match`): tokens [B, L] int32/int64 and lengths [B] on one device. Values are not
    checked here (that would be a host sync inside the op); `specops.ops.ngram_match` checks them when
    `validate` is true, and the kernels clamp lengths to [0, L] in any case. `block_size` overrides
    every tile (a power of two >= 2), for tests of the multi-tile paths."""
    # The op is reachable directly, not only through the wrapper; the kernels index rows densely.
    tokens, lengths = tokens.contiguous(), lengths.contiguous()
    batch, length = tokens.shape
    device = tokens.device
    if batch == 0 or length == 0:
        return (torch.full((batch, num_candidates, width), -1, dtype=torch.int64, device=device),
                torch.zeros((batch, num_candidates), dtype=torch.int64, device=device),
                torch.zeros((batch, num_candidates), dtype=torch.int64, device=device))
    if block_size is not None and (block_size < 2 or block_size & (block_size - 1)):
        raise ValueError(f"ngram_match: block_size must be a power of two >= 2, got {block_size}")
    if block_size is None:
        block_e, block_i, block_j, block_d = _BLOCK_E, _BLOCK_I, _BLOCK_J, _BLOCK_D
    else:
        block_e = block_i = block_j = block_d = block_size
    stride_tb = tokens.stride(0)

    n_tiles_e = triton.cdiv(length, block_e)
    match = torch.empty((batch, length), dtype=torch.int8, device=device)
    tile_count = torch.empty((batch, n_tiles_e), dtype=torch.int32, device=device)
    _match_length_kernel[(batch * n_tiles_e,)](
        tokens, lengths, match, tile_count,
        stride_tb, length, n_tiles_e, min_ngram, max_ngram,
        BLOCK=block_e, num_warps=4)
    tile_end = torch.cumsum(tile_count, dim=1, dtype=torch.int32)

    occ_end = torch.empty((batch, length), dtype=torch.int32, device=device)
    occ_level = torch.empty((batch, length), dtype=torch.int8, device=device)
    occ_hash = torch.empty((batch, length), dtype=torch.int32, device=device)
    _compact_kernel[(batch * n_tiles_e,)](
        tokens, lengths, match, tile_end, occ_end, occ_level, occ_hash,
        stride_tb, length, n_tiles_e, width, min_ngram,
        BLOCK=block_e, num_warps=4)

    n_tiles_i = triton.cdiv(length, block_i)
    keys = torch.empty((batch, length), dtype=torch.int64, device=device)
    _group_kernel[(batch * n_tiles_i,)](
        tokens, lengths, tile_end, occ_end, occ_level, occ_hash, keys,
        stride_tb, length, n_tiles_e, n_tiles_i, width,
        BLOCK_I=block_i, BLOCK_J=block_j, num_warps=4)

    # Keys are distinct except for the zeros of non-leaders, which decode to "no candidate" in any order.
    num_keys = min(num_candidates, length)
    top_keys = torch.topk(keys, num_keys, dim=1).values.contiguous()
    # The decode kernel writes every output element.
    candidates = torch.empty((batch, num_candidates, width), dtype=torch.int64, device=device)
    counts = torch.empty((batch, num_candidates), dtype=torch.int64, device=device)
    ngram = torch.empty((batch, num_candidates), dtype=torch.int64, device=device)
    n_tiles_d = triton.cdiv(num_candidates * width, block_d)
    _decode_kernel[(batch * n_tiles_d,)](
        tokens, lengths, top_keys, candidates, counts, ngram,
        stride_tb, length, n_tiles_d, num_candidates, num_keys, width,
        BLOCK=block_d, num_warps=4)
    return candidates, counts, ngram


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
ngram_match_cuda = guarded(check_ngram_match, ngram_match_triton)
torch.library.register_kernel("specops::ngram_match", "cuda", ngram_match_cuda)
