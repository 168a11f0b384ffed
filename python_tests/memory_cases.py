"""Stores and indexes for the n-gram memory's ops (ngram_memory_insert, ngram_memory_lookup): runs of tokens laid
out apart in one int32 store, and their index built by inserts of several sizes."""

from __future__ import annotations

import random

import torch

from specops import reference


def store_of(runs: list[list[int]], gap: int = 1, tail: int = 0) -> tuple[torch.Tensor, list[int]]:
    """The store holding `runs` one after another, each followed by `gap` separators (-1), then `tail` unwritten
    slots; and where each run starts."""
    tokens, starts = [], []
    for run in runs:
        starts.append(len(tokens))
        tokens += list(run) + [-1] * gap
    tokens += [-1] * tail
    return torch.tensor(tokens, dtype=torch.int32), starts


def followed(tokens: torch.Tensor) -> list[int]:
    """Every position holding a token followed by a token: what the memory indexes."""
    t = tokens.tolist()
    return [p for p in range(len(t) - 1) if t[p] >= 0 and t[p + 1] >= 0]


def random_runs(rng: random.Random, count: int, vocab: int, low: int = 1, high: int = 30) -> list[list[int]]:
    """Runs over a small vocabulary, so that matches are many; some runs repeat stretches of earlier ones, so
    that some matches are long."""
    runs: list[list[int]] = []
    for _ in range(count):
        run = [rng.randrange(vocab) for _ in range(rng.randint(low, high))]
        if runs and rng.random() < 0.5:
            source = rng.choice(runs)
            cut = rng.randrange(len(source))
            run = run[:rng.randint(0, len(run))] + source[cut:cut + rng.randint(1, 20)]
        runs.append(run)
    return runs


def chunked(positions: list[int], rng: random.Random, most: int) -> list[list[int]]:
    """positions cut into consecutive inserts of 1..most positions each."""
    chunks, i = [], 0
    while i < len(positions):
        n = rng.randint(1, most)
        chunks.append(positions[i:i + n])
        i += n
    return chunks


def build(tokens: torch.Tensor, chunks: list[list[int]], depth: int, insert=None, room: int = 0
          ) -> tuple[torch.Tensor, list[int]]:
    """The index (its entries buffer, exactly full unless `room` more is asked for, and its level sizes, oldest
    first) after inserting each chunk in turn, with `insert` (the reference's by default) called in place as
    insert(tokens, entries, levels, positions, depth)."""
    insert = insert or reference.ngram_memory_insert
    entries = torch.full((sum(map(len, chunks)) + room,), -7, dtype=torch.int32)
    levels: list[int] = []
    for chunk in chunks:
        insert(tokens, entries, levels, torch.tensor(chunk, dtype=torch.int64), depth)
        levels = reference.memory_levels(levels, len(chunk))
    return entries, levels


def contexts_from(tokens: torch.Tensor, rng: random.Random, rows: int, width: int, vocab: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Query contexts [rows, width] and their lengths: half copied from stretches of the store (long matches),
    half random over the vocabulary."""
    t = [v for v in tokens.tolist()]
    contexts = torch.zeros(rows, width, dtype=torch.int64)
    lengths = torch.zeros(rows, dtype=torch.int64)
    for b in range(rows):
        n = rng.randint(0, width)
        if rng.random() < 0.5 and len(t) > 1:
            end = rng.randrange(1, len(t))
            row = [v for v in t[max(0, end - n):end] if v >= 0][-n:] if n else []
        else:
            row = [rng.randrange(vocab) for _ in range(n)]
        contexts[b, :len(row)] = torch.tensor(row, dtype=torch.int64)
        lengths[b] = len(row)
    return contexts, lengths
