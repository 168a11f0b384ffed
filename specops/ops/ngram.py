"""ngram_match: batched context n-gram lookup."""

from __future__ import annotations

import torch

from specops.ops._checks import _c_dtype, _c_number, _c_sizes, _raise_first, _require, _where

__all__ = ["ngram_match"]


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
    if tokens.dim() != 2:
        raise ValueError(f"ngram_match: tokens must be [B, L], got shape {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ngram_match: tokens must be int32 or int64, got {tokens.dtype}")
    batch, length = tokens.shape
    if length >= 2**28:
        raise ValueError(f"ngram_match: tokens must have L < 2**28 columns, got {length}")
    device = tokens.device
    if lengths is None:
        lengths = torch.full((batch,), length, dtype=torch.int64, device=device)
    elif not isinstance(lengths, torch.Tensor):
        raise TypeError(f"ngram_match: lengths must be a [B] int64 tensor or None, got {type(lengths).__name__}")
    elif lengths.shape != (batch,):
        raise ValueError(f"ngram_match: lengths must be [B] = [{batch}], got shape {tuple(lengths.shape)}")
    elif lengths.dtype != torch.int64:
        raise TypeError(f"ngram_match: lengths must be int64, got {lengths.dtype}")
    elif lengths.device != device:
        raise ValueError(f"ngram_match: lengths is on {lengths.device} but tokens is on {device}")
    for name, value in (("min_ngram", min_ngram), ("max_ngram", max_ngram), ("num_candidates", num_candidates),
                        ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"ngram_match: {name} must be an int, got {type(value).__name__}")
    if not 1 <= min_ngram <= max_ngram <= 63:
        raise ValueError(f"ngram_match: need 1 <= min_ngram <= max_ngram <= 63, got min_ngram = {min_ngram}, "
                         f"max_ngram = {max_ngram}")
    if not (1 <= num_candidates < 2**28 and 1 <= width < 2**28):
        raise ValueError(f"ngram_match: num_candidates and width must be >= 1 and < 2**28 (as L), got "
                         f"{num_candidates} and {width}")
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
    _require(num_candidates >= 1, op, f"num_candidates must be >= 1, got {num_candidates}")
    _require(width >= 1, op, f"width must be >= 1, got {width}")
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
    batch = tokens.shape[0]
    candidates = tokens.new_empty((batch, num_candidates, width), dtype=torch.int64)
    counts = tokens.new_empty((batch, num_candidates), dtype=torch.int64)
    ngram = tokens.new_empty((batch, num_candidates), dtype=torch.int64)
    return candidates, counts, ngram
