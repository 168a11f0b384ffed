"""ngram_match: batched context n-gram lookup; ngram_memory_insert / ngram_memory_lookup: the index of the n-gram
memory, continuations of earlier requests' text."""

from __future__ import annotations

import torch

from specops.ops._checks import _c_dtype, _c_number, _c_sizes, _raise_first, _require, _where

__all__ = ["ngram_match", "ngram_memory_insert", "ngram_memory_lookup"]


def ngram_match(tokens: torch.Tensor, lengths: torch.Tensor | None = None, *, min_ngram: int = 1,
                max_ngram: int = 3, num_candidates: int = 1, width: int = 4,
                validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context n-gram drafts: continuations of the earlier occurrences of each row's last tokens.

    Row b's context is tokens[b, :lengths[b]]. An earlier end position e is an occurrence when the
    tokens ending at e match the context's last m >= min_ngram tokens (m capped at max_ngram; the
    match may overlap them); its continuation is the `width` tokens after e. Distinct continuations
    rank by level L (their longest match), then count N (occurrences at that level), then recency R
    (the latest of those), all descending; the first num_candidates are returned.

    Shape:
        tokens: [B, L] int32 or int64, right-padded token ids (>= 0 inside each context), L < 2**28.
        lengths: [B] int64 in [0, L], each row's context length; default L for every row.
        min_ngram, max_ngram: ints with 1 <= min_ngram <= max_ngram <= 63.
        num_candidates (k), width: ints in [1, 2**28).
        validate: check that context tokens are >= 0 (on CPU the kernel does, in its row pass; on
            accelerators it costs one host sync in the op's contract, together with the lengths check).
            With False, the CPU kernel still rejects lengths outside [0, L] and GPU kernels clamp them,
            so no kernel reads out of bounds either way.

    Returns (all int64, on tokens' device):
        candidates: [B, k, width] continuations, -1 past the end of the context and where there is
            no candidate.
        counts: [B, k] N, 0 where there is no candidate.
        ngram: [B, k] L, 0 where there is no candidate.
    """
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"ngram_match: tokens must be a tensor, got {type(tokens).__name__}")
    if lengths is None:  # every token (a tensor that is not [B, L] gets the op's message)
        batch, length = (tokens.shape[0], tokens.shape[-1]) if tokens.dim() else (0, 0)
        lengths = torch.full((batch,), length, dtype=torch.int64, device=tokens.device)
    elif not isinstance(lengths, torch.Tensor):
        raise TypeError(f"ngram_match: lengths must be a [B] int64 tensor or None, got {type(lengths).__name__}")
    for name, value in (("min_ngram", min_ngram), ("max_ngram", max_ngram), ("num_candidates", num_candidates),
                        ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"ngram_match: {name} must be an int, got {type(value).__name__}")
    # Values are checked once, by the op (the C++ kernel on CPU, its contract check_ngram_match elsewhere); an
    # int the schema's int64 cannot carry gets the op's message here.
    if not all(-2**63 <= v < 2**63 for v in (min_ngram, max_ngram)):
        raise ValueError(f"ngram_match: need 1 <= min_ngram <= max_ngram <= 63, got min_ngram = {min_ngram}, "
                         f"max_ngram = {max_ngram}")
    for name, value in (("num_candidates", num_candidates), ("width", width)):
        if not -2**63 <= value < 2**63:
            raise ValueError(f"ngram_match: {name} must be >= 1 and < 2**28, got {value}")
    return torch.ops.specops.ngram_match(tokens.contiguous(), lengths.contiguous(), min_ngram, max_ngram,
                                         num_candidates, width, validate)


def check_ngram_match(tokens, lengths, min_ngram, max_ngram, num_candidates, width, validate=True) -> None:
    """ngram_match's contract where its kernel cannot check: the C++ kernel's checks and messages
    (`specops.ops.sampling.check_chain_verify` says more)."""
    op = "ngram_match"
    _require(tokens.dim() == 2, op, f"tokens must be [B, L], got {tokens.dim()} dimensions")
    _require(tokens.dtype in (torch.int32, torch.int64), op,
             f"tokens must be int32 or int64, got {_c_dtype(tokens.dtype)}", TypeError)
    batch, length = tokens.shape
    _require(length < 2**28, op, f"tokens must have L < 2**28 columns, got {length}")
    _require(lengths.dim() == 1 and lengths.shape[0] == batch, op,
             f"lengths must be [B] = [{batch}], got {_c_sizes(lengths)}")
    _require(lengths.dtype == torch.int64, op, f"lengths must be int64, got {_c_dtype(lengths.dtype)}", TypeError)
    _require(lengths.device == tokens.device, op, f"lengths is on {lengths.device} but tokens is on {tokens.device}")
    _require(1 <= min_ngram <= max_ngram <= 63, op, f"need 1 <= min_ngram <= max_ngram <= 63, got min_ngram = "
             f"{min_ngram}, max_ngram = {max_ngram}")
    _require(1 <= num_candidates < 2**28, op, f"num_candidates must be >= 1 and < 2**28, got {num_candidates}")
    _require(1 <= width < 2**28, op, f"width must be >= 1 and < 2**28, got {width}")
    if not validate:
        return
    inside = torch.arange(length, device=tokens.device) < lengths.unsqueeze(1)
    _raise_first(op, [_where((lengths < 0) | (lengths > length),
                             lambda at: f"lengths[{at[0]}] = {_c_number(lengths[at[0]])} is outside [0, {length}]"),
                      _where(inside & (tokens < 0),
                             lambda at: f"tokens[{at[0]}, {at[1]}] = {_c_number(tokens[at[0], at[1]])} is negative; "
                                        "context tokens must be ids >= 0")])


@torch.library.register_fake("specops::ngram_match")
def _ngram_match_fake(tokens, lengths, min_ngram, max_ngram, num_candidates, width, validate=True):
    # What can be checked without the values is checked here too (shapes, dtypes, devices, caps): a traced call
    # refuses what the kernels refuse.
    check_ngram_match(tokens, lengths, min_ngram, max_ngram, num_candidates, width, validate=False)
    batch = tokens.shape[0]
    candidates = tokens.new_empty((batch, num_candidates, width), dtype=torch.int64)
    counts = tokens.new_empty((batch, num_candidates), dtype=torch.int64)
    ngram = tokens.new_empty((batch, num_candidates), dtype=torch.int64)
    return candidates, counts, ngram


# ---- The n-gram memory's index (specops.memory.NgramMemory holds it; semantics in specops/reference.py) ----

MEMORY_MAX_DEPTH = 64  # the longest key, hence the longest match (csrc/cpu/ngram_memory.h kMaxDepth)
MEMORY_MAX_WIDTH = 256  # continuation tokens per candidate
MEMORY_MAX_OCCURRENCES = 256  # occurrences read per row and lookup
_MEMORY_MAX_STORE = 2**31 - 1  # positions are int32


def _levels_list(op: str, levels) -> list[int]:
    if isinstance(levels, torch.Tensor) or not isinstance(levels, (list, tuple)) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in levels):
        raise TypeError(f"{op}: levels must be a list of ints (the level sizes, newest first)")
    return list(levels)


def ngram_memory_insert(tokens: torch.Tensor, entries: torch.Tensor, levels: list[int], positions: torch.Tensor, *,
                        depth: int = MEMORY_MAX_DEPTH, validate: bool = True) -> list[int]:
    """Add end positions to the n-gram memory's index, in place (`specops.memory.NgramMemory` calls it;
    specops/reference.py defines the order and the levels).

    The store `tokens` holds runs of token ids apart, separated by negative tokens; the key of an end position
    e is the run's tokens read backwards from e, at most `depth` of them. `entries` is a buffer holding the
    index's levels one after another from its start, oldest first, each sorted by (key, position); `levels`
    are their sizes. The new positions become the newest level, merged with the newest levels it has
    outgrown; the merged level is written over them, so only the buffer's tail changes.

    Shape:
        tokens: [T] int32, T < 2**31; the new positions' tokens already written.
        entries: [capacity] int32, contiguous, with room for sum(levels) + n entries; levels: sizes, each >= 1.
        positions: [n] int64, strictly increasing; each holds a token followed by a token.
        depth: int in [1, 64]. validate: check the positions (on CPU in the kernel; on accelerators in the op's
            contract, one host sync).

    Returns the new level sizes (`reference.memory_levels(levels, n)`).
    """
    levels = _levels_list("ngram_memory_insert", levels)
    torch.ops.specops.ngram_memory_insert(tokens, entries, levels, positions, depth, validate)
    from specops.reference import memory_levels

    return memory_levels(levels, int(positions.shape[0]))


def ngram_memory_lookup(tokens: torch.Tensor, entries: torch.Tensor, levels: list[int], contexts: torch.Tensor,
                        lengths: torch.Tensor | None = None, *, depth: int = MEMORY_MAX_DEPTH, min_match: int = 1,
                        num_candidates: int = 8, width: int = 8, max_occurrences: int = 64,
                        validate: bool = True) -> tuple[torch.Tensor, ...]:
    """Continuations in the n-gram memory of each row's last tokens: the longest match and what followed it.

    Row b's query is its last min(lengths[b], depth) context tokens. Its match L is the most of them any
    stored end position matches (0, with nothing more, below min_match); every entry matching L tokens is an
    occurrence. At most `max_occurrences` occurrences are read, the newest levels first (a level that does not
    fit in what is left is read at evenly spread places); each continues with the `width` tokens after it, -1
    past its run's end. Distinct continuations rank by how many read occurrences have them, then by their
    latest position.

    Shape:
        tokens, entries, levels, depth: the index (`ngram_memory_insert`): levels oldest first, read newest
            first.
        contexts: [B, C] int32 or int64, right-padded ids (>= 0 inside each context); lengths: [B] int64 in
            [0, C] (default C).
        min_match: int in [1, depth]. max_occurrences: int in [1, 256]. num_candidates (k): int in
            [1, max_occurrences]. width: int in [1, 256].
        validate: check that context tokens are >= 0 (the CPU kernel always checks lengths).

    Returns (int64, on contexts' device): candidates [B, k, width] (-1 where there is none), counts [B, k]
    (0 where none), latest [B, k] (the candidate's latest position, -1 where none), match [B] (L, 0 where
    none), occurrences [B] (all occurrences, read or not).
    """
    levels = _levels_list("ngram_memory_lookup", levels)
    if lengths is None and isinstance(contexts, torch.Tensor) and contexts.dim() == 2:
        lengths = torch.full((contexts.shape[0],), contexts.shape[1], dtype=torch.int64, device=contexts.device)
    return torch.ops.specops.ngram_memory_lookup(tokens, entries, levels, contexts, lengths, depth, min_match,
                                                 num_candidates, width, max_occurrences, validate)


def _check_memory_index(op: str, tokens, entries, levels, depth) -> None:
    """csrc/cpu/ngram_memory.h check_index, with its messages."""
    _require(tokens.dim() == 1, op, f"tokens must be [T], got {tokens.dim()} dimensions")
    _require(tokens.dtype == torch.int32, op, f"tokens must be int32, got {_c_dtype(tokens.dtype)}", TypeError)
    _require(tokens.shape[0] <= _MEMORY_MAX_STORE, op, f"tokens must have T < 2**31 positions, got {tokens.shape[0]}")
    _require(entries.dim() == 1, op, f"entries must be [capacity], got {entries.dim()} dimensions")
    _require(entries.dtype == torch.int32, op, f"entries must be int32, got {_c_dtype(entries.dtype)}", TypeError)
    _require(entries.device == tokens.device, op, f"entries is on {entries.device} but tokens is on {tokens.device}")
    for i, size in enumerate(levels):
        _require(size >= 1, op, f"levels[{i}] = {size} must be >= 1")
    _require(sum(levels) <= entries.shape[0], op,
             f"levels sum to {sum(levels)} but entries has room for {entries.shape[0]}")
    _require(1 <= depth <= MEMORY_MAX_DEPTH, op, f"depth must be in [1, {MEMORY_MAX_DEPTH}], got {depth}")


def check_ngram_memory_insert(tokens, entries, levels, positions, depth, validate=True) -> None:
    """ngram_memory_insert's contract where its kernel cannot check: the C++ kernel's checks and messages."""
    op = "ngram_memory_insert"
    _check_memory_index(op, tokens, entries, levels, depth)
    _require(entries.is_contiguous(), op, "entries must be contiguous (it is written in place)")
    _require(positions.dim() == 1, op, f"positions must be [n], got {positions.dim()} dimensions")
    _require(positions.dtype == torch.int64, op, f"positions must be int64, got {_c_dtype(positions.dtype)}",
             TypeError)
    _require(positions.device == tokens.device, op, f"positions is on {positions.device} but tokens is on "
             f"{tokens.device}")
    n, size = positions.shape[0], tokens.shape[0]
    _require(sum(levels) + n <= entries.shape[0], op, f"entries has room for {entries.shape[0]} entries, and the "
             f"index would hold {sum(levels) + n}")
    if not validate or n == 0:
        return
    p = positions
    outside = (p < 0) | (p + 1 >= size)
    inside = p.clamp(0, max(size - 2, 0))
    if size:
        held = ~outside & ((tokens[inside] < 0) | (tokens[(inside + 1).clamp(max=size - 1)] < 0))
    else:
        held = outside
    steps = torch.cat([torch.zeros(1, dtype=torch.bool, device=p.device), p[1:] <= p[:-1]])
    # The C++ kernel checks each position in turn, all three rules on one before the next: the first bad one wins.
    bad = outside | steps | held
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0, 0])
    value = int(p[i])
    if bool(outside[i]):
        raise ValueError(f"{op}: positions[{i}] = {value} is outside [0, {size - 1}): an entry is a token with a "
                         "token after it")
    if bool(steps[i]):
        raise ValueError(f"{op}: positions must increase strictly, but positions[{i}] = {value} follows "
                         f"{int(p[i - 1])}")
    raise ValueError(f"{op}: positions[{i}] = {value} does not hold a token followed by a token (tokens[{value}:"
                     f"{value + 2}] = {int(tokens[value])}, {int(tokens[value + 1])})")


def check_ngram_memory_lookup(tokens, entries, levels, contexts, lengths, depth, min_match, num_candidates, width,
                              max_occurrences, validate=True) -> None:
    """ngram_memory_lookup's contract where its kernel cannot check: the C++ kernel's checks and messages."""
    op = "ngram_memory_lookup"
    _check_memory_index(op, tokens, entries, levels, depth)
    _require(contexts.dim() == 2, op, f"contexts must be [B, C], got {contexts.dim()} dimensions")
    _require(contexts.dtype in (torch.int32, torch.int64), op,
             f"contexts must be int32 or int64, got {_c_dtype(contexts.dtype)}", TypeError)
    batch, columns = contexts.shape
    _require(lengths.dim() == 1 and lengths.shape[0] == batch, op,
             f"lengths must be [B] = [{batch}], got {_c_sizes(lengths)}")
    _require(lengths.dtype == torch.int64, op, f"lengths must be int64, got {_c_dtype(lengths.dtype)}", TypeError)
    _require(contexts.device == tokens.device and lengths.device == tokens.device, op,
             f"contexts and lengths must be on tokens' device ({tokens.device})")
    _require(1 <= min_match <= depth, op, f"min_match must be in [1, depth = {depth}], got {min_match}")
    _require(1 <= max_occurrences <= MEMORY_MAX_OCCURRENCES, op,
             f"max_occurrences must be in [1, {MEMORY_MAX_OCCURRENCES}], got {max_occurrences}")
    _require(1 <= num_candidates <= max_occurrences, op,
             f"num_candidates must be in [1, max_occurrences = {max_occurrences}], got {num_candidates}")
    _require(1 <= width <= MEMORY_MAX_WIDTH, op, f"width must be in [1, {MEMORY_MAX_WIDTH}], got {width}")
    checks = [_where((lengths < 0) | (lengths > columns),
                     lambda at: f"lengths[{at[0]}] = {_c_number(lengths[at[0]])} is outside [0, {columns}]")]
    if validate:
        inside = torch.arange(columns, device=contexts.device) < lengths.unsqueeze(1)
        checks.append(_where(inside & (contexts < 0),
                             lambda at: f"contexts[{at[0]}, {at[1]}] = {_c_number(contexts[at[0], at[1]])} is "
                                        "negative; context tokens must be ids >= 0"))
    _raise_first(op, checks)


@torch.library.register_fake("specops::ngram_memory_insert")
def _ngram_memory_insert_fake(tokens, entries, levels, positions, depth, validate=True):
    check_ngram_memory_insert(tokens, entries, levels, positions, depth, False)


@torch.library.register_fake("specops::ngram_memory_lookup")
def _ngram_memory_lookup_fake(tokens, entries, levels, contexts, lengths, depth, min_match, num_candidates, width,
                              max_occurrences, validate=True):
    # Not the contract: it checks the lengths' values whatever validate says (GPU kernels index with them), which
    # a traced call cannot.
    batch = contexts.shape[0]
    long = dict(dtype=torch.int64, device=contexts.device)
    return (torch.empty((batch, num_candidates, width), **long), torch.empty((batch, num_candidates), **long),
            torch.empty((batch, num_candidates), **long), torch.empty((batch,), **long),
            torch.empty((batch,), **long))
