"""ngram_memory_lookup: each row's longest match in the n-gram memory and the continuations that followed it.
Hand cases (longest match first, counts, the quota of occurrences, levels newest first, runs' ends), every
backend against the reference on random stores, the match against a brute-force scan, inputs that must not
read out of bounds, opcheck and torch.compile."""

from __future__ import annotations

import random

import pytest
import torch

from memory_cases import build, chunked, contexts_from, followed, random_runs, store_of
from _triton import IMPLS, TRITON_DEVICE, needs_triton, triton_launcher
from specops import ops, reference


def lookup(impl: str):
    """lookup(tokens, entries, levels, contexts, lengths, depth, min_match, k, width, max_occurrences) -> the
    five outputs, on CPU tensors."""
    if impl == "reference":
        return reference.ngram_memory_lookup
    if impl == "cpp":
        return lambda t, e, sizes, c, n, d, m, k, w, s: ops.ngram_memory_lookup(
            t, e, sizes, c, n, depth=d, min_match=m, num_candidates=k, width=w, max_occurrences=s)
    launcher = triton_launcher("ngram_memory_lookup")

    def run(t, e, sizes, c, n, d, m, k, w, s):
        out = launcher(t.to(TRITON_DEVICE), e.to(TRITON_DEVICE), sizes, c.to(TRITON_DEVICE), n.to(TRITON_DEVICE), d, m,
                       k, w, s)
        return tuple(x.cpu() for x in out)
    return run


def index_of(runs, depth=8, chunk=None):
    tokens, starts = store_of(runs)
    positions = followed(tokens)
    entries, levels = build(tokens, [positions] if chunk is None else chunk(positions), depth)
    return tokens, entries, levels, starts


def one(impl, runs, context, depth=8, min_match=1, k=4, width=3, max_occurrences=64, chunk=None):
    tokens, entries, levels, _ = index_of(runs, depth, chunk)
    c = torch.tensor([context], dtype=torch.int64)
    out = lookup(impl)(tokens, entries, levels, c, torch.tensor([len(context)]), depth, min_match, k, width,
                       max_occurrences)
    return [x[0].tolist() for x in out]


@pytest.mark.parametrize("impl", IMPLS)
def test_longest_match_and_counts_by_hand(impl):
    runs = [[1, 2, 3, 4, 5, 9], [9, 2, 3, 4, 6], [2, 3, 4, 5, 7], [8, 3, 4, 6, 6]]
    candidates, counts, latest, match, occurrences = one(impl, runs, [0, 2, 3, 4], width=2)
    # "2 3 4" occurs three times (runs 0, 1, 2); "0 2 3 4" nowhere; "3 4" four times, but shorter.
    assert match == 3 and occurrences == 3
    # "5 7" and "5 9" are different continuations of width 2; "6" stops at its run's end. Equal counts: the
    # latest position first (run 2 lies after run 1, after run 0).
    assert candidates == [[5, 7], [6, -1], [5, 9], [-1, -1]]
    assert counts == [1, 1, 1, 0]
    assert latest[:3] == sorted(latest[:3], reverse=True) and latest[3] == -1


@pytest.mark.parametrize("impl", IMPLS)
def test_frequency_ranks_continuations_of_the_longest_match(impl):
    runs = [[1, 2, 7], [1, 2, 7], [1, 2, 8], [5, 1, 2, 9]]
    candidates, counts, _, match, occurrences = one(impl, runs, [1, 2], width=1)
    assert match == 2 and occurrences == 4
    assert candidates == [[7], [9], [8], [-1]] and counts == [2, 1, 1, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_below_min_match_finds_nothing(impl):
    runs = [[1, 2, 3]]
    assert one(impl, runs, [9, 2], min_match=2)[3:] == [0, 0]
    assert one(impl, runs, [9, 2], min_match=1)[3:] == [1, 1]
    candidates, counts, latest, match, occurrences = one(impl, runs, [9, 9], min_match=1)
    assert match == 0 and occurrences == 0 and counts == [0] * 4 and latest == [-1] * 4
    assert candidates == [[-1] * 3] * 4


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_context_and_empty_memory(impl):
    assert one(impl, [[1, 2]], [])[3:] == [0, 0]
    tokens = torch.full((4,), -1, dtype=torch.int32)
    out = lookup(impl)(tokens, torch.empty(0, dtype=torch.int32), [], torch.tensor([[1, 2]]), torch.tensor([2]), 8, 1,
                       2, 2, 8)
    assert out[3].tolist() == [0] and out[0].tolist() == [[[-1, -1], [-1, -1]]]


@pytest.mark.parametrize("impl", IMPLS)
def test_match_is_capped_at_depth(impl):
    run = list(range(10)) + [99]
    assert one(impl, [run], list(range(10)), depth=4)[3] == 4
    assert one(impl, [run], list(range(10)), depth=64)[3] == 10


@pytest.mark.parametrize("impl", IMPLS)
def test_quota_reads_newest_levels_first_then_spreads(impl):
    # 13 runs "1 x" with x = 10 .. 22; the query "1" matches all 13 occurrences.
    runs = [[1, 10 + i] for i in range(13)]
    # Inserted one run at a time: several levels (oldest first); the newest holds the last runs.
    tokens, entries, levels, starts = index_of(runs, depth=2, chunk=lambda p: [[q] for q in p])
    assert len(levels) > 1
    context = torch.tensor([[1]])
    for quota in (1, 3, 5, 13, 40):
        got = lookup(impl)(tokens, entries, levels, context, torch.tensor([1]), 2, 1, 1, 1, quota)
        want = reference.ngram_memory_lookup(tokens, entries, levels, context, torch.tensor([1]), 2, 1, 1, 1, quota)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert got[4].item() == 13  # every occurrence is counted, read or not
    # All read: every continuation once; the latest wins the tie.
    got = lookup(impl)(tokens, entries, levels, context, torch.tensor([1]), 2, 1, 13, 1, 13)
    assert sorted(got[0][0, :, 0].tolist()) == list(range(10, 23)) and got[1][0].tolist() == [1] * 13
    assert got[0][0, 0, 0].item() == 22
    # One read: from the newest level, which holds the last run inserted.
    got = lookup(impl)(tokens, entries, levels, context, torch.tensor([1]), 2, 1, 1, 1, 1)
    newest = set(entries[sum(levels[:-1]):sum(levels)].tolist())
    assert got[2][0, 0].item() in newest


@pytest.mark.parametrize("impl", IMPLS)
def test_continuations_stop_at_the_run_end(impl):
    candidates, counts, *_ = one(impl, [[4, 5, 6], [4, 5]], [4], width=4)
    # "4" followed by "5 6" and by "5" (the second run ends there).
    assert sorted(map(tuple, candidates[:2])) == [(5, -1, -1, -1), (5, 6, -1, -1)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference(impl, seed):
    rng = random.Random(100 + seed)
    vocab = rng.choice([2, 3, 6])
    runs = random_runs(rng, 10 if impl == "triton" else 40, vocab=vocab)
    tokens, _ = store_of(runs, gap=rng.randint(1, 2))
    positions = followed(tokens)
    depth = rng.choice([3, 8, 64])
    entries, levels = build(tokens, [sorted(c) for c in chunked(positions, rng, 12)], depth)
    contexts, lengths = contexts_from(tokens, rng, 5 if impl == "triton" else 16, 20, vocab)
    for min_match, k, width, quota in ((1, 4, 3, 64), (2, 1, 1, 1), (1, 6, 5, 7), (3, 3, 9, 16)):
        min_match = min(min_match, depth)
        want = reference.ngram_memory_lookup(tokens, entries, levels, contexts, lengths, depth, min_match, k, width,
                                             quota)
        got = lookup(impl)(tokens, entries, levels, contexts, lengths, depth, min_match, k, width, quota)
        for name, a, b in zip(("candidates", "counts", "latest", "match", "occurrences"), got, want):
            assert torch.equal(a, b), (name, a, b)


@pytest.mark.parametrize("seed", range(3))
def test_match_is_the_longest_common_suffix_anywhere(seed):
    """Against a scan of the store itself, not the reference: the match is the longest common suffix of the
    query with the store ending at any followed position, and occurrences count the positions reaching it."""
    rng = random.Random(200 + seed)
    runs = random_runs(rng, 40, vocab=3)
    tokens, _ = store_of(runs)
    positions = followed(tokens)
    t = tokens.tolist()
    entries, levels = build(tokens, chunked(positions, rng, 15), 16,
                            lambda tk, e, sizes, p, d: ops.ngram_memory_insert(tk, e, sizes, p, depth=d))
    contexts, lengths = contexts_from(tokens, rng, 30, 24, 3)
    out = ops.ngram_memory_lookup(tokens, entries, levels, contexts, lengths, depth=16, min_match=1)
    for b in range(contexts.shape[0]):
        query = contexts[b, :int(lengths[b])].tolist()[::-1][:16]

        def common(p):
            m = 0
            while m < len(query) and p - m >= 0 and t[p - m] == query[m]:
                m += 1
            return m
        lengths_at = [common(p) for p in positions]
        best = max(lengths_at, default=0)
        assert out[3][b].item() == best
        assert out[4][b].item() == (sum(m >= best for m in lengths_at) if best else 0)


@pytest.mark.parametrize("impl", ["cpp", pytest.param("triton", marks=needs_triton)])
def test_bad_entries_do_not_read_out_of_bounds(impl):
    """Entries are not checked at each lookup (the memory builds them); positions outside the store read as
    separators, so a corrupt index gives wrong answers, never a crash."""
    tokens, _ = store_of([[1, 2, 3]])
    entries = torch.tensor([-5, 0, 1, 2**31 - 1, 40], dtype=torch.int32)
    out = lookup(impl)(tokens, entries, [5], torch.tensor([[1, 2]]), torch.tensor([2]), 8, 1, 3, 4, 8)
    assert out[3].item() >= 0


def test_opcheck_and_compile():
    tokens, entries, levels, _ = index_of([[1, 2, 3, 1, 2, 4], [2, 3]], depth=6)
    contexts, lengths = torch.tensor([[1, 2], [5, 2]]), torch.tensor([2, 2])
    args = (tokens, entries, levels, contexts, lengths, 6, 1, 2, 3, 8, True)
    torch.library.opcheck(torch.ops.specops.ngram_memory_lookup.default, args)

    def f(contexts):
        return ops.ngram_memory_lookup(tokens, entries, levels, contexts, lengths, depth=6, num_candidates=2,
                                       width=3, max_occurrences=8)
    compiled = torch.compile(f, fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(compiled(contexts), f(contexts)))
