"""Typed wrappers around `torch.ops.specops.*`, with the fake (meta) implementation of every op.

The wrappers normalize arguments (scalars to per-row tensors, default seeds) and validate shapes,
dtypes and devices without touching tensor values; the op itself (or, on accelerators, a one-sync
check here) rejects bad values. The dispatcher picks the C++ CPU or Triton CUDA kernel by device.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from specops._rows import per_row
from specops._seeds import draw_seed, row_seeds

__all__ = ["chain_verify", "ensemble_logits", "llama_layers", "ngram_match", "quantized_linear",
           "sample_without_replacement", "skinny_linear", "stochastic_beam_step", "tree_attention",
           "tree_verify", "vocab_project"]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# How far from 1 a used draft_probs row may sum with validate=True (reasons: chain_verify's docstring;
# csrc/cpu/sampling.h holds the same kProbSumTolerance).
_PROBS_SUM_TOLERANCE = 1e-3


def _check_logits(op: str, name: str, value, dims: int, shape: str) -> None:
    """`value` must be a `dims`-dimensional logits tensor (`shape` describes it) of a _LOGIT_DTYPES type."""
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        raise ValueError(f"{op}: {name} must be {shape} tensor")
    if value.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {value.dtype}")


def _check_tensor(op: str, name: str, value, shape: tuple[int, ...], shape_rule: str, dtype: torch.dtype) -> None:
    """`value` must be a tensor of `shape` (the message says `shape_rule`) and `dtype`."""
    if not isinstance(value, torch.Tensor) or value.shape != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{op}: {name} must be {shape_rule}, got {got}")
    if value.dtype != dtype:
        raise TypeError(f"{op}: {name} must be {str(dtype).removeprefix('torch.')}, got {value.dtype}")


def _check_int(op: str, name: str, value, low: int, high: int, rule: str) -> None:
    """`value` must be an int (not a bool) in [low, high], which `rule` states: a ValueError naming it
    otherwise. Checked here because the dispatcher rejects an int outside int64 as if it were no int
    ("Expected a value of type 'int' ... found type 'int'")."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{op}: {name} must be {rule}, got {value!r}")


_INT64_MAX = 2**63 - 1


def _sampling_args(op: str, anchor: str, device: torch.device, rows: int, tensors: dict, temperature, top_k,
                   top_p, seed, offset) -> tuple[torch.Tensor, ...]:
    """The sampling arguments every stochastic op takes, checked (devices of all tensor arguments,
    `tensors` included, and the offset) and normalized to per-row tensors on `device`."""
    tensors = dict(tensors)
    for value, name in ((temperature, "temperature"), (top_k, "top_k"), (top_p, "top_p"), (seed, "seed")):
        if isinstance(value, torch.Tensor):
            tensors[name] = value
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {anchor} is on {device}")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"{op}: offset must be an int, got {type(offset).__name__}")
    if not 0 <= offset < 2**63:
        raise ValueError(f"{op}: offset must be in [0, 2**63), got {offset}")
    return (per_row("temperature", temperature, rows, torch.float32, device),
            per_row("top_k", top_k, rows, torch.int64, device),
            per_row("top_p", top_p, rows, torch.float32, device),
            row_seeds(draw_seed() if seed is None else seed, rows, device))


def _ids_out_of_range(draft_tokens: torch.Tensor, num_draft: torch.Tensor, vocab: int) -> torch.Tensor:
    """Whether a valid draft (position < num_draft) lies outside [0, vocab); later positions are ignored."""
    valid = torch.arange(draft_tokens.shape[1], device=draft_tokens.device) < num_draft.unsqueeze(1)
    return (valid & ((draft_tokens < 0) | (draft_tokens >= vocab))).any()


def _raise_first(op: str, checks: list[tuple[torch.Tensor, str | Callable[[], str]]]) -> None:
    """Value checks for devices whose kernels cannot raise: the flags of all (flag, message) checks in
    one host sync, then ValueError with the message of the first flag that is set (a callable message,
    one that names where the problem is, is called only then)."""
    flags = torch.stack([flag for flag, _ in checks]).tolist()
    for flag, (_, message) in zip(flags, checks):
        if flag:
            raise ValueError(f"{op}: {message() if callable(message) else message}")


def _nan_or_posinf(logits: torch.Tensor) -> torch.Tensor:
    return torch.isnan(logits).any() | torch.isposinf(logits).any()


def _sampling_checks(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> list:
    """The value checks of the per-row sampling arguments, for `_raise_first`."""
    return [(((temperature < 0) | ~torch.isfinite(temperature)).any(), "temperature must be finite and >= 0"),
            ((top_k < 0).any(), "top_k must be >= 0"),
            (~((top_p > 0) & (top_p <= 1)).all(), "top_p must be in (0, 1]")]


def _check_values(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p) -> None:
    """chain_verify's value checks for devices whose kernels cannot raise: one host sync for all of them."""
    batch, k1, vocab = target_logits.shape
    logits = target_logits.float()
    checks = [(_nan_or_posinf(logits), "target_logits contains NaN or +inf"),
              (~(logits > float("-inf")).any(-1).all(), "target_logits has a row with no finite logit"),
              (_ids_out_of_range(draft_tokens, num_draft, vocab), f"draft_tokens has ids outside [0, {vocab})"),
              (((num_draft < 0) | (num_draft > k1 - 1)).any(), f"num_draft must be in [0, {k1 - 1}]"),
              *_sampling_checks(temperature, top_k, top_p)]
    if draft_probs is not None:
        # float32 sums: torch's reductions are tree-shaped, ~1e-6 off at V = 262,144, far inside the tolerance.
        sums = draft_probs.sum(-1)
        used = torch.arange(k1 - 1, device=sums.device) < num_draft.unsqueeze(1)
        unnormalized = used & ((sums - 1).abs() > _PROBS_SUM_TOLERANCE)

        def unnormalized_row() -> str:
            b, i = unnormalized.nonzero()[0].tolist()
            return (f"draft_probs[{b}, {i}] sums to {float(sums[b, i]):.6g}, not 1 "
                    "(each used row must be a distribution)")
        checks += [((~torch.isfinite(draft_probs) | (draft_probs < 0)).any(), "draft_probs must be finite and >= 0"),
                   (unnormalized.any(), unnormalized_row)]
    _raise_first("chain_verify", checks)


def chain_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor | None = None, *, num_draft: torch.Tensor | None = None,
                 temperature=1.0, top_k=0, top_p=1.0, seed=None, offset: int = 0,
                 validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a chain of K drafts per request in one fused pass (speculative sampling).

    Accepts draft i with probability min(1, p(x)/q(x)); at the first rejection emits a recovered
    token from norm(max(0, p - q)); if every valid draft is accepted emits a bonus token from p.
    p = softmax(logits / T) after top-k then top-p filtering (ties at a threshold are kept).
    Temperature 0 is greedy: accept while the draft is the target argmax (first index), then emit it;
    so is a row whose largest logit / T overflows float32, to +inf or (every logit with it) to -inf, e.g.
    T = 1e-45: the T -> 0 limit.
    If a residual has no mass (p <= q everywhere, reachable only through round-off), the recovered
    token is drawn from p instead, which is the distribution the residual converges to.

    Shape:
        target_logits: [B, K+1, V] float32, bfloat16 or float16. -inf marks impossible tokens.
        draft_tokens: [B, K] int64; positions past num_draft are ignored (e.g. -1 padding).
        draft_probs: [B, K, V] float32, the distribution each draft was sampled from; None for
            deterministic drafters (q one-hot on the draft).
        num_draft: [B] int64 in [0, K], valid drafts per row; default K.
        temperature, top_p: float or [B] tensor. top_k: int or [B] tensor (0 = off).
        seed: int or [B] int64 per-request seeds (None draws one from torch's generator,
            `specops._seeds.draw_seed`). An int gives row b the stream s + b * 0x9E3779B97F4A7C15
            (`specops._seeds.row_seeds`); pass [B] seeds for results that do not depend on a
            request's row.
        offset: int counter, e.g. the decoding step; different offsets give independent draws.
        validate: check every value (NaN / +inf logits, rows without a finite logit, NaN / inf /
            negative draft probabilities, ids) wherever it lies, and that every used draft_probs row
            (b, i < num_draft[b]; padding rows are not checked) sums to 1 within 1e-3. On CPU the
            kernel does this in one extra pass; on accelerators it costs one host sync here. With
            False, the CPU kernel still rejects bad logits in the rows it reads but skips the rest,
            and GPU kernels trust the values. Shapes, dtypes, devices and scalar ranges are always
            checked, and no kernel reads out of bounds either way.
            The tolerance: a float32 distribution that was normalized in float32 sums to 1 within
            its rounding, 2**-24 relative per entry plus the normalizer's error: ~1e-6 for pairwise
            or tree summation over V = 262,144 terms; torch.softmax on CPU rows of that width sums
            to within 2.6e-5 (measured, logits N(0, s^2), s from 0.01 to 10). The check's own sums
            (float64 over 16-value float32 partials on CPU, torch's float32 tree reductions
            elsewhere) add ~1e-6. 1e-3 is 40x above the worst of these, and 10x below a row off by
            1%, the size of the bias it is there to catch (a missed renormalization after top-k /
            top-p or a vocabulary cut); an unnormalized q biases both the acceptance test and the
            recovered token. Probabilities rounded through bfloat16 (2**-9 per entry) can fail it:
            normalize them in float32.

    Returns:
        out_tokens: [B, K+1] int64: accepted drafts, then the recovered or bonus token, then -1.
        num_accepted: [B] int64.

    Randomness: Philox4x32-10 keyed by the row's seed, counter (position, stream, offset), the same in
    C++, Triton and `specops.reference`, so the same seeds give the same tokens on CPU and GPU.
    """
    _check_logits("chain_verify", "target_logits", target_logits, 3, "a [B, K+1, V]")
    batch, k1, vocab = target_logits.shape
    if k1 < 1 or vocab < 1:
        raise ValueError(f"chain_verify: target_logits shape {tuple(target_logits.shape)} needs K+1 >= 1 and V >= 1")
    device = target_logits.device
    _check_tensor("chain_verify", "draft_tokens", draft_tokens, (batch, k1 - 1),
                  f"[B, K] = [{batch}, {k1 - 1}] to match target_logits [B, K+1, V]", torch.int64)
    tensors = {"draft_tokens": draft_tokens}
    if draft_probs is not None:
        _check_tensor("chain_verify", "draft_probs", draft_probs, (batch, k1 - 1, vocab),
                      f"[B, K, V] = [{batch}, {k1 - 1}, {vocab}]", torch.float32)
        tensors["draft_probs"] = draft_probs
    if num_draft is None:
        num_draft = torch.full((batch,), k1 - 1, dtype=torch.int64, device=device)
    elif isinstance(num_draft, torch.Tensor):
        if num_draft.dtype != torch.int64 or num_draft.shape != (batch,):
            raise ValueError(f"chain_verify: num_draft must be a [{batch}] int64 tensor, got "
                             f"{tuple(num_draft.shape)} {num_draft.dtype}")
        tensors["num_draft"] = num_draft
    else:
        raise TypeError("chain_verify: num_draft must be a [B] int64 tensor or None")
    temperature, top_k, top_p, seeds = _sampling_args("chain_verify", "target_logits", device, batch, tensors,
                                                      temperature, top_k, top_p, seed, offset)
    if validate and device.type != "cpu":
        _check_values(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p)
    return torch.ops.specops.chain_verify(
        target_logits.contiguous(), draft_tokens.contiguous(),
        None if draft_probs is None else draft_probs.contiguous(), num_draft.contiguous(),
        temperature, top_k, top_p, seeds, offset, validate)


@torch.library.register_fake("specops::chain_verify")
def _chain_verify_fake(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p,
                       seed, offset, validate=True):
    batch, k1, _ = target_logits.shape
    out_tokens = target_logits.new_empty((batch, k1), dtype=torch.int64)
    num_accepted = target_logits.new_empty((batch,), dtype=torch.int64)
    return out_tokens, num_accepted


def sample_without_replacement(logits: torch.Tensor, num_samples: int, *, temperature=1.0, top_k=0, top_p=1.0,
                               seed=None, offset: int = 0,
                               validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """num_samples distinct tokens per row, in the order drawn, from q = softmax(logits / T) after top-k
    then top-p, and q itself: a draft tree's siblings for RSD-C (paper 003) and the draft_probs that
    `tree_verify` needs for them (pass replacement=False there).

    The draws are exactly sequential sampling without replacement (the distribution of Gumbel-top-k):
    draw i comes from q with draws 0..i-1 removed, renormalized. Draws past the support of q are -1.
    Temperature 0 is greedy: the num_samples largest logits (ties: lower index first), with a one-hot q
    on the first argmax (such rows only make sense under a greedy target); so is a row whose largest
    logit / T overflows float32 (to +inf or -inf: the T -> 0 limit, as chain_verify). For a drafter with
    another vocabulary, pass log q of `vocab_project`'s q at T = 1.

    Shape:
        logits: [N, V] float32, bfloat16 or float16.
        num_samples: int in [1, V].
        temperature, top_p: float or [N] tensor. top_k: int or [N] tensor (0 = off).
        seed, offset: as chain_verify; draw i uses position i of Philox stream 3, so it never shares
            random numbers with chain_verify / tree_verify (streams 0, 1) or vocab_project (2).
        validate: check the logits for NaN / +inf and rows without a finite value: one host sync here
            on accelerators. The CPU kernel reads every row and always checks them.

    Returns:
        tokens: [N, num_samples] int64.
        probs: [N, V] float32, q (each row sums to 1).
    """
    op = "sample_without_replacement"
    _check_logits(op, "logits", logits, 2, "an [N, V]")
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError(f"{op}: logits has no columns")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or not 1 <= num_samples <= vocab:
        raise ValueError(f"{op}: num_samples must be an int in [1, V = {vocab}], got {num_samples!r}")
    temperature, top_k, top_p, seeds = _sampling_args(op, "logits", logits.device, rows, {}, temperature, top_k,
                                                      top_p, seed, offset)
    if validate and logits.device.type != "cpu":
        x = logits.float()
        _raise_first(op, [(_nan_or_posinf(x), "logits contains NaN or +inf"),
                          (~(x > float("-inf")).any(-1).all(), "logits has a row with no finite value"),
                          *_sampling_checks(temperature, top_k, top_p)])
    return torch.ops.specops.sample_without_replacement(logits.contiguous(), num_samples, temperature, top_k, top_p,
                                                        seeds, offset, validate)


@torch.library.register_fake("specops::sample_without_replacement")
def _sample_without_replacement_fake(logits, num_samples, temperature, top_k, top_p, seed, offset, validate=True):
    rows, vocab = logits.shape
    return (logits.new_empty((rows, num_samples), dtype=torch.int64),
            logits.new_empty((rows, vocab), dtype=torch.float32))


def stochastic_beam_step(logits: torch.Tensor, beam_log_probs: torch.Tensor, beam_scores: torch.Tensor,
                         beam_width: int, *, temperature=1.0, top_k=0, top_p=1.0, seed=None, offset: int = 0,
                         validate: bool = True) -> tuple[torch.Tensor, ...]:
    """One level of Stochastic Beam Search (Kool et al. 2019), the proposal of RSD-S (paper 003): the
    beam_width children with the largest truncated-Gumbel scores over all beams of each request, so that
    the beams after L levels are L-token sequences drawn without replacement from the drafter.

    Each live beam (log-probability phi and score G above -inf) draws up to beam_width distinct children
    from q = softmax(logits / T) after top-k then top-p, as `sample_without_replacement` does with the
    beam's seed; their scores descend from G in draw order as Gumbels conditioned on their maximum being G,
    computed in the stable form -log(exp(-G) + exp(-g)) (no exp overflows, nothing cancels; paper 003's
    printed Alg. 9 line 6 drops a sign). The beam_width best children over all beams are kept, best first;
    the ones kept from one beam are always the first of its draws, in draw order, which is what
    `tree_verify(..., replacement=False)` needs with probs as their draft_probs. Temperature 0 is
    deterministic beam search: each beam's beam_width largest logits, scored phi + log_softmax(logits); so
    is a beam whose largest logit / T overflows float32 (to +inf or -inf: the T -> 0 limit).
    Semantics in full: `specops.reference.stochastic_beam_step`.

    Shape:
        logits: [B, W, V] float32, bfloat16 or float16: the drafter's logits after each beam's path. Rows of
            beams that are not live are not read.
        beam_log_probs, beam_scores: [B, W] float32: phi and G per beam; -inf in either marks no beam. The
            first level is one beam per request with phi = G = 0.
        beam_width: int in [1, V]: children kept per request (K).
        temperature, top_p: float or [B] tensor. top_k: int or [B] tensor (0 = off).
        seed, offset: as chain_verify, per request; beam w draws with seed + w * 0x632BE59BD9B4E019 (mod
            2**64), its tokens from Philox stream 3 (as sample_without_replacement) and its Gumbels from
            stream 4.
        validate: check the live beams' logits for NaN / +inf and rows without a finite value, and phi and
            G for NaN / +inf: one host sync here on accelerators. The CPU kernel always checks.

    Returns:
        parents: [B, K] int64, the beam of each kept child, best score first; -1 past the children there are.
        tokens: [B, K] int64 (-1 there). log_probs: [B, K] float32, phi + log q of the child (-inf there).
        scores: [B, K] float32, the truncated Gumbel scores, descending (-inf there).
        probs: [B, W, V] float32: each live beam's q (the draft_probs of its children), 0 for other beams.
    """
    op = "stochastic_beam_step"
    _check_logits(op, "logits", logits, 3, "a [B, W, V]")
    batch, beams, vocab = logits.shape
    if beams < 1 or vocab < 1:
        raise ValueError(f"{op}: logits shape {tuple(logits.shape)} needs W >= 1 and V >= 1")
    for name, t in (("beam_log_probs", beam_log_probs), ("beam_scores", beam_scores)):
        _check_tensor(op, name, t, (batch, beams), f"[B, W] = [{batch}, {beams}] to match logits", torch.float32)
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or not 1 <= beam_width <= vocab:
        raise ValueError(f"{op}: beam_width must be an int in [1, V = {vocab}], got {beam_width!r}")
    temperature, top_k, top_p, seeds = _sampling_args(
        op, "logits", logits.device, batch, {"beam_log_probs": beam_log_probs, "beam_scores": beam_scores},
        temperature, top_k, top_p, seed, offset)
    if validate and logits.device.type != "cpu":
        live = (beam_log_probs > float("-inf")) & (beam_scores > float("-inf"))
        x = logits.float()
        _raise_first(op, [(live[..., None].expand_as(x).logical_and(torch.isnan(x) | torch.isposinf(x)).any(),
                           "logits of a live beam contains NaN or +inf"),
                          ((live & ~(x > float("-inf")).any(-1)).any(), "logits of a live beam has no finite value"),
                          (_nan_or_posinf(beam_log_probs) | _nan_or_posinf(beam_scores),
                           "beam_log_probs and beam_scores must not hold NaN or +inf"),
                          *_sampling_checks(temperature, top_k, top_p)])
    return torch.ops.specops.stochastic_beam_step(logits.contiguous(), beam_log_probs.contiguous(),
                                                  beam_scores.contiguous(), beam_width, temperature, top_k, top_p,
                                                  seeds, offset, validate)


@torch.library.register_fake("specops::stochastic_beam_step")
def _stochastic_beam_step_fake(logits, beam_log_probs, beam_scores, beam_width, temperature, top_k, top_p, seed,
                               offset, validate=True):
    batch, beams, vocab = logits.shape
    index = logits.new_empty((batch, beam_width), dtype=torch.int64)
    score = logits.new_empty((batch, beam_width), dtype=torch.float32)
    return (index, torch.empty_like(index), score, torch.empty_like(score),
            logits.new_empty((batch, beams, vocab), dtype=torch.float32))


def tree_verify(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                draft_probs: torch.Tensor | None = None, *, num_nodes: torch.Tensor | None = None,
                replacement: bool = False, temperature=1.0, top_k=0, top_p=1.0, seed=None, offset: int = 0,
                validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a draft tree per request by recursive rejection sampling (RSD, Jeon et al. 2024; SpecInfer's
    multi-step speculative sampling with `replacement=True`): the output follows the target exactly.

    From the root, a node's children are tried in node order (the order they were drawn in): child x_i
    is accepted with probability min(1, p_i(x_i) / q_i(x_i)) and the walk descends into it. On a
    rejection p_{i+1} = norm(max(0, p_i - q_i)) and, for children drawn without replacement, q_{i+1} = q_i
    without x_i, renormalized (i.i.d. children keep q). When no child is accepted, or at a leaf, a token
    is emitted from the current p. p is softmax(logits / T) after top-k then top-p at that node; q is
    draft_probs[b, n] for node n's children, or one-hot on each child (deterministic drafts: n-gram
    rows, top-k trees). Temperature 0 is greedy: follow the child equal to the first argmax, emit the
    argmax where none is (also where the largest logit / T overflows float32, as chain_verify). A residual
    with no mass (round-off only) is kept as the previous p, chain_verify's policy. On a chain this is
    chain_verify, with the same tokens for the same seeds.

    Shape:
        target_logits: [B, N, V] float32, bfloat16 or float16: row n is the target's logits after the
            path to node n.
        tokens: [B, N] int64: node 0 is the root (the last emitted token, not read), nodes 1.. drafts.
        parents: [B, N] int64, parents[b, n] < n for 1 <= n < num_nodes[b] (parents[b, 0] is not read).
        draft_probs: [B, N, V] float32 or None: the distribution node n's children were drawn from,
            before any was removed.
        num_nodes: [B] int64 in [1, N], valid nodes per request (default N); later nodes are ignored.
        replacement: children drawn i.i.d. (True) or without replacement (False, RSD).
        temperature, top_p: float or [B] tensor. top_k: int or [B] tensor (0 = off).
        seed, offset: as chain_verify. Node c's acceptance test uses position c - 1 of the accept stream
            and a token emitted at node n position n of the sample stream.
        validate: check every value: NaN / +inf logits and rows without a finite logit, ids outside
            [0, V), parents not before their children, draft_probs rows that are not finite and >= 0 or
            (for nodes with children) do not sum to 1 within chain_verify's 1e-3, a child whose q is 0
            (it could not have been drawn; without replacement this includes a repeated sibling).
            On CPU the kernel checks; on accelerators it costs one host sync here. With False the values
            are trusted, and no kernel reads out of bounds either way.

    Returns:
        out_tokens: [B, N] int64: accepted drafts along the path, then the emitted token, then -1.
        out_nodes: [B, N] int64: the node of each accepted draft, -1 elsewhere.
        num_accepted: [B] int64.
    """
    op = "tree_verify"
    _check_logits(op, "target_logits", target_logits, 3, "a [B, N, V]")
    batch, nodes, vocab = target_logits.shape
    if nodes < 1 or vocab < 1:
        raise ValueError(f"{op}: target_logits shape {tuple(target_logits.shape)} needs N >= 1 and V >= 1")
    device = target_logits.device
    for name, t in (("tokens", tokens), ("parents", parents)):
        _check_tensor(op, name, t, (batch, nodes), f"[B, N] = [{batch}, {nodes}] to match target_logits", torch.int64)
    tensors = {"tokens": tokens, "parents": parents}
    if draft_probs is not None:
        _check_tensor(op, "draft_probs", draft_probs, (batch, nodes, vocab), f"[B, N, V] = [{batch}, {nodes}, {vocab}]",
                      torch.float32)
        tensors["draft_probs"] = draft_probs
    if num_nodes is None:
        num_nodes = torch.full((batch,), nodes, dtype=torch.int64, device=device)
    elif isinstance(num_nodes, torch.Tensor):
        if num_nodes.dtype != torch.int64 or num_nodes.shape != (batch,):
            raise ValueError(f"{op}: num_nodes must be a [{batch}] int64 tensor, got {tuple(num_nodes.shape)} "
                             f"{num_nodes.dtype}")
        tensors["num_nodes"] = num_nodes
    else:
        raise TypeError(f"{op}: num_nodes must be a [B] int64 tensor or None")
    if not isinstance(replacement, bool):
        raise TypeError(f"{op}: replacement must be a bool, got {type(replacement).__name__}")
    temperature, top_k, top_p, seeds = _sampling_args(op, "target_logits", device, batch, tensors, temperature,
                                                      top_k, top_p, seed, offset)
    if validate and device.type != "cpu":
        _raise_first(op, _tree_verify_checks(target_logits, tokens, parents, draft_probs, num_nodes, replacement)
                     + _sampling_checks(temperature, top_k, top_p))
    return torch.ops.specops.tree_verify(
        target_logits.contiguous(), tokens.contiguous(), parents.contiguous(),
        None if draft_probs is None else draft_probs.contiguous(), num_nodes.contiguous(), replacement,
        temperature, top_k, top_p, seeds, offset, validate)


def _tree_verify_checks(target_logits, tokens, parents, draft_probs, num_nodes, replacement) -> list:
    """tree_verify's value checks (the CPU kernel makes the same ones), for `_raise_first`."""
    batch, nodes, vocab = target_logits.shape
    index = torch.arange(nodes, device=target_logits.device)
    valid = index < num_nodes.unsqueeze(1)  # [B, N]
    drafts = valid & (index > 0)
    logits = target_logits.float()
    checks = [(((num_nodes < 1) | (num_nodes > nodes)).any(), f"num_nodes must be in [1, {nodes}]"),
              ((valid & (torch.isnan(logits) | torch.isposinf(logits)).any(-1)).any(),
               "target_logits contains NaN or +inf"),
              ((valid & ~(logits > float("-inf")).any(-1)).any(), "target_logits has a row with no finite logit"),
              ((drafts & ((tokens < 0) | (tokens >= vocab))).any(), f"tokens has draft ids outside [0, {vocab})"),
              ((drafts & ((parents < 0) | (parents >= index))).any(),
               "parents must satisfy 0 <= parents[b, n] < n for every valid node n >= 1")]
    if draft_probs is not None:
        parent = parents.clamp(0, nodes - 1).masked_fill(~drafts, 0)
        has_children = torch.zeros(batch, nodes, dtype=torch.bool, device=target_logits.device)
        has_children.scatter_(1, parent, drafts)
        sums = draft_probs.sum(-1)
        q_child = draft_probs.gather(1, parent.unsqueeze(-1).expand(batch, nodes, vocab))
        q_child = q_child.gather(2, tokens.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
        checks += [((~torch.isfinite(draft_probs) | (draft_probs < 0)).any(), "draft_probs must be finite and >= 0"),
                   ((has_children & ((sums - 1).abs() > _PROBS_SUM_TOLERANCE)).any(),
                    "draft_probs has a row of a node with children that does not sum to 1"),
                   ((drafts & (q_child <= 0)).any(),
                    "a child has q = 0 under its parent's draft_probs row (it could not have been drawn)")]
        if not replacement:
            same = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (tokens.unsqueeze(2) == tokens.unsqueeze(1))
            pairs = same & drafts.unsqueeze(2) & drafts.unsqueeze(1) & ~torch.eye(nodes, dtype=torch.bool,
                                                                                   device=same.device)
            checks.append((pairs.any(), "two siblings share a token although drawn without replacement"))
    return checks


@torch.library.register_fake("specops::tree_verify")
def _tree_verify_fake(target_logits, tokens, parents, draft_probs, num_nodes, replacement, temperature, top_k,
                      top_p, seed, offset, validate=True):
    batch, nodes, _ = target_logits.shape
    return (target_logits.new_empty((batch, nodes), dtype=torch.int64),
            target_logits.new_empty((batch, nodes), dtype=torch.int64),
            target_logits.new_empty((batch,), dtype=torch.int64))


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
            accelerators it costs one host sync here, together with the lengths check). With False,
            the CPU kernel still rejects lengths outside [0, L] and GPU kernels clamp them, so no
            kernel reads out of bounds either way.

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
    if validate and device.type != "cpu":
        valid = torch.arange(length, device=device) < lengths.unsqueeze(1)
        _raise_first("ngram_match", [(((lengths < 0) | (lengths > length)).any(), f"lengths must be in [0, {length}]"),
                                     ((valid & (tokens < 0)).any(), "tokens has negative ids inside a context")])
    return torch.ops.specops.ngram_match(tokens.contiguous(), lengths.contiguous(), min_ngram, max_ngram,
                                         num_candidates, width, validate)


@torch.library.register_fake("specops::ngram_match")
def _ngram_match_fake(tokens, lengths, min_ngram, max_ngram, num_candidates, width, validate=True):
    batch = tokens.shape[0]
    candidates = tokens.new_empty((batch, num_candidates, width), dtype=torch.int64)
    counts = tokens.new_empty((batch, num_candidates), dtype=torch.int64)
    ngram = tokens.new_empty((batch, num_candidates), dtype=torch.int64)
    return candidates, counts, ngram


def vocab_project(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_vocab: int, *, temperature=1.0,
                  top_k=0, top_p=1.0, seed=None, offset: int = 0,
                  validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A heterogeneous drafter's distribution over the vocabulary it shares with the target, in target
    ids, and one draft sampled from it (TLI, paper 000 Alg 4): the exact q that chain_verify needs.

    Drafter ids outside the intersection (target_ids < 0) get probability 0; temperature, top-k and
    top-p then act on the rest, which is renormalized. Temperature 0 is greedy: the first argmax inside
    the intersection, with a one-hot q; so is a row whose largest logit / T overflows float32 (to +inf or
    -inf: the T -> 0 limit). A map that sends every drafter id somewhere (the union of the
    two vocabularies, paper 000 Alg 1) gives the drafter's unrestricted distribution.

    Shape:
        draft_logits: [N, V_d] float32, bfloat16 or float16 (rows past the tokenizer's vocabulary
            included; map them to -1).
        target_ids: [V_d] int64, the target id of each drafter id, -1 outside the intersection; the
            mapped ids are distinct and in [0, target_vocab). `specops.vocab.VocabMap` builds it.
        target_vocab: int in [1, 2**31), the width of the output distribution.
        temperature, top_p: float or [N] tensor. top_k: int or [N] tensor (0 = off).
        seed: int or [N] int64 per-row seeds (None draws one); offset: int counter (e.g. the step).
        validate: check the values (NaN / +inf logits, rows with no finite logit inside the
            intersection, ids out of range or repeated). On CPU the kernel does this as it goes; on
            accelerators it costs one host sync here. With False no kernel reads out of bounds, but
            bad values give unspecified results.

    Returns:
        probs: [N, target_vocab] float32, q in target ids (each row sums to 1).
        tokens: [N] int64, the sampled drafts in target ids.
        draft_tokens: [N] int64, the same drafts in drafter ids (what the drafter reads next).

    Randomness: uniform(seed, offset, position 0, stream 2) of the Philox generator chain_verify uses
    (streams 0 and 1), so a draft and its verification at the same offset draw independent numbers.
    """
    _check_logits("vocab_project", "draft_logits", draft_logits, 2, "an [N, V_d]")
    rows, draft_vocab = draft_logits.shape
    if draft_vocab < 1:
        raise ValueError("vocab_project: draft_logits has no columns")
    device = draft_logits.device
    _check_tensor("vocab_project", "target_ids", target_ids, (draft_vocab,),
                  f"[V_d] = [{draft_vocab}] to match draft_logits", torch.int64)
    # Target ids are int32 in the kernels.
    _check_int("vocab_project", "target_vocab", target_vocab, 1, 2**31 - 1, "an int >= 1 and < 2**31")
    tensors = {"target_ids": target_ids}
    temperature, top_k, top_p, seeds = _sampling_args("vocab_project", "draft_logits", device, rows, tensors,
                                                      temperature, top_k, top_p, seed, offset)
    if validate and device.type != "cpu":
        _check_projection(draft_logits, target_ids, target_vocab, temperature, top_k, top_p)
    return torch.ops.specops.vocab_project(draft_logits.contiguous(), target_ids.contiguous(), target_vocab,
                                           temperature, top_k, top_p, seeds, offset, validate)


def _check_projection(draft_logits, target_ids, target_vocab, temperature, top_k, top_p) -> None:
    """vocab_project's value checks for devices whose kernels cannot raise: one host sync for all of them."""
    logits = draft_logits.float()
    inside = torch.where(target_ids >= 0, logits, float("-inf"))
    # Ids are clamped before counting repeats: out-of-range ids must reach their own message.
    in_range = (target_ids >= 0) & (target_ids < target_vocab)
    uses = torch.zeros(target_vocab + 1, dtype=torch.int64, device=target_ids.device).scatter_add_(
        0, torch.where(in_range, target_ids + 1, 0), torch.ones_like(target_ids))[1:]
    _raise_first("vocab_project", [
        (_nan_or_posinf(logits), "draft_logits contains NaN or +inf"),
        (((target_ids < -1) | (target_ids >= target_vocab)).any(), f"target_ids must be -1 or in [0, {target_vocab})"),
        (uses.gt(1).any(), "target_ids maps two drafter ids to the same target id"),
        (~(inside > float("-inf")).any(-1).all(),
         "draft_logits has a row with no finite logit inside the intersection (target_ids >= 0)"),
        *_sampling_checks(temperature, top_k, top_p)])


@torch.library.register_fake("specops::vocab_project")
def _vocab_project_fake(draft_logits, target_ids, target_vocab, temperature, top_k, top_p, seed, offset,
                        validate=True):
    rows = draft_logits.shape[0]
    probs = draft_logits.new_empty((rows, target_vocab), dtype=torch.float32)
    tokens = draft_logits.new_empty((rows,), dtype=torch.int64)
    draft_tokens = draft_logits.new_empty((rows,), dtype=torch.int64)
    return probs, tokens, draft_tokens


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor, *,
                   kv_mask: torch.Tensor | None = None, scale: float | None = None, window: int | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None,
                   validate: bool = True) -> torch.Tensor:
    """Attention of a draft tree's nodes over a KV-cached prefix and the tree itself, for ragged trees of
    N nodes per request (RSD's tree attention, paper 003 Alg 5; a chain is a tree).

    Node i attends to every prefix slot that holds a token and to the nodes set in its row of the
    ancestor bitmask (its ancestors and itself): softmax(q.k * scale) over those keys, with an online
    softmax accumulated in float32. Positions count tokens (a prefix slot: the valid slots before it;
    node i: all valid prefix slots plus its depth, popcount(row i) - 1), so a sliding window is counted
    in tokens whatever holes the prefix has.

    Shape:
        query: [B, Hq, N, D] float32, bfloat16 or float16, N >= 1 (B >= 0).
        key, value: [B, Hkv, S, D] of query's dtype, S >= N: each request's cache, its last N slots the
            nodes' keys and values in node order; Hq a multiple of Hkv (grouped-query attention).
        tree_mask: [B, N, ceil(N/32)] int32: bit j % 32 of word j // 32 of row i is set iff node j is
            node i or an ancestor of node i (RSD's construction: a child's row is its parent's row plus
            its own bit). Padding nodes of a ragged tree see only themselves.
        kv_mask: [B, S - N] bool, which prefix slots hold a token (default: all).
        scale: the softmax scale (default D ** -0.5).
        window: keep only keys with position(query) - position(key) < window: an int in [1, 2**63)
            (None: no window).
        softcap: scores become softcap * tanh(scores / softcap) before masking (None: off).
        sinks: [Hq] float, one extra logit per query head in each row's softmax denominator, with no
            value (attention sinks; None: off).
        validate: check the mask's values (no bit at or past N, every node sees itself). On CPU the kernel
            does this in its pass over the rows; on accelerators it costs one host sync here. Shapes,
            dtypes and devices are always checked, and no kernel reads out of bounds either way.

    NaN and inf: what a row does not see never enters it, whatever it holds: a prefix slot kv_mask hides
    or outside its window, a node that is not its ancestor (a padding node, a sibling's branch); a cache
    fresh from torch.empty is ordinary input. A NaN in what it sees shows in its output, never as
    plausible numbers: a NaN (or +inf) in its query, in a score it sees or in its head's sink makes the
    whole row NaN; a NaN or inf in a value it sees enters as p * v (NaN / inf in those columns).

    Returns [B, Hq, N, D] in query's dtype (B = 0: empty); a row with nothing to attend to is zeros.
    """
    op = "tree_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D tensor ([B, H, N or S, D])")
    if query.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"{op}: query must be float32, bfloat16 or float16, got {query.dtype}")
    batch, heads, nodes, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    if nodes < 1 or dim < 1:
        raise ValueError(f"{op}: query {tuple(query.shape)} needs N >= 1 nodes and D >= 1")
    if key.shape != (batch, kv_heads, slots, dim) or value.shape != key.shape:
        raise ValueError(f"{op}: key and value must both be [B, Hkv, S, D] = [{batch}, Hkv, S, {dim}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"{op}: key and value must have query's dtype {query.dtype}, got {key.dtype} and "
                        f"{value.dtype}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{op}: Hq = {heads} query heads must be a multiple of Hkv = {kv_heads} key/value heads")
    if slots < nodes:
        raise ValueError(f"{op}: key/value hold S = {slots} slots, fewer than the N = {nodes} tree nodes")
    words = (nodes + 31) // 32
    _check_tensor(op, "tree_mask", tree_mask, (batch, nodes, words), f"[B, N, ceil(N/32)] = [{batch}, {nodes}, "
                  f"{words}]", torch.int32)
    device = query.device
    if kv_mask is None:
        kv_mask = torch.ones(batch, slots - nodes, dtype=torch.bool, device=device)
    _check_tensor(op, "kv_mask", kv_mask, (batch, slots - nodes), f"[B, S - N] = [{batch}, {slots - nodes}]",
                  torch.bool)
    tensors = {"key": key, "value": value, "tree_mask": tree_mask, "kv_mask": kv_mask}
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (heads,) or not sinks.is_floating_point():
            got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"{op}: sinks must be a float [Hq] = [{heads}] tensor, got {got}")
        tensors["sinks"] = sinks
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but query is on {device}")
    scale = dim ** -0.5 if scale is None else scale
    for name, number in (("scale", scale), ("softcap", softcap)):
        if number is not None and not _finite_positive(number):
            raise ValueError(f"{op}: {name} must be a finite number > 0, got {number!r}")
    if window is not None:
        _check_int(op, "window", window, 1, _INT64_MAX, "an int >= 1 or None (at most 2**63 - 1)")
    if validate and device.type != "cpu":
        _raise_first(op, _tree_mask_checks(tree_mask, nodes))
    return torch.ops.specops.tree_attention(
        query.contiguous(), key.contiguous(), value.contiguous(), tree_mask.contiguous(), kv_mask.contiguous(),
        float(scale), int(window or 0), float(softcap or 0.0),
        None if sinks is None else sinks.float().contiguous(), validate)


def _finite_positive(number) -> bool:
    """Whether `number` is an int or float (not a bool) that is finite and > 0 as a float."""
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return False
    try:
        return 0 < float(number) < float("inf")
    except OverflowError:  # an int beyond float's range
        return False


def _tree_mask_checks(tree_mask: torch.Tensor, nodes: int) -> list:
    """The tree mask's value checks (the CPU kernel makes the same ones): no bit at or past N, and every
    node's own bit set."""
    from specops.reference import tree_visibility

    words = tree_mask.shape[-1]
    spare = 32 * words - nodes
    high = torch.zeros((), dtype=torch.bool, device=tree_mask.device)
    if spare:
        keep = (1 << (32 - spare)) - 1  # the bits of nodes < N in the last word
        high = (tree_mask[..., -1].to(torch.int64) & ~keep & 0xFFFFFFFF).ne(0).any()
    sees = tree_visibility(tree_mask, nodes)
    own = torch.diagonal(sees, dim1=1, dim2=2)
    return [(high, f"tree_mask has a bit set at or past node N = {nodes}"),
            (~own.all(), "tree_mask has a node that does not see itself (its own bit is clear)")]


@torch.library.register_fake("specops::tree_attention")
def _tree_attention_fake(query, key, value, tree_mask, kv_mask, scale, window, softcap, sinks, validate=True):
    return torch.empty_like(query)


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
        weights: M non-negative numbers summing to 1 (a sequence or a tensor), for "weighted".
        mu: >= 0; alpha: in [0, 1), 0 for no cut ("contrastive").
        validate: on accelerators, also check the logits' values (NaN, +inf, a row with no finite
            logit; one host sync). The CPU kernel always checks them: its passes read them anyway.

    Returns [..., V] float32.
    """
    op = "ensemble_logits"
    if mode not in _ENSEMBLE_MODES:
        raise ValueError(f"{op}: mode must be 'weighted' or 'contrastive', got {mode!r}")
    if not isinstance(members, (list, tuple)) or not members:
        raise ValueError(f"{op}: members must be a non-empty list of logit tensors [..., V]")
    count = len(members)
    for i, m in enumerate(members):
        if not isinstance(m, torch.Tensor) or m.dim() < 1 or m.shape[-1] < 1:
            raise ValueError(f"{op}: members[{i}] must be a tensor [..., V] with V >= 1")
        if m.dtype not in _LOGIT_DTYPES:
            raise TypeError(f"{op}: members[{i}] must be float32, bfloat16 or float16, got {m.dtype}")
        if m.shape != members[0].shape:
            raise ValueError(f"{op}: members[{i}] has shape {tuple(m.shape)}, members[0] has {tuple(members[0].shape)}")
        if m.device != members[0].device:
            raise ValueError(f"{op}: members[{i}] is on {m.device} but members[0] is on {members[0].device}")
    device = members[0].device
    if mode == "weighted":
        if weights is None:
            raise ValueError(f"{op}: a weighted ensemble needs weights (one per member, summing to 1)")
        values = weights.detach().cpu().double().reshape(-1).tolist() if isinstance(weights, torch.Tensor) else weights
        if not isinstance(values, (list, tuple)) or len(values) != count or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in values):
            raise ValueError(f"{op}: weights must be {count} numbers (one per member), got {weights!r}")
        if not all(math.isfinite(w) and w >= 0 for w in values):
            raise ValueError(f"{op}: weights must be finite and >= 0, got {list(values)}")
        if abs(sum(values) - 1) > _WEIGHT_SUM_TOLERANCE:
            raise ValueError(f"{op}: weights must sum to 1, got {sum(values):.6g}")
        weights = torch.tensor(values, dtype=torch.float32, device=device)
    else:
        if count != 2:
            raise ValueError(f"{op}: a contrastive ensemble has exactly 2 members (expert, amateur), got {count}")
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not math.isfinite(mu) or mu < 0:
            raise ValueError(f"{op}: mu must be a finite number >= 0, got {mu!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < 1:
            raise ValueError(f"{op}: alpha must be in [0, 1), got {alpha!r}")
        weights = torch.empty(0, dtype=torch.float32, device=device)
    if validate and device.type != "cpu":
        checks = []
        for i, m in enumerate(members):
            x = m.float()
            checks += [(_nan_or_posinf(x), f"members[{i}] contains NaN or +inf"),
                       (~(x > float("-inf")).any(-1).all(), f"members[{i}] has a row with no finite logit")]
        _raise_first(op, checks)
    return torch.ops.specops.ensemble_logits(list(members), weights, _ENSEMBLE_MODES[mode], float(mu), float(alpha),
                                             validate)


@torch.library.register_fake("specops::ensemble_logits")
def _ensemble_logits_fake(members, weights, mode, mu, alpha, validate=True):
    return members[0].new_empty(members[0].shape, dtype=torch.float32)


def _check_linear_input(op: str, input: torch.Tensor) -> None:
    """The input of skinny_linear / quantized_linear: float32 on the CPU, a logit dtype on accelerators."""
    allowed = (torch.float32,) if input.device.type == "cpu" else _LOGIT_DTYPES
    if input.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{op}: input on {input.device.type} must be {names}, got {input.dtype}")


def _check_bias(op: str, bias, n: int) -> None:
    if not isinstance(bias, torch.Tensor) or bias.shape != (n,):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{op}: bias must be [N] = [{n}] or None, got {got}")


def skinny_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """input @ weight^T + bias for the few rows a decoding forward carries (one token, a draft chain or a
    tree), reading the weight once whatever the number of rows: `torch.nn.functional.linear`'s semantics.

    BLAS GEMMs are tuned for many rows; for a few they re-read the weight (MKL on an Intel Xeon once per
    three rows, on AMD EPYC about once per row), and a forward's cost is mostly reading weights. On the
    CPU each output is a 16-lane dot product summed by one fixed tree, so a row's result has the same
    bits whatever the number of rows is and wherever the row sits (batch invariance). Best for up to a
    few dozen rows; beyond that a BLAS GEMM is as fast. Forward only: with gradients enabled and a
    tensor that requires them it raises (use F.linear to train).

    Shape:
        input: [..., K]; float32 on CPU; float32, bfloat16 or float16 on CUDA.
        weight: [N, K] of input's dtype (a non-contiguous weight is copied first: pass a contiguous one).
        bias: [N] of input's dtype, or None.

    NaN and inf propagate as in F.linear, row by row: a NaN in an input row makes that output row NaN and
    leaves the other rows as they are.

    Returns [..., N] in input's dtype.
    """
    op = "skinny_linear"
    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        raise ValueError(f"{op}: input must be a tensor [..., K]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != input.shape[-1]:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{op}: weight must be [N, K] with K = {input.shape[-1]} (input's last dim), got {got}")
    device = input.device
    _check_linear_input(op, input)
    tensors = {"weight": weight}
    if bias is not None:
        _check_bias(op, bias, weight.shape[0])
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.dtype != input.dtype:
            raise TypeError(f"{op}: {name} must have input's dtype {input.dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but input is on {device}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        raise RuntimeError(f"{op} has no backward: call it under torch.no_grad() or torch.inference_mode() "
                           "(a decoding forward), or use torch.nn.functional.linear to train")
    rows = input.reshape(math.prod(input.shape[:-1]), input.shape[-1])
    out = torch.ops.specops.skinny_linear(rows, weight, bias)
    return out.reshape(*input.shape[:-1], weight.shape[0])


@torch.library.register_fake("specops::skinny_linear")
def _skinny_linear_fake(input, weight, bias):
    return input.new_empty((input.shape[0], weight.shape[0]))


_QUANTIZED_FORMATS = {torch.bfloat16: "bfloat16", torch.int8: "int8", torch.uint8: "int4"}


def _check_quantized_weight(op: str, label: str, weight, scales, mins, k: int, k_rule: str) -> dict:
    """A quantized_linear weight (the format its dtype names) with its scales and mins, for inputs of
    width k (`k_rule` says where k comes from); messages start with `label`. Returns the tensors by name."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{op}: {label}weight must be a 2-D tensor")
    fmt = _QUANTIZED_FORMATS.get(weight.dtype)
    article = "an" if fmt in ("int8", "int4") else "a"
    if fmt is None:
        raise TypeError(f"{op}: {label}weight must be bfloat16, int8 or uint8 (packed int4), got "
                        f"{weight.dtype}")
    n = weight.shape[0]
    width = k // 2 if fmt == "int4" else k
    if weight.shape[1] != width or (fmt == "int4" and k % 32):
        rule = "[N, K / 2] with K a multiple of 32" if fmt == "int4" else "[N, K]"
        raise ValueError(f"{op}: {label}{article} {fmt} weight must be {rule}, K = {k} ({k_rule}); got "
                         f"{tuple(weight.shape)}")
    tensors = {"weight": weight}
    needs = {"bfloat16": (), "int8": ("scales",), "int4": ("scales", "mins")}[fmt]
    for name, value in (("scales", scales), ("mins", mins)):
        if name not in needs:
            if value is not None:
                raise ValueError(f"{op}: {label}{article} {fmt} weight takes no {name}")
            continue
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != n:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{op}: {label}{name} must be [N, G] = [{n}, G] for {article} {fmt} weight, got "
                             f"{got}")
        if value.dtype != torch.float32:
            raise TypeError(f"{op}: {label}{name} must be float32, got {value.dtype}")
        tensors[name] = value
    if "scales" in needs:
        groups = scales.shape[1]
        if groups < 1 or k % groups or (groups > 1 and (k // groups) % 32):
            raise ValueError(f"{op}: {label}scales [N, G] must split K = {k} into G groups of a multiple of "
                             f"32 weights (or G = 1), got G = {groups}")
        if mins is not None and mins.shape != scales.shape:
            raise ValueError(f"{op}: {label}mins must have the shape of scales {tuple(scales.shape)}, got "
                             f"{tuple(mins.shape)}")
    return tensors


def quantized_linear(input: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
                     mins: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """input @ W^T + bias with W stored in low precision and de-quantized as it is read (weight-only
    quantization: the input stays in its float type), for the few rows of a decoding forward: a
    skinny_linear that reads 2, 1 or 0.5 bytes per weight instead of 4. `specops.quantize` builds these
    weights from a model's linear layers. The weight's dtype names the format (exact definition:
    `specops.reference.dequantize`):

    - bfloat16 [N, K]: W = weight; no scales or mins.
    - int8 [N, K] with float32 scales [N, G]: W[n, k] = weight[n, k] * scales[n, k // (K / G)].
    - uint8 [N, K / 2] (int4, two per byte) with float32 scales and mins [N, G]:
      W[n, k] = q[n, k] * scales[n, g] + mins[n, g], q in 0..15; in each block of 32 weights along K,
      byte j holds weight j in its low nibble and weight j + 16 in its high nibble (K % 32 == 0).

    G = 1 is one scale per output channel; with G > 1 a group spans K / G weights, a multiple of 32. On
    the CPU each output is float32 de-quantized weights times inputs in 16 lanes summed by a fixed tree,
    so a row's result has the same bits whatever the number of rows (as skinny_linear). Forward only.

    Shape:
        input: [..., K]; float32 on CPU; float32, bfloat16 or float16 on CUDA.
        weight, scales, mins: as above, on input's device. bias: [N] of input's dtype, or None.

    NaN and inf propagate as in F.linear, row by row (as skinny_linear).

    Returns [..., N] in input's dtype.
    """
    op = "quantized_linear"
    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        raise ValueError(f"{op}: input must be a tensor [..., K]")
    device = input.device
    _check_linear_input(op, input)
    k = input.shape[-1]
    tensors = _check_quantized_weight(op, "", weight, scales, mins, k, "input's last dim")
    n = weight.shape[0]
    if bias is not None:
        _check_bias(op, bias, n)
        if bias.dtype != input.dtype:
            raise TypeError(f"{op}: bias must have input's dtype {input.dtype}, got {bias.dtype}")
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but input is on {device}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, scales, mins, bias)):
        raise RuntimeError(f"{op} has no backward: call it under torch.no_grad() or torch.inference_mode()")
    rows = input.reshape(math.prod(input.shape[:-1]), k)
    out = torch.ops.specops.quantized_linear(rows, weight, scales, mins, bias)
    return out.reshape(*input.shape[:-1], n)


@torch.library.register_fake("specops::quantized_linear")
def _quantized_linear_fake(input, weight, scales, mins, bias):
    return input.new_empty((input.shape[0], weight.shape[0]))


_LLAMA_SLOTS = ("q", "k", "v", "o", "gate", "up", "down")
# The products of a layer: slots multiplied by one input, whose outputs are concatenated (a slot without
# a weight is fused into the slot before it in its product).
_LLAMA_PRODUCTS = ((0, 1, 2), (3,), (4, 5), (6,))


def _check_llama_layer(op: str, linears: list, layer: int, d: int, heads: int, kv_heads: int,
                       dim: int) -> None:
    """Each present weight of one llama_layers layer must have the shape its slot (and the absent slots
    fused into it) needs: q [heads * D, d], k and v [kv_heads * D, d], o [d, heads * D], gate and up
    [inter, d] alike (gate|up fused: [2 inter, d]), down [d, inter]; its scales, mins and bias to match.
    Only totals would reach the kernel, which would split a wrong-width q|k or gate|up elsewhere."""
    base = 28 * layer
    gate = linears[base + 16]
    if not isinstance(gate, torch.Tensor) or gate.dim() != 2:
        raise ValueError(f"{op}: linears[{base + 16}] (layer {layer}'s gate weight) must be a 2-D tensor")
    fused_up = linears[base + 20] is None
    if fused_up and gate.shape[0] % 2:
        raise ValueError(f"{op}: linears[{base + 16}] (layer {layer}'s gate|up weight) must be [2 inter, d] "
                         f"with an even 2 inter, got {tuple(gate.shape)}")
    inter = gate.shape[0] // 2 if fused_up else gate.shape[0]
    rows = {"q": (heads * dim, "heads * D"), "k": (kv_heads * dim, "kv_heads * D"),
            "v": (kv_heads * dim, "kv_heads * D"), "o": (d, "d"), "gate": (inter, "inter"),
            "up": (inter, "inter (the gate weight's)"), "down": (d, "d")}
    inputs = {"q": (d, "d"), "k": (d, "d"), "v": (d, "d"), "o": (heads * dim, "heads * D"), "gate": (d, "d"),
              "up": (d, "d"), "down": (inter, "inter")}
    for product in _LLAMA_PRODUCTS:
        covered: list[list[int]] = []
        for slot in product:
            if linears[base + 4 * slot] is not None or not covered:
                covered.append([slot])
            else:
                covered[-1].append(slot)
        for slots in covered:
            names = [_LLAMA_SLOTS[s] for s in slots]
            _check_llama_weight(op, linears, base + 4 * slots[0], layer, names, rows, inputs)


def _check_llama_weight(op: str, linears: list, index: int, layer: int, names: list[str], rows: dict,
                        inputs: dict) -> None:
    """linears[index .. index + 3], the weight, scales, mins and bias giving the outputs of slots `names`
    (concatenated), of input width inputs[names[0]]; the entries of the fused slots after it must be None."""
    weight, scales, mins, bias = linears[index:index + 4]
    label = f"linears[{index}] (layer {layer}'s {'|'.join(names)} weight)"
    n = sum(rows[name][0] for name in names)
    n_rule = " + ".join(rows[name][1] for name in names)
    k, k_rule = inputs[names[0]]
    for extra in range(index + 4, index + 4 * len(names)):
        if linears[extra] is not None:
            raise ValueError(f"{op}: linears[{extra}] must be None: its slot has no weight (fused into "
                             f"{label})")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{op}: {label} must be a 2-D tensor")
    if weight.device.type != "cpu":
        raise ValueError(f"{op} runs on the CPU; {label} is on {weight.device}")
    packed = weight.dtype == torch.uint8  # int4, two weights a byte
    want = (n, k // 2 if packed else k)
    if weight.shape != want:
        rule = f"[{n_rule}, {k_rule}{' / 2' if packed else ''}]"
        raise ValueError(f"{op}: {label} must be {rule} = {list(want)}, got {tuple(weight.shape)}")
    if weight.dtype == torch.float32:
        if scales is not None or mins is not None:
            raise ValueError(f"{op}: {label} is float32 and takes no scales or mins")
    else:
        parts = _check_quantized_weight(op, f"{label}: ", weight, scales, mins, k, k_rule)
        for name, t in parts.items():
            if t.device.type != "cpu":
                raise ValueError(f"{op} runs on the CPU; {label}'s {name} is on {t.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n,) or
                             bias.dtype != torch.float32 or bias.device.type != "cpu"):
        got = (tuple(bias.shape), bias.dtype, bias.device.type) if isinstance(bias, torch.Tensor) else \
            type(bias).__name__
        raise ValueError(f"{op}: the bias of {label} must be float32 [{n_rule}] = [{n}] on the CPU, "
                         f"got {got}")


def llama_layers(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                 norms: list[torch.Tensor], linears: list[torch.Tensor | None], keys: list[torch.Tensor],
                 values: list[torch.Tensor], heads: int, kv_heads: int, eps: float, scale: float) -> torch.Tensor:
    """The decoder layers of a Llama-family model (RMSNorm pre-norm, rotary attention over a KV cache,
    SiLU-gated MLP) over the few new rows of a CPU decoding forward, in one call: what a Python loop over
    the layers spends in framework calls (about a third of SmolLM2-135M's int8 forward) becomes plain
    loops. Semantics and argument layout: `specops.reference.llama_layers`. Products go through
    skinny_linear (float32 weights) or quantized_linear (its formats); attention is a loop over the
    cache. The CPU only: on accelerators, a model's own forward under CUDA graphs has no such overhead.
    Forward only.

    The caches are written in place: each layer's keys and values hold the cache followed by room for
    the n new rows, which the op fills with their keys (after rotary embedding) and values. A caller
    keeps a cache in a buffer with spare slots and passes views of it, so nothing is copied per forward.

    Shape:
        hidden: [B * n, d] float32. cos, sin: [B, n, D] float32 (the model's rotary embedding).
        attn_mask: [B, 1, n, past + n] bool (True: seen) or None (every slot seen). A row that sees no
            slot attends to nothing (zeros). A slot a row does not see never enters it, whatever it holds
            (an unwritten cache slot is ordinary input); a NaN in what it sees makes it NaN, as in
            `tree_attention`.
        norms: 2 L weights [d] (each layer's input and post-attention norm).
        linears: 28 L entries, per layer (weight, scales, mins, bias) for q, k, v, o, gate, up, down:
            a float32 weight (no scales or mins) or a `quantized_linear` one, each [N, K] (int4: [N, K / 2])
            with q [heads * D, d], k and v [kv_heads * D, d], o [d, heads * D], gate and up [inter, d],
            down [d, inter]. A slot whose entries are all None is fused into the slot before: that weight
            gives both outputs (q|k|v [(heads + 2 kv_heads) * D, d], gate|up [2 inter, d]). Each shape is
            checked (ValueError naming the entry and the shape it needs).
        heads, kv_heads: ints >= 1, heads a multiple of kv_heads. eps, scale: finite numbers.
        keys, values: L float32 tensors [B, kv_heads, past + n, D], contiguous along D (other strides
            free: views of a larger buffer): slots past .. past + n - 1 are written.

    Returns hidden [B * n, d].
    """
    op = "llama_layers"
    if not isinstance(cos, torch.Tensor) or cos.dim() != 3 or not isinstance(sin, torch.Tensor) or \
            sin.shape != cos.shape:
        raise ValueError(f"{op}: cos and sin must be tensors [B, n, D] of one shape")
    batch, n, dim = cos.shape
    if dim % 2:
        raise ValueError(f"{op}: the head dim D must be even, got {dim}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] != batch * n:
        raise ValueError(f"{op}: hidden must be [B * n, d] = [{batch * n}, d]")
    for name, value in (("heads", heads), ("kv_heads", kv_heads)):
        _check_int(op, name, value, 1, 2**31 - 1, "an int >= 1 and < 2**31")
    if heads % kv_heads:
        raise ValueError(f"{op}: heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    layers = len(keys)
    if layers < 1 or len(values) != layers or len(norms) != 2 * layers or len(linears) != 28 * layers:
        raise ValueError(f"{op}: for L >= 1 layers give L keys, L values, 2 L norms and 28 L linears; got "
                         f"{layers}, {len(values)}, {len(norms)} and {len(linears)}")
    tensors = [("hidden", hidden), ("cos", cos), ("sin", sin)] + [("a norm", w) for w in norms]
    slots = keys[0].shape[2] if isinstance(keys[0], torch.Tensor) and keys[0].dim() == 4 else -1
    if slots < n:
        raise ValueError(f"{op}: keys[0] must be [B, kv_heads, past + n, D] with room for the n = {n} new rows")
    for layer, (k, v) in enumerate(zip(keys, values)):
        for name, t in ((f"keys[{layer}]", k), (f"values[{layer}]", v)):
            if not isinstance(t, torch.Tensor) or t.shape != (batch, kv_heads, slots, dim):
                raise ValueError(f"{op}: {name} must be [B, kv_heads, past + n, D] = [{batch}, {kv_heads}, "
                                 f"{slots}, {dim}] like keys[0], got {tuple(getattr(t, 'shape', ()))}")
            if t.stride(-1) != 1:
                raise ValueError(f"{op}: {name} must be contiguous along D")
            tensors.append((name, t))
    for name, t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"{op} runs on the CPU; {name} is on {t.device}")
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be float32, got {t.dtype}")
    if any(w.shape != (hidden.shape[1],) for w in norms):
        raise ValueError(f"{op}: norm weights must be [d] = [{hidden.shape[1]}]")
    if attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.shape != (batch, 1, n, slots)):
        raise ValueError(f"{op}: attn_mask must be bool [B, 1, n, past + n] = [{batch}, 1, {n}, {slots}] or None")
    for name, number in (("eps", eps), ("scale", scale)):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise ValueError(f"{op}: {name} must be a finite number, got {number!r}")
    for layer in range(layers):
        if linears[28 * layer] is None or linears[28 * layer + 12] is None or linears[28 * layer + 16] is None or \
                linears[28 * layer + 24] is None:
            raise ValueError(f"{op}: layer {layer} needs q, o, gate and down weights")
        _check_llama_layer(op, linears, layer, hidden.shape[1], heads, kv_heads, dim)
    return torch.ops.specops.llama_layers(hidden, cos, sin, attn_mask, list(norms), list(linears), list(keys),
                                          list(values), heads, kv_heads, float(eps), float(scale))


@torch.library.register_fake("specops::llama_layers")
def _llama_layers_fake(hidden, cos, sin, attn_mask, norms, linears, keys, values, heads, kv_heads, eps, scale):
    return hidden.new_empty(hidden.shape)
