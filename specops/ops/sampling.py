"""Verification and sampling ops: chain_verify, tree_verify, sample_without_replacement,
stochastic_beam_step and vocab_project (temperature / top-k / top-p, per-row Philox seeds)."""

from __future__ import annotations

import torch

from specops.ops._checks import (_PROBS_SUM_TOLERANCE, _c_number, _check_devices, _check_logit_dtype, _check_per_row,
                                 _int, _logit_row_checks, _raise_first, _require, _sampling_checks, _sampling_rows,
                                 _sizes, _tensor, _where)

__all__ = ["CHAIN_SCHEMES", "TREE_SCHEMES", "chain_verify", "sample_without_replacement", "stochastic_beam_step", "tree_verify",
           "vocab_project"]

CHAIN_SCHEMES = ("token", "block")  # chain_verify's verification schemes
TREE_SCHEMES = ("recursive", "traversal")  # tree_verify's verification schemes


def check_chain_verify(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p, seed, offset,
                       validate=True, scheme="token") -> None:
    """chain_verify's contract where its kernel cannot check (the Triton one): every check the C++ kernel
    makes, in its order and with its messages, on the op's own arguments; the values (validate=True) in
    one host sync. `test_validation.py` holds the two to the same outcome on the same bad inputs."""
    op = "chain_verify"
    _require(target_logits.dim() == 3, op, "target_logits must be [B, K+1, V]")
    batch, k1, vocab = target_logits.shape
    _require(k1 >= 1 and vocab >= 1, op, "target_logits needs K+1 >= 1 and V >= 1")
    _require(draft_tokens.dim() == 2 and tuple(draft_tokens.shape) == (batch, k1 - 1), op,
             "draft_tokens must be [B, K] matching target_logits [B, K+1, V]")
    _require(draft_tokens.dtype == torch.int64, op, "draft_tokens must be int64", TypeError)
    _check_per_row(op, (num_draft, top_k, seed), batch, torch.int64, "num_draft, top_k and seed must be [B] int64")
    _check_per_row(op, (temperature, top_p), batch, torch.float32, "temperature and top_p must be [B] float32")
    _require(offset >= 0, op, "offset must be >= 0")
    _require(scheme in CHAIN_SCHEMES, op, f"scheme must be 'token' or 'block', got '{scheme}'")
    _check_logit_dtype(op, "target_logits", target_logits)
    if draft_probs is not None:
        _require(tuple(draft_probs.shape) == (batch, k1 - 1, vocab), op,
                 "draft_probs must be [B, K, V] matching target_logits")
        _require(draft_probs.dtype == torch.float32, op, "draft_probs must be float32", TypeError)
    _check_devices(op, "target_logits", target_logits.device,
                   {"draft_tokens": draft_tokens, "draft_probs": draft_probs, "num_draft": num_draft,
                    "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed})
    if not validate:
        return
    used = torch.arange(k1 - 1, device=num_draft.device) < num_draft.unsqueeze(1)
    checks = [_where((num_draft < 0) | (num_draft > k1 - 1),
                     lambda at: f"num_draft[{at[0]}] = {_c_number(num_draft[at[0]])} is outside [0, {k1 - 1}]"),
              *_sampling_checks(temperature, top_k, top_p),
              _where(used & ((draft_tokens < 0) | (draft_tokens >= vocab)),
                     lambda at: f"draft_tokens[{at[0]}, {at[1]}] = {_c_number(draft_tokens[at[0], at[1]])} is "
                                f"outside the vocabulary [0, {vocab})"),
              *_logit_row_checks(op, "target_logits", target_logits)]
    if draft_probs is not None:
        # float32 sums: torch's reductions are tree-shaped, ~1e-6 off at V = 262,144, far inside the tolerance;
        # the message gives the float64 sum, as the C++ kernel does.
        sums = draft_probs.sum(-1)
        checks += [_where((~torch.isfinite(draft_probs) | (draft_probs < 0)).any(-1),
                          lambda at: f"draft_probs[{at[0]}, {at[1]}] contains NaN, inf or negative values"),
                   _where(used & ((sums - 1).abs() > _PROBS_SUM_TOLERANCE),
                          lambda at: f"draft_probs[{at[0]}, {at[1]}] sums to "
                                     f"{_c_number(draft_probs[at[0], at[1]].double().sum())}, not 1 "
                                     "(each used row must be a distribution)")]
    _raise_first(op, checks)


def chain_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor | None = None, *, num_draft: torch.Tensor | None = None,
                 temperature=1.0, top_k=0, top_p=1.0, seed=None, offset: int = 0,
                 validate: bool = True, scheme: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
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
        scheme: "token" (the rule above: each draft tested on its own) or "block": block verification
            (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025, arXiv
            2403.10444), which decides the accepted prefix from the whole chain at once. With
            W_0 = 1 and W_k = min(1, W_{k-1} p(x_k) / q(x_k)), it keeps k drafts with probability
            h_k = S_k / (S_k + 1 - W_k) given that no longer prefix was kept (walking from k = K down;
            h_K = W_K), where S_k is the mass of the residual max(0, W_k p_{k+1} - q_{k+1}) at the next
            position, and emits the next token from that residual (from p after all K). Lossless like
            "token", never fewer accepted drafts in expectation, and optimal among verifiers that see
            the same p and q; with one-hot q (deterministic drafts) its expectation equals "token"'s.
            Greedy rows (T = 0) are the same in both. The derivation: docs/verification.md.
        validate: check every value (NaN / +inf logits, rows without a finite logit, NaN / inf /
            negative draft probabilities, ids) wherever it lies, and that every used draft_probs row
            (b, i < num_draft[b]; padding rows are not checked) sums to 1 within 1e-3. On CPU the
            kernel does this in one extra pass; on accelerators it costs one host sync in the op's contract. With
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
    op = "chain_verify"
    target_logits = _tensor(op, "target_logits", target_logits)
    rows, positions = _sizes(target_logits, 2)
    device = target_logits.device
    if num_draft is None:
        num_draft = torch.full((rows,), max(positions - 1, 0), dtype=torch.int64, device=device)
    temperature, top_k, top_p, seeds = _sampling_rows(op, rows, device, temperature, top_k, top_p, seed, offset)
    return torch.ops.specops.chain_verify(
        target_logits, _tensor(op, "draft_tokens", draft_tokens), _tensor(op, "draft_probs", draft_probs, True),
        _tensor(op, "num_draft", num_draft), temperature, top_k, top_p, seeds, offset, validate, scheme)


@torch.library.register_fake("specops::chain_verify")
def _chain_verify_fake(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p,
                       seed, offset, validate=True, scheme="token"):
    check_chain_verify(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p, seed, offset,
                       False, scheme)
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
        validate: check the logits for NaN / +inf and rows without a finite value: one host sync in the
            op's contract on accelerators. The CPU kernel reads every row and always checks them.

    Returns:
        tokens: [N, num_samples] int64.
        probs: [N, V] float32, q (each row sums to 1).
    """
    op = "sample_without_replacement"
    logits = _tensor(op, "logits", logits)
    rows, = _sizes(logits, 1)
    temperature, top_k, top_p, seeds = _sampling_rows(op, rows, logits.device, temperature, top_k, top_p, seed,
                                                      offset)
    return torch.ops.specops.sample_without_replacement(logits, _int(op, "num_samples", num_samples), temperature,
                                                        top_k, top_p, seeds, offset, validate)


def check_sample_without_replacement(logits, num_samples, temperature, top_k, top_p, seed, offset,
                                     validate=True) -> None:
    """sample_without_replacement's contract where its kernel cannot check: the C++ kernel's checks and
    messages (check_chain_verify says more)."""
    op = "sample_without_replacement"
    _require(logits.dim() == 2, op, "logits must be [N, V]")
    rows, vocab = logits.shape
    _require(vocab >= 1, op, "logits has no columns")
    _require(1 <= num_samples <= vocab, op, f"num_samples must be in [1, {vocab}], got {num_samples}")
    _check_per_row(op, (top_k, seed), rows, torch.int64, "top_k and seed must be [N] int64")
    _check_per_row(op, (temperature, top_p), rows, torch.float32, "temperature and top_p must be [N] float32")
    _require(offset >= 0, op, "offset must be >= 0")
    _check_logit_dtype(op, "logits", logits)
    _check_devices(op, "logits", logits.device, {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                                                 "seed": seed})
    if validate:
        _raise_first(op, [*_sampling_checks(temperature, top_k, top_p),
                          *_logit_row_checks(op, "logits", logits, no_finite="has no finite value")])


@torch.library.register_fake("specops::sample_without_replacement")
def _sample_without_replacement_fake(logits, num_samples, temperature, top_k, top_p, seed, offset, validate=True):
    check_sample_without_replacement(logits, num_samples, temperature, top_k, top_p, seed, offset, False)
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
            G for NaN / +inf: one host sync in the op's contract on accelerators. The CPU kernel always checks.

    Returns:
        parents: [B, K] int64, the beam of each kept child, best score first; -1 past the children there are.
        tokens: [B, K] int64 (-1 there). log_probs: [B, K] float32, phi + log q of the child (-inf there).
        scores: [B, K] float32, the truncated Gumbel scores, descending (-inf there).
        probs: [B, W, V] float32: each live beam's q (the draft_probs of its children), 0 for other beams.
    """
    op = "stochastic_beam_step"
    logits = _tensor(op, "logits", logits)
    rows, = _sizes(logits, 1)
    temperature, top_k, top_p, seeds = _sampling_rows(op, rows, logits.device, temperature, top_k, top_p, seed,
                                                      offset)
    return torch.ops.specops.stochastic_beam_step(logits, _tensor(op, "beam_log_probs", beam_log_probs),
                                                  _tensor(op, "beam_scores", beam_scores),
                                                  _int(op, "beam_width", beam_width), temperature, top_k, top_p,
                                                  seeds, offset, validate)


def check_stochastic_beam_step(logits, beam_log_probs, beam_scores, beam_width, temperature, top_k, top_p, seed,
                               offset, validate=True) -> None:
    """stochastic_beam_step's contract where its kernel cannot check: the C++ kernel's checks and messages
    (check_chain_verify says more). Logit rows are named as the kernel names them, by beam row b * W + w."""
    op = "stochastic_beam_step"
    _require(logits.dim() == 3, op, "logits must be [B, W, V]")
    batch, beams, vocab = logits.shape
    _require(beams >= 1 and vocab >= 1, op, "logits needs W >= 1 and V >= 1")
    _require(1 <= beam_width <= vocab, op, f"beam_width must be in [1, {vocab}], got {beam_width}")
    for t in (beam_log_probs, beam_scores):
        _require(t.dim() == 2 and tuple(t.shape) == (batch, beams) and t.dtype == torch.float32, op,
                 "beam_log_probs and beam_scores must be [B, W] float32")
    _check_per_row(op, (top_k, seed), batch, torch.int64, "top_k and seed must be [B] int64")
    _check_per_row(op, (temperature, top_p), batch, torch.float32, "temperature and top_p must be [B] float32")
    _require(offset >= 0, op, "offset must be >= 0")
    _check_logit_dtype(op, "logits", logits)
    _check_devices(op, "logits", logits.device, {"beam_log_probs": beam_log_probs, "beam_scores": beam_scores,
                                                 "temperature": temperature, "top_k": top_k, "top_p": top_p,
                                                 "seed": seed})
    if not validate:
        return
    live = (beam_log_probs > float("-inf")) & (beam_scores > float("-inf"))
    beam_bad = torch.isnan(beam_log_probs) | torch.isposinf(beam_log_probs) | torch.isnan(beam_scores) | \
        torch.isposinf(beam_scores)
    _raise_first(op, [_where(beam_bad, lambda at: "beam_log_probs and beam_scores must not hold NaN or +inf "
                                                  f"(beam {at[1]} of request {at[0]})"),
                      *_sampling_checks(temperature, top_k, top_p),
                      *_logit_row_checks(op, "logits", logits.reshape(batch * beams, vocab), live.reshape(-1),
                                         no_finite="has no finite value")])


@torch.library.register_fake("specops::stochastic_beam_step")
def _stochastic_beam_step_fake(logits, beam_log_probs, beam_scores, beam_width, temperature, top_k, top_p, seed,
                               offset, validate=True):
    check_stochastic_beam_step(logits, beam_log_probs, beam_scores, beam_width, temperature, top_k, top_p, seed,
                               offset, False)
    batch, beams, vocab = logits.shape
    index = logits.new_empty((batch, beam_width), dtype=torch.int64)
    score = logits.new_empty((batch, beam_width), dtype=torch.float32)
    return (index, torch.empty_like(index), score, torch.empty_like(score),
            logits.new_empty((batch, beams, vocab), dtype=torch.float32))


def tree_verify(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                draft_probs: torch.Tensor | None = None, *, num_nodes: torch.Tensor | None = None,
                replacement: bool = False, temperature=1.0, top_k=0, top_p=1.0, seed=None, offset: int = 0,
                validate: bool = True, scheme: str = "recursive") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    scheme "traversal" is traversal verification (Weng et al., NeurIPS 2025, arXiv 2505.12398): the tree
    is verified from its leaves to the root, each path kept with a probability that weighs the whole path
    (w_c = min(1, w_parent p(x_c) / q(x_c)) from the root down), and a rejected node updates its parent's
    target to norm(max(0, w p - q)) before the next path is tried. Lossless like the default; in expectation
    over the trees drawn it kept at least as many drafts wherever measured (docs/verification.md). On a
    chain it is `chain_verify(..., scheme="block")`, with the same tokens for the same seeds. Rule and
    random numbers: `specops.reference._traversal_verify_request`.

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
            On CPU the kernel checks; on accelerators it costs one host sync in the op's contract. With False the values
            are trusted, and no kernel reads out of bounds either way.
        scheme: "recursive" (the default: recursive rejection sampling) or "traversal".

    Returns:
        out_tokens: [B, N] int64: accepted drafts along the path, then the emitted token, then -1.
        out_nodes: [B, N] int64: the node of each accepted draft, -1 elsewhere.
        num_accepted: [B] int64.
    """
    op = "tree_verify"
    target_logits = _tensor(op, "target_logits", target_logits)
    rows, nodes = _sizes(target_logits, 2)
    device = target_logits.device
    if num_nodes is None:
        num_nodes = torch.full((rows,), nodes, dtype=torch.int64, device=device)
    if not isinstance(replacement, bool):  # the dispatcher would take an int for the bool
        raise TypeError(f"{op}: replacement must be a bool, got {type(replacement).__name__}")
    temperature, top_k, top_p, seeds = _sampling_rows(op, rows, device, temperature, top_k, top_p, seed, offset)
    return torch.ops.specops.tree_verify(
        target_logits, _tensor(op, "tokens", tokens), _tensor(op, "parents", parents),
        _tensor(op, "draft_probs", draft_probs, True), _tensor(op, "num_nodes", num_nodes), replacement,
        temperature, top_k, top_p, seeds, offset, validate, scheme)


def check_tree_verify(target_logits, tokens, parents, draft_probs, num_nodes, replacement, temperature, top_k, top_p,
                      seed, offset, validate=True, scheme="recursive") -> None:
    """tree_verify's contract where its kernel cannot check (the Triton one): every check the C++ kernel
    makes, with its messages (check_chain_verify says more)."""
    op = "tree_verify"
    _require(scheme in TREE_SCHEMES, op, f"scheme must be 'recursive' or 'traversal', got '{scheme}'")
    _require(target_logits.dim() == 3, op, "target_logits must be [B, N, V]")
    batch, nodes, vocab = target_logits.shape
    _require(nodes >= 1 and vocab >= 1, op, "target_logits needs N >= 1 and V >= 1")
    for t in (tokens, parents):
        _require(t.dim() == 2 and tuple(t.shape) == (batch, nodes), op,
                 "tokens and parents must be [B, N] matching target_logits")
        _require(t.dtype == torch.int64, op, "tokens and parents must be int64", TypeError)
    _check_per_row(op, (num_nodes, top_k, seed), batch, torch.int64, "num_nodes, top_k and seed must be [B] int64")
    _check_per_row(op, (temperature, top_p), batch, torch.float32, "temperature and top_p must be [B] float32")
    _require(offset >= 0, op, "offset must be >= 0")
    _check_logit_dtype(op, "target_logits", target_logits)
    if draft_probs is not None:
        _require(tuple(draft_probs.shape) == (batch, nodes, vocab), op,
                 "draft_probs must be [B, N, V] matching target_logits")
        _require(draft_probs.dtype == torch.float32, op, "draft_probs must be float32", TypeError)
    _check_devices(op, "target_logits", target_logits.device,
                   {"tokens": tokens, "parents": parents, "draft_probs": draft_probs, "num_nodes": num_nodes,
                    "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed})
    if validate:
        _raise_first(op, _tree_verify_checks(target_logits, tokens, parents, draft_probs, num_nodes, replacement,
                                             temperature, top_k, top_p))


def _tree_verify_checks(target_logits, tokens, parents, draft_probs, num_nodes, replacement, temperature, top_k,
                        top_p) -> list:
    """tree_verify's value checks, in the C++ kernel's order and words, for `_raise_first`: the node
    counts, the sampling arguments, parents before children and ids in the vocabulary (nodes >= 1 below
    num_nodes), then the valid nodes' logit rows, the draft_probs rows of nodes with children, each
    child's q > 0 and (without replacement) distinct siblings. Rows of leaves and of padding nodes are
    not read, so anything in them is accepted."""
    batch, nodes, vocab = target_logits.shape
    index = torch.arange(nodes, device=target_logits.device)
    valid = index < num_nodes.unsqueeze(1)  # [B, N]
    drafts = valid & (index > 0)
    checks = [_where((num_nodes < 1) | (num_nodes > nodes),
                     lambda at: f"num_nodes[{at[0]}] = {_c_number(num_nodes[at[0]])} is outside [1, {nodes}]"),
              *_sampling_checks(temperature, top_k, top_p),
              _where(drafts & ((parents < 0) | (parents >= index)),
                     lambda at: f"parents[{at[0]}, {at[1]}] = {_c_number(parents[at[0], at[1]])} must be in "
                                f"[0, {at[1]}) (parents come before their children)"),
              _where(drafts & ((tokens < 0) | (tokens >= vocab)),
                     lambda at: f"tokens[{at[0]}, {at[1]}] = {_c_number(tokens[at[0], at[1]])} is outside the "
                                f"vocabulary [0, {vocab})"),
              *_logit_row_checks("tree_verify", "target_logits", target_logits, valid)]
    if draft_probs is None:
        return checks
    parent = parents.clamp(0, nodes - 1).masked_fill(~drafts, 0)
    has_children = torch.zeros(batch, nodes, dtype=torch.bool, device=target_logits.device)
    has_children.scatter_(1, parent, drafts)
    sums = draft_probs.sum(-1)
    q_child = draft_probs.gather(1, parent.unsqueeze(-1).expand(batch, nodes, vocab))
    q_child = q_child.gather(2, tokens.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    checks += [_where(has_children & (~torch.isfinite(draft_probs) | (draft_probs < 0)).any(-1),
                      lambda at: f"draft_probs[{at[0]}, {at[1]}] contains NaN, inf or negative values"),
               _where(has_children & ((sums - 1).abs() > _PROBS_SUM_TOLERANCE),
                      lambda at: f"draft_probs[{at[0]}, {at[1]}] sums to "
                                 f"{_c_number(draft_probs[at[0], at[1]].double().sum())}, not 1 (each row of a node "
                                 "with children must be a distribution)"),
               _where(drafts & ~(q_child > 0),
                      lambda at: f"tokens[{at[0]}, {at[1]}] = {_c_number(tokens[at[0], at[1]])} has q = 0 under "
                                 f"draft_probs[{at[0]}, {_c_number(parents[at[0], at[1]])}] (it could not have been "
                                 "drawn)")]
    if not replacement:
        # [B, c, e]: node e < c is a sibling of c with its token (the C++ kernel's loop order: c, then e).
        same = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (tokens.unsqueeze(2) == tokens.unsqueeze(1))
        earlier = index.unsqueeze(1) > index.unsqueeze(0)
        pairs = same & drafts.unsqueeze(2) & drafts.unsqueeze(1) & earlier
        checks.append(_where(pairs, lambda at: f"nodes {at[2]} and {at[1]} of request {at[0]} are siblings with "
                                               f"the same token {_c_number(tokens[at[0], at[1]])} although drawn "
                                               "without replacement"))
    return checks


@torch.library.register_fake("specops::tree_verify")
def _tree_verify_fake(target_logits, tokens, parents, draft_probs, num_nodes, replacement, temperature, top_k,
                      top_p, seed, offset, validate=True, scheme="recursive"):
    check_tree_verify(target_logits, tokens, parents, draft_probs, num_nodes, replacement, temperature, top_k, top_p,
                      seed, offset, False, scheme)
    batch, nodes, _ = target_logits.shape
    return (target_logits.new_empty((batch, nodes), dtype=torch.int64),
            target_logits.new_empty((batch, nodes), dtype=torch.int64),
            target_logits.new_empty((batch,), dtype=torch.int64))


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
            accelerators it costs one host sync in the op's contract. With False no kernel reads out of bounds, but
            bad values give unspecified results.

    Returns:
        probs: [N, target_vocab] float32, q in target ids (each row sums to 1).
        tokens: [N] int64, the sampled drafts in target ids.
        draft_tokens: [N] int64, the same drafts in drafter ids (what the drafter reads next).

    Randomness: uniform(seed, offset, position 0, stream 2) of the Philox generator chain_verify uses
    (streams 0 and 1), so a draft and its verification at the same offset draw independent numbers.
    """
    op = "vocab_project"
    draft_logits = _tensor(op, "draft_logits", draft_logits)
    rows, = _sizes(draft_logits, 1)
    temperature, top_k, top_p, seeds = _sampling_rows(op, rows, draft_logits.device, temperature, top_k, top_p,
                                                      seed, offset)
    return torch.ops.specops.vocab_project(draft_logits, _tensor(op, "target_ids", target_ids),
                                           _int(op, "target_vocab", target_vocab), temperature, top_k, top_p, seeds,
                                           offset, validate)


def check_vocab_project(draft_logits, target_ids, target_vocab, temperature, top_k, top_p, seed, offset,
                        validate=True) -> None:
    """vocab_project's contract where its kernel cannot check: the C++ kernel's checks and messages
    (check_chain_verify says more)."""
    op = "vocab_project"
    _require(draft_logits.dim() == 2, op, "draft_logits must be an [N, V_d] tensor")
    _check_logit_dtype(op, "draft_logits", draft_logits)
    rows, draft_vocab = draft_logits.shape
    _require(draft_vocab >= 1, op, "draft_logits has no columns")
    _require(target_ids.dim() == 1 and target_ids.shape[0] == draft_vocab, op,
             f"target_ids must be [V_d] = [{draft_vocab}] to match draft_logits")
    _require(target_ids.dtype == torch.int64, op, "target_ids must be int64", TypeError)
    _require(target_vocab >= 1, op, f"target_vocab must be an int >= 1, got {target_vocab}")
    _require(draft_vocab < 2**31 and target_vocab < 2**31, op,
             "vocabularies of 2**31 tokens or more are not supported")
    _check_per_row(op, (top_k, seed), rows, torch.int64, "top_k and seed must be [N] int64")
    _check_per_row(op, (temperature, top_p), rows, torch.float32, "temperature and top_p must be [N] float32")
    _require(offset >= 0, op, "offset must be >= 0")
    _check_devices(op, "draft_logits", draft_logits.device, {"target_ids": target_ids, "temperature": temperature,
                                                             "top_k": top_k, "top_p": top_p, "seed": seed})
    if not validate:
        return
    # The first bad drafter id v, as the kernel scans them: out of range, or a target id an earlier one took.
    index = torch.arange(draft_vocab, device=target_ids.device)
    in_range = (target_ids >= 0) & (target_ids < target_vocab)
    slot = torch.where(in_range, target_ids, target_vocab)
    first = torch.full((target_vocab + 1,), draft_vocab, dtype=torch.int64, device=target_ids.device)
    first = first.scatter_reduce(0, slot, index, "amin")
    repeated = in_range & (first[slot] < index)
    bad_id = (~in_range & (target_ids != -1)) | repeated

    def id_message(at: list[int]) -> str:
        v, target = at[0], int(target_ids[at[0]])
        if not repeated[v]:
            return f"target_ids[{v}] = {target} must be -1 or in [0, {target_vocab})"
        return (f"target_ids maps two drafter ids to the same target id (drafter ids {int(first[target])} and "
                f"{v} to target id {target})")
    x = draft_logits.float()
    nan_rows = _logit_row_checks(op, "draft_logits", x, no_finite=None)[0]
    _raise_first(op, [*_sampling_checks(temperature, top_k, top_p), _where(bad_id, id_message), nan_rows,
                      _where(~torch.where(in_range, x, float("-inf")).gt(float("-inf")).any(-1),
                             lambda at: f"draft_logits[{at[0]}] has no finite logit inside the intersection "
                                        "(target_ids >= 0)")])


@torch.library.register_fake("specops::vocab_project")
def _vocab_project_fake(draft_logits, target_ids, target_vocab, temperature, top_k, top_p, seed, offset,
                        validate=True):
    check_vocab_project(draft_logits, target_ids, target_vocab, temperature, top_k, top_p, seed, offset, False)
    rows = draft_logits.shape[0]
    probs = draft_logits.new_empty((rows, target_vocab), dtype=torch.float32)
    tokens = draft_logits.new_empty((rows,), dtype=torch.int64)
    draft_tokens = draft_logits.new_empty((rows,), dtype=torch.int64)
    return probs, tokens, draft_tokens
