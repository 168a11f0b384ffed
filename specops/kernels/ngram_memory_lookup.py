"""Triton kernel for `specops::ngram_memory_lookup`: the longest match of each row's last tokens in the n-gram
memory's index, and the continuations that followed it (semantics: specops/reference.py, "The n-gram memory's
index").

One program per row, in three passes over the levels:
1. per level, a binary search for the query's place in the level's order (a key comparison is one vector
   load of up to `depth` tokens backwards from the entry); the row's match L is the longest common prefix of
   the query with the entries on either side of its place, over all levels;
2. per level, newest first (levels lie in the buffer oldest first), the stretch of entries matching L tokens
   around that place, by galloping out and a binary search; the quota of occurrences read is filled from the
   newest levels first, evenly spread in a level that does not fit;
3. the read occurrences go to a scratch buffer and are grouped by exact comparison of their continuations,
   tiles of 32 against tiles of 32, one continuation token at a time read from the store (so nothing as
   large as [occurrences, width] is held), each group led by its latest occurrence; the top k groups are
   written out.
No host syncs; the level offsets go to the device as a small tensor built from the level sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.ops._checks import guarded
from specops.ops.ngram import check_ngram_memory_lookup

__all__ = ["ngram_memory_lookup_triton"]

_TILE = 32  # occurrences compared at once in the grouping pass: [32, 32] per tile pair


@triton.jit
def _compare(tokens_ptr, T, e, query, qlen, offs):
    """(tokens of the query that key(e) matches, whether key(e) < query): key(e) is t[e], t[e - 1], ..., -1
    past the store or from a negative token on, which differs from every query token (all >= 0)."""
    at = e - offs
    x = tl.load(tokens_ptr + at, mask=(offs < qlen) & (at >= 0) & (at < T), other=-1).to(tl.int64)
    differs = (x != query) & (offs < qlen)
    first = tl.min(tl.where(differs, offs, qlen), 0)
    below = tl.sum(tl.where((offs == first) & differs & (x < query), 1, 0), 0) > 0
    return first, below


@triton.jit
def _matching_stretch(tokens_ptr, entries_ptr, T, start, size, place, query, qlen, length, offs):
    """[first, end): the entries of the level at entries_ptr + start (size of them) around `place` whose keys
    match `length` query tokens, by galloping out from place and a binary search at each side."""
    # Down: entries [good, place) match.
    good = place
    step = place * 0 + 1
    failed = place * 0 - 1
    while (good > 0) & (failed < 0):
        probe = tl.maximum(good - step, 0)
        m, _ = _compare(tokens_ptr, T, tl.load(entries_ptr + start + probe).to(tl.int64), query, qlen, offs)
        ok = m >= length
        failed = tl.where(ok, failed, probe)
        good = tl.where(ok, probe, good)
        step = step * 2
    lo = tl.where(failed < 0, good, failed + 1)
    hi = good
    while lo < hi:
        mid = (lo + hi) // 2
        m, _ = _compare(tokens_ptr, T, tl.load(entries_ptr + start + mid).to(tl.int64), query, qlen, offs)
        ok = m >= length
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid + 1)
    first = lo
    # Up: entries [place, good) match.
    good = place
    step = place * 0 + 1
    failed = place * 0 - 1
    while (good < size) & (failed < 0):
        probe = tl.minimum(good + step, size) - 1
        m, _ = _compare(tokens_ptr, T, tl.load(entries_ptr + start + probe).to(tl.int64), query, qlen, offs)
        ok = m >= length
        failed = tl.where(ok, failed, probe)
        good = tl.where(ok, probe + 1, good)
        step = step * 2
    lo = good
    hi = tl.where(failed < 0, good, failed)
    while lo < hi:
        mid = (lo + hi) // 2
        m, _ = _compare(tokens_ptr, T, tl.load(entries_ptr + start + mid).to(tl.int64), query, qlen, offs)
        ok = m >= length
        lo = tl.where(ok, mid + 1, lo)
        hi = tl.where(ok, hi, mid)
    return first, lo


# One program per request: search every level, then gather and rank the continuations, in one launch. The
# searches are the helpers above; the ranking keeps its candidate tiles in registers, so it stays whole.
@triton.jit(do_not_specialize=["T", "C", "n_levels", "depth", "min_match", "num_candidates", "width",
                               "max_occurrences"])
def _lookup_kernel(tokens_ptr, entries_ptr, starts_ptr, contexts_ptr, lengths_ptr, places_ptr, chosen_ptr, keys_ptr,
                   candidates_ptr, counts_ptr, latest_ptr, match_ptr, occurrences_ptr,
                   T, C, n_levels,
                   depth, min_match, num_candidates, width, max_occurrences,
                   BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + b), 0), C)  # clamped: never read outside the row
    qlen = tl.minimum(n, depth)
    query = tl.load(contexts_ptr + b * C + (n - 1 - offs), mask=offs < qlen, other=-2).to(tl.int64)

    # 1. The query's place in every level, and the longest match L.
    best = n * 0
    for level in range(0, n_levels):
        start = tl.load(starts_ptr + level)
        size = tl.load(starts_ptr + level + 1) - start
        lo = start * 0
        hi = size
        while lo < hi:
            mid = (lo + hi) // 2
            _, below = _compare(tokens_ptr, T, tl.load(entries_ptr + start + mid).to(tl.int64), query, qlen, offs)
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        tl.store(places_ptr + b * n_levels + level, lo)
        if lo > 0:
            m, _ = _compare(tokens_ptr, T, tl.load(entries_ptr + start + lo - 1).to(tl.int64), query, qlen, offs)
            best = tl.maximum(best, m)
        if lo < size:
            m, _ = _compare(tokens_ptr, T, tl.load(entries_ptr + start + lo).to(tl.int64), query, qlen, offs)
            best = tl.maximum(best, m)
    found = (qlen > 0) & (best >= min_match)

    # 2. The occurrences, and which of them are read.
    slots = tl.arange(0, BLOCK_S)
    chosen = tl.full([BLOCK_S], -1, tl.int64)
    taken = n * 0
    left = tl.where(found, max_occurrences, 0).to(tl.int64)
    total = n * 0
    if found:
        for newest in range(0, n_levels):
            level = n_levels - 1 - newest
            start = tl.load(starts_ptr + level)
            size = tl.load(starts_ptr + level + 1) - start
            place = tl.load(places_ptr + b * n_levels + level)
            first, end = _matching_stretch(tokens_ptr, entries_ptr, T, start, size, place, query, qlen, best, offs)
            count = end - first
            total += count
            whole = count <= left
            take = tl.where(whole, count, left)
            local = (slots - taken).to(tl.int64)
            here = (local >= 0) & (local < take)
            index = first + tl.where(whole, local, (local * count) // tl.maximum(left, 1))
            e = tl.load(entries_ptr + start + index, mask=here, other=-1).to(tl.int64)
            chosen = tl.where(here, e, chosen)
            taken += take
            left -= take
    tl.store(chosen_ptr + b * BLOCK_S + slots, chosen)
    tl.debug_barrier()  # the tiles below read what other threads of this program stored

    # 3. Continuations, grouped exactly (tiles of occurrences, one continuation token at a time, read from the
    #    store); each group is led by its latest occurrence, whose key (count << 32 | position) ranks it.
    tile = tl.arange(0, TILE)
    for i0 in range(0, BLOCK_S, TILE):
        mine = tl.load(chosen_ptr + b * BLOCK_S + i0 + tile)
        mine_valid = (i0 + tile) < taken
        count = tl.zeros([TILE], tl.int64)
        last = tl.full([TILE], -1, tl.int64)
        for j0 in range(0, BLOCK_S, TILE):
            theirs = tl.load(chosen_ptr + b * BLOCK_S + j0 + tile)
            their_valid = (j0 + tile) < taken
            same = mine_valid[:, None] & their_valid[None, :]
            mine_alive = mine_valid
            their_alive = their_valid
            for j in range(0, width):
                x = tl.load(tokens_ptr + mine + 1 + j, mask=mine_alive & (mine + 1 + j < T), other=-1)
                y = tl.load(tokens_ptr + theirs + 1 + j, mask=their_alive & (theirs + 1 + j < T), other=-1)
                mine_alive = mine_alive & (x >= 0)
                their_alive = their_alive & (y >= 0)
                x = tl.where(mine_alive, x, -1)
                y = tl.where(their_alive, y, -1)
                same = same & (x[:, None] == y[None, :])
            count += tl.sum(same.to(tl.int64), 1)
            last = tl.maximum(last, tl.max(tl.where(same, theirs[None, :], -1), 1))
        key = tl.where(mine_valid & (mine == last), (count << 32) | last, -1)
        tl.store(keys_ptr + b * BLOCK_S + i0 + tile, key)

    tl.debug_barrier()
    keys = tl.load(keys_ptr + b * BLOCK_S + slots)
    cols = tl.arange(0, BLOCK_W)
    out = b * num_candidates
    for t in range(0, num_candidates):
        top = tl.max(keys, 0)
        e = tl.where(top >= 0, top & 0xFFFFFFFF, T)  # no group left: a place past the store, nothing read
        at = e + 1 + cols
        raw = tl.load(tokens_ptr + at, mask=(cols < width) & (at < T), other=-1).to(tl.int64)
        row = tl.where(tl.cumsum((raw < 0).to(tl.int32), 0) > 0, -1, raw)
        tl.store(candidates_ptr + (out + t) * width + cols, row, mask=cols < width)
        tl.store(counts_ptr + out + t, tl.where(top >= 0, top >> 32, 0))
        tl.store(latest_ptr + out + t, tl.where(top >= 0, e, -1))
        keys = tl.where(keys == top, -1, keys)
    tl.store(match_ptr + b, tl.where(found, best, 0))
    tl.store(occurrences_ptr + b, total)


def ngram_memory_lookup_triton(tokens: torch.Tensor, entries: torch.Tensor, levels: list[int], contexts: torch.Tensor,
                               lengths: torch.Tensor, depth: int, min_match: int, num_candidates: int, width: int,
                               max_occurrences: int, validate: bool = True) -> tuple[torch.Tensor, ...]:
    """Triton implementation of `specops::ngram_memory_lookup` on the op's arguments (see
    `specops.ops.ngram_memory_lookup`). Values are not checked here (`check_ngram_memory_lookup` does, before
    the launch); the kernel clamps lengths and masks every load, so no input reads out of bounds."""
    tokens, entries = tokens.contiguous(), entries.contiguous()
    contexts, lengths = contexts.contiguous(), lengths.contiguous()
    batch, columns = contexts.shape
    device = contexts.device
    long = dict(dtype=torch.int64, device=device)
    candidates = torch.full((batch, num_candidates, width), -1, **long)
    counts = torch.zeros((batch, num_candidates), **long)
    latest = torch.full((batch, num_candidates), -1, **long)
    match = torch.zeros((batch,), **long)
    occurrences = torch.zeros((batch,), **long)
    if batch == 0 or columns == 0 or not levels:
        return candidates, counts, latest, match, occurrences
    starts = torch.tensor([0, *torch.tensor(levels).cumsum(0).tolist()], **long)
    places = torch.empty((batch, len(levels)), **long)
    block_s = max(_TILE, triton.next_power_of_2(max_occurrences))
    chosen = torch.empty((batch, block_s), **long)  # scratch: the occurrences read, and their groups' keys
    keys = torch.empty((batch, block_s), **long)
    _lookup_kernel[(batch,)](
        tokens, entries, starts, contexts, lengths, places, chosen, keys,
        candidates, counts, latest, match, occurrences,
        tokens.shape[0], columns, len(levels),
        depth, min_match, num_candidates, width, max_occurrences,
        BLOCK_D=triton.next_power_of_2(depth), BLOCK_S=block_s, BLOCK_W=triton.next_power_of_2(width), TILE=_TILE,
        num_warps=4)
    return candidates, counts, latest, match, occurrences


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
ngram_memory_lookup_cuda = guarded(check_ngram_memory_lookup, ngram_memory_lookup_triton)
torch.library.register_kernel("specops::ngram_memory_lookup", "cuda", ngram_memory_lookup_cuda)
