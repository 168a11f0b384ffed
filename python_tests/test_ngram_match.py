"""Tests of `specops::ngram_match` (context n-gram drafts), in layers, plus bad inputs.

1. Exact: hand-made contexts whose answers are written out by hand (repeats, overlapping matches,
   truncated continuations, no match, short contexts, each ranking rule, padding, int32 tokens),
   for every backend.
2. The reference itself against an independent brute force written from the contract's text with
   Python lists and dicts, on many random contexts.
3. Agreement: the C++ CPU kernel and the Triton kernel (interpreted on CPU without a GPU) return
   exactly the reference's outputs on seeded random ragged batches; the public wrapper too.
4. Bad inputs raise ValueError / TypeError naming the problem; validate=False never crashes.
5. `torch.library.opcheck` and `torch.compile(fullgraph=True)`.

Implementations are named "reference" (specops.reference.ngram_match, the spec), "cpp"
(torch.ops.specops.ngram_match on CPU tensors) and "triton" (ngram_match_triton on the Triton
device), all called with the op's arguments. Every result is exact integers: any difference is a bug.
Batches are right-padded with junk (-1 and each row's last token) that changes the answer if read.
"""

from __future__ import annotations

import random

import pytest
import torch
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher

import specops
from specops import reference

ngram_match_triton = triton_launcher("ngram_match")


# ---- helpers ----

def make_batch(contexts: list[list[int]], dtype: torch.dtype = torch.int64, extra_padding: int = 3,
               total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, L] right-padded with junk, and lengths [B] int64, from per-row token lists.
    L is the longest context plus `extra_padding`, or `total`."""
    width = max([len(c) for c in contexts], default=0) + extra_padding if total is None else total
    rows = []
    for ctx in contexts:
        # Junk that changes the answer if read: the row's last token (it moves the query) and -1.
        junk = (ctx[-1] if ctx else 3, -1)
        rows.append(ctx + [junk[i % 2] for i in range(width - len(ctx))])
    tokens = torch.tensor(rows, dtype=dtype).reshape(len(contexts), width)
    return tokens, torch.tensor([len(c) for c in contexts], dtype=torch.int64)


def run_impl(impl: str, tokens: torch.Tensor, lengths: torch.Tensor, min_ngram: int, max_ngram: int,
             num_candidates: int, width: int, validate: bool = True):
    """(candidates, counts, ngram) on CPU from one implementation, given CPU tensors; the outputs'
    dtypes, shapes and device are checked here for every call."""
    args = (min_ngram, max_ngram, num_candidates, width)
    if impl == "reference":
        result = reference.ngram_match(tokens, lengths, *args)
        device = "cpu"
    elif impl == "cpp":
        result = torch.ops.specops.ngram_match(tokens, lengths, *args, validate)
        device = "cpu"
    elif impl == "triton":
        result = ngram_match_triton(tokens.to(TRITON_DEVICE), lengths.to(TRITON_DEVICE), *args,
                                    validate=validate)
        device = TRITON_DEVICE
    else:
        raise AssertionError(impl)
    check_outputs(result, tokens.shape[0], num_candidates, width, device)
    return tuple(t.cpu() for t in result)


def check_outputs(result, batch: int, num_candidates: int, width: int, device) -> None:
    candidates, counts, ngram = result
    for name, t, shape in (("candidates", candidates, (batch, num_candidates, width)),
                           ("counts", counts, (batch, num_candidates)),
                           ("ngram", ngram, (batch, num_candidates))):
        assert t.dtype == torch.int64, f"{name} is {t.dtype}, not int64"
        assert tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, not {shape}"
        assert t.device.type == torch.device(device).type, f"{name} is on {t.device}, not {device}"


def assert_same(result, expected, what: str = "") -> None:
    for name, got, exp in zip(("candidates", "counts", "ngram"), result, expected):
        assert torch.equal(got, exp), f"{what}{name}\n{got.tolist()}\n!= reference\n{exp.tolist()}"


def assert_lists(result, candidates, counts, ngram) -> None:
    got = [t.tolist() for t in result]
    assert got == [candidates, counts, ngram], (
        f"got candidates {got[0]} counts {got[1]} ngram {got[2]}; "
        f"expected candidates {candidates} counts {counts} ngram {ngram}")


# ==== 1. Exact: hand-made contexts, answers written by hand ====

# id: (context, (min_ngram, max_ngram, num_candidates, width), candidates, counts, ngram[, dtype]).
# m(e) is the match length at end e; "cont" a continuation, L its level, N its count, R its recency.
HAND_CASES = {
    # e=1 and e=4 both match "1 2" (m=2): L and N tie, the later one (R=4) ranks first; k pads.
    "repeats_tie_to_recency": ([1, 2, 3, 1, 2, 4, 1, 2], (1, 3, 3, 2),
                               [[4, 1], [3, 1], [-1, -1]], [1, 1, 0], [2, 2, 0]),
    # Overlapping matches: m(0)=1 -> [7 7], m(1)=2 -> [7 7], m(2)=3 -> [7 -1] (truncated).
    # [7 7] has level 2 (count 1: only e=1 is at its level), [7 -1] level 3.
    "overlap_7777": ([7, 7, 7, 7], (1, 3, 2, 2), [[7, -1], [7, 7]], [1, 1], [3, 2]),
    # All continuations are [7]; m = 1, 2, 2, 2 (capped at 2): count only the three at level 2.
    "overlap_one_continuation": ([7, 7, 7, 7, 7], (1, 2, 2, 1), [[7], [-1]], [3, 0], [2, 0]),
    # e=3 ends right before the end: [4 -1 -1]; e=1: [3 4 4]. Both m=1, N=1: recency decides.
    "match_right_before_the_end": ([3, 4, 3, 4, 4], (1, 3, 2, 3), [[4, -1, -1], [3, 4, 4]], [1, 1], [1, 1]),
    # The last token never occurred before.
    "no_match": ([1, 2, 3, 4], (1, 3, 2, 2), [[-1, -1], [-1, -1]], [0, 0], [0, 0]),
    "length_0": ([], (1, 3, 2, 2), [[-1, -1], [-1, -1]], [0, 0], [0, 0]),
    "length_1": ([5], (1, 3, 2, 2), [[-1, -1], [-1, -1]], [0, 0], [0, 0]),
    "length_2": ([5, 5], (1, 3, 2, 3), [[5, -1, -1], [-1, -1, -1]], [1, 0], [1, 0]),
    # Shorter than min_ngram + 1: m(e) <= e + 1 < 3 for every earlier end e.
    "shorter_than_min_ngram": ([4, 4, 4], (3, 3, 1, 2), [[-1, -1]], [0], [0]),
    "just_long_enough_for_min_ngram": ([4, 4, 4, 4], (3, 3, 1, 2), [[4, -1]], [1], [3]),
    # Last token 1 at e=0, 2, 4: [5] twice beats the more recent [6] once.
    "frequency_beats_recency": ([1, 5, 1, 5, 1, 6, 1], (1, 1, 3, 1), [[5], [6], [-1]], [2, 1, 0], [1, 1, 0]),
    # "2 1" at e=1 -> [8] (m=2); "3 1" three times -> [5] (m=1, N=3): the longer match wins.
    "longer_match_beats_frequency": ([2, 1, 8, 3, 1, 5, 3, 1, 5, 3, 1, 5, 2, 1], (1, 3, 2, 1),
                                     [[8], [5]], [1, 3], [2, 1]),
    # Same context, levels capped at 1: now frequency decides.
    "max_ngram_caps_the_level": ([2, 1, 8, 3, 1, 5, 3, 1, 5, 3, 1, 5, 2, 1], (1, 1, 2, 1),
                                 [[5], [8]], [3, 1], [1, 1]),
    # Same context, min_ngram 2: the single-token matches are not occurrences.
    "min_ngram_filters": ([2, 1, 8, 3, 1, 5, 3, 1, 5, 3, 1, 5, 2, 1], (2, 3, 2, 1),
                          [[8], [-1]], [1, 0], [2, 0]),
    # [5] at e=1 (m=2), e=4 and e=7 (m=1): L=2 and N=1, not 3.
    "count_only_at_the_best_level": ([2, 1, 5, 3, 1, 5, 4, 1, 5, 2, 1], (1, 3, 2, 1),
                                     [[5], [-1]], [1, 0], [2, 0]),
    # [5] at e=1 (m=2) and e=7 (m=1); [6] at e=4 (m=2). R of [5] is 1 (its level-2 end), not 7: [6] first.
    "recency_among_the_best_level": ([2, 1, 5, 2, 1, 6, 3, 1, 5, 4, 2, 1], (1, 3, 2, 1),
                                     [[6], [5]], [1, 1], [2, 2]),
    # k and width larger than anything in the context.
    "wide_and_many": ([1, 2, 1], (1, 3, 4, 5), [[2, 1, -1, -1, -1]] + [[-1] * 5] * 3,
                      [1, 0, 0, 0], [1, 0, 0, 0]),
    # 0..69 twice: the one earlier match has 70 common tokens, capped at max_ngram = 63.
    "max_ngram_63": (list(range(70)) * 2, (1, 63, 2, 2), [[0, 1], [-1, -1]], [1, 0], [63, 0]),
    "min_ngram_63": (list(range(70)) * 2, (63, 63, 1, 2), [[0, 1]], [1], [63]),
    # Ids past 32 bits: 2**40 + 1 and 1 agree in their low 32 bits, and must not match.
    "ids_past_32_bits": ([2**40 + 1, 9, 1, 8, 2**40 + 1], (1, 3, 2, 1), [[9], [-1]], [1, 0], [1, 0]),
    # int32 tokens, up to the largest int32 id.
    "int32_tokens": ([2**31 - 1, 0, 2**31 - 1, 3, 2**31 - 1], (1, 3, 3, 1), [[3], [0], [-1]], [1, 1, 0],
                     [1, 1, 0], torch.int32),
    "int32_repeats": ([1, 2, 3, 1, 2, 4, 1, 2], (1, 3, 3, 2), [[4, 1], [3, 1], [-1, -1]], [1, 1, 0],
                      [2, 2, 0], torch.int32),
}


def hand_case(case: str):
    context, params, candidates, counts, ngram, *dtype = HAND_CASES[case]
    return context, params, (candidates, counts, ngram), dtype[0] if dtype else torch.int64


@pytest.mark.parametrize("case", list(HAND_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_hand_case(impl, case):
    context, params, expected, dtype = hand_case(case)
    tokens, lengths = make_batch([context], dtype)
    assert_lists(run_impl(impl, tokens, lengths, *params), *([row] for row in expected))


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_cases_in_ragged_batches(impl):
    # Every hand case, grouped by parameters and dtype into one right-padded batch per group: a row's
    # answer does not depend on its neighbours, its position or the padding length.
    groups: dict[tuple, list[str]] = {}
    for case in HAND_CASES:
        _, params, _, dtype = hand_case(case)
        groups.setdefault((params, dtype), []).append(case)
    batched = 0
    for (params, dtype), cases in groups.items():
        if len(cases) < 2:
            continue  # a lone case is test_hand_case's (and the interpreter is slow)
        cases = cases[::-1] + cases  # each case twice, at different rows
        tokens, lengths = make_batch([hand_case(c)[0] for c in cases], dtype, extra_padding=5)
        result = run_impl(impl, tokens, lengths, *params)
        for b, case in enumerate(cases):
            expected = hand_case(case)[2]
            got = [t[b].tolist() for t in result]
            assert got == list(expected), f"{case} at row {b}: {got} != {list(expected)}"
        batched += 1
    assert batched >= 2  # the grouping does build multi-request batches


@pytest.mark.parametrize("impl", IMPLS)
def test_long_constant_context(impl):
    # n sevens: m = 1, 2, then 3 from e=2 on (max_ngram 3). [7 7] for e=2..n-3 (N = n-4, R = n-3);
    # [7 -1] for e = n-2 only. Equal levels, so the count decides. width 1: all [7], N = n-3.
    n = 3000 if impl == "cpp" else 200
    tokens, lengths = make_batch([[7] * n, [7] * (n // 2)])
    m = n // 2
    assert_lists(run_impl(impl, tokens, lengths, 1, 3, 3, 2),
                 [[[7, 7], [7, -1], [-1, -1]]] * 2, [[n - 4, 1, 0], [m - 4, 1, 0]], [[3, 3, 0]] * 2)
    assert_lists(run_impl(impl, tokens, lengths, 1, 3, 2, 1), [[[7], [-1]]] * 2, [[n - 3, 0], [m - 3, 0]],
                 [[3, 0]] * 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_shapes(impl):
    # No requests, and requests with no tokens at all (L = 0).
    assert_lists(run_impl(impl, torch.empty(0, 5, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                          1, 3, 2, 2), [], [], [])
    assert_lists(run_impl(impl, torch.empty(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                          1, 3, 1, 2), [[[-1, -1]]] * 2, [[0]] * 2, [[0]] * 2)


# ==== 2. The reference against a brute force written from the contract ====

def brute_force(contexts: list[list[int]], min_ngram: int, max_ngram: int, num_candidates: int,
                width: int) -> tuple[list, list, list]:
    """The contract, literally, with lists and dicts: (candidates, counts, ngram) as nested lists."""
    all_candidates, all_counts, all_levels = [], [], []
    for ctx in contexts:
        n = len(ctx)
        occurrences: dict[tuple, list[tuple[int, int]]] = {}  # continuation -> [(m(e), e)]
        for e in range(n - 1):
            m = 0  # longest common suffix of ctx[:e+1] and ctx, capped at max_ngram
            while m < max_ngram and m <= e and ctx[e - m] == ctx[n - 1 - m]:
                m += 1
            if m >= min_ngram:
                continuation = tuple(ctx[i] if i < n else -1 for i in range(e + 1, e + 1 + width))
                occurrences.setdefault(continuation, []).append((m, e))
        ranked = []
        for continuation, found in occurrences.items():
            level = max(m for m, _ in found)
            at_level = [e for m, e in found if m == level]
            ranked.append(((level, len(at_level), max(at_level)), continuation))
        ranked.sort(reverse=True)  # (L, N, R) descending; R differs between continuations
        ranked = ranked[:num_candidates]
        pad = num_candidates - len(ranked)
        all_candidates.append([list(c) for _, c in ranked] + [[-1] * width] * pad)
        all_counts.append([key[1] for key, _ in ranked] + [0] * pad)
        all_levels.append([key[0] for key, _ in ranked] + [0] * pad)
    return all_candidates, all_counts, all_levels


def random_context(rng: random.Random, n: int, vocab: int, style: str) -> list[int]:
    """n tokens in [0, vocab): uniform, a noisy repeated motif, or text-like copies of earlier spans."""
    if style == "uniform":
        return [rng.randrange(vocab) for _ in range(n)]
    if style == "periodic":
        motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        return [motif[i % len(motif)] if rng.random() > 0.1 else rng.randrange(vocab) for i in range(n)]
    assert style == "copies"
    ctx: list[int] = []
    while len(ctx) < n:
        if ctx and rng.random() < 0.5:
            start = rng.randrange(len(ctx))
            ctx += ctx[start:start + rng.randint(1, 30)]
        else:
            ctx += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    return ctx[:n]


STYLES = ("uniform", "periodic", "copies")


def random_params(rng: random.Random) -> tuple[int, int, int, int]:
    min_ngram = rng.choice([1, 1, 1, 2, 3, 4])
    max_ngram = rng.choice([min_ngram, min_ngram + 1, min_ngram + 2, 5, 8, 63])
    return min_ngram, max(min_ngram, max_ngram), rng.randint(1, 6), rng.randint(1, 5)


def random_contexts(rng: random.Random, batch: int, max_len: int, vocab: int) -> list[list[int]]:
    """Ragged contexts: some empty, single-token or full length, mixed styles."""
    lengths = [rng.choice([0, 1, 2, max_len, rng.randint(0, max_len), rng.randint(0, max_len)])
               for _ in range(batch)]
    return [random_context(rng, n, vocab, rng.choice(STYLES)) for n in lengths]


def test_brute_force_on_hand_cases():
    # The brute force is the reference's judge: it must get every hand answer too.
    for case in HAND_CASES:
        context, params, expected, _ = hand_case(case)
        assert brute_force([context], *params) == tuple([row] for row in expected), case


def test_reference_matches_brute_force():
    rng = random.Random(2024)
    checked_with_candidates = 0
    for trial in range(300):
        contexts = random_contexts(rng, rng.randint(1, 5), rng.choice([8, 20, 40]), rng.choice([2, 3, 5, 12]))
        params = random_params(rng)
        tokens, lengths = make_batch(contexts, rng.choice([torch.int64, torch.int32]))
        result = run_impl("reference", tokens, lengths, *params)
        expected = brute_force(contexts, *params)
        assert [t.tolist() for t in result] == list(expected), f"trial {trial}, params {params}: {contexts}"
        checked_with_candidates += sum(c > 0 for row in expected[1] for c in row)
    assert checked_with_candidates > 400  # the random cases do exercise ranking, not only empty rows


# ==== 3. Agreement: C++ and Triton against the reference ====

def random_batch(seed: int, batch: int, max_len: int, vocab: int, dtype: torch.dtype = torch.int64,
                 total: int | None = None):
    """A ragged batch of random contexts of at most max_len tokens, padded with junk to L = total
    (default: the longest context + 3)."""
    rng = random.Random(seed)
    return make_batch(random_contexts(rng, batch, max_len, vocab), dtype, total=total)


# (seed, batch, max_len, vocab, min_ngram, max_ngram, num_candidates, width, dtype): kept small enough
# for the Triton interpreter (contexts <= 200 tokens, a few rows).
AGREEMENT_CASES = [
    (0, 5, 60, 2, 1, 3, 4, 2, torch.int64),
    (1, 4, 200, 3, 1, 3, 8, 8, torch.int64),
    (2, 6, 120, 8, 2, 4, 3, 1, torch.int32),
    (3, 3, 150, 50, 1, 1, 5, 3, torch.int64),
    (4, 4, 100, 4, 3, 8, 2, 5, torch.int32),
    (5, 3, 180, 2, 1, 63, 6, 4, torch.int64),
]


@pytest.mark.parametrize("case", AGREEMENT_CASES, ids=lambda c: f"seed{c[0]}")
@pytest.mark.parametrize("impl", KERNELS)
def test_agrees_with_reference(impl, case):
    seed, batch, max_len, vocab, *params, dtype = case
    tokens, lengths = random_batch(seed, batch, max_len, vocab, dtype)
    expected = run_impl("reference", tokens, lengths, *params)
    assert int(expected[1].count_nonzero()) > 0  # the case has candidates to rank
    assert_same(run_impl(impl, tokens, lengths, *params), expected, f"seed {seed}: ")


def test_cpp_agrees_on_many_small_batches():
    rng = random.Random(77)
    for trial in range(80):
        contexts = random_contexts(rng, rng.randint(1, 6), rng.choice([10, 40, 100]),
                                   rng.choice([2, 3, 6, 30]))
        params = random_params(rng)
        tokens, lengths = make_batch(contexts, rng.choice([torch.int64, torch.int32]))
        expected = run_impl("reference", tokens, lengths, *params)
        assert_same(run_impl("cpp", tokens, lengths, *params), expected, f"trial {trial}, params {params}: ")


def zipf_tokens(gen: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    """Zipf-distributed ids with spans copied from earlier in the row: text-like repeats."""
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    tokens = torch.multinomial(probs.expand(batch, vocab), length, replacement=True, generator=gen)
    for b in range(batch):
        for _ in range(length // 50):
            span = int(torch.randint(2, 40, (), generator=gen))
            src = int(torch.randint(0, length - span, (), generator=gen))
            dst = int(torch.randint(src + 1, length - span + 1, (), generator=gen))
            tokens[b, dst:dst + span] = tokens[b, src:src + span].clone()
    return tokens


@pytest.mark.parametrize("vocab, params, dtype", [
    (3, (1, 3, 8, 8), torch.int64), (1000, (1, 3, 8, 8), torch.int32), (1000, (2, 8, 4, 3), torch.int64),
    (50, (1, 16, 16, 2), torch.int32)])
def test_cpp_agrees_on_long_contexts(vocab, params, dtype):
    gen = torch.Generator().manual_seed(vocab + params[1])
    batch, length = 5, 4000
    tokens = zipf_tokens(gen, batch, length, vocab)
    lengths = torch.tensor([length, length - 1, 2500, 3999, 1], dtype=torch.int64)
    for b, src in ((0, 100), (2, 2400), (3, 7)):  # these contexts end by repeating an earlier span
        n = int(lengths[b])
        tokens[b, n - 70:n] = tokens[b, src:src + 70].clone()
    tokens = tokens.to(dtype)
    expected = run_impl("reference", tokens, lengths, *params)
    assert int((expected[1][:, 0] > 0).sum()) >= 3  # several rows have candidates
    assert_same(run_impl("cpp", tokens, lengths, *params), expected)


@pytest.mark.parametrize("impl", KERNELS)
def test_same_result_with_and_without_validation(impl):
    tokens, lengths = random_batch(11, 4, 80, 3)
    params = (1, 3, 4, 3)
    assert_same(run_impl(impl, tokens, lengths, *params, validate=False),
                run_impl("reference", tokens, lengths, *params))


def test_wrapper_matches_reference(device):
    tokens, lengths = random_batch(12, 5, 150, 4)
    kwargs = dict(min_ngram=2, max_ngram=5, num_candidates=3, width=6)
    expected = reference.ngram_match(tokens, lengths, 2, 5, 3, 6)
    result = specops.ops.ngram_match(tokens.to(device), lengths.to(device), **kwargs)
    check_outputs(result, 5, 3, 6, device)
    assert_same(tuple(t.cpu() for t in result), expected)
    # Defaults: min_ngram 1, max_ngram 3, num_candidates 1, width 4.
    result = specops.ops.ngram_match(tokens.to(device), lengths.to(device))
    assert_same(tuple(t.cpu() for t in result), reference.ngram_match(tokens, lengths, 1, 3, 1, 4))


def test_wrapper_without_lengths_uses_every_token(device):
    tokens = random_batch(13, 4, 90, 3)[0].clamp(min=0)  # the padding becomes part of every row
    full = torch.full((4,), tokens.shape[1], dtype=torch.int64)
    result = specops.ops.ngram_match(tokens.to(device), None, num_candidates=4, width=2)
    assert_same(tuple(t.cpu() for t in result), reference.ngram_match(tokens, full, 1, 3, 4, 2))


def test_wrapper_accepts_a_slice_of_a_longer_buffer(device):
    # A decoder keeps one growing token buffer and passes a window of it: a non-contiguous view.
    tokens, lengths = random_batch(14, 3, 120, 3)
    buffer = torch.full((3, 2 * tokens.shape[1] + 7), 9, dtype=torch.int64, device=device)
    buffer[:, 7::2] = tokens.to(device)
    window = buffer[:, 7::2]
    assert not window.is_contiguous()
    result = specops.ops.ngram_match(window, lengths.to(device), num_candidates=4, width=3)
    assert_same(tuple(t.cpu() for t in result), reference.ngram_match(tokens, lengths, 1, 3, 4, 3))


def test_op_never_misreads_non_contiguous_tokens():
    # Called directly, the C++ op either honours strides or refuses the input: never silently wrong.
    tokens, lengths = random_batch(15, 3, 60, 3)
    buffer = torch.full((3, 2 * tokens.shape[1]), 9, dtype=torch.int64)
    buffer[:, ::2] = tokens
    try:
        result = torch.ops.specops.ngram_match(buffer[:, ::2], lengths, 1, 3, 4, 3)
    except (ValueError, RuntimeError) as error:
        assert "contiguous" in str(error)
    else:
        assert_same(result, reference.ngram_match(tokens, lengths, 1, 3, 4, 3))


# ==== 4. Bad inputs ====

def _valid_inputs(device: str) -> dict:
    return dict(tokens=torch.tensor([[1, 2, 1, 2, 1, 2], [3, 3, 3, 3, 3, 3], [5, 6, 5, 6, -1, -1]],
                                    device=device),
                lengths=torch.tensor([6, 0, 4], device=device), min_ngram=1, max_ngram=3, num_candidates=2,
                width=2)


def _with(name: str, make):
    """A change to the valid inputs: input `name` becomes make(inputs)."""
    def change(inputs):
        inputs[name] = make(inputs)
    return change


def _lengths(values):
    return _with("lengths", lambda i: torch.tensor(values, device=i["tokens"].device))


def _context_token(row: int, position: int, value: int):
    def make(inputs):
        tokens = inputs["tokens"].clone()
        tokens[row, position] = value
        return tokens
    return _with("tokens", make)


# id: (change to the valid inputs, exception, message pattern). Every message starts "ngram_match: ".
BAD_INPUTS = {
    "tokens_1d": (_with("tokens", lambda i: i["tokens"][0]), ValueError, r"tokens.*(2-D|\[B, L\])"),
    "tokens_3d": (_with("tokens", lambda i: i["tokens"][None]), ValueError, r"tokens.*(2-D|\[B, L\])"),
    "tokens_not_a_tensor": (_with("tokens", lambda i: i["tokens"].tolist()), (TypeError, ValueError),
                            r"tokens"),
    "float_tokens": (_with("tokens", lambda i: i["tokens"].float()), TypeError, r"tokens.*int32.*(float32|Float)"),
    "int16_tokens": (_with("tokens", lambda i: i["tokens"].to(torch.int16)), TypeError, r"tokens.*(int16|Short)"),
    "bool_tokens": (_with("tokens", lambda i: i["tokens"] > 1), TypeError, r"tokens.*(bool|Bool)"),
    "int32_lengths": (_with("lengths", lambda i: i["lengths"].int()), (TypeError, ValueError),
                      r"lengths.*int64.*(int32|Int)"),
    "float_lengths": (_with("lengths", lambda i: i["lengths"].float()), (TypeError, ValueError),
                      r"lengths.*int64.*(float32|Float)"),
    "lengths_too_many": (_lengths([6, 0, 4, 1]), ValueError, r"lengths.*\[3\].*4"),
    "lengths_2d": (_with("lengths", lambda i: i["lengths"][:, None]), ValueError, r"lengths.*\[3\].*1"),
    "lengths_scalar": (_with("lengths", lambda i: i["lengths"][0]), ValueError, r"lengths.*\[3\]"),
    "lengths_a_list": (_with("lengths", lambda i: [6, 0, 4]), (TypeError, ValueError), r"lengths"),
    "min_ngram_zero": (_with("min_ngram", lambda i: 0), ValueError, r"min_ngram"),
    "min_above_max": (_with("min_ngram", lambda i: 4), ValueError, r"min_ngram.*max_ngram"),
    "max_ngram_64": (_with("max_ngram", lambda i: 64), ValueError, r"max_ngram.*63"),
    "num_candidates_zero": (_with("num_candidates", lambda i: 0), ValueError, r"num_candidates"),
    "width_zero": (_with("width", lambda i: 0), ValueError, r"width"),
    "width_negative": (_with("width", lambda i: -2), ValueError, r"width"),
    "bool_min_ngram": (_with("min_ngram", lambda i: True), TypeError, r"min_ngram"),
    "float_width": (_with("width", lambda i: 2.0), TypeError, r"width"),
    "tensor_num_candidates": (_with("num_candidates", lambda i: torch.tensor(2)), TypeError,
                              r"num_candidates"),
    "length_above_l": (_lengths([6, 0, 7]), ValueError, r"lengths.*\[0, 6\]"),
    "huge_length": (_lengths([2**40, 0, 4]), ValueError, r"lengths.*\[0, 6\]"),
    "negative_length": (_lengths([6, -1, 4]), ValueError, r"lengths.*\[0, 6\]"),
    "negative_context_token": (_context_token(2, 3, -5), ValueError, r"tokens.*(negative|>= 0)"),
    "negative_last_token": (_context_token(0, 5, -1), ValueError, r"tokens.*(negative|>= 0)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise(device, case):
    change, error, pattern = BAD_INPUTS[case]
    inputs = _valid_inputs(device)
    specops.ops.ngram_match(**inputs)  # the unchanged inputs are fine (negative padding included)
    change(inputs)
    with pytest.raises(error, match=r"^ngram_match: .*" + pattern):
        specops.ops.ngram_match(**inputs)


def test_lengths_on_another_device_raise(device):
    # Without a second real device, "meta" tensors stand in for tensors on the wrong device.
    other = "meta" if device == "cpu" else "cpu"
    inputs = _valid_inputs(device)
    inputs["lengths"] = inputs["lengths"].to(other)
    with pytest.raises(ValueError, match=rf"^ngram_match: lengths.*{other}.*{device}"):
        specops.ops.ngram_match(**inputs)


def test_contexts_of_2_to_the_28_tokens_raise():
    # The key packs recency in 28 bits. A meta tensor: nothing is allocated.
    tokens = torch.empty(1, 2**28, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"^ngram_match: .*(2\*\*28|268435456)"):
        specops.ops.ngram_match(tokens, torch.empty(1, dtype=torch.int64, device="meta"))


def test_negative_padding_is_not_an_error(device):
    inputs = _valid_inputs(device)
    result = specops.ops.ngram_match(**inputs)  # row 2 is [5 6 5 6] with -1 padding
    assert [t.cpu()[2].tolist() for t in result] == [[[5, 6], [-1, -1]], [1, 0], [2, 0]]
    assert [t.cpu()[1].tolist() for t in result] == [[[-1, -1], [-1, -1]], [0, 0], [0, 0]]


@pytest.mark.parametrize("values", [[6, 0, 7], [-1, 0, 4], [2**40, 0, 4], [6, -(2**40), 4]])
def test_cpu_checks_lengths_even_without_validation(values):
    # Lengths bound every read: the C++ kernel checks them whatever `validate` says.
    inputs = _valid_inputs("cpu")
    inputs["lengths"] = torch.tensor(values)
    with pytest.raises(ValueError, match=r"lengths"):
        specops.ops.ngram_match(**inputs, validate=False)
    with pytest.raises(ValueError, match=r"lengths"):
        torch.ops.specops.ngram_match(inputs["tokens"], inputs["lengths"], 1, 3, 2, 2, False)


@pytest.mark.parametrize("impl", KERNELS)
def test_negative_context_tokens_without_validation_do_not_crash(impl):
    tokens, lengths = random_batch(16, 4, 60, 3)
    tokens[lengths > 0, 0] = -7
    tokens[lengths > 1, lengths[lengths > 1] - 1] = -1  # the query itself, and -1 is the padding value
    run_impl(impl, tokens, lengths, 1, 3, 4, 3, validate=False)  # shapes and dtypes checked inside
    with pytest.raises(ValueError, match=r"tokens"):
        specops.ops.ngram_match(tokens, lengths, num_candidates=4, width=3)


@needs_triton
def test_triton_without_validation_clamps_lengths():
    # Accelerators check values only with validate=True (one host sync in the wrapper); without it the
    # kernel clamps lengths to [0, L], so it never reads outside the row.
    tokens, _ = random_batch(17, 4, 50, 3)
    width = tokens.shape[1]
    lengths = torch.tensor([width + 5, -3, 2**40, 20])
    clamped = lengths.clamp(0, width)
    assert_same(run_impl("triton", tokens, lengths, 1, 3, 3, 2, validate=False),
                run_impl("reference", tokens, clamped, 1, 3, 3, 2))


# ==== 5. opcheck and torch.compile ====

@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_opcheck(device, dtype):
    tokens, lengths = random_batch(18, 4, 40, 3, dtype)
    torch.library.opcheck(torch.ops.specops.ngram_match.default,
                          (tokens.clamp(min=0).to(device), lengths.to(device), 1, 3, 4, 3))
    torch.library.opcheck(torch.ops.specops.ngram_match.default,
                          (tokens.clamp(min=0).to(device), lengths.to(device), 2, 5, 1, 2, False))


def _draft_step(tokens, lengths, validate=True):
    return specops.ops.ngram_match(tokens, lengths, min_ngram=1, max_ngram=3, num_candidates=4, width=3,
                                   validate=validate)


def test_torch_compile_matches_eager(device):
    # Inductor with fullgraph: the op must trace through its fake implementation. On accelerators
    # validate=True is a host sync with a data-dependent raise, which no full graph can hold; a
    # compiled decoding step there runs with validate=False.
    torch._dynamo.reset()
    compiled = torch.compile(_draft_step, fullgraph=True)
    tokens, lengths = random_batch(19, 4, 60, 3)
    tokens, lengths = tokens.clamp(min=0).to(device), lengths.to(device)
    validate = device == "cpu"
    assert_same(compiled(tokens, lengths, validate), _draft_step(tokens, lengths))


def test_torch_compile_does_not_recompile_per_step():
    # Decoding calls it every step with new tokens and lengths (same shapes): one compiled frame.
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(_draft_step, backend=counter, fullgraph=True)
    for seed in range(4):
        tokens, lengths = random_batch(20 + seed, 3, 40, 3, total=40)
        tokens = tokens.clamp(min=0)
        assert_same(compiled(tokens, lengths), _draft_step(tokens, lengths))
    assert counter.frame_count == 1
