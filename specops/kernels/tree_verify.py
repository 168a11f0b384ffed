"""Triton kernels for `specops::tree_verify`: recursive rejection sampling over a draft tree (RSD, Jeon et
al. 2024; SpecInfer's multi-step speculative sampling with replacement), or with scheme "traversal"
traversal verification (Weng et al., NeurIPS 2025, arXiv 2505.12398).

Two launches, none of which holds a whole vocabulary row in one program:

1. `_tile_stats_kernel`, grid (B*N, n_tiles): per vocabulary tile of every valid node's row (n <
   num_nodes[b]), the maximum of x = logits / T and sum(exp(x - that maximum)), and the raw logits'
   maximum with its first index (the argmax for greedy rows and for rows where logits / T overflows).
   The walk reaches only some rows, but which is not known before it runs.
2. The walk of one request, grid (B,):
   - `_walk_kernel` (scheme "recursive"): root -> children in node order -> descend on acceptance.
     Accept child x iff u * q_i(x) * R < r(x), p_i = r / R (r = p, R = 1 until a rejection); on a rejection
     r <- r without x (one-hot q) or r <- max(0, r * f32(1 / R) - q * f32(1 / s)) (q_i = q / s, s the
     float64 mass of q not yet drawn), R <- its float64 mass. The residual r lives in a float32 scratch row
     per request, written only from the first rejection at a node on (two rows with draft_probs: the
     update reads one and writes the other, as it is dropped if it has no mass); its per-tile float64
     masses stay in registers. The emitted token is the two-level inverse CDF of r.
   - `_traversal_kernel` (scheme "traversal"): from the first leaf up, each rejected node updating its
     parent's residual r_b and weight. No residual row is stored. Each update of r_b is elementwise,
     r_b <- max(0, r_b * a_k - q * c_k) at the k-th child removed (a_k, c_k float32 scalars; one-hot q:
     r_b with x_k zeroed), so r_b at a token or over a tile is recomputed from p_b and q_b by replaying
     them, bit for bit the row the reference stores. Scratch is 72 bytes a node: [B, 5, N] float64 (w,
     num, den, R, s), [B, 4, N] float32 (the row's maximum and normalizer, the two scales of the node's
     removal), [B, 4, N] int32 (keep-cut, kind, argmax, status). Stored rows would take [B, depth, 2, V]
     float32 (by depth on the path; two to ping-pong, as an update without mass is dropped), with depth
     up to N - 1 as it is not known on the host: 2 GB at B = 32, N = 64, V = 128K. Replaying costs
     compute instead: the pass after b's k-th loss replays k updates a value, while reading the logits
     and q much as the recursive walk reads r and q.

Every random number is Philox4x32-10 on the counter (position, stream, offset), as in
`specops.reference`, so the tokens equal the reference's for the same seeds up to float ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.kernels._sampling import (_SAMPLED, _STREAM_ACCEPT, _STREAM_SAMPLE, _filter_cut,
                                       _inverse_cdf_index, _inverse_cdf_tile, _ordered_key, _request_sampling,
                                       _row_argmax, _row_normalizer, _row_state, _row_tile_stats, _uniform,
                                       offset_words, tile_stat_buffers, vocab_tiling)
from specops.ops._checks import guarded
from specops.ops.sampling import check_tree_verify

__all__ = ["tree_verify_triton"]


@triton.jit(do_not_specialize=["N"])
def _tile_stats_kernel(logits_ptr, num_nodes_ptr, temperature_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr,
                       tile_arg_ptr, stride_lb, stride_ln, V, N, n_tiles, BLOCK_V: tl.constexpr):
    """Per tile of row (b, n): m_t = max x, s_t = sum exp(x - m_t), x = logits / T (T = 1 for greedy
    rows), and the raw logits' maximum with its first index; the row's normalizer is then
    Z = sum_t s_t exp(m_t - m), m = max_t m_t (online softmax, Milakov & Gimelshein 2018)."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    b = row // N
    n = row % N
    # Rows of padding nodes are never read by the walk, which clamps num_nodes to [1, N] as here.
    if n < tl.maximum(tl.load(num_nodes_ptr + b), 1):
        row_ptr = logits_ptr + b.to(tl.int64) * stride_lb + n.to(tl.int64) * stride_ln
        _row_tile_stats(row_ptr, tl.load(temperature_ptr + b), tile, row.to(tl.int64) * n_tiles + tile,
                        tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, V, BLOCK_V)


@triton.jit
def _target_prob(row_ptr, offs, mask, scale, row_max, z, cut):
    """p at `offs` (masked lanes: 0), float32 like the reference's softmax of the filtered row. The one
    formula for p(x) in an acceptance test and for the residual it starts, so both agree bit for bit."""
    raw = tl.load(row_ptr + offs, mask=mask, other=-float("inf"))
    x = tl.math.div_rn(raw.to(tl.float32), scale)
    keep = mask & (_ordered_key(x) >= cut)
    return tl.where(keep, tl.math.div_rn(tl.exp(x - row_max), z), 0.0)


@triton.jit
def _fill_target(row_ptr, res_ptr, scale, row_max, z, cut, tiles, V, n_tiles, BLOCK_V: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Writes p into the residual row; returns its per-tile float64 masses."""
    # Other threads may still be reading the row as the previous node left it.
    tl.debug_barrier()
    masses = tl.zeros([BLOCK_T], tl.float64)
    for tile in range(0, n_tiles):
        offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = offs < V
        p = _target_prob(row_ptr, offs, in_row, scale, row_max, z, cut)
        tl.store(res_ptr + offs, p, mask=in_row)
        masses = tl.where(tiles == tile, tl.sum(p.to(tl.float64), 0), masses)
    # Later reads of the row (a scalar r(x), other lanes' tiles) may come from other threads.
    tl.debug_barrier()
    return masses


@triton.jit
def _draft_update(r, q, scale_r, scale_q):
    """max(0, r * scale_r - q * scale_q): a residual after a rejection against draft probabilities q. The one
    formula of both schemes; kernels calling it run without FP fusion, as an FMA would round differently from
    the reference."""
    return tl.maximum(r * scale_r - q * scale_q, 0.0)


@triton.jit
def _request_tree(tokens_ptr, parents_ptr, num_nodes_ptr, out_tokens_ptr, out_nodes_ptr, stride_tb, stride_pb,
                  stride_ob, b, N):
    """Request b's tree as both walks read it: its node count, clamped to [1, N] so that an unchecked count
    (validate=False) never indexes past the rows, and its rows of tokens, parents and outputs."""
    b64 = b.to(tl.int64)
    count = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + b), 1), N).to(tl.int32)
    return (count, tokens_ptr + b64 * stride_tb, parents_ptr + b64 * stride_pb, out_tokens_ptr + b64 * stride_ob,
            out_nodes_ptr + b64 * stride_ob)


@triton.jit
def _greedy_child(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, tokens_row_ptr, parents_row_ptr, node, count, V):
    """A greedy step at `node`: the first argmax of its raw logits, and the first child drafting it (or -1)."""
    _raw_max, best = _row_argmax(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, V)
    follow = tl.full([], -1, tl.int32)
    for c in range(node + 1, count):
        if follow < 0:
            child = (tl.load(parents_row_ptr + c) == node) & (tl.load(tokens_row_ptr + c) == best)
            follow = tl.where(child, c, follow)
    return best, follow


@triton.jit
def _subtract_draft(res_ptr, next_ptr, q_ptr, scale_r, scale_q, tiles, V, n_tiles, BLOCK_V: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    """Writes max(0, r * scale_r - q * scale_q) into the other residual row; returns its per-tile float64
    masses. Launched without FP fusion: an FMA would round differently from the reference."""
    masses = tl.zeros([BLOCK_T], tl.float64)
    for tile in range(0, n_tiles):
        offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = offs < V
        r = tl.load(res_ptr + offs, mask=in_row, other=0.0)
        q = tl.load(q_ptr + offs, mask=in_row, other=0.0)
        w = _draft_update(r, q, scale_r, scale_q)
        tl.store(next_ptr + offs, w, mask=in_row)
        masses = tl.where(tiles == tile, tl.sum(w.to(tl.float64), 0), masses)
    tl.debug_barrier()
    return masses


# One program per tree walks it from the root in one launch. Its named parts are the helpers above; what is
# left is the walk's loop, whose node, residual and tile statistics live in registers and scratch from one
# iteration to the next, so it stays one function (issue 50: kernels keep their fused structure).
@triton.jit(do_not_specialize=["N", "offset_lo", "offset_hi"])
def _walk_kernel(logits_ptr, tokens_ptr, parents_ptr, draft_probs_ptr, num_nodes_ptr, temperature_ptr, top_k_ptr,
                 top_p_ptr, seed_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, residual_ptr,
                 out_tokens_ptr, out_nodes_ptr, num_accepted_ptr,
                 stride_lb, stride_ln, stride_tb, stride_pb, stride_qb, stride_qn, stride_rb, stride_ob,
                 V, N, n_tiles,
                 offset_lo, offset_hi,
                 HAS_PROBS: tl.constexpr, REPLACEMENT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Recursive rejection sampling (Jeon et al. 2024, paper 003 Alg 3-4) from the root: at node n try its
    children c in node order, accepting x = tokens[c] iff u * q_i(x) < p_i(x), u = uniform(c - 1,
    accept stream), and descend into the accepted child; where none is accepted (or at a leaf) emit a
    token from p_i by inverse CDF at uniform(n, sample stream). Greedy rows (T = 0, or logits / T
    overflowing) follow the first child equal to the first argmax and emit the argmax where none is."""
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    count, tokens_row_ptr, parents_row_ptr, out_tokens_row_ptr, out_nodes_row_ptr = _request_tree(
        tokens_ptr, parents_ptr, num_nodes_ptr, out_tokens_ptr, out_nodes_ptr, stride_tb, stride_pb, stride_ob, b, N)
    temperature, top_k, top_p, seed, greedy, scale, tiles, tile_ok = _request_sampling(
        temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, b, n_tiles, BLOCK_T)
    res_base_ptr = residual_ptr + b64 * stride_rb

    node = tl.zeros([], tl.int32)
    depth = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    # Each step descends one level and a child's index exceeds its parent's: N steps reach any leaf.
    for step in range(0, N):
        if done == 0:
            node64 = node.to(tl.int64)
            row_ptr = logits_ptr + b64 * stride_lb + node64 * stride_ln
            stats = (b64 * N + node64) * n_tiles + tiles
            tile_max = tl.load(tile_max_ptr + stats, mask=tile_ok, other=-float("inf"))
            row_max = tl.max(tile_max, 0)
            follow = tl.full([], -1, tl.int32)
            token = tl.full([], -1, tl.int64)
            if greedy | (tl.abs(row_max) == float("inf")):
                best, follow = _greedy_child(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, tokens_row_ptr,
                                             parents_row_ptr, node, count, V)
                token = best.to(tl.int64)
            else:
                z = _row_normalizer(tile_sum_ptr, stats, tile_ok, tile_max, row_max)
                cut, z = _filter_cut(row_ptr, scale, top_k, top_p, row_max, z, V, n_tiles, BLOCK_V)
                q_row_ptr = draft_probs_ptr + b64 * stride_qb + node64 * stride_qn
                materialized = tl.zeros([], tl.int32)  # else r = p, not written out
                cur = tl.zeros([], tl.int32)  # which residual row holds r
                masses = tl.zeros([BLOCK_T], tl.float64)  # per tile of r, once materialized
                mass = tl.full([], 1.0, tl.float64)  # R: p_i = r / R
                left = tl.full([], 1.0, tl.float64)  # s: q_i = q / s
                for c in range(node + 1, count):
                    if follow < 0:
                        if tl.load(parents_row_ptr + c) == node64:
                            x = tl.load(tokens_row_ptr + c)
                            # Out-of-range ids (only without validation) are never read: p(x) = 0 rejects them.
                            valid = (x >= 0) & (x < V)
                            res_ptr = res_base_ptr + cur * V
                            if materialized != 0:
                                p_x = tl.load(res_ptr + x, mask=valid, other=0.0)
                            else:
                                p_x = _target_prob(row_ptr, x, valid, scale, row_max, z, cut)
                            q_x = tl.full([], 1.0, tl.float64)
                            q_raw = tl.zeros([], tl.float32)
                            if HAS_PROBS:
                                q_raw = tl.load(q_row_ptr + x, mask=valid, other=0.0)
                                q_x = q_raw.to(tl.float64) / left
                            u = _uniform(seed, c - 1, _STREAM_ACCEPT, offset_lo, offset_hi)
                            # float64 like the reference: u has 52 random bits.
                            if u * q_x * mass < p_x.to(tl.float64):
                                follow = c
                            else:
                                if materialized == 0:
                                    masses = _fill_target(row_ptr, res_ptr, scale, row_max, z, cut, tiles, V,
                                                          n_tiles, BLOCK_V, BLOCK_T)
                                    materialized = materialized + 1
                                if HAS_PROBS:
                                    next_ptr = res_base_ptr + (1 - cur) * V
                                    scale_r = (1.0 / mass).to(tl.float32)
                                    scale_q = (1.0 / left).to(tl.float32)
                                    next_masses = _subtract_draft(res_ptr, next_ptr, q_row_ptr, scale_r, scale_q,
                                                                  tiles, V, n_tiles, BLOCK_V, BLOCK_T)
                                    total = tl.sum(next_masses, 0)
                                    # No mass left (round-off only): keep p_i, chain_verify's policy.
                                    if total > 0.0:
                                        cur = 1 - cur
                                        masses = next_masses
                                        mass = total
                                    if not REPLACEMENT:
                                        left = left - q_raw.to(tl.float64)
                                else:
                                    # max(0, p_i - onehot(x)) is p_i without x, unless nothing would be left.
                                    # Nothing to remove where p_i(x) = 0 (out-of-range ids included).
                                    rest = mass - p_x.to(tl.float64)
                                    if (p_x > 0.0) & (rest > 0.0):
                                        # The tile's mass is summed again rather than decremented, so a tile
                                        # left without weight has mass exactly 0 for the inverse CDF.
                                        x_tile = x // BLOCK_V
                                        offs = x_tile * BLOCK_V + tl.arange(0, BLOCK_V)
                                        in_row = offs < V
                                        r = tl.load(res_ptr + offs, mask=in_row, other=0.0)
                                        r = tl.where(offs == x, 0.0, r)
                                        masses = tl.where(tiles == x_tile, tl.sum(r.to(tl.float64), 0), masses)
                                        # Every thread has read r(x) for the test before it is zeroed, and
                                        # sees the zero in later tests.
                                        tl.debug_barrier()
                                        tl.store(res_ptr + x, 0.0)
                                        tl.debug_barrier()
                                        mass = rest
                if follow < 0:
                    res_ptr = res_base_ptr + cur * V
                    if materialized == 0:
                        masses = _fill_target(row_ptr, res_ptr, scale, row_max, z, cut, tiles, V, n_tiles,
                                              BLOCK_V, BLOCK_T)
                    target = _uniform(seed, node, _STREAM_SAMPLE, offset_lo, offset_hi) * tl.sum(masses, 0)
                    tile, prefix, found = _inverse_cdf_tile(masses, tiles, tile_ok, target, BLOCK_T)
                    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
                    in_row = offs < V
                    w = tl.load(res_ptr + offs, mask=in_row, other=0.0).to(tl.float64)
                    token = _inverse_cdf_index(w, offs, in_row, prefix, target, found, V).to(tl.int64)
                else:
                    token = tl.load(tokens_row_ptr + follow)
            tl.store(out_tokens_row_ptr + depth, token)
            if follow < 0:
                done = done + 1
            else:
                tl.store(out_nodes_row_ptr + depth, follow.to(tl.int64))
                node = follow
                depth = depth + 1
    tl.store(num_accepted_ptr + b, depth.to(tl.int64))
    # Padding, at positions the walk never wrote.
    for d in range(0, N):
        tl.store(out_tokens_row_ptr + d, -1, mask=d > depth)
        tl.store(out_nodes_row_ptr + d, -1, mask=d >= depth)


# The traversal walk's per-node scratch, [B, fields, N] per type. A node's fields are written as the walk
# enters the node, reads its row or removes one of its children, and read only after that.
_W: tl.constexpr = tl.constexpr(0)  # float64: w (num / den once the node has lost a child)
_NUM: tl.constexpr = tl.constexpr(1)  # float64: num and den, once the node has lost a child
_DEN: tl.constexpr = tl.constexpr(2)
_MASS: tl.constexpr = tl.constexpr(3)  # float64: R, p_n = r_n / R
_LEFT: tl.constexpr = tl.constexpr(4)  # float64: s, q_n = q / s
_F64_FIELDS: tl.constexpr = tl.constexpr(5)
_ROW_MAX: tl.constexpr = tl.constexpr(0)  # float32: the row's maximum and normalizer (`_row_state`)
_Z: tl.constexpr = tl.constexpr(1)
_SCALE_R: tl.constexpr = tl.constexpr(2)  # float32: the scales of the update its removal made to its parent
_SCALE_Q: tl.constexpr = tl.constexpr(3)
_F32_FIELDS: tl.constexpr = tl.constexpr(4)
_CUT: tl.constexpr = tl.constexpr(0)  # int32: the row's keep-cut, kind (_SAMPLED, _GREEDY, _EMPTY) and argmax
_KIND: tl.constexpr = tl.constexpr(1)
_BEST: tl.constexpr = tl.constexpr(2)
_STATUS: tl.constexpr = tl.constexpr(3)  # int32: one of the statuses below
_I32_FIELDS: tl.constexpr = tl.constexpr(4)
_UNREAD: tl.constexpr = tl.constexpr(-1)  # _KIND until the row's statistics are read
# On the current path, before and after losing a child; removed, its update of the parent dropped (no mass
# left) or made.
_FRESH: tl.constexpr = tl.constexpr(0)
_LOST: tl.constexpr = tl.constexpr(1)
_DROPPED: tl.constexpr = tl.constexpr(2)
_SUBTRACTED: tl.constexpr = tl.constexpr(3)
# What the traversal walk does next at its current node.
_DESCEND: tl.constexpr = tl.constexpr(0)
_TEST: tl.constexpr = tl.constexpr(1)
_EMIT: tl.constexpr = tl.constexpr(2)
_FINISHED: tl.constexpr = tl.constexpr(3)


@triton.jit
def _field(ptr, field: tl.constexpr, node, N):
    """The address of a node's field in a request's [fields, N] scratch."""
    return ptr + field * N + node


@triton.jit
def _enter(f64_ptr, i32_ptr, node, weight, N):
    """Starts a node's scratch as the walk enters it: w, R = s = 1, fresh, its row not read."""
    # Every thread has read what it needs before one writes, and sees the writes after (one thread stores a
    # scalar): all the walk's scratch stores sit between two barriers.
    tl.debug_barrier()
    tl.store(_field(f64_ptr, _W, node, N), weight)
    tl.store(_field(f64_ptr, _MASS, node, N), 1.0)
    tl.store(_field(f64_ptr, _LEFT, node, N), 1.0)
    tl.store(_field(i32_ptr, _STATUS, node, N), _FRESH)
    tl.store(_field(i32_ptr, _KIND, node, N), _UNREAD)
    tl.debug_barrier()


@triton.jit
def _saved_row(f32_ptr, i32_ptr, node, N):
    """A node's row statistics as `_row_state` gave them: (maximum, normalizer, keep-cut, kind, argmax)."""
    return (tl.load(_field(f32_ptr, _ROW_MAX, node, N)), tl.load(_field(f32_ptr, _Z, node, N)),
            tl.load(_field(i32_ptr, _CUT, node, N)), tl.load(_field(i32_ptr, _KIND, node, N)),
            tl.load(_field(i32_ptr, _BEST, node, N)))


@triton.jit
def _node_prob(row_ptr, ids, valid, scale, row_max, z, cut, kind, best):
    """p_n at `ids` (0 where not valid): `_target_prob` of a sampled row, else a point mass on the first
    argmax (logits / T overflowing: the reference's `_target_row`)."""
    p = _target_prob(row_ptr, ids, valid, scale, row_max, z, cut)
    return tl.where(kind == _SAMPLED, p, tl.where(valid & (ids == best), 1.0, 0.0))


@triton.jit
def _replay(r, q, ids, tokens_row_ptr, parents_row_ptr, f32_ptr, i32_ptr, node, stop, N,
            HAS_PROBS: tl.constexpr):
    """r_n at `ids` from r = p_n (and q = q_n) there: the updates made by the children of n removed before
    `stop`, in node order, less those dropped. Elementwise, so equal to the row the reference stores."""
    for c in range(node + 1, stop):
        if (tl.load(parents_row_ptr + c) == node) & (tl.load(_field(i32_ptr, _STATUS, c, N)) == _SUBTRACTED):
            if HAS_PROBS:
                r = _draft_update(r, q, tl.load(_field(f32_ptr, _SCALE_R, c, N)),
                                  tl.load(_field(f32_ptr, _SCALE_Q, c, N)))
            else:
                r = tl.where(ids == tl.load(tokens_row_ptr + c), 0.0, r)
    return r


@triton.jit
def _residual_tile(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f32_ptr, i32_ptr, tile, scale,
                   row_max, z, cut, kind, best, node, stop, V, N, HAS_PROBS: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """One vocabulary tile of r_n (`_replay` before `stop`) and of q_n (zeros without draft probabilities)."""
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = offs < V
    p = _node_prob(row_ptr, offs, in_row, scale, row_max, z, cut, kind, best)
    q = tl.zeros([BLOCK_V], tl.float32)
    if HAS_PROBS:
        q = tl.load(q_row_ptr + offs, mask=in_row, other=0.0)
    r = _replay(p, q, offs, tokens_row_ptr, parents_row_ptr, f32_ptr, i32_ptr, node, stop, N, HAS_PROBS)
    return offs, in_row, r, q


@triton.jit
def _residual_masses(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f32_ptr, i32_ptr, scale, row_max, z,
                     cut, kind, best, node, stop, scale_r, scale_q, tiles, V, N, n_tiles,
                     HAS_PROBS: tl.constexpr, SUBTRACT: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    """Per-tile float64 masses of r_n, or with SUBTRACT of its update max(0, r_n * scale_r - q_n * scale_q)."""
    masses = tl.zeros([BLOCK_T], tl.float64)
    for tile in range(0, n_tiles):
        _offs, _in_row, r, q = _residual_tile(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f32_ptr,
                                              i32_ptr, tile, scale, row_max, z, cut, kind, best, node, stop, V,
                                              N, HAS_PROBS, BLOCK_V)
        if SUBTRACT:
            r = _draft_update(r, q, scale_r, scale_q)
        masses = tl.where(tiles == tile, tl.sum(r.to(tl.float64), 0), masses)
    return masses


@triton.jit
def _kept(f64_ptr, i32_ptr, node, seed, offset_lo, offset_hi, N):
    """Whether the path to candidate `node` is kept: u < w, or u * den < num once it has lost a child."""
    u = _uniform(seed, node - 1, _STREAM_ACCEPT, offset_lo, offset_hi)
    keep = u < tl.load(_field(f64_ptr, _W, node, N))
    if tl.load(_field(i32_ptr, _STATUS, node, N)) == _LOST:
        keep = u * tl.load(_field(f64_ptr, _DEN, node, N)) < tl.load(_field(f64_ptr, _NUM, node, N))
    return keep


@triton.jit
def _remove(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f64_ptr, f32_ptr, i32_ptr, node, up, scale,
            tiles, V, N, n_tiles, HAS_PROBS: tl.constexpr, REPLACEMENT: tl.constexpr, BLOCK_V: tl.constexpr,
            BLOCK_T: tl.constexpr):
    """Removes rejected `node` from its parent `up` (on the path, so its row has been read) and updates up:
    r_b, its mass S (R_b <- S where S > 0), s_b, and w_b <- S / (S + 1 - w_b) (0 / 1 where that has no
    positive denominator; the root keeps w = 1). Returns up's new w."""
    row_max, z, cut, kind, best = _saved_row(f32_ptr, i32_ptr, up, N)
    weight = tl.load(_field(f64_ptr, _W, up, N))
    mass = tl.load(_field(f64_ptr, _MASS, up, N))
    left = tl.load(_field(f64_ptr, _LEFT, up, N))
    x = tl.load(tokens_row_ptr + node)
    valid = (x >= 0) & (x < V)
    scale_r = (weight / mass).to(tl.float32)
    scale_q = (1.0 / left).to(tl.float32)
    if HAS_PROBS:
        masses = _residual_masses(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f32_ptr, i32_ptr, scale,
                                  row_max, z, cut, kind, best, up, node, scale_r, scale_q, tiles, V, N, n_tiles,
                                  HAS_PROBS, True, BLOCK_V, BLOCK_T)
        total = tl.sum(masses, 0)
        rest = total
        if not REPLACEMENT:
            left = left - tl.load(q_row_ptr + x, mask=valid, other=0.0).to(tl.float64)
    else:
        # One-hot q: r_b loses x, with no pass over the row.
        p_x = _node_prob(row_ptr, x, valid, scale, row_max, z, cut, kind, best)
        r_x = _replay(p_x, 0.0, x, tokens_row_ptr, parents_row_ptr, f32_ptr, i32_ptr, up, node, N, HAS_PROBS)
        rest = mass - r_x.to(tl.float64)
        total = weight * rest / mass
    made = total > 0.0
    den = total + 1.0 - weight
    num = tl.where(den > 0.0, total, 0.0)
    den = tl.where(den > 0.0, den, 1.0)
    tl.debug_barrier()
    tl.store(_field(i32_ptr, _STATUS, node, N), tl.where(made, _SUBTRACTED, _DROPPED))
    tl.store(_field(f32_ptr, _SCALE_R, node, N), scale_r)
    tl.store(_field(f32_ptr, _SCALE_Q, node, N), scale_q)
    tl.store(_field(f64_ptr, _MASS, up, N), tl.where(made, rest, mass))
    tl.store(_field(f64_ptr, _LEFT, up, N), left)
    if up != 0:
        weight = num / den
        tl.store(_field(f64_ptr, _W, up, N), weight)
        tl.store(_field(f64_ptr, _NUM, up, N), num)
        tl.store(_field(f64_ptr, _DEN, up, N), den)
        tl.store(_field(i32_ptr, _STATUS, up, N), _LOST)
    tl.debug_barrier()
    return weight


@triton.jit
def _child_weight(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f64_ptr, f32_ptr, i32_ptr, node, child,
                  scale, row_max, z, cut, kind, best, V, N, HAS_PROBS: tl.constexpr):
    """w_c = min(1, w_b p_b(x) / q_b(x)) of `child` (token x) under `node`, float64 in the reference's
    order: w_b * (r_b(x) / R_b) against q(x) / s_b."""
    x = tl.load(tokens_row_ptr + child)
    # Out-of-range ids (only without validation) are never read: p(x) = 0.
    valid = (x >= 0) & (x < V)
    p_x = _node_prob(row_ptr, x, valid, scale, row_max, z, cut, kind, best)
    q_raw = tl.zeros([], tl.float32)
    q_x = tl.full([], 1.0, tl.float64)
    if HAS_PROBS:
        q_raw = tl.load(q_row_ptr + x, mask=valid, other=0.0)
        q_x = q_raw.to(tl.float64) / tl.load(_field(f64_ptr, _LEFT, node, N))
    r_x = _replay(p_x, q_raw, x, tokens_row_ptr, parents_row_ptr, f32_ptr, i32_ptr, node, child, N, HAS_PROBS)
    mass = tl.load(_field(f64_ptr, _MASS, node, N))
    scaled = tl.load(_field(f64_ptr, _W, node, N)) * (r_x.to(tl.float64) / mass)
    return tl.where(scaled >= q_x, 1.0, scaled / q_x)


# One program per tree: the leaves-to-root traversal in one launch. Its named parts are the helpers above;
# the loop that is left carries the current node and its masses across iterations, so it stays one function.
@triton.jit(do_not_specialize=["N", "offset_lo", "offset_hi"])
def _traversal_kernel(logits_ptr, tokens_ptr, parents_ptr, draft_probs_ptr, num_nodes_ptr, temperature_ptr,
                      top_k_ptr, top_p_ptr, seed_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr,
                      node_f64_ptr, node_f32_ptr, node_i32_ptr, out_tokens_ptr, out_nodes_ptr,
                      num_accepted_ptr,
                      stride_lb, stride_ln, stride_tb, stride_pb, stride_qb, stride_qn, stride_ob,
                      V, N, n_tiles,
                      offset_lo, offset_hi,
                      HAS_PROBS: tl.constexpr, REPLACEMENT: tl.constexpr, BLOCK_V: tl.constexpr,
                      BLOCK_T: tl.constexpr):
    """Traversal verification (Weng et al., "Traversal Verification for Speculative Tree Decoding", NeurIPS
    2025, arXiv 2505.12398), as `specops.reference._traversal_verify_request`: from the first leaf in node
    order keep the path to candidate a iff u < w_a (u * den_a < num_a once a has lost a child), u =
    uniform(a - 1, accept stream), w_c = min(1, w_b p_b(x_c) / q_b(x_c)) from the root down; else remove a,
    r_b <- max(0, f32(w_b / R_b) r_b - f32(1 / s_b) q) (one-hot q: r_b without x_a), w_b <- S / (S + 1 - w_b),
    and go on from the first leaf left. Emit from r_a by inverse CDF at uniform(a, sample stream). Greedy
    requests (T = 0) walk the argmax path, as `_walk_kernel`."""
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    count, tokens_row_ptr, parents_row_ptr, out_tokens_row_ptr, out_nodes_row_ptr = _request_tree(
        tokens_ptr, parents_ptr, num_nodes_ptr, out_tokens_ptr, out_nodes_ptr, stride_tb, stride_pb, stride_ob, b, N)
    temperature, top_k, top_p, seed, greedy, scale, tiles, tile_ok = _request_sampling(
        temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, b, n_tiles, BLOCK_T)
    f64_ptr = node_f64_ptr + b64 * _F64_FIELDS * N
    f32_ptr = node_f32_ptr + b64 * _F32_FIELDS * N
    i32_ptr = node_i32_ptr + b64 * _I32_FIELDS * N

    node = tl.zeros([], tl.int32)
    depth = tl.zeros([], tl.int32)
    token = tl.full([], -1, tl.int64)
    if greedy:
        done = tl.zeros([], tl.int32)
        # Each step descends one level and a child's index exceeds its parent's: N steps reach any leaf.
        for step in range(0, N):
            if done == 0:
                stats = (b64 * N + node.to(tl.int64)) * n_tiles + tiles
                best, follow = _greedy_child(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, tokens_row_ptr,
                                             parents_row_ptr, node, count, V)
                if follow < 0:
                    token = best.to(tl.int64)
                    done = done + 1
                else:
                    node = follow
                    depth = depth + 1
    else:
        _enter(f64_ptr, i32_ptr, node, 1.0, N)
        mode = tl.full([], _DESCEND, tl.int32)
        after = node  # the children of `node` left are those past this index
        # A step enters a node (count - 1 at most), tests a candidate (each test but the last removes one)
        # or emits: 2 N steps are enough.
        for step in range(0, 2 * N):
            if mode != _FINISHED:
                child = tl.full([], -1, tl.int32)
                if mode == _DESCEND:
                    # Children are tried, and removed, in node order.
                    for c in range(after + 1, count):
                        if child < 0:
                            child = tl.where(tl.load(parents_row_ptr + c) == node, c, child)
                    if child < 0:
                        mode = tl.where(node == 0, _EMIT, _TEST)
                if mode == _TEST:
                    if _kept(f64_ptr, i32_ptr, node, seed, offset_lo, offset_hi, N):
                        mode = tl.full([], _EMIT, tl.int32)
                    else:
                        up = tl.load(parents_row_ptr + node).to(tl.int32)
                        row_ptr = logits_ptr + b64 * stride_lb + up.to(tl.int64) * stride_ln
                        q_row_ptr = draft_probs_ptr + b64 * stride_qb + up.to(tl.int64) * stride_qn
                        weight = _remove(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f64_ptr, f32_ptr,
                                         i32_ptr, node, up, scale, tiles, V, N, n_tiles, HAS_PROBS, REPLACEMENT,
                                         BLOCK_V, BLOCK_T)
                        # Where w_b = 0 nothing below b can be kept: b is the candidate.
                        mode = tl.where((up != 0) & (weight == 0.0), _TEST, _DESCEND)
                        after = node
                        node = up
                        depth = depth - 1
                else:
                    # Entering `child` or emitting: either reads the node's row, once a node.
                    row_ptr = logits_ptr + b64 * stride_lb + node.to(tl.int64) * stride_ln
                    q_row_ptr = draft_probs_ptr + b64 * stride_qb + node.to(tl.int64) * stride_qn
                    row_max, z, cut, kind, best = _saved_row(f32_ptr, i32_ptr, node, N)
                    if kind == _UNREAD:
                        stats = (b64 * N + node.to(tl.int64)) * n_tiles + tiles
                        row_max, z, cut, kind, best = _row_state(row_ptr, scale, temperature, top_k, top_p,
                                                                 tile_max_ptr, tile_sum_ptr, tile_raw_ptr,
                                                                 tile_arg_ptr, stats, tile_ok, V, n_tiles,
                                                                 BLOCK_V)
                        tl.debug_barrier()
                        tl.store(_field(f32_ptr, _ROW_MAX, node, N), row_max)
                        tl.store(_field(f32_ptr, _Z, node, N), z)
                        tl.store(_field(i32_ptr, _CUT, node, N), cut)
                        tl.store(_field(i32_ptr, _KIND, node, N), kind)
                        tl.store(_field(i32_ptr, _BEST, node, N), best)
                        tl.debug_barrier()
                    if mode == _EMIT:
                        masses = _residual_masses(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f32_ptr,
                                                  i32_ptr, scale, row_max, z, cut, kind, best, node, count, 0.0,
                                                  0.0, tiles, V, N, n_tiles, HAS_PROBS, False, BLOCK_V, BLOCK_T)
                        u = _uniform(seed, node, _STREAM_SAMPLE, offset_lo, offset_hi)
                        target = u * tl.sum(masses, 0)
                        tile, prefix, found = _inverse_cdf_tile(masses, tiles, tile_ok, target, BLOCK_T)
                        offs, in_row, r, _q = _residual_tile(row_ptr, q_row_ptr, tokens_row_ptr,
                                                             parents_row_ptr, f32_ptr, i32_ptr, tile, scale,
                                                             row_max, z, cut, kind, best, node, count, V, N,
                                                             HAS_PROBS, BLOCK_V)
                        token = _inverse_cdf_index(r.to(tl.float64), offs, in_row, prefix, target, found,
                                                   V).to(tl.int64)
                        mode = tl.full([], _FINISHED, tl.int32)
                    else:
                        weight = _child_weight(row_ptr, q_row_ptr, tokens_row_ptr, parents_row_ptr, f64_ptr,
                                               f32_ptr, i32_ptr, node, child, scale, row_max, z, cut, kind,
                                               best, V, N, HAS_PROBS)
                        _enter(f64_ptr, i32_ptr, child, weight, N)
                        # A node of weight 0 stands for its subtree: nothing in it can be kept.
                        mode = tl.where(weight == 0.0, _TEST, _DESCEND)
                        after = child
                        node = child
                        depth = depth + 1

    tl.store(num_accepted_ptr + b, depth.to(tl.int64))
    tl.store(out_tokens_row_ptr + depth, token)
    # The path back up from the last node: the accepted drafts; padding past them.
    for d in range(0, N):
        slot = depth - 1 - d
        if slot >= 0:
            tl.store(out_tokens_row_ptr + slot, tl.load(tokens_row_ptr + node))
            tl.store(out_nodes_row_ptr + slot, node.to(tl.int64))
            node = tl.load(parents_row_ptr + node).to(tl.int32)
        tl.store(out_tokens_row_ptr + d, -1, mask=d > depth)
        tl.store(out_nodes_row_ptr + d, -1, mask=d >= depth)


# The traversal walk holds float64 scalar state besides its tiles: at 4 warps ptxas keeps it to 128 registers
# and spills, at 16 warps (128 registers a thread) it spills more; 8 warps fit, whatever the tile.
_TRAVERSAL_WARPS = 8


def tree_verify_triton(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       draft_probs: torch.Tensor | None, num_nodes: torch.Tensor, replacement: bool,
                       temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                       offset: int, validate: bool = True, scheme: str = "recursive",
                       block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton implementation of `specops::tree_verify` on the op's normalized arguments (see
    `specops.ops.tree_verify`): tensors on one device. Values are not checked here (that would be a
    host sync inside the op); `specops.ops.tree_verify` checks them when `validate` is true. `scheme`
    picks the walk ("recursive": `_walk_kernel`, "traversal": `_traversal_kernel`). `block_v` overrides the
    vocabulary tile (a power of two), for tests of the multi-tile paths."""
    if scheme not in ("recursive", "traversal"):
        raise ValueError(f"tree_verify: scheme must be 'recursive' or 'traversal', got {scheme!r}")
    # The op is reachable directly, not only through the wrapper that makes inputs contiguous, and the
    # kernels index rows and vocabulary densely. A no-op for contiguous inputs.
    target_logits, tokens, parents, num_nodes, temperature, top_k, top_p, seed = (
        t.contiguous() for t in (target_logits, tokens, parents, num_nodes, temperature, top_k, top_p, seed))
    draft_probs = None if draft_probs is None else draft_probs.contiguous()
    batch, nodes, vocab = target_logits.shape
    device = target_logits.device
    out_tokens = torch.empty((batch, nodes), dtype=torch.int64, device=device)
    out_nodes = torch.empty((batch, nodes), dtype=torch.int64, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return out_tokens, out_nodes, num_accepted
    block_v, n_tiles, block_t, num_warps = vocab_tiling("tree_verify", vocab, block_v)

    tile_max, tile_sum, tile_raw, tile_arg = tile_stat_buffers(batch * nodes, n_tiles, device)
    has_probs = draft_probs is not None
    # Never read without HAS_PROBS; any tensor stands in for the pointer.
    probs = draft_probs if has_probs else target_logits
    stride_qb, stride_qn = (draft_probs.stride(0), draft_probs.stride(1)) if has_probs else (0, 0)
    stride_lb, stride_ln = target_logits.stride(0), target_logits.stride(1)
    offset_lo, offset_hi = offset_words(offset)

    _tile_stats_kernel[(batch * nodes, n_tiles)](
        target_logits, num_nodes, temperature, tile_max, tile_sum, tile_raw, tile_arg,
        stride_lb, stride_ln, vocab, nodes, n_tiles, BLOCK_V=block_v, num_warps=num_warps)
    # Both walks without FP fusion: a residual update must round r * a and q * b separately, as the reference.
    if scheme == "traversal":
        # Per node, no vocabulary row (see the module docstring): 72 bytes a node.
        node_f64 = torch.empty((batch, 5, nodes), dtype=torch.float64, device=device)
        node_f32 = torch.empty((batch, 4, nodes), dtype=torch.float32, device=device)
        node_i32 = torch.empty((batch, 4, nodes), dtype=torch.int32, device=device)
        _traversal_kernel[(batch,)](
            target_logits, tokens, parents, probs, num_nodes, temperature, top_k, top_p, seed,
            tile_max, tile_sum, tile_raw, tile_arg, node_f64, node_f32, node_i32, out_tokens, out_nodes,
            num_accepted,
            stride_lb, stride_ln, tokens.stride(0), parents.stride(0), stride_qb, stride_qn,
            out_tokens.stride(0),
            vocab, nodes, n_tiles, offset_lo, offset_hi,
            HAS_PROBS=has_probs, REPLACEMENT=bool(replacement) and has_probs, BLOCK_V=block_v, BLOCK_T=block_t,
            num_warps=_TRAVERSAL_WARPS, enable_fp_fusion=False)
        return out_tokens, out_nodes, num_accepted
    # Row b holds request b's residual; with draft_probs a second row after it, as an update that leaves no
    # mass is dropped: the update reads one row and writes the other.
    residual = torch.empty((batch, 2 if has_probs else 1, vocab), dtype=torch.float32, device=device)
    _walk_kernel[(batch,)](
        target_logits, tokens, parents, probs, num_nodes, temperature, top_k, top_p, seed,
        tile_max, tile_sum, tile_raw, tile_arg, residual, out_tokens, out_nodes, num_accepted,
        stride_lb, stride_ln, tokens.stride(0), parents.stride(0), stride_qb, stride_qn, residual.stride(0),
        out_tokens.stride(0),
        vocab, nodes, n_tiles, offset_lo, offset_hi,
        HAS_PROBS=has_probs, REPLACEMENT=bool(replacement) and has_probs, BLOCK_V=block_v, BLOCK_T=block_t,
        num_warps=num_warps, enable_fp_fusion=False)
    return out_tokens, out_nodes, num_accepted


# Whether `_traversal_kernel` has matched the reference on a GPU. On an H200 (Triton 3.6, 2026-12-04) it did
# not: 17 of the suite's traversal cases differed there (more drafts kept, rows with no token) while every
# one matches in Triton's interpreter, and the recursive walk matched everywhere. Until a GPU run passes
# python_tests/test_traversal_verify.py and bench/gpu_traversal_check.py, CUDA calls with scheme "traversal"
# run the C++ kernel on host copies: exact, at the cost of moving the logits across.
TRAVERSAL_KERNEL_VERIFIED = False


def _tree_verify_device(target_logits, tokens, parents, draft_probs, num_nodes, replacement, temperature,
                        top_k, top_p, seed, offset, validate=True, scheme="recursive"):
    """The CUDA kernel of `specops::tree_verify`: the Triton walk, or for an unverified traversal kernel the
    C++ one on host copies (values already checked by the contract)."""
    if scheme != "traversal" or TRAVERSAL_KERNEL_VERIFIED:
        return tree_verify_triton(target_logits, tokens, parents, draft_probs, num_nodes, replacement,
                                  temperature, top_k, top_p, seed, offset, validate, scheme)
    tree = [None if t is None else t.cpu() for t in (target_logits, tokens, parents, draft_probs, num_nodes)]
    sampling = [t.cpu() for t in (temperature, top_k, top_p, seed)]
    out = torch.ops.specops.tree_verify(*tree, replacement, *sampling, offset, validate, scheme)
    return tuple(t.to(target_logits.device) for t in out)


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
tree_verify_cuda = guarded(check_tree_verify, _tree_verify_device)
torch.library.register_kernel("specops::tree_verify", "cuda", tree_verify_cuda)
