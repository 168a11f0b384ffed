"""Adversarial inputs for every op of `specops.ops`: each case gives the correct (or documented) result
or raises ValueError / TypeError / RuntimeError with a clear message; none may kill the process.

The cases that reach a kernel (empty batches, V = 1, K = 0, NaN and inf in inputs, masked or hidden
positions holding garbage, unchecked ids and parents, extreme seeds and temperatures, non-contiguous
inputs) run in child processes, one for the C++ kernels (the wrappers on CPU tensors) and one for the
Triton kernels (their launchers on the wrappers' normalized arguments, interpreted on CPU without a
GPU): each child prints one line per case, so a crash (a signal, an abort) fails that case alone and
the rest run in a fresh child. Argument checks run in-process: the op's (the C++ kernel's on CPU, which
raises before it computes anything) and the few a wrapper makes itself (an argument of the wrong kind, a
number that int64 or float cannot hold).

Expected results come from `specops.reference` (same seeds, same tokens), from the NaN-free input (a
hidden position must not change anything) or from the documented rule (greedy at T = 1e-45, NaN rows).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import pytest
import torch
from _triton import TRITON_DEVICE, triton, triton_launcher

from specops import ops, reference
from specops.ops._checks import _sampling_rows
from specops.quantization import pack

NAN, INF = float("nan"), float("inf")
SEEDS = [0, -1, 2**63 - 1]
TEMPERATURES = [1e-45, 1e30]
# The Triton kernels run where there is a GPU, or in the interpreter (conftest.py sets it without one).
TRITON_RUNS = triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")

# name -> (backend, case); a case returns nothing and raises AssertionError where it fails.
CASES: dict = {}


def case(*backends: str):
    """Register a case function `fn(backend)` once per backend ("cpp", "triton")."""
    def register(fn):
        for backend in backends:
            CASES[f"{fn.__name__}[{backend}]"] = (backend, functools.partial(fn, backend))
        return fn
    return register


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def moved(args):
    """Tensors to the Triton device (the interpreter's is the CPU), other arguments as they are."""
    return [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


def cpu(result):
    return tuple(t.cpu() for t in result) if isinstance(result, (tuple, list)) else result.cpu()


def sampling(op: str, rows: int, temperature, top_k, top_p, seed, offset) -> tuple:
    """The per-row sampling arguments as the wrappers normalize them."""
    return _sampling_rows(op, rows, torch.device("cpu"), temperature, top_k, top_p, seed, offset)


def equal(a, b) -> bool:
    """Tensors (or tuples of them) equal, NaN where the other has NaN."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(torch.isnan(a), torch.isnan(b)) and \
        torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def close(a, b, tol=1e-5) -> bool:
    """Within tol relative to b (plus tol absolute), NaN exactly where b has NaN."""
    return a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)) and \
        bool(((torch.nan_to_num(a) - torch.nan_to_num(b)).abs() <= tol * (1 + b.nan_to_num().abs())).all())


# ---- chain_verify ----

def chain(backend, logits, drafts, probs=None, num_draft=None, temperature=1.0, top_k=0, top_p=1.0, seed=0,
          offset=0, validate=True):
    if backend == "cpp":
        return ops.chain_verify(logits, drafts, probs, num_draft=num_draft, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, offset=offset, validate=validate)
    batch, k1, _ = logits.shape
    num_draft = torch.full((batch,), k1 - 1) if num_draft is None else num_draft
    rows = sampling("chain_verify", batch, temperature, top_k, top_p, seed, offset)
    args = (logits, drafts, probs, num_draft, *rows, offset)
    if backend == "reference":
        return reference.chain_verify(*args)
    return cpu(triton_launcher("chain_verify")(*moved(args), validate))


def _chain_case(batch=2, k=3, vocab=6, seed=0):
    logits = torch.randn(batch, k + 1, vocab, generator=gen(seed))
    drafts = torch.randint(0, vocab, (batch, k), generator=gen(seed + 1))
    drafts[:, 0] = logits[:, 0].argmax(-1)  # one accepted draft at least under greedy rows
    return logits, drafts


@case("cpp", "triton")
def chain_verify_empty_batch(backend):
    out, accepted = chain(backend, torch.randn(0, 3, 5), torch.zeros(0, 2, dtype=torch.int64))
    assert out.shape == (0, 3) and accepted.shape == (0,)


@case("cpp", "triton")
def chain_verify_one_token_vocabulary(backend):
    logits = torch.randn(2, 4, 1, generator=gen(0))
    drafts = torch.zeros(2, 3, dtype=torch.int64)
    for probs in (None, torch.ones(2, 3, 1)):
        out, accepted = chain(backend, logits, drafts, probs)
        assert torch.equal(out, torch.zeros(2, 4, dtype=torch.int64))
        assert torch.equal(accepted, torch.tensor([3, 3]))


@case("cpp", "triton")
def chain_verify_no_drafts(backend):
    logits = torch.randn(3, 1, 7, generator=gen(1))
    got = chain(backend, logits, torch.zeros(3, 0, dtype=torch.int64), seed=5)
    assert equal(got, chain("reference", logits, torch.zeros(3, 0, dtype=torch.int64), seed=5))
    assert torch.equal(got[1], torch.zeros(3, dtype=torch.int64))


@case("cpp", "triton")
def chain_verify_extreme_seeds_and_temperatures(backend):
    logits, drafts = _chain_case()
    probs = torch.softmax(torch.randn(2, 3, 6, generator=gen(2)), -1)
    for seed in SEEDS + [2**70]:  # an int seed of any size is taken mod 2**64
        for temperature in TEMPERATURES:
            for p in (None, probs):
                kwargs = dict(temperature=temperature, seed=seed, offset=2**63 - 1)
                got = chain(backend, logits, drafts, p, **kwargs)
                want = chain("reference", logits, drafts, p, **kwargs)
                assert equal(got, want), (seed, temperature)


@case("cpp", "triton")
def chain_verify_underflowing_temperature_is_greedy(backend):
    """Every logit / 1e-45 is -inf: the T -> 0 limit, the argmax, not token 0."""
    logits = -(torch.rand(2, 3, 6, generator=gen(3)) + 0.5)
    drafts = logits[:, :2].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % 6
    got = chain(backend, logits, drafts, temperature=1e-45)
    assert equal(got, chain(backend, logits, drafts, temperature=0.0))
    assert torch.equal(got[0][0], logits[0].argmax(-1)) and int(got[0][1, 1]) == int(logits[1, 1].argmax())


@case("cpp", "triton")
def chain_verify_nan_in_rows_past_num_draft(backend):
    """Rows past a request's drafts are not read: NaN there changes nothing (validate=False; with
    validate=True the C++ kernel checks every value, as documented)."""
    logits, drafts = _chain_case()
    num_draft = torch.tensor([1, 3])
    clean = chain(backend, logits, drafts, num_draft=num_draft, seed=7, validate=False)
    dirty = logits.clone()
    dirty[0, 2:] = NAN
    assert equal(chain(backend, dirty, drafts, num_draft=num_draft, seed=7, validate=False), clean)
    if backend == "cpp":
        with pytest.raises(ValueError, match="contains NaN or \\+inf"):
            chain(backend, dirty, drafts, num_draft=num_draft, seed=7)


def well_formed_or_raises(call, match: str, check) -> None:
    """`call()` either raises ValueError matching `match` or returns what passes `check`."""
    try:
        result = call()
    except ValueError as error:
        assert re.search(match, str(error)), str(error)
        return
    check(result)


@case("cpp", "triton")
def chain_verify_unchecked_ids(backend):
    """Draft ids outside [0, V) with validate=False: no read out of bounds; the C++ kernel still rejects
    the ids it reads, the Triton kernel rejects such drafts (p = 0)."""
    logits, drafts = _chain_case()
    drafts[0, 1], drafts[1, 0] = 1000, -7

    def check(result):
        out, accepted = result
        assert ((out >= -1) & (out < 6)).all() and ((accepted >= 0) & (accepted <= 3)).all()
    well_formed_or_raises(lambda: chain(backend, logits, drafts, validate=False),
                          r"draft_tokens\[\d, \d\] = (1000|-7) is outside the vocabulary", check)
    if backend == "cpp":
        with pytest.raises(ValueError, match="outside the vocabulary"):
            chain(backend, logits, drafts)


@case("cpp")
def chain_verify_non_contiguous(backend):
    logits, drafts = _chain_case()
    strided = logits.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.zeros(2, 6, dtype=torch.int64)
    wide[:, ::2] = drafts
    assert equal(chain(backend, strided, wide[:, ::2], seed=3), chain(backend, logits, drafts, seed=3))


# ---- tree_verify ----

def tree(backend, logits, tokens, parents, probs=None, num_nodes=None, replacement=False, temperature=1.0,
         top_k=0, top_p=1.0, seed=0, offset=0, validate=True):
    if backend == "cpp":
        return ops.tree_verify(logits, tokens, parents, probs, num_nodes=num_nodes, replacement=replacement,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset,
                               validate=validate)
    batch, nodes, _ = logits.shape
    num_nodes = torch.full((batch,), nodes) if num_nodes is None else num_nodes
    args = (logits, tokens, parents, probs, num_nodes, replacement,
            *sampling("tree_verify", batch, temperature, top_k, top_p, seed, offset), offset)
    if backend == "reference":
        return reference.tree_verify(*args)
    return cpu(triton_launcher("tree_verify")(*moved(args), validate))


def _tree_case(vocab=6, seed=0):
    """Two requests of 5 nodes: a root with two children, one of which has two more."""
    logits = torch.randn(2, 5, vocab, generator=gen(seed))
    parents = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 2, 3]])
    tokens = torch.tensor([[0, 1, 2, 3, 4], [0, 5, 4, 3, 2]]) % vocab
    return logits, tokens, parents


@case("cpp", "triton")
def tree_verify_empty_batch(backend):
    empty = torch.zeros(0, 3, dtype=torch.int64)
    out = tree(backend, torch.randn(0, 3, 4), empty, empty)
    assert [t.shape for t in out] == [(0, 3), (0, 3), (0,)]


@case("cpp", "triton")
def tree_verify_one_token_vocabulary_and_root_only(backend):
    logits, _, parents = _tree_case(vocab=1)
    tokens = torch.zeros(2, 5, dtype=torch.int64)
    out, nodes, accepted = tree(backend, logits, tokens, parents, seed=3)
    assert equal((out, nodes, accepted), tree("reference", logits, tokens, parents, seed=3))
    assert (out[:, :1] == 0).all() and (accepted >= 1).all()
    root = tree(backend, logits[:, :1], tokens[:, :1], parents[:, :1], seed=4)  # N = 1: no drafts (K = 0)
    assert equal(root, tree("reference", logits[:, :1], tokens[:, :1], parents[:, :1], seed=4))


@case("cpp", "triton")
def tree_verify_extreme_seeds_and_temperatures(backend):
    logits, tokens, parents = _tree_case()
    for seed in SEEDS:
        for temperature in TEMPERATURES:
            kwargs = dict(temperature=temperature, seed=seed, offset=2**63 - 1)
            got = tree(backend, logits, tokens, parents, **kwargs)
            want = tree("reference", logits, tokens, parents, **kwargs)
            assert equal(got, want), (seed, temperature)


@case("cpp", "triton")
def tree_verify_underflowing_temperature_is_greedy(backend):
    logits, tokens, parents = _tree_case()
    logits = -(logits.abs() + 0.5)
    tokens[0, 1] = logits[0, 0].argmax()
    got = tree(backend, logits, tokens, parents, temperature=1e-45)
    assert equal(got, tree(backend, logits, tokens, parents, temperature=0.0))
    assert int(got[0][0, 0]) == int(logits[0, 0].argmax()) and int(got[0][1, 0]) == int(logits[1, 0].argmax())


@case("cpp", "triton")
def tree_verify_nan_in_nodes_past_num_nodes(backend):
    logits, tokens, parents = _tree_case()
    num_nodes = torch.tensor([3, 5])
    clean = tree(backend, logits, tokens, parents, num_nodes=num_nodes, seed=2)
    dirty = logits.clone()
    dirty[0, 3:] = NAN
    tokens = tokens.clone()
    tokens[0, 3:], parents = -5, parents.clone()
    parents[0, 3:] = 99  # padding nodes hold anything
    assert equal(tree(backend, dirty, tokens, parents, num_nodes=num_nodes, seed=2), clean)


@case("cpp", "triton")
def tree_verify_parents_not_a_tree(backend):
    """Parents after their child, self-loops, negative or past N, tokens out of range: ValueError with
    validation (C++), and without it no read out of bounds and a well-formed output."""
    logits, tokens, parents = _tree_case()
    for bad_parents, bad_tokens in (([0, 2, 0, 1, 1], None), ([0, 0, 2, 1, 1], None),
                                    ([0, 0, -3, 1, 40], None), (None, [0, 9, -1, 3, 4])):
        p, t = parents.clone(), tokens.clone()
        if bad_parents is not None:
            p[0] = torch.tensor(bad_parents)
        if bad_tokens is not None:
            t[0] = torch.tensor(bad_tokens)
        message = r"parents\[0, \d\] = -?\d+ must be in|tokens\[0, \d\] = -?\d+ is outside the vocabulary"

        def check(result):
            out, nodes, accepted = result
            assert ((out >= -1) & (out < 6)).all() and ((nodes >= -1) & (nodes < 5)).all()
            assert ((accepted >= 0) & (accepted < 5)).all()
        well_formed_or_raises(functools.partial(tree, backend, logits, t, p, validate=False), message, check)
        if backend == "cpp":
            with pytest.raises(ValueError, match=message):
                tree(backend, logits, t, p)


@case("cpp")
def tree_verify_non_contiguous(backend):
    logits, tokens, parents = _tree_case()
    probs = torch.softmax(torch.randn(2, 5, 6, generator=gen(1)), -1)
    tokens[:, 1:] = torch.tensor([[1, 2, 3, 4], [5, 4, 3, 2]])  # distinct siblings: drawable from probs
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (logits, probs)]
    wide = torch.stack([tokens, parents], -1)  # [2, 5, 2]: tokens and parents as strided views
    got = tree(backend, strided[0], wide[..., 0], wide[..., 1], strided[1], seed=6)
    assert equal(got, tree(backend, logits, tokens, parents, probs, seed=6))


# ---- sample_without_replacement ----

def swr(backend, logits, num_samples, temperature=1.0, top_k=0, top_p=1.0, seed=0, offset=0, validate=True):
    if backend == "cpp":
        return ops.sample_without_replacement(logits, num_samples, temperature=temperature, top_k=top_k,
                                              top_p=top_p, seed=seed, offset=offset, validate=validate)
    args = (logits, num_samples, *sampling("sample_without_replacement", logits.shape[0], temperature, top_k,
                                           top_p, seed, offset), offset)
    if backend == "reference":
        return reference.sample_without_replacement(*args)
    return cpu(triton_launcher("sample_without_replacement")(*moved(args), validate))


@case("cpp", "triton")
def sample_without_replacement_edges(backend):
    tokens, probs = swr(backend, torch.randn(0, 5), 2)
    assert tokens.shape == (0, 2) and probs.shape == (0, 5)
    tokens, probs = swr(backend, torch.randn(3, 1), 1, seed=-1)  # V = 1
    assert torch.equal(tokens, torch.zeros(3, 1, dtype=torch.int64)) and torch.equal(probs, torch.ones(3, 1))
    one = torch.full((2, 6), -INF)
    one[:, 4] = 0.0  # a single possible token: the other draws are -1
    tokens, _ = swr(backend, one, 3)
    assert torch.equal(tokens, torch.tensor([[4, -1, -1], [4, -1, -1]]))


@case("cpp", "triton")
def sample_without_replacement_extreme_seeds_and_temperatures(backend):
    logits = torch.randn(2, 8, generator=gen(4))
    for seed in SEEDS:
        for temperature in TEMPERATURES:
            got = swr(backend, logits, 3, temperature=temperature, seed=seed, offset=2**63 - 1)
            want = swr("reference", logits, 3, temperature=temperature, seed=seed, offset=2**63 - 1)
            assert torch.equal(got[0], want[0]) and close(got[1], want[1]), (seed, temperature)
    negative = -(logits.abs() + 0.5)
    tokens, probs = swr(backend, negative, 3, temperature=1e-45)  # greedy: the 3 largest logits, q one-hot
    assert torch.equal(tokens, negative.topk(3).indices) and torch.equal(probs.sum(-1), torch.ones(2))


@case("cpp", "triton")
def sample_without_replacement_nan(backend):
    logits = torch.randn(2, 8, generator=gen(5))
    logits[1, 3] = NAN
    if backend == "cpp":  # the C++ kernel reads every row, so it always checks
        with pytest.raises(ValueError, match=r"logits\[1\] contains NaN"):
            swr(backend, logits, 3, validate=False)
    else:  # unchecked: garbage in, but no read out of bounds and well-formed tokens
        tokens, _ = swr(backend, logits, 3, validate=False)
        assert ((tokens >= -1) & (tokens < 8)).all()


@case("cpp")
def sample_without_replacement_non_contiguous(backend):
    logits = torch.randn(8, 3, generator=gen(6)).t()
    assert equal(swr(backend, logits, 2, seed=1), swr(backend, logits.contiguous(), 2, seed=1))


# ---- stochastic_beam_step ----

def beam(backend, logits, log_probs, scores, width, temperature=1.0, top_k=0, top_p=1.0, seed=0, offset=0,
         validate=True):
    if backend == "cpp":
        return ops.stochastic_beam_step(logits, log_probs, scores, width, temperature=temperature,
                                        top_k=top_k, top_p=top_p, seed=seed, offset=offset, validate=validate)
    args = (logits, log_probs, scores, width, *sampling("stochastic_beam_step", logits.shape[0], temperature,
                                                        top_k, top_p, seed, offset), offset)
    if backend == "reference":
        return reference.stochastic_beam_step(*args)
    return cpu(triton_launcher("stochastic_beam_step")(*moved(args), validate))


def _beam_case(vocab=7):
    logits = torch.randn(2, 3, vocab, generator=gen(7))
    log_probs = torch.tensor([[0.0, -1.0, -INF], [-0.5, -INF, -2.0]])
    return logits, log_probs, log_probs.clone()


def _beams_agree(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got[:2], want[:2])) and \
        all(close(g, w, 1e-4) for g, w in zip(got[2:], want[2:]))


@case("cpp", "triton")
def stochastic_beam_step_edges(backend):
    out = beam(backend, torch.randn(0, 2, 5), torch.zeros(0, 2), torch.zeros(0, 2), 2)
    assert [t.shape for t in out] == [(0, 2), (0, 2), (0, 2), (0, 2), (0, 2, 5)]
    logits = torch.randn(2, 2, 1, generator=gen(8))  # V = 1: one child per live beam, the best kept
    scores = torch.tensor([[0.0, -1.0]] * 2)
    parents, tokens, _, _, probs = beam(backend, logits, torch.zeros(2, 2), scores, 1)
    zeros = torch.zeros(2, 1, dtype=torch.int64)
    assert torch.equal(tokens, zeros) and torch.equal(parents, zeros)
    assert torch.equal(probs, torch.ones(2, 2, 1))


@case("cpp", "triton")
def stochastic_beam_step_dead_beams_hold_garbage(backend):
    logits, log_probs, scores = _beam_case()
    clean = beam(backend, logits, log_probs, scores, 3, seed=9)
    dirty = logits.clone()
    dirty[0, 2], dirty[1, 1] = NAN, INF  # dead beams: not read
    assert _beams_agree(beam(backend, dirty, log_probs, scores, 3, seed=9), clean)


@case("cpp", "triton")
def stochastic_beam_step_extreme_seeds_and_temperatures(backend):
    logits, log_probs, scores = _beam_case()
    for seed in SEEDS:
        for temperature in TEMPERATURES:
            kwargs = dict(temperature=temperature, seed=seed, offset=2**63 - 1)
            got = beam(backend, logits, log_probs, scores, 3, **kwargs)
            want = beam("reference", logits, log_probs, scores, 3, **kwargs)
            assert _beams_agree(got, want), (seed, temperature)
    negative = -(logits.abs() + 0.5)  # logits / 1e-45 all -inf: deterministic beam search, children kept
    got = beam(backend, negative, log_probs, scores, 3, temperature=1e-45)
    assert (got[1] >= 0).all()
    assert _beams_agree(got, beam(backend, negative, log_probs, scores, 3, temperature=0.0))


@case("cpp")
def stochastic_beam_step_non_contiguous(backend):
    logits, log_probs, scores = _beam_case()
    strided = logits.transpose(1, 2).contiguous().transpose(1, 2)
    pairs = torch.stack([log_probs, scores], -1)
    assert _beams_agree(beam(backend, strided, pairs[..., 0], pairs[..., 1], 3, seed=2),
                        beam(backend, logits, log_probs, scores, 3, seed=2))


# ---- ngram_match ----

def ngram(backend, tokens, lengths=None, validate=True, **kwargs):
    if backend == "cpp":
        return ops.ngram_match(tokens, lengths, validate=validate, **kwargs)
    lengths = torch.full((tokens.shape[0],), tokens.shape[1]) if lengths is None else lengths
    k = dict(min_ngram=1, max_ngram=3, num_candidates=1, width=4) | kwargs
    return cpu(triton_launcher("ngram_match")(*moved((tokens, lengths)), k["min_ngram"], k["max_ngram"],
                                              k["num_candidates"], k["width"], validate))


@case("cpp", "triton")
def ngram_match_edges(backend):
    candidates, counts, levels = ngram(backend, torch.zeros(0, 5, dtype=torch.int64), num_candidates=2)
    assert candidates.shape == (0, 2, 4) and counts.shape == levels.shape == (0, 2)
    candidates, counts, _ = ngram(backend, torch.zeros(2, 0, dtype=torch.int64))  # L = 0
    assert (candidates == -1).all() and (counts == 0).all()
    tokens = torch.tensor([[1, 2, 3, 1, 2, -5, -9], [4, 4, 4, 4, 4, 4, 4]])
    lengths = torch.tensor([5, 7])  # negative ids past a context are not read
    got = ngram(backend, tokens, lengths, num_candidates=2, width=3)
    clean = tokens.clone()
    clean[0, 5:] = 0
    assert equal(got, ngram(backend, clean, lengths, num_candidates=2, width=3))
    assert torch.equal(got[0][0, 0], torch.tensor([3, 1, 2]))


@case("cpp", "triton")
def ngram_match_unchecked_values(backend):
    """A negative id inside a context, lengths outside [0, L]: the C++ kernel always checks lengths and,
    with validate, tokens; the Triton kernel clamps lengths. No read out of bounds either way."""
    tokens = torch.tensor([[1, 2, -3, 1, 2], [0, 1, 0, 1, 0]])
    for lengths in [torch.tensor([5, 5])] + ([torch.tensor([-4, 99])] if backend == "triton" else []):
        candidates, counts, _ = ngram(backend, tokens, lengths, validate=False)
        assert (candidates >= -3).all() and (counts >= 0).all()
    if backend == "cpp":
        with pytest.raises(ValueError, match=r"tokens\[0, 2\] = -3 is negative"):
            ngram(backend, tokens)
        with pytest.raises(ValueError, match=r"lengths\[0\] = -4"):
            ngram(backend, tokens, torch.tensor([-4, 99]), validate=False)


@case("cpp")
def ngram_match_non_contiguous_and_int32(backend):
    tokens = torch.randint(0, 3, (12, 2), generator=gen(10)).t()
    want = ngram(backend, tokens.contiguous(), num_candidates=3)
    assert equal(ngram(backend, tokens, num_candidates=3), want)
    assert equal(ngram(backend, tokens.int(), num_candidates=3), want)


# ---- vocab_project ----

def project(backend, logits, target_ids, target_vocab, temperature=1.0, top_k=0, top_p=1.0, seed=0, offset=0,
            validate=True):
    if backend == "cpp":
        return ops.vocab_project(logits, target_ids, target_vocab, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seed, offset=offset, validate=validate)
    args = (logits, target_ids, target_vocab, *sampling("vocab_project", logits.shape[0], temperature, top_k,
                                                        top_p, seed, offset), offset)
    if backend == "reference":
        return reference.vocab_project(*args)
    return cpu(triton_launcher("vocab_project")(*moved(args), validate))


def _projection():
    logits = torch.randn(2, 6, generator=gen(11))
    return logits, torch.tensor([3, -1, 0, 5, -1, 1])


@case("cpp", "triton")
def vocab_project_edges(backend):
    probs, tokens, drafts = project(backend, torch.randn(0, 4), torch.arange(4), 4)
    assert probs.shape == (0, 4) and tokens.shape == drafts.shape == (0,)
    probs, tokens, drafts = project(backend, torch.randn(2, 1), torch.zeros(1, dtype=torch.int64), 1, seed=-1)
    assert torch.equal(probs, torch.ones(2, 1)) and (tokens == 0).all() and (drafts == 0).all()


@case("cpp", "triton")
def vocab_project_garbage_outside_the_intersection(backend):
    logits, ids = _projection()
    clean = project(backend, logits, ids, 7, seed=4, validate=False)
    dirty = logits.clone()
    dirty[:, 1], dirty[0, 4] = NAN, INF  # unmapped drafter ids: never read without validation
    assert equal(project(backend, dirty, ids, 7, seed=4, validate=False), clean)
    if backend == "cpp":
        with pytest.raises(ValueError, match="contains NaN or \\+inf"):
            project(backend, dirty, ids, 7)


@case("cpp", "triton")
def vocab_project_extreme_seeds_and_temperatures(backend):
    logits, ids = _projection()
    for seed in SEEDS:
        for temperature in TEMPERATURES:
            got = project(backend, logits, ids, 7, temperature=temperature, seed=seed, offset=2**63 - 1)
            want = project("reference", logits, ids, 7, temperature=temperature, seed=seed, offset=2**63 - 1)
            assert close(got[0], want[0]) and equal(got[1:], want[1:]), (seed, temperature)
    negative = -(logits.abs() + 0.5)
    _, tokens, _ = project(backend, negative, ids, 7, temperature=1e-45)
    inside = torch.where(ids >= 0, negative, -INF)
    assert torch.equal(tokens, ids[inside.argmax(-1)])


@case("cpp", "triton")
def vocab_project_unchecked_ids(backend):
    logits, _ = _projection()
    for ids in (torch.tensor([3, 3, 0, 50, -9, 1]), torch.tensor([-1, -1, -1, 2, -1, -1])):
        _, tokens, drafts = project(backend, logits, ids, 7, validate=False)
        assert ((tokens >= -1) & (tokens < 7)).all() and ((drafts >= 0) & (drafts < 6)).all()
        if backend == "cpp" and ids[0] == 3:
            with pytest.raises(ValueError, match="target_ids"):
                project(backend, logits, ids, 7)


@case("cpp")
def vocab_project_non_contiguous(backend):
    logits, ids = _projection()
    strided = logits.t().contiguous().t()
    wide = torch.stack([ids, ids], -1)
    assert equal(project(backend, strided, wide[:, 0], 7, seed=8), project(backend, logits, ids, 7, seed=8))


# ---- ensemble_logits ----

def ensemble(backend, members, weights=(0.5, 0.5), mode="weighted", mu=0.5, alpha=0.0, validate=True):
    if backend == "cpp":
        return ops.ensemble_logits(members, list(weights) if mode == "weighted" else None, mode=mode, mu=mu,
                                   alpha=alpha, validate=validate)
    w = torch.tensor(weights if mode == "weighted" else [], dtype=torch.float32)
    return cpu(triton_launcher("ensemble_logits")(moved(members), *moved([w]), int(mode == "contrastive"), mu,
                                                  alpha))


@case("cpp", "triton")
def ensemble_logits_edges(backend):
    assert ensemble(backend, [torch.randn(0, 5), torch.randn(0, 5)]).shape == (0, 5)
    one = [torch.randn(2, 3, 1, generator=gen(12)), torch.randn(2, 3, 1, generator=gen(13))]  # V = 1
    assert close(ensemble(backend, one), torch.zeros(2, 3, 1))
    assert close(ensemble(backend, one, mode="contrastive"), torch.zeros(2, 3, 1))
    members = [torch.randn(6, 3, generator=gen(14)).t(), torch.randn(3, 6, generator=gen(15))]  # one strided
    assert close(ensemble(backend, members), ensemble(backend, [m.contiguous() for m in members]))


@case("cpp", "triton")
def ensemble_logits_nan(backend):
    members = [torch.randn(2, 5, generator=gen(16)), torch.randn(2, 5, generator=gen(17))]
    members[1][0, 2] = NAN
    if backend == "cpp":  # the C++ kernel always checks
        with pytest.raises(ValueError, match="member 1, row 0 contains NaN"):
            ensemble(backend, members, validate=False)
    else:
        assert ensemble(backend, members).shape == (2, 5)


# ---- skinny_linear, quantized_linear, int8_linear ----

def linear(backend, x, weight, bias=None, scales=None, mins=None):
    quantized = weight.dtype != torch.float32
    if backend == "cpp":
        if quantized:
            return ops.quantized_linear(x, weight, scales, mins, bias)
        return ops.skinny_linear(x, weight, bias)
    if quantized:
        return cpu(triton_launcher("quantized_linear")(*moved((x, weight, scales, mins, bias))))
    return cpu(triton_launcher("skinny_linear")(*moved((x, weight, bias))))


@case("cpp", "triton")
def linear_edges_and_nan_rows(backend):
    weight = torch.randn(5, 64, generator=gen(18))
    bias = torch.randn(5, generator=gen(19))
    int8 = pack(weight, "int8")
    for w, extra in ((weight, {}), (int8[0], dict(scales=int8[1]))):
        assert linear(backend, torch.randn(0, 64), w, bias, **extra).shape == (0, 5)
        x = torch.randn(3, 64, generator=gen(20))
        clean = linear(backend, x, w, bias, **extra)
        x[1, 7] = NAN  # a NaN row makes its output row NaN, and only it
        out = linear(backend, x, w, bias, **extra)
        assert torch.isnan(out[1]).all() and equal(out[[0, 2]], clean[[0, 2]])
    strided = torch.randn(64, 3, generator=gen(21)).t()
    want = torch.nn.functional.linear(strided, weight, bias)
    assert close(linear(backend, strided, weight, bias), want, 1e-4)
    assert equal(linear(backend, strided, int8[0], scales=int8[1]),
                 linear(backend, strided.contiguous(), int8[0], scales=int8[1]))
    if backend == "cpp":
        no_k = ops.skinny_linear(torch.randn(2, 0), torch.randn(3, 0), bias[:3])  # K = 0: the bias
        assert torch.equal(no_k, bias[:3].expand(2, 3))
        assert ops.skinny_linear(torch.randn(2, 4), torch.randn(0, 4)).shape == (2, 0)


def int8(backend, x, xs, w, ws):
    if backend == "cpp":
        return ops.int8_linear(x, xs, w, ws)
    return cpu(triton_launcher("int8_linear")(*moved((x, xs, w, ws))))


@case("cpp", "triton")
def int8_linear_edges_and_non_finite_scales(backend):
    x = torch.randint(-128, 128, (3, 64), generator=gen(22), dtype=torch.int8)
    w = torch.randint(-128, 128, (5, 64), generator=gen(23), dtype=torch.int8)
    xs, ws = torch.rand(3, generator=gen(24)), torch.rand(5, generator=gen(25))

    def want(x, xs, w, ws):  # the kernels' bits: the exact sum, converted once, times each scale in turn
        return (x.long() @ w.long().T).float() * xs[:, None] * ws[None, :]
    assert int8(backend, x[:0], xs[:0], w, ws).shape == (0, 5)
    assert int8(backend, x, xs, w[:0], ws[:0]).shape == (3, 0)
    signed = torch.tensor([1.0, -1.0, 2.0])  # K = 0: zero sums, scaled (-0.0 in row 1)
    assert equal(int8(backend, x[:, :0], signed, w[:, :0], ws), want(x[:, :0], signed, w[:, :0], ws))
    assert torch.signbit(int8(backend, x[:, :0], signed, w[:, :0], ws)[1]).all()
    # A NaN or inf scale is not checked: it reaches its own row or column only (0 * inf is NaN).
    xs_bad, ws_bad = xs.clone(), ws.clone()
    xs_bad[1], ws_bad[3] = NAN, INF
    x_zero = x.clone()
    x_zero[2] = 0
    got = int8(backend, x_zero, xs_bad, w, ws_bad)
    assert equal(got, want(x_zero, xs_bad, w, ws_bad))
    assert torch.isnan(got[1]).all() and torch.isnan(got[2, 3]) and torch.isinf(got[0, 3])
    strided = torch.randint(-128, 128, (64, 3), generator=gen(26), dtype=torch.int8).t()
    assert equal(int8(backend, strided, xs, w, ws), want(strided, xs, w, ws))
    # The extremes over the longest K that keeps (-128)^2 * K in int32.
    k = 2**17 - 1
    low = torch.full((1, k), -128, dtype=torch.int8)
    assert int8(backend, low, torch.ones(1), low.expand(2, k), torch.ones(2)).tolist() == [[2**31 - 2**14] * 2]


# ---- tree_attention ----

def attention(backend, q, k, v, mask, kv_mask=None, scale=None, window=None, softcap=None, sinks=None,
              validate=True):
    if backend == "cpp":
        return ops.tree_attention(q, k, v, mask, kv_mask=kv_mask, scale=scale, window=window, softcap=softcap,
                                  sinks=sinks, validate=validate)
    batch, _, nodes, dim = q.shape
    kv_mask = torch.ones(batch, k.shape[2] - nodes, dtype=torch.bool) if kv_mask is None else kv_mask
    args = (q, k, v, mask, kv_mask, dim ** -0.5 if scale is None else scale, window or 0, softcap or 0.0,
            None if sinks is None else sinks.float())
    if backend == "reference":
        return reference.tree_attention(*args)
    return cpu(triton_launcher("tree_attention")(*moved(args), validate, block_m=16, block_n=16))


def tree_words(parents: list[list[int]], nodes: int) -> torch.Tensor:
    """[B, N, 1] ancestor words of trees of up to 31 nodes: parents[b][i] < i, -1 for a root; nodes past
    a request's list are padding that sees only itself."""
    out = torch.zeros(len(parents), nodes, 1, dtype=torch.int32)
    for b, row in enumerate(parents):
        for i in range(nodes):
            out[b, i, 0] = (out[b, row[i], 0] if i < len(row) and row[i] >= 0 else 0) | (1 << i)
    return out


def _attention_case(batch=2, heads=4, kv_heads=2, nodes=5, prefix=20, dim=8, seed=0):
    g = gen(seed)
    q = torch.randn(batch, heads, nodes, dim, generator=g)
    k = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=g)
    v = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=g)
    kv_mask = torch.rand(batch, prefix, generator=g) < 0.7
    kv_mask[:, -1] = True
    mask = tree_words([[-1, 0, 0, 1], [-1, 0, 1, 2, 3]], nodes)[:batch]  # request 0: node 4 is padding
    return q, k, v, mask, kv_mask


@case("cpp", "triton")
def tree_attention_empty_batch(backend):
    """The C++ kernel used to divide by B * Hkv here (SIGFPE)."""
    out = attention(backend, torch.randn(0, 2, 3, 4), torch.randn(0, 1, 5, 4), torch.randn(0, 1, 5, 4),
                    torch.zeros(0, 3, 1, dtype=torch.int32))
    assert out.shape == (0, 2, 3, 4)
    assert attention("reference", torch.randn(0, 2, 3, 4), torch.randn(0, 1, 5, 4), torch.randn(0, 1, 5, 4),
                     torch.zeros(0, 3, 1, dtype=torch.int32)).shape == (0, 2, 3, 4)


@case("cpp", "triton")
def tree_attention_hidden_garbage_never_enters(backend):
    """NaN / inf in prefix slots kv_mask hides (as a fresh torch.empty cache may hold), in slots outside a
    window and in a padding node nobody else sees: the other rows equal the clean result."""
    q, k, v, mask, kv_mask = _attention_case()
    for kwargs in (dict(), dict(window=4, softcap=3.0, sinks=torch.randn(4, generator=gen(1)))):
        clean = attention(backend, q, k, v, mask, kv_mask, **kwargs)
        dirty_k, dirty_v = k.clone(), v.clone()
        hidden = ~kv_mask[:, None, :, None].expand(2, 2, 20, 8)
        dirty_k[:, :, :20][hidden], dirty_v[:, :, :20][hidden] = NAN, -INF
        dirty_k[0, :, 24], dirty_v[0, :, 24] = NAN, NAN  # request 0's padding node 4
        if "window" in kwargs:  # request 1's first valid slot is outside every node's window of 4
            first = int(kv_mask[1].nonzero()[0])
            dirty_k[1, :, first], dirty_v[1, :, first] = INF, NAN
        got = attention(backend, q, dirty_k, dirty_v, mask, kv_mask, **kwargs)
        want = attention("reference", q, dirty_k, dirty_v, mask, kv_mask, **kwargs)
        assert torch.isnan(got[0, :, 4]).all() and close(got, want), kwargs  # the padding node sees itself
        keep = torch.ones(2, 4, 5, dtype=torch.bool)
        keep[0, :, 4] = False
        assert close(got[keep], clean[keep]), kwargs
    empty = torch.empty(2, 2, 25, 8).fill_(NAN)  # a cache fresh from torch.empty: its slots past the tree
    empty[:, :, 20:] = k[:, :, 20:]
    none_seen = torch.zeros(2, 20, dtype=torch.bool)
    assert close(attention(backend, q, empty, empty, mask, none_seen),
                 attention("reference", q, k[:, :, 20:].contiguous(), k[:, :, 20:].contiguous(), mask,
                           torch.zeros(2, 0, dtype=torch.bool)))


@case("cpp")
def tree_attention_garbage_across_key_splits(backend):
    """One request and one key/value head over 600 slots: the C++ kernel splits the keys across tasks
    and merges them; garbage in hidden slots (a split's tiles hold other splits' slots too) stays out,
    and a NaN sink still makes its rows NaN."""
    q, k, v, _, kv_mask = _attention_case(batch=1, heads=2, kv_heads=1, prefix=600, seed=3)
    mask = tree_words([[-1, 0, 0, 1, 2]], 5)
    clean = attention(backend, q, k, v, mask, kv_mask, window=300)
    k2, v2 = k.clone(), v.clone()
    k2[0, 0, :600][~kv_mask[0]], v2[0, 0, :600][~kv_mask[0]] = NAN, INF
    k2[0, 0, :100], v2[0, 0, :100] = NAN, NAN  # outside every node's window of 300 tokens
    assert close(attention(backend, q, k2, v2, mask, kv_mask, window=300), clean)
    got = attention(backend, q, k2, v2, mask, kv_mask, window=300, sinks=torch.tensor([NAN, 0.5]))
    assert torch.isnan(got[0, 0]).all() and close(got, attention("reference", q, k2, v2, mask, kv_mask,
                                                                  window=300, sinks=torch.tensor([NAN, 0.5])))


@case("cpp", "triton")
def tree_attention_nan_in_what_is_seen(backend):
    """A NaN query row, sink or seen key makes its rows NaN (not zeros, not finite numbers); a seen NaN
    value shows in its column; the other rows are untouched."""
    q, k, v, mask, kv_mask = _attention_case()
    sinks = torch.randn(4, generator=gen(2))
    clean = attention(backend, q, k, v, mask, kv_mask, sinks=sinks)
    q2, s2, k2, v2 = q.clone(), sinks.clone(), k.clone(), v.clone()
    q2[1, 3, 2, 0] = NAN
    s2[0] = NAN
    k2[1, 0, 20 + 3, 5] = NAN  # request 1's node 3: seen by nodes 3 and 4 of heads 0 and 1
    v2[0, 1, int(kv_mask[0].nonzero()[0]), 6] = NAN  # a valid prefix slot of request 0, kv head 1
    got = attention(backend, q2, k2, v2, mask, kv_mask, sinks=s2)
    nan_rows = torch.zeros(2, 4, 5, dtype=torch.bool)
    nan_rows[:, 0] = True  # head 0's sink
    nan_rows[1, 3, 2] = True  # the query row
    nan_rows[1, :2, 3:] = True  # request 1 is a chain: nodes 3 and 4 see node 3
    assert torch.isnan(got).all(-1)[nan_rows].all()
    other_columns = [0, 1, 2, 3, 4, 5, 7]
    assert torch.isnan(got[0, 2:, :, 6]).all() and not torch.isnan(got[0, 2:, :, other_columns]).any()
    untouched = ~nan_rows
    untouched[0, 2:] = False
    assert close(got[untouched], clean[untouched])
    assert close(got, attention("reference", q2, k2, v2, mask, kv_mask, sinks=s2))


@case("cpp", "triton")
def tree_attention_shapes_and_windows(backend):
    q, k, v, mask, kv_mask = _attention_case()
    for window in (2**62, 2**63 - 1):  # past every position: no window
        assert close(attention(backend, q, k, v, mask, kv_mask, window=window),
                     attention(backend, q, k, v, mask, kv_mask))
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v)]
    assert close(attention(backend, *strided, mask, kv_mask), attention(backend, q, k, v, mask, kv_mask))
    one = attention(backend, q[:, :, :1], k[:, :, 20:21], v[:, :, 20:21], mask[:, :1])  # N = 1, no prefix
    assert close(one, v[:, :, 20:21].repeat_interleave(2, 1))
    bad = mask.clone()
    bad[0, 1, 0] = 0  # a node that does not see itself: unchecked, no crash, finite
    assert torch.isfinite(attention(backend, q, k, v, bad, kv_mask, validate=False)).all()


# ---- llama_layers (CPU only) ----

D_MODEL, HEAD_DIM, INTER = 32, 8, 48


def _llama_args(batch=2, n=2, past=3, heads=4, kv_heads=2):
    g = gen(30)
    norms, linears = [], []
    norms += [torch.rand(D_MODEL, generator=g) + 0.5, torch.rand(D_MODEL, generator=g) + 0.5]
    q_out, kv_out = heads * HEAD_DIM, kv_heads * HEAD_DIM
    for out, inp in ((q_out, D_MODEL), (kv_out, D_MODEL), (kv_out, D_MODEL), (D_MODEL, q_out),
                     (INTER, D_MODEL), (INTER, D_MODEL), (D_MODEL, INTER)):
        linears += [torch.randn(out, inp, generator=g) / inp ** 0.5, None, None, None]
    hidden = torch.randn(batch * n, D_MODEL, generator=g)
    angle = torch.rand(batch, n, HEAD_DIM // 2, generator=g).repeat(1, 1, 2)
    keys = [torch.randn(batch, kv_heads, past + n, HEAD_DIM, generator=g)]
    values = [torch.randn(batch, kv_heads, past + n, HEAD_DIM, generator=g)]
    mask = torch.ones(batch, 1, n, past + n, dtype=torch.bool)
    mask[..., past:] = torch.ones(n, n, dtype=torch.bool).tril()
    return dict(hidden=hidden, cos=angle.cos(), sin=angle.sin(), attn_mask=mask, norms=norms, linears=linears,
                keys=keys, values=values, heads=heads, kv_heads=kv_heads, eps=1e-5, scale=HEAD_DIM ** -0.5)


def llama(args, fn=ops.llama_layers):
    args = dict(args, keys=[t.clone() for t in args["keys"]], values=[t.clone() for t in args["values"]])
    with torch.inference_mode():
        return fn(**args)


@case("cpp")
def llama_layers_edges(backend):
    args = _llama_args()
    empty = dict(args, hidden=torch.randn(0, D_MODEL), cos=args["cos"][:0], sin=args["sin"][:0],
                 attn_mask=args["attn_mask"][:0], keys=[args["keys"][0][:0]], values=[args["values"][0][:0]])
    assert llama(empty).shape == (0, D_MODEL)


@case("cpp")
def llama_layers_hidden_cache_slots_hold_garbage(backend):
    args = _llama_args()
    clean = llama(args)
    keys, values = args["keys"][0].clone(), args["values"][0].clone()
    args["attn_mask"][1, :, :, 1] = False  # request 1 hides cache slot 1 from its rows
    clean = llama(args)
    keys[1, :, 1], values[1, :, 1] = NAN, INF
    dirty = dict(args, keys=[keys], values=[values])
    got = llama(dirty)
    assert equal(got, clean) and close(got, llama(dirty, reference.llama_layers).float())
    seen = dict(dirty, attn_mask=None)  # the same slot seen: the rows of request 1 are NaN, request 0's not
    got = llama(seen)
    assert torch.isnan(got[2:]).all(-1).all() and torch.isfinite(got[:2]).all()
    assert torch.isnan(llama(seen, reference.llama_layers)[2:]).all(-1).all()


@case("cpp")
def llama_layers_non_contiguous(backend):
    args = _llama_args()
    strided = dict(args, hidden=args["hidden"].t().contiguous().t(),
                   cos=args["cos"].transpose(0, 1).contiguous().transpose(0, 1))
    assert equal(llama(strided), llama(args))


@case("cpp")
def llama_layers_nan_row(backend):
    args = _llama_args()
    clean = llama(args)
    args["hidden"] = args["hidden"].clone()
    args["hidden"][0, 3] = NAN  # request 0's first new row; its second row sees it (causal)
    got = llama(args)
    assert torch.isnan(got[:2]).all(-1).all() and equal(got[2:], clean[2:])


# ---- the harness: cases in child processes, one line each ----

def run_cases(names: list[str]) -> None:
    """In a child: run the named cases, printing one line per case (after it ran, so a crash leaves its
    line out)."""
    for name in names:
        try:
            (_ABORT if name == "_abort" else CASES[name][1])()
            outcome = "ok"
        except BaseException as error:  # noqa: BLE001 (reported to the parent, which fails the case)
            outcome = f"{type(error).__name__}: {error}"
        print(f"CASE {name} | {' '.join(outcome.split())}", flush=True)


_ABORT = os.abort  # the harness's own test: a case that kills its process
_CHILD = "import sys; sys.path.insert(0, {path!r}); import test_ops_adversarial as t; t.run_cases({names!r})"


def _run_children(names: list[str]) -> dict[str, str]:
    """Outcomes of the cases, in as few children as crashes allow: where a child dies, its case is
    reported with the return code and the output's tail, and the rest run in a fresh child."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    outcomes: dict[str, str] = {}
    todo = list(names)
    while todo:
        try:
            child = _CHILD.format(path=os.path.dirname(os.path.abspath(__file__)), names=todo)
            # The interpreter's numpy warns on NaN arithmetic: kept out of the tail a crash reports.
            proc = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-c", child],
                                  capture_output=True, text=True, timeout=240, env=env, check=False)
            stdout, code, tail = proc.stdout, proc.returncode, proc.stderr[-1500:]
        except subprocess.TimeoutExpired as error:
            stdout = error.stdout.decode() if isinstance(error.stdout, bytes) else error.stdout or ""
            code, tail = "timeout", ""
        for line in stdout.splitlines():
            if line.startswith("CASE ") and " | " in line:
                name, outcome = line[5:].split(" | ", 1)
                outcomes[name] = outcome
        todo = [n for n in todo if n not in outcomes]
        if todo:  # the child died in todo[0]
            outcomes[todo.pop(0)] = f"the process died (return code {code}): {tail}"
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    runnable = [name for name, (backend, _) in CASES.items() if backend == "cpp" or TRITON_RUNS]
    return _run_children(runnable)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.skipif(
    backend == "triton" and not TRITON_RUNS, reason="needs triton, and a GPU or TRITON_INTERPRET=1"))
    for name, (backend, _) in CASES.items()])
def test_case_in_a_child_process(name, outcomes):
    assert outcomes[name] == "ok", outcomes[name]


@pytest.mark.slow
def test_the_harness_reports_a_crash():
    """A case that kills its process (here an abort) fails alone; the cases after it still run."""
    got = _run_children(["chain_verify_empty_batch[cpp]", "_abort", "ensemble_logits_edges[cpp]"])
    assert got["chain_verify_empty_batch[cpp]"] == "ok" and got["ensemble_logits_edges[cpp]"] == "ok"
    assert got["_abort"].startswith("the process died (return code -6)")


# ---- argument checks (the op's: the C++ kernel's on CPU, its contract's elsewhere; a wrapper refuses only an
# argument of the wrong kind or a number that int64 or float cannot hold): in-process ----

def _logits(*shape):
    return torch.randn(*shape, generator=gen(40))


_LONG = torch.zeros(2, 2, dtype=torch.int64)
BAD_ARGUMENTS = [
    # Integers outside int64 (the dispatcher's "Expected a value of type 'int' ... found type 'int'").
    (lambda: ops.tree_attention(*_attention_case()[:4], window=2**70), ValueError,
     "window must fit int64, got 1180591620717411303424"),
    (lambda: ops.tree_attention(*_attention_case()[:4], window=True), TypeError, "window must be an int, got bool"),
    (lambda: ops.tree_attention(*_attention_case()[:4], scale=2**2000), ValueError,
     f"scale must be a float, got {2**2000}"),
    (lambda: ops.sample_without_replacement(_logits(2, 5), 2**70), ValueError,
     "num_samples must fit int64, got 1180591620717411303424"),
    (lambda: ops.stochastic_beam_step(_logits(2, 1, 5), torch.zeros(2, 1), torch.zeros(2, 1), 2**70),
     ValueError, "beam_width must fit int64, got 1180591620717411303424"),
    (lambda: ops.vocab_project(_logits(2, 4), torch.arange(4), 2**70), ValueError,
     "target_vocab must fit int64, got 1180591620717411303424"),
    (lambda: ops.ngram_match(_LONG, num_candidates=2**70), ValueError,
     r"num_candidates must be >= 1 and < 2\*\*28"),
    (lambda: ops.ngram_match(_LONG, width=2**64), ValueError, r"and < 2\*\*28"),
    (lambda: ops.chain_verify(_logits(2, 3, 5), _LONG, top_k=2**70), ValueError, "top_k must fit int64"),
    (lambda: ops.chain_verify(_logits(2, 3, 5), _LONG, offset=2**64), ValueError,
     "offset must fit int64, got 18446744073709551616"),
    (lambda: ops.tree_verify(_logits(2, 2, 5), _LONG, _LONG, seed=torch.tensor([1.5, 2.0])), ValueError,
     r"num_nodes, top_k and seed must be \[B\] int64"),
    (lambda: llama(dict(_llama_args(), heads=2**70)), ValueError, "heads must fit int64, got 1180591620717411303424"),
    (lambda: llama(dict(_llama_args(), eps=NAN)), ValueError, "eps must be a finite number"),
    # Wrong dtypes.
    (lambda: ops.chain_verify(_logits(2, 3, 5).double(), _LONG), TypeError, "target_logits must be float32"),
    (lambda: ops.chain_verify(_logits(2, 3, 5), _LONG.int()), TypeError, "draft_tokens must be int64"),
    (lambda: ops.tree_verify(_logits(2, 2, 5), _LONG, _LONG.float()), TypeError, "parents must be int64"),
    (lambda: ops.sample_without_replacement(_logits(2, 5).long(), 1), TypeError, "logits must be float32"),
    (lambda: ops.stochastic_beam_step(_logits(2, 1, 5), torch.zeros(2, 1).double(), torch.zeros(2, 1), 1),
     ValueError, r"beam_log_probs and beam_scores must be \[B, W\] float32"),
    (lambda: ops.ngram_match(_LONG.float()), TypeError, "tokens must be int32 or int64"),
    (lambda: ops.vocab_project(_logits(2, 4), torch.arange(4).int(), 4), TypeError,
     "target_ids must be int64"),
    (lambda: ops.ensemble_logits([_logits(2, 4), _logits(2, 4).double()], [0.5, 0.5]), TypeError,
     "members must be float32, bfloat16 or float16"),
    (lambda: ops.skinny_linear(_logits(2, 4), _logits(3, 4).double()), TypeError,
     "the CPU kernel takes float32 input and weight"),
    (lambda: ops.quantized_linear(_logits(2, 64), _logits(3, 64)), TypeError,
     "weight must be bfloat16, int8"),
    (lambda: ops.int8_linear(_logits(2, 4), torch.ones(2), torch.zeros(3, 4, dtype=torch.int8), torch.ones(3)),
     ValueError, r"int8_linear: input must be int8 \[M, K\]"),
    (lambda: ops.int8_linear(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2), torch.zeros(3, 4, dtype=torch.int8),
                             torch.ones(3).double()), ValueError, r"weight_scales must be float32 \[N\] with N = 3"),
    (lambda: ops.tree_attention(*_attention_case()[:3], _attention_case()[3].long()), ValueError,
     r"tree_mask must be \[B, N, ceil\(N/32\)\] int32"),
    (lambda: llama(dict(_llama_args(), hidden=_llama_args()["hidden"].double())), TypeError,
     "hidden must be float32"),
]


@pytest.mark.parametrize("index", range(len(BAD_ARGUMENTS)))
def test_bad_arguments_raise_clear_errors(index):
    call, error, match = BAD_ARGUMENTS[index]
    with pytest.raises(error, match=match):
        call()


def _with_linear(index: int, value, **more):
    args = _llama_args()
    linears = list(args["linears"])
    linears[index] = value
    for i, v in more.items():
        linears[int(i.removeprefix("at"))] = v
    return dict(args, linears=linears)


LLAMA_SHAPES = [
    # gate and up of different widths whose total is right: once re-split silently, now named.
    (_with_linear(16, torch.randn(40, D_MODEL), at20=torch.randn(56, D_MODEL)),
     (r"linears\[20\] \(layer 0's up weight\) must be \[inter \(the gate weight's\), d\] = \[40, 32\], "
      r"got \[56, 32\]")),
    (_with_linear(4, torch.randn(24, D_MODEL), at8=torch.randn(8, D_MODEL)),
     r"linears\[4\] \(layer 0's k weight\) must be \[kv_heads \* D, d\] = \[16, 32\], got \[24, 32\]"),
    (_with_linear(0, torch.randn(72, D_MODEL), at4=None, at8=None),  # q|k|v fused: (4 + 2 * 2) heads of 8
     (r"linears\[0\] \(layer 0's q\|k\|v weight\) must be \[heads \* D \+ kv_heads \* D \+ kv_heads \* D, "
      r"d\] = \[64, 32\], got \[72, 32\]")),
    (_with_linear(0, torch.randn(32, D_MODEL + 1)),
     r"linears\[0\] \(layer 0's q weight\) must be \[heads \* D, d\]"),
    (_with_linear(24, torch.randn(D_MODEL, INTER - 1)),
     r"linears\[24\] \(layer 0's down weight\) must be \[d, inter\]"),
    (_with_linear(3, torch.randn(7)),
     r"the bias of linears\[0\] \(layer 0's q weight\) must be float32 \[heads \* D\]"),
    (_with_linear(21, torch.ones(1)),
     r"linears\[20\] \(layer 0's up weight\) is float32 and takes no scales"),
    (_with_linear(20, None, at23=torch.zeros(INTER)), r"linears\[23\] must be None: its slot has no weight"),
]


@pytest.mark.parametrize("index", range(len(LLAMA_SHAPES)))
def test_llama_layers_checks_each_weight_shape(index):
    args, match = LLAMA_SHAPES[index]
    with pytest.raises(ValueError, match=match):
        llama(args)


def test_llama_layers_accepts_fused_weights():
    """q|k|v and gate|up fused into one weight each (the slots after them None): the same result."""
    args = _llama_args()
    linears = list(args["linears"])
    qkv, gate_up = torch.cat([linears[0], linears[4], linears[8]]), torch.cat([linears[16], linears[20]])
    fused = [qkv] + [None] * 11 + linears[12:16] + [gate_up] + [None] * 7 + linears[24:28]
    assert close(llama(dict(args, linears=fused)), llama(args))


@pytest.mark.parametrize("index", range(len(LLAMA_SHAPES)))
def test_llama_layers_kernel_is_the_checker(index):
    """Called directly, the C++ kernel refuses each weight shape with the wrapper's message: it is the one
    checker, the wrapper adds none."""
    args, match = LLAMA_SHAPES[index]
    with pytest.raises(ValueError, match=match):
        llama(args, torch.ops.specops.llama_layers)
