"""Pure-torch semantics of every specops op: the spec all backends are tested against.

Nothing here is fast. Every function replays the same counter-based random numbers as the C++ and
Triton kernels, so a backend must return the same tokens for the same seeds (up to floating-point
ties). Arguments are the op's normalized arguments (per-row tensors), as `specops.ops` passes them.
"""

from __future__ import annotations

import math

import torch

__all__ = ["philox4x32", "uniform", "filter_logits", "chain_verify", "ensemble_logits", "ngram_match",
           "vocab_project", "tree_attention", "tree_visibility", "tree_children", "tree_verify",
           "sample_without_replacement", "stochastic_beam_step", "truncated_gumbel", "skinny_linear",
           "dequantize", "quantized_linear", "int8_linear", "int8_linear_pack", "int8_linear_unpack",
           "INT8_LINEAR_MOST_K", "llama_layers",
           "NGRAM_KEY_BITS", "MEMORY_LEVEL_RATIO",
           "memory_merged_blocks", "memory_levels", "memory_keys", "ngram_memory_insert", "ngram_memory_lookup"]

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85

# Random streams: which draw a uniform is for. Part of the counter, so streams never overlap.
STREAM_ACCEPT = 0
STREAM_SAMPLE = 1
STREAM_DRAFT = 2
STREAM_WITHOUT_REPLACEMENT = 3
STREAM_BEAM = 4
SMALLEST_NORMAL_LOG = -87.33654475  # log(2**-126): exp below it is 0 in the kernels


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # int64 products wrap modulo 2**64, so the low 64 bits of the 32x32 product are exact.
    prod = x * m
    return (prod >> 32) & _MASK32, prod & _MASK32


def philox4x32(key: torch.Tensor, c0, c1, c2, c3) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (Salmon et al., SC'11). `key` is int64 (two 32-bit words); counters are
    int64 tensors or ints holding uint32 values. Returns four int64 tensors holding uint32 values."""
    k0 = key & _MASK32
    k1 = (key >> 32) & _MASK32
    c = [torch.as_tensor(v, dtype=torch.int64, device=key.device) & _MASK32 for v in (c0, c1, c2, c3)]
    c0, c1, c2, c3 = torch.broadcast_tensors(*c, k0)[:4]
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _PHILOX_W0) & _MASK32
        k1 = (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def uniform(seed: torch.Tensor, offset: int, position, stream: int) -> torch.Tensor:
    """float64 uniform in (0, 1), never 0 or 1: ((a >> 6) * 2**26 + (b >> 6) + 0.5) * 2**-52,
    where (a, b) are the first two Philox words for key `seed` and counter
    (position, stream, offset low word, offset high word)."""
    off = int(offset) & 0xFFFFFFFFFFFFFFFF
    a, b, _, _ = philox4x32(seed, position, stream, off & _MASK32, off >> 32)
    k = ((a >> 6) << 26) | (b >> 6)
    return (k.to(torch.float64) + 0.5) * 2.0**-52


def _ordered_threshold_mask(x: torch.Tensor, weights: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """Keep {x >= t} where t is the largest value of x whose upper set {x >= t} has weight >= need.
    Ties at t are kept. x, weights: [N, V]; need: [N] float64."""
    xs, order = torch.sort(x, dim=-1, descending=True)
    cum = torch.cumsum(weights.gather(-1, order).to(torch.float64), dim=-1)
    # The prefix ending at the last element equal to xs[i] is the upper set of xs[i].
    idx = torch.searchsorted(cum, torch.minimum(need.unsqueeze(-1), cum[:, -1:]))
    idx = idx.clamp(max=x.shape[-1] - 1)
    t = xs.gather(-1, idx)
    return x >= t


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Scaled, filtered logits [N, V] float32: x = logits / T, then top-k (keep x >= k-th largest),
    then top-p (keep x >= t, t the largest value whose upper set holds >= top_p of the top-k mass).
    Filtered entries are -inf. Rows with T == 0 are returned unscaled (greedy ignores filtering)."""
    x = logits.float()
    t = temperature.to(x.dtype).unsqueeze(-1)
    greedy = t == 0
    x = torch.where(greedy, x, x / torch.where(greedy, torch.ones_like(t), t))
    n, vocab = x.shape
    k = top_k.to(torch.int64)
    use_k = (k > 0) & (k < vocab) & ~greedy.squeeze(-1)
    if bool(use_k.any()):
        xs = torch.sort(x, dim=-1, descending=True).values
        kth = xs.gather(-1, (k.clamp(1, vocab) - 1).unsqueeze(-1))
        x = torch.where(use_k.unsqueeze(-1) & (x < kth), float("-inf"), x)
    use_p = (top_p < 1) & ~greedy.squeeze(-1)
    if bool(use_p.any()):
        m = x.max(dim=-1, keepdim=True).values
        w = torch.exp(x - m)
        need = top_p.to(torch.float64) * w.to(torch.float64).sum(-1)
        keep = _ordered_threshold_mask(x, w, need)
        x = torch.where(use_p.unsqueeze(-1) & ~keep, float("-inf"), x)
    return x


def _overflows(raw: torch.Tensor, temperature: torch.Tensor) -> bool:
    """Whether a row's largest logit / T overflows float32: to +inf, or to -inf (and every other logit
    with it). Either is the T -> 0 limit of softmax(logits / T), a point mass on the argmax: greedy."""
    return bool(torch.isinf(raw.max() / temperature))


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose float64 running sum exceeds u * total; the last positive index if
    round-off leaves none. weights: [V] float32 >= 0 with a positive sum; u: float64 scalar."""
    cum = torch.cumsum(weights.to(torch.float64), dim=0)
    target = u * cum[-1]
    hit = torch.nonzero(cum > target)
    if hit.numel():
        return hit[0, 0]
    return torch.nonzero(weights > 0)[-1, 0]


def chain_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 num_draft: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seed: torch.Tensor, offset: int,
                 scheme: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling verification of a chain of drafts (Leviathan et al. 2023, Chen et al. 2023).

    Row b, draft position j < num_draft[b]: accept draft x with u * q(x) < p(x), u = uniform(seed[b],
    offset, j, STREAM_ACCEPT). At the first rejection emit a token from norm(max(0, p - q)), or from p
    if that residual has no mass; if all drafts are accepted emit a bonus token from p at position
    num_draft[b]. Sampling is the inverse CDF at u = uniform(seed[b], offset, j, STREAM_SAMPLE).
    Temperature 0: accept while the draft equals the first argmax, then emit the argmax. A row whose
    scaled maximum logits / T overflows float32 (to +inf or -inf) is greedy too: the T -> 0 limit of p.

    Shapes: target_logits [B, K+1, V]; draft_tokens [B, K] int64; draft_probs [B, K, V] float32 or
    None (one-hot on the draft); num_draft, top_k, seed [B] int64; temperature, top_p [B] float32.
    Returns out_tokens [B, K+1] int64 (-1 padded) and num_accepted [B] int64.

    scheme "block" verifies the chain jointly instead (`_block_verify_row`); greedy rows are the same.
    """
    batch, k1, vocab = target_logits.shape
    device = target_logits.device
    out = torch.full((batch, k1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    for b in range(batch):
        n = int(num_draft[b])
        greedy = float(temperature[b]) == 0.0
        rows = filter_logits(target_logits[b, : n + 1], temperature[b].expand(n + 1),
                             top_k[b].expand(n + 1), top_p[b].expand(n + 1))
        if scheme == "block" and not greedy:
            j = _block_verify_row(target_logits[b], rows, draft_tokens[b], draft_probs[b] if draft_probs is not None
                                  else None, n, temperature[b], seed[b], offset, out[b])
            num_accepted[b] = j
            continue
        for j in range(n + 1):
            x = rows[j]
            draft = int(draft_tokens[b, j]) if j < n else -1
            raw = target_logits[b, j].float()
            if greedy or _overflows(raw, temperature[b]):
                best = int(torch.argmax(raw))  # first index of the maximum
                if j < n and draft == best:
                    out[b, j] = draft
                    continue
                out[b, j] = best
                break
            p = torch.softmax(x, dim=-1)
            if j < n:
                q = draft_probs[b, j].float() if draft_probs is not None else None
                q_x = float(q[draft]) if q is not None else 1.0
                u = uniform(seed[b], offset, j, STREAM_ACCEPT)
                if float(u) * q_x < float(p[draft]):
                    out[b, j] = draft
                    continue
                if q is None:
                    q = torch.zeros_like(p)
                    q[draft] = 1.0
                residual = torch.clamp(p - q, min=0.0)
                weights = residual if float(residual.to(torch.float64).sum()) > 0 else p
            else:
                weights = p
            u = uniform(seed[b], offset, j, STREAM_SAMPLE)
            out[b, j] = _inverse_cdf(weights, u)
            break
        num_accepted[b] = j
    return out, num_accepted


def _target_row(raw: torch.Tensor, x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """p of one position: softmax of the filtered row x, or a point mass on the first argmax of the raw
    logits where logits / T overflows (the T -> 0 limit)."""
    if _overflows(raw.float(), temperature):
        p = torch.zeros_like(x)
        p[int(torch.argmax(raw.float()))] = 1.0
        return p
    return torch.softmax(x, dim=-1)


def block_weights(p_draft: list[float], q_draft: list[float]) -> list[float]:
    """Block verification's weights W_0 = 1, W_k = min(1, W_{k-1} p(x_k) / q(x_k)) (float64) for drafts
    x_1..x_n with target and draft probabilities p(x_k), q(x_k) (float32 values): W_k is the largest
    probability with which the first k drafts can be kept. W_k = 1 where W_{k-1} p >= q (also q = 0)."""
    weights = [1.0]
    for p, q in zip(p_draft, q_draft):
        w = weights[-1] * float(p)
        weights.append(1.0 if w >= float(q) else w / float(q))
    return weights


def _block_verify_row(raw: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor, probs: torch.Tensor | None,
                      n: int, temperature: torch.Tensor, seed: torch.Tensor, offset: int, out: torch.Tensor) -> int:
    """Block verification of one request's chain (Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh,
    "Block Verification Accelerates Speculative Decoding", ICLR 2025, arXiv 2403.10444, Alg. 2), derived in
    docs/verification.md. With W_k from `block_weights`, the residual after keeping k drafts is
    r_k = max(0, W_k p_k - q_k) at position k < n (float32: fl(W_k) * p - q), and W_n p_n for all n kept;
    its mass is S_k (float64; S_n = W_n). Keeping exactly k drafts has conditional probability
    h_k = S_k / (S_k + 1 - W_k) given that no longer prefix was kept: walking k = n, n-1, ..., 1, keep k
    when u_k * (S_k + 1 - W_k) < S_k with u_k = uniform(seed, offset, k - 1, STREAM_ACCEPT) (at k = n:
    u_n < W_n); otherwise keep none. h_k <= W_k (S_k <= W_k), so k is passed over where u_k >= W_k without
    computing S_k, as every backend does (the same decision up to the rounding of S_k). Then emit a token from norm(r_k) at position k by inverse CDF with
    uniform(seed, offset, k, STREAM_SAMPLE), from p_k if r_k has no mass. p at a position whose logits / T
    overflow is a point mass on the argmax. Rows past the first W_k = 0 are never read (h is 0 there).
    Writes out[:k+1] and returns k."""
    p_rows = [_target_row(raw[j], rows[j], temperature) for j in range(n + 1)]
    q_rows = []
    for j in range(n):
        if probs is not None:
            q_rows.append(probs[j].float())
        else:
            q = torch.zeros_like(p_rows[j])
            q[int(drafts[j])] = 1.0
            q_rows.append(q)
    ids = [int(drafts[j]) for j in range(n)]
    weights = block_weights([float(p_rows[j][ids[j]]) for j in range(n)], [float(q_rows[j][ids[j]]) for j in range(n)])

    def residual(k: int) -> torch.Tensor:
        if k == n:
            return p_rows[n]
        return torch.clamp(torch.tensor(weights[k], dtype=torch.float32) * p_rows[k] - q_rows[k], min=0.0)

    kept = 0
    for k in range(n, 0, -1):
        w = weights[k]
        u = float(uniform(seed, offset, k - 1, STREAM_ACCEPT))
        if k == n:
            if u < w:
                kept = k
                break
            continue
        if u >= w:
            continue
        s = float(residual(k).to(torch.float64).sum())
        if u * (s + 1.0 - w) < s:
            kept = k
            break
    r = residual(kept)
    weights_k = r if kept == n or float(r.to(torch.float64).sum()) > 0 else p_rows[kept]
    out[:kept] = drafts[:kept]
    out[kept] = _inverse_cdf(weights_k, uniform(seed, offset, kept, STREAM_SAMPLE))
    return kept


def expected_accepted(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, scheme: str = "token") -> torch.Tensor:
    """E[num_accepted | drafts] of chain_verify for each of N chains, exactly (float64): p [N, K+1, V] the
    target's distributions at the K+1 positions (after temperature and filtering), q [N, K, V] the drafts'
    distributions, drafts [N, K]. "token": sum_k prod_{j <= k} min(1, p_j(x_j) / q_j(x_j)); "block":
    `expected_block_kept`. Averaged over chains drawn from q, the difference is what block verification
    gains (never negative in expectation over drafts)."""
    k = p.shape[1] - 1
    p, q = p.double(), q.double()
    p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    if scheme == "token":
        return torch.cumprod(torch.clamp(p_d / q_d, max=1.0), 1).sum(1)
    return expected_block_kept(p_d, q_d, lambda j, w: torch.clamp(w[:, None] * p[:, j] - q[:, j], min=0.0).sum(-1))


def expected_block_kept(p_d: torch.Tensor, q_d: torch.Tensor, residual_mass) -> torch.Tensor:
    """E[drafts kept | chain] of block verification for N chains (float64 [N]): p_d, q_d [N, K] the target's and
    the drafter's probability of each draft; residual_mass(j, w) gives S_j = sum_x max(0, w p_j(x) - q_j(x))
    [N] at position j < K for weights w [N] (a caller with many chains per position can compute it without a
    pass over the vocabulary per chain). The weights W_k and keep probabilities h_k of `_block_verify_row`:
    sum_k k P(k kept), P(K kept) = W_K, P(k kept) = h_k prod_{j > k} (1 - h_j)."""
    n, k = p_d.shape
    weights = [torch.ones(n, dtype=torch.float64, device=p_d.device)]
    for j in range(k):
        pw = weights[-1] * p_d[:, j]
        weights.append(torch.where(pw >= q_d[:, j], 1.0, pw / q_d[:, j].clamp(min=1e-300)))
    expected = torch.zeros(n, dtype=torch.float64, device=p_d.device)
    stay = torch.ones(n, dtype=torch.float64, device=p_d.device)
    for j in range(k, 0, -1):
        w = weights[j]
        if j == k:
            h = w
        else:
            mass = residual_mass(j, w)
            denominator = mass + 1.0 - w
            h = torch.where(denominator > 0, mass / denominator.clamp(min=1e-300), 0.0)
        expected += stay * h * j
        stay = stay * (1.0 - h)
    return expected


# ngram_match ranks a continuation by one int64 key: (level << 56) | (count << 28) | recency, so
# every backend sorts the same way with one integer comparison. Contexts are shorter than 2**28 tokens.
NGRAM_KEY_BITS = 28


def ngram_match(tokens: torch.Tensor, lengths: torch.Tensor, min_ngram: int, max_ngram: int,
                num_candidates: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context n-gram drafts (paper 001, section 4.2), row by row with torch `unfold`.

    Row b's context is ctx = tokens[b, :lengths[b]], n tokens. For each earlier end position e < n - 1,
    m(e) is the length of the longest common suffix of ctx[:e+1] and ctx, capped at max_ngram (the
    query, the last q tokens, may overlap the match). e is an occurrence if m(e) >= min_ngram; its
    continuation is ctx[e+1 : e+1+width], -1 past the end of the context. For every distinct
    continuation c: level L(c) = the longest match among its occurrences, count N(c) = how many of its
    occurrences match at that level, recency R(c) = the latest of those. Continuations rank by
    L, then N, then R, all descending (longest match first, then frequency, ties to the most recent).

    Returns candidates [B, k, width] int64 (-1 where there is no candidate), counts [B, k] int64 and
    ngram [B, k] int64 (the level L; 0 where there is no candidate), k = num_candidates.
    """
    batch = tokens.shape[0]
    device = tokens.device
    candidates = torch.full((batch, num_candidates, width), -1, dtype=torch.int64, device=device)
    counts = torch.zeros(batch, num_candidates, dtype=torch.int64, device=device)
    ngram = torch.zeros(batch, num_candidates, dtype=torch.int64, device=device)
    for b in range(batch):
        n = int(lengths[b])
        if n < 2:
            continue
        ctx = tokens[b, :n].long()
        # match[q - 1, e]: the q tokens ending at e equal the last q tokens (e < n - 1: earlier ends only).
        match_len = torch.zeros(n - 1, dtype=torch.int64, device=device)
        for q in range(1, min(max_ngram, n - 1) + 1):
            grams = ctx[: n - 1].unfold(0, q, 1)  # grams[s] = ctx[s : s + q], ending at e = s + q - 1
            hit = (grams == ctx[n - q:]).all(-1)
            match_len[q - 1:] = torch.where(hit, q, match_len[q - 1:])
        # Longest common suffix is monotone: a q-match implies every shorter one, so the largest hit
        # is the length (the loop above writes increasing q last).
        ends = torch.nonzero(match_len >= min_ngram).flatten()
        if ends.numel() == 0:
            continue
        level_of = match_len[ends]
        padded = torch.cat([ctx, torch.full((width,), -1, dtype=torch.int64, device=device)])
        conts = padded[(ends + 1).unsqueeze(1) + torch.arange(width, device=device)]
        unique, inverse = torch.unique(conts, dim=0, return_inverse=True)
        groups = unique.shape[0]
        level = torch.zeros(groups, dtype=torch.int64, device=device).scatter_reduce(
            0, inverse, level_of, "amax", include_self=False)
        at_level = level_of == level[inverse]
        count = torch.zeros(groups, dtype=torch.int64, device=device).scatter_add(0, inverse, at_level.long())
        recency = torch.full((groups,), -1, dtype=torch.int64, device=device).scatter_reduce(
            0, inverse, torch.where(at_level, ends, -1), "amax")
        key = (level << (2 * NGRAM_KEY_BITS)) | (count << NGRAM_KEY_BITS) | recency
        take = min(num_candidates, groups)
        order = torch.argsort(key, descending=True)[:take]
        candidates[b, :take] = unique[order]
        counts[b, :take] = count[order]
        ngram[b, :take] = level[order]
    return candidates, counts, ngram


# ---- The n-gram memory's index (ngram_memory_insert, ngram_memory_lookup) ----
#
# The store is a flat int32 token array in which runs of tokens (earlier requests' prompts and outputs) lie
# apart, separated by negative tokens. The index is a sorted array of end positions e: the key of e is the
# run's tokens read backwards from e, t[e], t[e - 1], ..., at most `depth` of them and stopping before the
# first negative token (or the array's start). Keys order lexicographically, a key before its extensions
# (a stopped key reads as -1 from there on); equal keys order by position. So the end positions whose last
# m tokens equal a query's last m tokens are one contiguous stretch of the sorted array, found by binary
# search. The entries are kept in levels, sorted runs laid out one after another in a buffer, oldest first,
# each at least MEMORY_LEVEL_RATIO times larger than the next: an insert sorts only what it adds and merges it
# with the newest levels it has outgrown, rewriting only the buffer's tail.

MEMORY_LEVEL_RATIO = 8


def memory_merged_blocks(levels: list[int], added: int) -> int:
    """How many blocks, of the levels (sizes, oldest first) followed by the `added` new entries (one block,
    when added > 0), merge into the new newest level, counted from the newest: while the merged block is at
    least 1 / MEMORY_LEVEL_RATIO of the next older level's size, that level joins it. 0 when nothing is
    added."""
    if added == 0:
        return 0
    merged, size = 1, added
    while merged <= len(levels) and size * MEMORY_LEVEL_RATIO > levels[-merged]:
        size += levels[-merged]
        merged += 1
    return merged


def memory_levels(levels: list[int], added: int) -> list[int]:
    """The level sizes (oldest first) after inserting `added` entries into levels of sizes `levels`."""
    merged = memory_merged_blocks(levels, added)
    if merged == 0:
        return list(levels)
    kept = len(levels) - (merged - 1)
    return [*levels[:kept], added + sum(levels[kept:])]


def memory_keys(tokens: torch.Tensor, positions: torch.Tensor, depth: int) -> torch.Tensor:
    """keys [n, depth] int64 of end positions [n]: key[i, j] = t[e - j] while e - j >= 0 and no token from
    t[e] back to t[e - j] is negative (or outside the store), else -1."""
    size = tokens.shape[0]
    at = positions.long()[:, None] - torch.arange(depth, device=tokens.device)
    inside = (at >= 0) & (at < size)
    raw = torch.where(inside, tokens.long()[at.clamp(0, max(size - 1, 0))], -1)
    alive = (raw >= 0).long().cumprod(1).bool()
    return torch.where(alive, raw, -1)


def _memory_order(tokens: torch.Tensor, positions: torch.Tensor, depth: int) -> torch.Tensor:
    """positions sorted by (key, position): stable sorts from the last key column to the first."""
    positions = positions.long().sort().values
    keys = memory_keys(tokens, positions, depth)
    for j in range(depth - 1, -1, -1):
        order = torch.sort(keys[:, j], stable=True).indices
        positions, keys = positions[order], keys[order]
    return positions


def ngram_memory_insert(tokens: torch.Tensor, entries: torch.Tensor, levels: list[int], positions: torch.Tensor,
                        depth: int) -> None:
    """Add end positions [n] (whose tokens are already in the store) to the index held in the buffer `entries`
    (levels of sizes `levels`, oldest first, from its start), in place: the new entries become the newest
    level, which merges with the newest levels `memory_merged_blocks` names; the buffer then holds
    `memory_levels(levels, n)` from its start (it needs room for them)."""
    merged = memory_merged_blocks(levels, positions.shape[0])
    if merged == 0:
        return
    start = sum(levels[:len(levels) - (merged - 1)])
    group = torch.cat([entries[start:sum(levels)].long(), positions.long()])
    entries[start:start + group.numel()] = _memory_order(tokens, group, depth).to(entries.dtype)


def ngram_memory_lookup(tokens: torch.Tensor, entries: torch.Tensor, levels: list[int], contexts: torch.Tensor,
                        lengths: torch.Tensor, depth: int, min_match: int, num_candidates: int, width: int,
                        max_occurrences: int) -> tuple[torch.Tensor, ...]:
    """Continuations in the memory of each row's last tokens.

    The index: the buffer `entries` holds levels of sizes `levels` (oldest first) from its start. Row b's query
    is its last min(lengths[b], depth) context tokens, read backwards. An entry e matches it for m(e) tokens:
    the length of the common prefix of key(e) and the query. The row's match is L = the largest m(e) over all
    entries (0, and nothing more, where that is below min_match); its occurrences are the entries with
    m(e) >= L, O_l of them in level l (in the level's order). At most max_occurrences of them are read:
    levels newest first, each whole while it fits in what is left of that quota, else the evenly spread
    O_l[floor(i * |O_l| / r)], i < r, of the r left. An occurrence e continues with t[e + 1], ..., t[e + width],
    -1 from the first negative token (or the end of the store) on. Distinct continuations rank by how many of
    the read occurrences have them (count), then by their largest e (latest), both descending.

    Returns candidates [B, k, width] (-1 where there is none), counts [B, k] (0), latest [B, k] (-1), match [B]
    and occurrences [B] (all entries with m(e) >= L, read or not), all int64; k = num_candidates.
    """
    batch = contexts.shape[0]
    device = contexts.device
    candidates = torch.full((batch, num_candidates, width), -1, dtype=torch.int64, device=device)
    counts = torch.zeros(batch, num_candidates, dtype=torch.int64, device=device)
    latest = torch.full((batch, num_candidates), -1, dtype=torch.int64, device=device)
    match = torch.zeros(batch, dtype=torch.int64, device=device)
    occurrences = torch.zeros(batch, dtype=torch.int64, device=device)
    tokens, entries = tokens.to(device), entries[:sum(levels)].to(device)
    bounds = [0]
    for size in levels:
        bounds.append(bounds[-1] + size)
    keys = memory_keys(tokens, entries, depth)
    size = tokens.shape[0]
    for b in range(batch):
        n = int(lengths[b])
        query = contexts[b, :n].long().flip(0)[:depth]
        if query.numel() == 0 or entries.numel() == 0:
            continue
        m = (keys[:, :query.numel()] == query).long().cumprod(1).sum(1)
        best = int(m.max())
        if best < min_match:
            continue
        match[b] = best
        occurrences[b] = int((m >= best).sum())
        chosen, left = [], max_occurrences
        for level in reversed(range(len(levels))):  # newest first
            found = entries[bounds[level]:bounds[level + 1]][m[bounds[level]:bounds[level + 1]] >= best].long()
            if found.numel() <= left:
                chosen.append(found)
                left -= found.numel()
            else:
                chosen.append(found[(torch.arange(left, device=device) * found.numel()) // left])
                left = 0
            if left == 0:
                break
        ends = torch.cat(chosen)
        at = ends[:, None] + 1 + torch.arange(width, device=device)
        raw = torch.where(at < size, tokens.long()[at.clamp(max=size - 1)], -1)
        conts = torch.where((raw >= 0).long().cumprod(1).bool(), raw, -1)
        unique, inverse = torch.unique(conts, dim=0, return_inverse=True)
        count = torch.zeros(unique.shape[0], dtype=torch.int64, device=device).scatter_add(
            0, inverse, torch.ones_like(inverse))
        last = torch.full((unique.shape[0],), -1, dtype=torch.int64, device=device).scatter_reduce(
            0, inverse, ends, "amax")
        order = torch.argsort(count * 2**32 + last, descending=True)[:num_candidates]
        take = order.numel()
        candidates[b, :take], counts[b, :take], latest[b, :take] = unique[order], count[order], last[order]
    return candidates, counts, latest, match, occurrences


def vocab_project(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_vocab: int,
                  temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                  offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's distribution over the vocabulary intersection, in target ids (paper 000, Alg 4).

    Row n: x = draft_logits[n] with every drafter id v whose target_ids[v] < 0 set to -inf; then
    filter_logits (temperature, top-k, top-p, all over the intersection); w = softmax. probs[n] holds
    w[v] at target id target_ids[v] and 0 elsewhere. The draft is the inverse CDF of w in drafter-id
    order at u = uniform(seed[n], offset, 0, STREAM_DRAFT). Greedy rows (T == 0, or a scaled maximum
    that overflows float32) take the first argmax of x and a one-hot probs row.

    Shapes: draft_logits [N, V_d]; target_ids [V_d] int64 (-1 = not in the intersection, the others
    distinct and < target_vocab); temperature, top_p [N] float32; top_k, seed [N] int64.
    Returns probs [N, target_vocab] float32, tokens [N] int64 (target ids) and draft_tokens [N] int64
    (drafter ids).
    """
    n, _ = draft_logits.shape
    device = draft_logits.device
    mapped = target_ids >= 0
    x = torch.where(mapped, draft_logits.float(), float("-inf"))
    filtered = filter_logits(x, temperature, top_k, top_p)
    probs = torch.zeros(n, target_vocab, dtype=torch.float32, device=device)
    draft_tokens = torch.empty(n, dtype=torch.int64, device=device)
    for row in range(n):
        greedy = float(temperature[row]) == 0.0 or _overflows(x[row], temperature[row])
        if greedy:
            d = torch.argmax(x[row])  # first index of the maximum
            probs[row, target_ids[d]] = 1.0
        else:
            w = torch.softmax(filtered[row], dim=-1)
            probs[row, target_ids[mapped]] = w[mapped]
            d = _inverse_cdf(w, uniform(seed[row], offset, 0, STREAM_DRAFT))
        draft_tokens[row] = d
    return probs, target_ids[draft_tokens], draft_tokens


def tree_visibility(tree_mask: torch.Tensor, nodes: int) -> torch.Tensor:
    """[B, N, ceil(N/32)] int32 ancestor words -> [B, N, N] bool: node i sees node j (bit j % 32 of word
    j // 32 of row i)."""
    shifts = torch.arange(32, device=tree_mask.device, dtype=torch.int64)
    bits = (tree_mask.to(torch.int64)[..., None] >> shifts) & 1  # [B, N, W, 32]
    return bits.reshape(*tree_mask.shape[:2], 32 * tree_mask.shape[2])[:, :, :nodes].bool()  # B = 0 too


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor,
                   kv_mask: torch.Tensor, scale: float, window: int, softcap: float,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of N draft-tree nodes over a cached prefix and the tree (RSD's tree attention, paper 003
    Alg 5, with grouped-query heads): node i attends to the prefix slots that hold a token and to the nodes
    whose bits are set in its row, its ancestors and itself.

    Positions count tokens: a prefix slot's position is the number of valid prefix slots before it; node
    i sits at P + depth(i), P the valid prefix slots, depth(i) = popcount(row i) - 1. window > 0 keeps
    only keys with position(query) - position(key) < window (a sliding window in tokens, whatever holes
    the prefix has). scores = q.k * scale, then softcap * tanh(scores / softcap) when softcap > 0; sinks
    [Hq] adds one logit per query head to the softmax's denominator (attention sinks), with no value.
    float32 throughout; a row with nothing to attend to gives zeros. NaN: a key, value or node the row does
    not see never enters it, whatever it holds; a NaN (or +inf) in the row's query, a score it sees or
    its sink makes the whole row NaN, and a NaN or inf value it sees enters as p * v
    (`_masked_softmax_values`).

    Shapes: query [B, Hq, N, D]; key, value [B, Hkv, S, D] with the nodes in the last N slots, Hq a
    multiple of Hkv; tree_mask [B, N, ceil(N/32)] int32; kv_mask [B, S - N] bool. Returns [B, Hq, N, D]
    in query's dtype.
    """
    batch, heads, nodes, _ = query.shape
    group = heads // key.shape[1]
    sees = tree_visibility(tree_mask, nodes)
    depth = sees.sum(-1) - 1  # [B, N]
    valid = kv_mask.bool()
    prefix_pos = valid.long().cumsum(1) - 1  # [B, S - N]
    query_pos = valid.sum(1, keepdim=True) + depth  # [B, N]
    allowed_prefix = valid[:, None, :].expand(batch, nodes, valid.shape[1])
    allowed_tree = sees
    if window > 0:
        allowed_prefix = allowed_prefix & (query_pos[:, :, None] - prefix_pos[:, None, :] < window)
        allowed_tree = allowed_tree & (depth[:, :, None] - depth[:, None, :] < window)
    allowed = torch.cat([allowed_prefix, allowed_tree], dim=-1)[:, None]  # [B, 1, N, S]
    q = query.float()
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(batch, heads, nodes, 1)
        scores = torch.cat([scores, sink], dim=-1)
    out = _masked_softmax_values(scores, allowed, v)
    return out.to(query.dtype)


def _masked_softmax_values(scores: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(scores) @ v over the keys each row is allowed to see, the NaN rules of tree_attention and
    llama_layers: scores [..., R, S'] (-inf where not allowed; S' >= S columns, those past S extra logits
    with no value: sinks), allowed [..., R, S] broadcastable, v [..., S, D]. A row whose scores hold a NaN
    or +inf is NaN; a row with no weight is zeros; a value the row does not see never enters it (p = 0
    does not multiply it), a NaN or inf value it sees does, as p * v."""
    top = scores.amax(-1, keepdim=True)
    poisoned = ~(top < float("inf"))  # NaN or +inf: no softmax
    shift = torch.where(poisoned | (top == float("-inf")), 0.0, top)
    weights = torch.where(poisoned, 0.0, torch.exp(scores - shift))
    total = weights.sum(-1, keepdim=True)
    weights = weights[..., :v.shape[-2]]
    finite = torch.isfinite(v)
    num = weights @ torch.where(finite, v, 0.0)
    if not bool(finite.all()):
        seen_bad = allowed[..., None] & ~finite[..., None, :, :]  # [..., R, S, D]
        num = num + torch.where(seen_bad, weights[..., None] * v[..., None, :, :], 0.0).sum(-2)
    out = torch.where(total > 0, num / torch.where(total > 0, total, 1.0), 0.0)
    return torch.where(poisoned, float("nan"), out)


def tree_children(parents: torch.Tensor, nodes: int) -> list[list[int]]:
    """Each node's children in node order (the order siblings were drawn in), for nodes < `nodes`."""
    children: list[list[int]] = [[] for _ in range(nodes)]
    for c in range(1, nodes):
        children[int(parents[c])].append(c)
    return children


def tree_verify(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                draft_probs: torch.Tensor | None, num_nodes: torch.Tensor, replacement: bool,
                temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                offset: int, scheme: str = "recursive") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over a draft tree (RSD, Jeon et al. 2024, paper 003 Alg 3-4; SpecInfer's
    multi-step speculative sampling with `replacement`).

    At node n, with p the target's distribution there (softmax(logits / T) after top-k / top-p) and q
    the distribution its children were drawn from (draft_probs[b, n]; one-hot on each child without
    draft_probs), the children x_1, x_2, ... are tried in node order: accept x_i iff
    u * q_i(x_i) < p_i(x_i), u = uniform(seed[b], offset, child - 1, STREAM_ACCEPT), then descend into it.
    On rejection p_{i+1} = norm(max(0, p_i - q_i)) (kept as p_i if that has no mass, chain_verify's
    policy) and, drawn without replacement, q_{i+1} = q_i without x_i, renormalized (i.i.d. children:
    q_{i+1} = q_i). When no child is accepted, or at a leaf, emit a token from the current p by inverse
    CDF at u = uniform(seed[b], offset, n, STREAM_SAMPLE). A chain is chain_verify, draw for draw.
    Temperature 0 (or logits / T overflowing) is greedy: follow the first child equal to the first
    argmax of the logits, and emit the argmax where none is.

    Arithmetic: p float32; the residual r float32 with its float64 mass R (p_i = r / R); a
    probabilistic q_i(x) = q(x) / s, s the float64 mass not yet drawn; the update is
    r <- max(0, r * f32(1 / R) - q * f32(1 / s)); a one-hot update zeroes r[x] and subtracts it from R.

    Shapes: target_logits [B, N, V]; tokens, parents [B, N] int64 (parents[b, n] < n for 1 <= n <
    num_nodes[b]; node 0 is the root); draft_probs [B, N, V] float32 or None; num_nodes, top_k, seed [B]
    int64; temperature, top_p [B] float32. Returns out_tokens [B, N] (accepted drafts, then the emitted
    token, -1 padding), out_nodes [B, N] (the node of each accepted draft, -1 elsewhere) and
    num_accepted [B], all int64.
    scheme "traversal" verifies the tree from its leaves instead (`_traversal_verify_request`); greedy
    requests are the same.
    """
    batch, nodes, _ = target_logits.shape
    device = target_logits.device
    out_tokens = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    out_nodes = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    for b in range(batch):
        count = int(num_nodes[b])
        children = tree_children(parents[b], count)
        greedy = float(temperature[b]) == 0.0
        rows = filter_logits(target_logits[b, :count], temperature[b].expand(count), top_k[b].expand(count),
                             top_p[b].expand(count))
        if scheme == "traversal" and not greedy:
            num_accepted[b] = _traversal_verify_request(
                target_logits[b], rows, tokens[b], children, draft_probs[b] if draft_probs is not None else None,
                replacement, temperature[b], seed[b], offset, out_tokens[b], out_nodes[b])
            continue
        node, depth = 0, 0
        while True:
            raw = target_logits[b, node].float()
            kids = children[node]
            if greedy or _overflows(raw, temperature[b]):
                best = int(torch.argmax(raw))  # first index of the maximum
                follow = next((c for c in kids if int(tokens[b, c]) == best), None)
                out_tokens[b, depth] = best
                if follow is None:
                    break
                out_nodes[b, depth] = follow
                node, depth = follow, depth + 1
                continue
            residual = torch.softmax(rows[node], dim=-1)
            mass = 1.0  # float64 mass of the residual: p_i = residual / mass
            q = draft_probs[b, node].float() if draft_probs is not None else None
            left = 1.0  # float64 mass of q not yet drawn
            accepted = None
            for c in kids:
                x = int(tokens[b, c])
                q_x = 1.0 if q is None else float(q[x]) / left
                u = float(uniform(seed[b], offset, c - 1, STREAM_ACCEPT))
                if u * q_x * mass < float(residual[x]):
                    accepted = c
                    break
                if q is None:  # max(0, p_i - onehot(x)): p_i without x
                    rest = mass - float(residual[x])
                    if rest > 0.0:  # else no mass would be left: keep p_i
                        residual = residual.clone()
                        residual[x] = 0.0
                        mass = rest
                else:
                    update = torch.clamp(residual * torch.tensor(1.0 / mass, dtype=torch.float32)
                                         - q * torch.tensor(1.0 / left, dtype=torch.float32), min=0.0)
                    total = float(update.to(torch.float64).sum())
                    if total > 0.0:
                        residual, mass = update, total
                    if not replacement:
                        left -= float(q[x])
            if accepted is None:
                u = uniform(seed[b], offset, node, STREAM_SAMPLE)
                out_tokens[b, depth] = _inverse_cdf(residual, u)
                break
            out_tokens[b, depth] = int(tokens[b, accepted])
            out_nodes[b, depth] = accepted
            node, depth = accepted, depth + 1
        num_accepted[b] = depth
    return out_tokens, out_nodes, num_accepted



def _traversal_verify_request(raw: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                              children: list[list[int]], probs: torch.Tensor | None, replacement: bool,
                              temperature: torch.Tensor, seed: torch.Tensor, offset: int, out_tokens: torch.Tensor,
                              out_nodes: torch.Tensor) -> int:
    """Traversal verification of one request's tree (Weng, Hu, Chen, Liu, Mei, Qiu, Tian, Shi, "Traversal
    Verification for Speculative Tree Decoding", NeurIPS 2025, arXiv 2505.12398), in the form derived in
    docs/verification.md; on a chain it is `_block_verify_row`, draw for draw (with draft probabilities).

    Every node b holds a target law p_b = r_b / R_b for its children (at first the target's row, R = 1),
    the draft law q_b = q / s_b they were drawn from (s_b the float64 mass of q not yet drawn: 1, less each
    rejected child's q without replacement; one-hot on each child without draft_probs), and a weight w_b:
    w_root = 1 always, and top-down w_c = min(1, w_b p_b(x_c) / q_b(x_c)) for a child c with token x_c
    (float64, `block_weights`' rule). The walk starts at the first leaf in node order (the first child of
    the first child ...; a node of weight 0 stands for its whole subtree, every node of which has weight
    0) and repeats:

    - keep the path to the current node a with probability w_a, u = uniform(seed, offset, a - 1, accept
      stream): u < w_a, or for a node whose children were all rejected u * den_a < num_a (w_a = num_a /
      den_a); then emit a token from p_a by inverse CDF at uniform(seed, offset, a, sample stream);
    - else remove a and update its parent b: r_b <- max(0, f32(w_b / R_b) r_b - f32(1 / s_b) q) (float32),
      S its float64 mass; with one-hot q, r_b <- r_b without x_a and S = w_b (R_b - r_b(x_a)) / R_b, no
      pass over the vocabulary. Where S = 0 (round-off) r_b stays. num_b = S, den_b = S + 1 - w_b
      (w_b = 0 where den_b = 0); the root keeps w = 1. Without replacement s_b -= q(x_a). Then the weights
      below b are computed again, and the walk goes on from the first leaf of what is left; at the root
      with no children left it emits from p_root.

    Writes out_tokens / out_nodes and returns the number of accepted drafts.

    One function, as the docstring states the walk: its state (alive children, residuals, masses, weights) is
    what every step reads and writes, and the closures below name its parts; split, the spec would scatter."""
    count = len(children)
    alive = [list(kids) for kids in children]
    parent = [-1] * count
    for b, kids in enumerate(children):
        for c in kids:
            parent[c] = b
    p_rows: dict[int, torch.Tensor] = {}

    def p_row(n: int) -> torch.Tensor:
        if n not in p_rows:
            p_rows[n] = _target_row(raw[n], rows[n], temperature)
        return p_rows[n]

    residual: dict[int, torch.Tensor] = {}  # r_b of the nodes that have lost a child (else p_b, R_b = 1)
    mass = [1.0] * count  # R_b
    left = [1.0] * count  # s_b
    fraction: dict[int, tuple[float, float]] = {}  # (num, den) of the nodes that have lost a child
    weight = [1.0] * count

    def r_of(b: int) -> torch.Tensor:
        return residual[b] if b in residual else p_row(b)

    def w_of(b: int) -> float:
        if b == 0:
            return 1.0
        if b in fraction:
            num, den = fraction[b]
            return num / den
        return weight[b]

    def reweigh() -> None:
        for c in range(1, count):
            b = parent[c]
            if c in fraction or c not in alive[b]:
                continue
            x = int(tokens[c])
            pw = w_of(b) * (float(r_of(b)[x]) / mass[b])
            q_x = float(probs[b, x]) / left[b] if probs is not None else 1.0
            weight[c] = 1.0 if pw >= q_x else pw / q_x

    reweigh()
    while True:
        a = 0
        while alive[a]:
            a = alive[a][0]
            if w_of(a) == 0.0:  # a subtree of weight 0: nothing in it can be kept
                break
        if a != 0:
            u = float(uniform(seed, offset, a - 1, STREAM_ACCEPT))
            keep = u * fraction[a][1] < fraction[a][0] if a in fraction else u < weight[a]
        if a == 0 or keep:
            break
        b, x = parent[a], int(tokens[a])
        alive[b].remove(a)
        w_b, r_b = w_of(b), r_of(b)
        if probs is None:
            s = w_b * (mass[b] - float(r_b[x])) / mass[b]
            if s > 0.0:
                mass[b] -= float(r_b[x])
                r_b = r_b.clone()
                r_b[x] = 0.0
                residual[b] = r_b
        else:
            update = torch.clamp(torch.tensor(w_b / mass[b], dtype=torch.float32) * r_b
                                 - torch.tensor(1.0 / left[b], dtype=torch.float32) * probs[b].float(), min=0.0)
            s = float(update.to(torch.float64).sum())
            if s > 0.0:
                residual[b], mass[b] = update, s
            if not replacement:
                left[b] -= float(probs[b, x])
        if b != 0:
            den = s + 1.0 - w_b
            fraction[b] = (s, den) if den > 0.0 else (0.0, 1.0)
        reweigh()
    path = []
    n = a
    while n != 0:
        path.append(n)
        n = parent[n]
    path.reverse()
    for depth, c in enumerate(path):
        out_tokens[depth] = int(tokens[c])
        out_nodes[depth] = c
    out_tokens[len(path)] = _inverse_cdf(r_of(a), uniform(seed, offset, a, STREAM_SAMPLE))
    return len(path)

def sample_without_replacement(logits: torch.Tensor, num_samples: int, temperature: torch.Tensor,
                               top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                               offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """num_samples distinct tokens per row in draw order, drawn without replacement from q =
    softmax(filter_logits(logits)): the siblings of a draft tree (RSD-C, paper 003) and the q that
    tree_verify needs. Equal in distribution to Gumbel-top-k (the k largest log q + Gumbel keys, in
    descending order); drawn here sequentially: draw i is the inverse CDF of the weights left after
    draws 0..i-1 are zeroed, at u = uniform(seed[n], offset, i, STREAM_WITHOUT_REPLACEMENT). Draws past
    q's support are -1; a token whose weight exp(x/T - m) is below float32's smallest normal is outside
    it. Greedy rows (T == 0, or a scaled maximum overflowing float32) take the num_samples largest
    logits (ties: lower index first; -inf logits are never taken) and a one-hot q on the first argmax.

    Shapes: logits [N, V]; temperature, top_p [N] float32; top_k, seed [N] int64.
    Returns tokens [N, num_samples] int64 and probs [N, V] float32 (q).
    """
    rows, vocab = logits.shape
    device = logits.device
    filtered = filter_logits(logits, temperature, top_k, top_p)
    tokens = torch.full((rows, num_samples), -1, dtype=torch.int64, device=device)
    probs = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
    for n in range(rows):
        raw = logits[n].float()
        if float(temperature[n]) == 0.0 or _overflows(raw, temperature[n]):
            order = torch.sort(raw, descending=True, stable=True).indices[:num_samples]
            order = order[raw[order] > float("-inf")]
            tokens[n, : order.numel()] = order
            probs[n, order[0]] = 1.0
            continue
        shifted = filtered[n] - filtered[n].max()
        # A weight exp(x - m) below float32's smallest normal is 0 (what the kernels' exp gives): such a
        # token is outside q's support, and draws past the support are -1.
        weights = torch.where(shifted < SMALLEST_NORMAL_LOG, 0.0, torch.exp(shifted))
        q = weights / weights.sum()
        probs[n] = q
        weights = q.clone()
        for i in range(num_samples):
            if not bool((weights > 0).any()):
                break
            token = _inverse_cdf(weights, uniform(seed[n], offset, i, STREAM_WITHOUT_REPLACEMENT))
            tokens[n, i] = token
            weights[token] = 0.0
    return tokens, probs


def truncated_gumbel(g: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """-log(exp(-bound) + exp(-g)): a Gumbel g conditioned to lie below `bound` (Kool et al. 2019, the
    top-down form), as min(bound, g) - log1p(exp(-|bound - g|)), which neither overflows nor cancels."""
    return torch.minimum(bound, g) - torch.log1p(torch.exp(-(bound - g).abs()))


def stochastic_beam_step(logits: torch.Tensor, beam_log_probs: torch.Tensor, beam_scores: torch.Tensor,
                         beam_width: int, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         seed: torch.Tensor, offset: int) -> tuple[torch.Tensor, ...]:
    """One level of Stochastic Beam Search (Kool, van Hoof, Welling 2019; RSD-S, paper 003 Alg. 9): the
    beam_width children with the largest truncated-Gumbel scores over all beams of a request.

    Beam w of request b is live when beam_log_probs[b, w] (phi, its path's log-probability) and
    beam_scores[b, w] (G, its perturbed score) are above -inf; other beams are not read and get q = 0.
    A live beam's children are drawn without replacement from q = softmax(filter_logits(logits[b, w]))
    exactly as `sample_without_replacement(logits[b, w], beam_width)` with the seed of `beam_seeds`
    (seed[b] + w * 0x632BE59BD9B4E019) draws them: tokens d_0, d_1, ... in draw order. Their scores
    follow the draw order down from the parent's (top-down Gumbels conditioned on their maximum being G):

        s_0 = G,   s_i = truncated_gumbel(phi + log m_i - log(-log u_i), s_{i-1})   (i >= 1)

    where m_i is the float64 sum of q over the tokens not among d_0..d_{i-1}, and u_i = uniform(seed of the
    beam, offset, i, STREAM_BEAM). By the Gumbel-top-k argument this is distributed as SBS's
    -log(exp(-G) - exp(-Z) + exp(-g_x)) over every child x, and the children a level keeps from one beam are
    a prefix of its draw order (paper 003 Thm 3.2), so tree_verify may check them in that order. Each child's
    log-probability is phi + log q(d_i). Greedy rows (T = 0, or logits / T overflowing float32): the
    beam_width largest logits, scored without noise by phi + log_softmax(logits)(d_i) (beam search), q one-hot
    on the first argmax as in sample_without_replacement.

    The kept children: all (w, i) with d_i >= 0, ordered by float32 score descending, ties by the lower w * K
    + i; the first beam_width of them.

    Shapes: logits [B, W, V]; beam_log_probs, beam_scores [B, W] float32; temperature, top_p [B] float32;
    top_k, seed [B] int64. Returns parents [B, K] int64 (the beam, -1 past the children there are), tokens
    [B, K] int64 (-1 there), log_probs and scores [B, K] float32 (-inf there), probs [B, W, V] float32.
    """
    from specops._seeds import beam_seeds

    batch, beams, vocab = logits.shape
    k = beam_width
    device = logits.device
    keys = beam_seeds(seed, beams)
    parents = torch.full((batch, k), -1, dtype=torch.int64, device=device)
    tokens = torch.full((batch, k), -1, dtype=torch.int64, device=device)
    log_probs = torch.full((batch, k), float("-inf"), dtype=torch.float32, device=device)
    scores = torch.full((batch, k), float("-inf"), dtype=torch.float32, device=device)
    probs = torch.zeros(batch, beams, vocab, dtype=torch.float32, device=device)
    for b in range(batch):
        cand = []  # (score float32, flat index, beam, token, log_prob)
        for w in range(beams):
            phi, parent_score = float(beam_log_probs[b, w]), float(beam_scores[b, w])
            if phi == float("-inf") or parent_score == float("-inf"):
                continue
            drawn, q = sample_without_replacement(logits[b, w][None], k, temperature[b:b + 1], top_k[b:b + 1],
                                                  top_p[b:b + 1], keys[b, w:w + 1], offset)
            drawn, q = drawn[0], q[0]
            probs[b, w] = q
            raw = logits[b, w].float()
            greedy = float(temperature[b]) == 0.0 or _overflows(raw, temperature[b])
            if greedy:
                scored = torch.log_softmax(raw.double(), 0)
            else:
                scored = torch.log(q.double())
            left = q.double().clone()
            score = torch.tensor(parent_score, dtype=torch.float64)
            for i in range(k):
                token = int(drawn[i])
                if token < 0:
                    break
                log_prob = phi + scored[token]
                if greedy:
                    score = log_prob
                elif i > 0:
                    noise = -torch.log(-torch.log(uniform(keys[b, w], offset, i, STREAM_BEAM)))
                    score = truncated_gumbel(phi + torch.log(left.sum()) + noise, score)
                left[token] = 0.0
                cand.append((float(torch.tensor(float(score), dtype=torch.float32)), w * k + i, w, token,
                             float(log_prob)))
        cand.sort(key=lambda c: (-c[0], c[1]))
        for j, (score, _, w, token, log_prob) in enumerate(cand[:k]):
            parents[b, j], tokens[b, j], log_probs[b, j], scores[b, j] = w, token, log_prob, score
    return parents, tokens, log_probs, scores, probs


def skinny_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """input [M, K] @ weight[N, K]^T + bias [N] (or None): a linear layer, computed in float64 and returned
    in input's dtype. The kernels sum in float32 in their own order: they match this to float32
    round-off of the products' magnitudes, not bit for bit."""
    out = input.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(input.dtype)


def dequantize(weight: torch.Tensor, scales: torch.Tensor | None = None,
               mins: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 [N, K] matrix a quantized_linear weight stands for; the weight's dtype names the format:

    - bfloat16 [N, K]: the weight itself (no scales or mins).
    - int8 [N, K] with scales [N, G]: weight[n, k] * scales[n, k // (K / G)] (symmetric; G = 1 is one
      scale per output channel).
    - uint8 [N, K / 2], int4: q[n, k] * scales[n, g] + mins[n, g] with q in 0..15, two per byte: in each
      block of 32 weights along K, byte j holds weight j in its low nibble and weight j + 16 in its high
      nibble. K is a multiple of 32.

    With G > 1 each group spans K / G weights, a multiple of 32."""
    if weight.dtype == torch.bfloat16:
        return weight.double()
    if weight.dtype == torch.int8:
        q = weight.double()
    else:
        n, half = weight.shape
        blocks = weight.view(n, half // 16, 16)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(n, 2 * half).double()
    n, k = q.shape
    groups = scales.shape[1]
    out = q.view(n, groups, k // groups) * scales.double()[..., None]
    if mins is not None:
        out = out + mins.double()[..., None]
    return out.reshape(n, k)


def quantized_linear(input: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
                     mins: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """input [M, K] @ dequantize(weight, scales, mins)^T + bias: a linear layer whose weight is stored in
    low precision (weight-only quantization: the input is not quantized), computed in float64 and
    returned in input's dtype. The kernels de-quantize in float32 and sum in their own order."""
    return skinny_linear(input, dequantize(weight, scales, mins), bias)


INT8_LINEAR_MOST_K = (1 << 17) - 1  # int8_linear's longest sum: K * 128 * 128 stays below 2^31


def int8_linear(input: torch.Tensor, input_scales: torch.Tensor, weight: torch.Tensor,
                weight_scales: torch.Tensor) -> torch.Tensor:
    """int8 input [M, K] times int8 weight [N, K]^T, each row scaled: out[m, n] = (sum_k input[m, k] *
    weight[n, k]) * input_scales[m] * weight_scales[n], float32 [M, N] (input_scales [M] and weight_scales [N]
    float32). The weight may come in int8_linear_pack's layout (uint8, 3-D; N from weight_scales). The sums
    are exact integers (K <= INT8_LINEAR_MOST_K); here the scaling is done in float64 and rounded once, the
    kernels round float(sum) * input_scale * weight_scale in float32 (at most three roundings: a relative
    difference of at most 3 * 2^-24 from the float64 value before this rounds it, and none where the sum, the
    scales and their products are exact in float32)."""
    if weight.dim() == 3:  # int8_linear_pack's layout
        weight = int8_linear_unpack(weight, weight_scales.shape[0], input.shape[1])
    sums = input.long() @ weight.long().T
    return (sums.double() * input_scales.double()[:, None] * weight_scales.double()[None, :]).float()


def int8_linear_pack(weight: torch.Tensor) -> torch.Tensor:
    """int8_linear's packed weight layout: int8 [N, K] as uint8 [ceil(N / 16), ceil(K / 4), 64] holding
    weight + 128, where weight[n, k] sits at [n // 16, k // 4, 4 * (n % 16) + k % 4]; the rows past N and
    the columns past K are zeros of the weight (128). A block of 16 weight rows is one contiguous run, and
    each 64-byte line of it holds 4 consecutive k of the 16 rows: what one VNNI instruction multiplies
    against 4 bytes of an input row broadcast, with no sums across lanes afterwards."""
    n, k = weight.shape
    blocks, quads = -(-n // 16), -(-k // 4)
    full = torch.zeros(blocks * 16, quads * 4, dtype=torch.int16, device=weight.device)
    full[:n, :k] = weight.to(torch.int16)
    full += 128
    return full.to(torch.uint8).view(blocks, 16, quads, 4).transpose(1, 2).reshape(blocks, quads, 64).contiguous()


def int8_linear_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 [N, K] weight that int8_linear_pack packed into `packed`."""
    blocks, quads = packed.shape[0], packed.shape[1]
    rows = packed.view(blocks, quads, 16, 4).transpose(1, 2).reshape(blocks * 16, quads * 4)
    return (rows[:n, :k].to(torch.int16) - 128).to(torch.int8)


LLAMA_SLOTS = ("q", "k", "v", "o", "gate", "up", "down")  # llama_layers' linear layers per decoder layer


def llama_layers(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                 norms: list[torch.Tensor], linears: list[torch.Tensor | None], keys: list[torch.Tensor],
                 values: list[torch.Tensor], heads: int, kv_heads: int, eps: float,
                 scale: float, qk_norms: list[torch.Tensor] | None = None, norm_offset: float = 0.0,
                 activation: str = "silu", local_layers: list[int] = (), local_cos: torch.Tensor | None = None,
                 local_sin: torch.Tensor | None = None, local_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder layers of a Llama-family model over the B * n new rows of a decoding forward, and the
    same layers with Gemma-3's and Qwen3's extras.

    Layer l (2 norms per layer, Llama's): h = norm(x, norms[2l]); q | k | v = h @ W^T for its q, k and v
    projections; with qk_norms, each head of q is normed by qk_norms[2l] and each head of k by
    qk_norms[2l + 1] (over its D features); q and k get rotary embedding x * cos + rotate_half(x) * sin
    (rotate_half(x) = [-x[D/2:], x[:D/2]]); k and v are written into the last n slots of the layer's keys and
    values; x += attention(q, keys, values) @ W_o^T, grouped-query (query head i reads key/value head
    i // (heads / kv_heads)), scores q.k * scale, masked where attn_mask is False (a row that sees no slot
    attends to nothing: zeros; a hidden slot never enters a row, whatever it holds, and a NaN in what a row
    sees makes it NaN, as in `tree_attention`); h = norm(x, norms[2l + 1]); x += (act(h @ W_gate^T) *
    (h @ W_up^T)) @ W_down^T, act silu or, with activation "gelu_tanh", gelu with the tanh approximation.
    norm(x, w) = x / sqrt(mean(x^2) + eps) * (w + norm_offset) (Gemma's norms: offset 1).

    With 4 norms per layer (Gemma-3's) they are the input, post-attention, pre-MLP and post-MLP norms: the
    attention's output is normed by norms[4l + 1] before it is added, the MLP's input is norm(x, norms[4l + 2])
    and its output is normed by norms[4l + 3] before it is added.

    A layer listed in local_layers (Gemma-3's sliding-window layers) reads local_cos, local_sin and
    local_mask (None: every slot seen) in place of cos, sin and attn_mask.

    linears holds per layer LLAMA_SLOTS' (weight, scales, mins, bias), 28 entries: a float32 weight with no
    scales or mins is a float layer, any other a quantized_linear weight (`dequantize`). A slot without a
    weight is fused into the slot before: that slot's weight gives both layers' outputs, concatenated
    (q | k | v in the q slot, gate | up in the gate slot).

    Shapes: hidden [B * n, d] float32 (row b * n + t: request b's t-th new token); cos, sin, local_cos,
    local_sin [B, n, D]; attn_mask, local_mask [B, 1, n, past + n] bool or None (every slot seen); norms 2 L
    or 4 L tensors [d]; qk_norms None or 2 L tensors [D]; keys, values L float32 tensors
    [B, kv_heads, past + n, D]: the first past slots the cache, the last n room for the new rows, written in
    place (rounded to float32). Returns x [B * n, d] float32. Computed in float64."""
    batch, n, dim = cos.shape
    half = dim // 2
    x = hidden.double()
    group = heads // kv_heads
    per_layer = len(norms) // len(keys)
    local = set(local_layers)

    def norm(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + norm_offset)

    def product(layer, first, count, t):
        outs = []
        for slot in range(first, first + count):
            w, scales, mins, bias = linears[(layer * len(LLAMA_SLOTS) + slot) * 4:][:4]
            if w is None:
                continue
            full = w.double() if w.dtype == torch.float32 and scales is None and mins is None else \
                dequantize(w, scales, mins)
            outs.append(skinny_linear(t, full, bias))
        return torch.cat(outs, dim=1)

    def rope(t, c, s):  # [B, n, H, D]
        return t * c + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * s

    def act(t):
        return torch.nn.functional.gelu(t, approximate="tanh") if activation == "gelu_tanh" else \
            torch.nn.functional.silu(t)

    past = keys[0].shape[2] - n
    for layer in range(len(keys)):
        w = norms[per_layer * layer:per_layer * (layer + 1)]
        c, s, mask = (local_cos, local_sin, local_mask) if layer in local else (cos, sin, attn_mask)
        c, s = c.double()[:, :, None], s.double()[:, :, None]
        qkv = product(layer, 0, 3, norm(x, w[0]))
        q = qkv[:, :heads * dim].reshape(batch, n, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(batch, n, kv_heads, dim)
        if qk_norms:
            q, k = norm(q, qk_norms[2 * layer]), norm(k, qk_norms[2 * layer + 1])
        q, k = rope(q, c, s).transpose(1, 2), rope(k, c, s).transpose(1, 2)
        v = qkv[:, (heads + kv_heads) * dim:].reshape(batch, n, kv_heads, dim).transpose(1, 2)
        all_k = torch.cat([keys[layer][:, :, :past].double(), k], dim=2)
        all_v = torch.cat([values[layer][:, :, :past].double(), v], dim=2)
        scores = q @ all_k.repeat_interleave(group, dim=1).transpose(-1, -2) * scale
        allowed = mask if mask is not None else torch.ones(1, 1, 1, past + n, dtype=torch.bool, device=x.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = _masked_softmax_values(scores, allowed, all_v.repeat_interleave(group, dim=1))
        out = product(layer, 3, 1, attn.transpose(1, 2).reshape(batch * n, heads * dim))
        x = x + (norm(out, w[1]) if per_layer == 4 else out)
        gu = product(layer, 4, 2, norm(x, w[2] if per_layer == 4 else w[1]))
        inter = gu.shape[1] // 2
        out = product(layer, 6, 1, act(gu[:, :inter]) * gu[:, inter:])
        x = x + (norm(out, w[3]) if per_layer == 4 else out)
        keys[layer][:, :, past:] = k.float()
        values[layer][:, :, past:] = v.float()
    return x.float()


WEIGHTED, CONTRASTIVE = 0, 1  # ensemble_logits modes


def ensemble_logits(members: list[torch.Tensor], weights: torch.Tensor, mode: int, mu: float = 0.0,
                    alpha: float = 0.0) -> torch.Tensor:
    """The logits of an ensemble of next-token distributions, each member's logits [..., V] over one
    vocabulary (-inf: a token the member cannot produce), computed in float64, returned as float32.

    - mode 0, weighted: log(sum_i weights[i] * softmax(members[i])); -inf where no member with a
      positive weight gives the token any probability.
    - mode 1, contrastive (two members, expert then amateur): (l_e - max l_e) - mu * (l_a - max l_a),
      -inf where either member has -inf and, with alpha > 0, where the expert's probability is below
      alpha times its largest (the adaptive-plausibility cut of contrastive decoding). A row where no
      token survives (possible only with members of different vocabularies) is the expert's cut logits.

    Temperature, top-k and top-p are not part of it: a consumer applies them to these logits as to one
    model's (chain_verify, tree_verify), so the ensemble samples like a model would."""
    logits = [m.double() for m in members]
    if mode == WEIGHTED:
        out = torch.full_like(logits[0], float("-inf"))
        for w, l in zip(weights.double().tolist(), logits):
            if w > 0:
                out = torch.logaddexp(out, math.log(w) + torch.log_softmax(l, dim=-1))
        return out.float()
    expert, amateur = logits
    e = expert - expert.amax(-1, keepdim=True)
    a = amateur - amateur.amax(-1, keepdim=True)
    cut = e >= math.log(alpha) if alpha > 0 else torch.ones_like(e, dtype=torch.bool)
    keep = cut & (e > float("-inf")) & (a > float("-inf"))
    out = torch.where(keep, e - mu * torch.where(keep, a, 0.0), float("-inf"))
    fallback = torch.where(cut & (e > float("-inf")), e, float("-inf"))
    empty = ~keep.any(-1, keepdim=True)
    return torch.where(empty, fallback, out).float()
