"""ensemble_logits: the logits of an ensemble of models in one fused pass over the vocabulary."""

from __future__ import annotations

import math

import torch

from specops.ops._checks import _LOGIT_DTYPES, _c_number, _c_sizes, _float, _raise_first, _require, _tensor, _where

__all__ = ["ensemble_logits"]


_ENSEMBLE_MODES = {"weighted": 0, "contrastive": 1}


_WEIGHT_SUM_TOLERANCE = 1e-4  # csrc/cpu/ensemble_logits.cpp holds the same kWeightSumTolerance


def ensemble_logits(members, weights=None, *, mode: str = "weighted", mu: float = 0.0, alpha: float = 0.0,
                    validate: bool = True) -> torch.Tensor:
    """The logits of an ensemble of models' next-token distributions, in one fused pass over the
    vocabulary: what chain_verify, tree_verify or sampling then consume as one model's logits, so
    temperature, top-k and top-p apply to the ensemble exactly as to a single model.

    mode "weighted": log(sum_i weights[i] * softmax(members[i])), the mixture of the members' probabilities
    (at temperature 0 a consumer takes the argmax of that mixture of temperature-1 distributions).
    mode "contrastive" (two members, expert then amateur; weights unused): (l_e - max l_e) - mu * (l_a -
    max l_a), contrastive decoding's score, restricted with alpha > 0 to the expert's plausible tokens
    (probability at least alpha times its largest). A token a member cannot produce has logit -inf there
    (a member with another vocabulary, projected: `vocab_project`'s intersection): the weighted ensemble
    gives it only the other members' mass; the contrastive one excludes it, and a row where nothing is
    left is the expert's plausible set alone.

    Shape:
        members: a list of M tensors [..., V] of one shape, float32, bfloat16 or float16, on one device.
        weights: M non-negative numbers summing to 1 (a sequence or a tensor, any dtype and device), for
            "weighted".
        mu: >= 0; alpha: in [0, 1), 0 for no cut ("contrastive").
        validate: on accelerators, also check the logits' values (NaN, +inf, a row with no finite
            logit; one host sync). The CPU kernel always checks them: its passes read them anyway.

    Returns [..., V] float32.
    """
    op = "ensemble_logits"
    if mode not in _ENSEMBLE_MODES:
        raise ValueError(f"{op}: mode must be 'weighted' or 'contrastive', got {mode!r}")
    if not isinstance(members, (list, tuple)):
        raise TypeError(f"{op}: members must be a list of logit tensors [..., V], got {type(members).__name__}")
    members = [_tensor(op, f"member {m}", member) for m, member in enumerate(members)]
    device = members[0].device if members else torch.device("cpu")
    if mode == "contrastive" or weights is None:
        weights = torch.empty(0, dtype=torch.float32, device=device)
    else:  # numbers, as a float32 [M] tensor on the members' device
        if isinstance(weights, torch.Tensor):
            weights = weights.detach().cpu().double().reshape(-1).tolist()
        if not isinstance(weights, (list, tuple)):
            raise TypeError(f"{op}: weights must be a sequence of numbers or a tensor, got {type(weights).__name__}")
        weights = torch.tensor([_float(op, "a weight", w) for w in weights], dtype=torch.float32, device=device)
    return torch.ops.specops.ensemble_logits(members, weights, _ENSEMBLE_MODES[mode], _float(op, "mu", mu),
                                             _float(op, "alpha", alpha), validate)


def check_ensemble_logits(members, weights, mode, mu, alpha, validate=True) -> None:
    """ensemble_logits's contract where its kernel cannot check: the C++ kernel's checks and messages
    (`specops.ops.sampling.check_chain_verify` says more); members on one device where the CPU kernel
    needs them on the CPU. The weights are values too: with validate=False they are trusted here."""
    op = "ensemble_logits"
    _require(mode in (0, 1), op, "mode must be 0 (weighted) or 1 (contrastive)")
    count = len(members)
    _require(count >= 1, op, "needs at least one member")
    _require(mode != 1 or count == 2, op,
             f"a contrastive ensemble has exactly 2 members (expert, amateur), got {count}")
    first = members[0]
    _require(first.dim() >= 1 and first.shape[-1] >= 1, op, "members must be [..., V] with V >= 1")
    for m, member in enumerate(members):
        _require(member.shape == first.shape, op, f"member {m} has shape {_c_sizes(member)}, member 0 has "
                 f"{_c_sizes(first)}")
        _require(member.device == first.device, op, f"member {m} is on {member.device}, member 0 on {first.device}")
        _require(member.dtype in _LOGIT_DTYPES, op, "members must be float32, bfloat16 or float16", TypeError)
    if mode == 0:
        _require(weights.dim() == 1 and weights.shape[0] == count, op, f"weights must be [{count}] (one per member)")
        _require(weights.dtype == torch.float32, op, "weights must be float32", TypeError)
    else:
        _require(math.isfinite(mu) and mu >= 0, op, f"mu must be finite and >= 0, got {_c_number(float(mu))}")
        _require(0 <= alpha < 1, op, f"alpha must be in [0, 1), got {_c_number(float(alpha))}")
    if not validate:
        return
    if mode == 0:
        values = weights.double().tolist()
        for m, w in enumerate(values):
            _require(math.isfinite(w) and w >= 0, op, f"weights must be finite and >= 0, got {_c_number(w)} for "
                     f"member {m}")
        total = 0.0
        for w in values:
            total += w
        _require(abs(total - 1) <= _WEIGHT_SUM_TOLERANCE, op, f"weights must sum to 1, got {_c_number(total)}")
    vocab = first.shape[-1]
    x = torch.stack([member.reshape(-1, vocab).float() for member in members], 1)  # [rows, M, V]
    bad = (torch.isnan(x) | torch.isposinf(x)).any(-1)
    empty = ~(x > float("-inf")).any(-1)
    _raise_first(op, [_where(bad, lambda at: f"member {at[1]}, row {at[0]} contains NaN or +inf"),
                      _where(empty, lambda at: f"member {at[1]}, row {at[0]} has no finite logit")])


@torch.library.register_fake("specops::ensemble_logits")
def _ensemble_logits_fake(members, weights, mode, mu, alpha, validate=True):
    check_ensemble_logits(members, weights, mode, mu, alpha, False)
    return members[0].new_empty(members[0].shape, dtype=torch.float32)
