"""Triton kernel for `specops::ngram_memory_insert`: new end positions join the n-gram memory's sorted index, in
place (semantics: specops/reference.py, "The n-gram memory's index").

One kernel merges pairs of sorted runs: every element finds, by binary search, how many elements of the other
run of its pair precede it in the key order (keys compared one depth at a time, all lanes together, until
every lane has decided: most comparisons end within a token or two), which with its own index in its run is
its place in the merged pair. The order is total (ties between equal keys go to the position), so the two runs of a pair fill the
merged run without collisions. The launcher sorts the new positions bottom up (runs of 1, 2, 4, ...), merges
the result with each level it has outgrown, newest first (`reference.memory_merged_blocks`), and writes it over
them at the buffer's tail; older levels are not touched. Every size is known on the host from the level
sizes, so there are no host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.ops._checks import guarded
from specops.ops.ngram import check_ngram_memory_insert
from specops.reference import memory_merged_blocks

__all__ = ["ngram_memory_insert_triton"]

_BLOCK = 128  # elements per program


@triton.jit
def _less(tokens_ptr, T, a, b, depth, live):
    """(key(a), a) < (key(b), b) lane by lane, for end positions a, b [BLOCK]: the keys read one depth at a time
    (t[e - j], -1 from the first negative token or the store's start on), until every live lane has decided."""
    undecided = live
    less = a < b  # equal keys: the position decides
    a_alive = live
    b_alive = live
    j = tl.zeros([], tl.int32)
    while (j < depth) & (tl.max(undecided.to(tl.int32), 0) > 0):
        at_a = a - j
        at_b = b - j
        x = tl.load(tokens_ptr + at_a, mask=undecided & (at_a >= 0) & (at_a < T), other=-1)
        y = tl.load(tokens_ptr + at_b, mask=undecided & (at_b >= 0) & (at_b < T), other=-1)
        a_alive = a_alive & (x >= 0)
        b_alive = b_alive & (y >= 0)
        x = tl.where(a_alive, x, -1)
        y = tl.where(b_alive, y, -1)
        differs = undecided & (x != y)
        less = tl.where(differs, x < y, less)
        undecided = undecided & ~differs & (a_alive | b_alive)  # both keys stopped: equal
        j += 1
    return less


@triton.jit(do_not_specialize=["T", "n", "run", "steps", "depth"])
def _merge_kernel(tokens_ptr, src_ptr, dst_ptr,
                  T, n, run, steps, depth,
                  BLOCK: tl.constexpr):
    """src [n] holds sorted runs of `run` elements (the last may be shorter); dst gets each pair of runs
    merged. steps >= log2(run + 1): binary-search iterations."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    me = tl.load(src_ptr + i, mask=live, other=0).to(tl.int64)
    which = i // run
    base = (which // 2) * (2 * run)
    left_run = which % 2 == 0
    other_start = tl.where(left_run, base + run, base)
    other_end = tl.minimum(tl.where(left_run, base + 2 * run, base + run), n)
    other_end = tl.maximum(other_end, other_start)
    # How many elements of the other run precede me.
    lo = other_start
    hi = other_end
    for _ in range(0, steps):
        searching = lo < hi
        mid = (lo + hi) // 2
        them = tl.load(src_ptr + mid, mask=live & searching, other=0).to(tl.int64)
        before = _less(tokens_ptr, T, them, me, depth, live & searching)
        lo = tl.where(searching & before, mid + 1, lo)
        hi = tl.where(searching & ~before, mid, hi)
    own = i - tl.where(left_run, base, base + run)
    tl.store(dst_ptr + base + own + (lo - other_start), me.to(tl.int32), mask=live)


def _merge_pass(tokens: torch.Tensor, src: torch.Tensor, run: int, depth: int) -> torch.Tensor:
    n = src.shape[0]
    dst = torch.empty_like(src)
    _merge_kernel[(triton.cdiv(n, _BLOCK),)](
        tokens, src, dst, tokens.shape[0], n, run, max(run, 1).bit_length(), depth,
        BLOCK=_BLOCK, num_warps=4)
    return dst


def ngram_memory_insert_triton(tokens: torch.Tensor, entries: torch.Tensor, levels: list[int], positions: torch.Tensor,
                               depth: int, validate: bool = True) -> None:
    """Triton implementation of `specops::ngram_memory_insert` on the op's arguments (see
    `specops.ops.ngram_memory_insert`), in place. Values are not checked here (`check_ngram_memory_insert` does,
    before the launch); every load is masked to the store, so no input reads out of bounds."""
    tokens = tokens.contiguous()
    added = positions.shape[0]
    merged = memory_merged_blocks(levels, added)
    if merged == 0:
        return
    front = positions.to(torch.int32).contiguous()
    run = 1
    while run < added:  # bottom-up merge sort of the new positions
        front = _merge_pass(tokens, front, run, depth)
        run *= 2
    end = sum(levels)
    for size in reversed(levels[len(levels) - (merged - 1):]):  # the newest levels, newest first
        level = entries[end - size:end]
        longer, shorter = (level, front) if size >= front.shape[0] else (front, level)
        front = _merge_pass(tokens, torch.cat([longer, shorter]), longer.shape[0], depth)
        end -= size
    entries[end:end + front.shape[0]] = front


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
ngram_memory_insert_cuda = guarded(check_ngram_memory_insert, ngram_memory_insert_triton)
torch.library.register_kernel("specops::ngram_memory_insert", "cuda", ngram_memory_insert_cuda)
