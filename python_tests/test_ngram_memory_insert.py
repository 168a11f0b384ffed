"""ngram_memory_insert: the n-gram memory's index after new end positions join it, in place. Hand cases, the
level policy, only the merged tail written, every backend against the reference (same inputs, same entries),
the order itself, opcheck."""

from __future__ import annotations

import random

import pytest
import torch

from memory_cases import build, chunked, followed, random_runs, store_of
from _triton import IMPLS, TRITON_DEVICE, triton_launcher
from specops import ops, reference


def insert(impl: str):
    """insert(tokens, entries, levels, positions, depth) of one implementation, in place, on CPU tensors."""
    if impl == "reference":
        return reference.ngram_memory_insert
    if impl == "cpp":
        return lambda t, e, sizes, p, d: ops.ngram_memory_insert(t, e, sizes, p, depth=d)
    launcher = triton_launcher("ngram_memory_insert")

    def run(t, e, sizes, p, d):
        buffer = e.to(TRITON_DEVICE)
        launcher(t.to(TRITON_DEVICE), buffer, sizes, p.to(TRITON_DEVICE), d)
        e.copy_(buffer.cpu())
    return run


def fresh(impl: str, tokens: torch.Tensor, positions: list[int], depth: int) -> torch.Tensor:
    """The entries of an index that held nothing, after one insert of `positions`."""
    entries = torch.full((len(positions),), -7, dtype=torch.int32)
    insert(impl)(tokens, entries, [], torch.tensor(positions, dtype=torch.int64), depth)
    return entries


def keys(tokens: torch.Tensor, entries: torch.Tensor, depth: int) -> list[tuple]:
    return [tuple(k) + (int(e),) for k, e in zip(reference.memory_keys(tokens, entries, depth).tolist(), entries)]


def test_levels_policy_by_hand():
    # Levels oldest first. The new block merges while it is at least an eighth of the next older level.
    assert reference.memory_merged_blocks([], 5) == 1
    assert reference.memory_merged_blocks([30], 4) == 2  # 4 * 8 = 32 > 30
    assert reference.memory_merged_blocks([32], 4) == 1  # 32 > 32 is false
    assert reference.memory_merged_blocks([30, 3], 1) == 3  # 1 joins 3 (8 > 3), then 4 joins 30 (32 > 30)
    assert reference.memory_merged_blocks([30, 3], 0) == 0
    assert reference.memory_levels([30, 3], 1) == [34]
    assert reference.memory_levels([32], 4) == [32, 4]
    assert reference.memory_levels([7], 0) == [7]


def test_levels_grow_geometrically():
    levels = []
    for _ in range(5000):
        levels = reference.memory_levels(levels, 3)
    assert sum(levels) == 15000
    assert all(older >= 8 * newer for older, newer in zip(levels, levels[1:]))
    assert len(levels) <= 5


@pytest.mark.parametrize("impl", IMPLS)
def test_order_by_hand(impl):
    # Runs: "5 1 2 | 7 1 2 | 1 3": keys read backwards from each end position (depth 3).
    tokens, _ = store_of([[5, 1, 2], [7, 1, 2], [1, 3]])
    # followed positions: 0 (5), 1 (1, after 5), 4 (7), 5 (1, after 7), 8 (1, run start)
    positions = followed(tokens)
    assert positions == [0, 1, 4, 5, 8]
    entries = fresh(impl, tokens, positions, 3)
    # keys: 0 -> (5), 1 -> (1, 5), 4 -> (7), 5 -> (1, 7), 8 -> (1): (1) < (1, 5) < (1, 7) < (5) < (7)
    assert entries.tolist() == [8, 1, 5, 0, 4]
    assert entries.dtype == torch.int32


@pytest.mark.parametrize("impl", IMPLS)
def test_equal_keys_order_by_position(impl):
    tokens, _ = store_of([[4, 4, 4, 4, 4]])
    # depth 2: position 0 has key (4); 1, 2, 3 all have key (4, 4).
    assert fresh(impl, tokens, [0, 1, 2, 3], 2).tolist() == [0, 1, 2, 3]
    assert fresh(impl, tokens, [0, 1, 2, 3], 1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("impl", IMPLS)
def test_nothing_added_changes_nothing(impl):
    tokens, _ = store_of([[1, 2, 3]])
    entries = torch.tensor([1, 0, -7], dtype=torch.int32)
    insert(impl)(tokens, entries, [2], torch.empty(0, dtype=torch.int64), 4)
    assert entries.tolist() == [1, 0, -7]


@pytest.mark.parametrize("impl", IMPLS)
def test_only_the_merged_tail_is_written(impl):
    """An insert writes its merged level over the newest levels it absorbed; older levels and the free room
    after the new index are not touched."""
    tokens, _ = store_of([list(range(40))])
    positions = followed(tokens)  # 0 .. 38
    entries, levels = build(tokens, [positions[:30], positions[30:31]], 4, room=5)
    assert levels == [30, 1]
    before = entries.clone()
    insert(impl)(tokens, entries, levels, torch.tensor(positions[31:32]), 4)  # 8 > 1, but 2 * 8 < 30
    assert reference.memory_levels(levels, 1) == [30, 2]
    assert torch.equal(entries[:30], before[:30]) and entries[32:].tolist() == [-7] * 4
    assert sorted(entries[30:32].tolist()) == positions[30:32]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference(impl, seed):
    rng = random.Random(seed)
    runs = random_runs(rng, 12 if impl == "triton" else 30, vocab=4)
    tokens, _ = store_of(runs, gap=rng.randint(1, 3))
    positions = followed(tokens)
    rng.shuffle(positions)
    depth = rng.choice([1, 3, 8, 64])
    # Inserts of increasing positions, in a random order of chunks (live runs interleave).
    chunks = [sorted(c) for c in chunked(positions, rng, 9)]
    entries, levels = build(tokens, chunks, depth)
    got, levels_got = build(tokens, chunks, depth, insert(impl))
    assert torch.equal(got, entries) and levels_got == levels


def test_large_insert_matches_reference():
    """An insert of more than 4096 positions sorts on packed key words first (csrc/cpu/ngram_memory_insert.cpp)."""
    rng = random.Random(7)
    runs = random_runs(rng, 600, vocab=3, low=5, high=20)
    tokens, _ = store_of(runs)
    positions = followed(tokens)
    assert len(positions) > 4096
    for depth in (1, 2, 16):
        assert torch.equal(fresh("cpp", tokens, positions, depth), fresh("reference", tokens, positions, depth))


@pytest.mark.parametrize("seed", range(3))
def test_every_level_is_sorted_and_holds_every_position(seed):
    rng = random.Random(seed)
    tokens, _ = store_of(random_runs(rng, 40, vocab=5))
    positions = followed(tokens)
    depth = 6
    entries, levels = build(tokens, chunked(positions, rng, 20), depth,
                            lambda t, e, sizes, p, d: ops.ngram_memory_insert(t, e, sizes, p, depth=d))
    assert sorted(entries.tolist()) == positions
    start = 0
    for size in levels:
        level = keys(tokens, entries[start:start + size], depth)
        assert level == sorted(level)
        start += size
    assert all(older >= 8 * newer for older, newer in zip(levels, levels[1:]))


def test_keys_stop_at_separators_and_the_store_start():
    tokens = torch.tensor([3, 1, -1, 2, 3, -1, 5], dtype=torch.int32)
    got = reference.memory_keys(tokens, torch.tensor([0, 1, 4, 6]), 3).tolist()
    assert got == [[3, -1, -1], [1, 3, -1], [3, 2, -1], [5, -1, -1]]


def test_opcheck():
    tokens, _ = store_of([[1, 2, 3, 1, 2], [2, 3]])
    positions = followed(tokens)
    entries, levels = build(tokens, [positions[:3]], 4, room=len(positions) - 3)
    torch.library.opcheck(torch.ops.specops.ngram_memory_insert.default,
                          (tokens, entries, levels, torch.tensor(positions[3:]), 4, True))
