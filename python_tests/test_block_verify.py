"""Tests of `chain_verify(..., scheme="block")`: block verification (Sun et al., ICLR 2025, arXiv 2403.10444),
in the layers of test_chain_verify.py.

0. The derivation: the law of what block verification emits, enumerated exactly on small Markov tables, is
   the target's; a variant with the token-level residual is not; block keeps at least as many drafts in
   expectation as token-level verification (the paper's two-token example: 11/9 against 10/9).
1. Exact: greedy rows are the token scheme's; one-hot targets; a draft of target probability 0 ends what can
   be kept; with one draft the two schemes decide identically for the same seeds.
2. Agreement: the C++ kernel and the Triton kernel (interpreted without a GPU) return exactly the reference's
   tokens for the same seeds: ragged batches, filtered and overflowing rows, several vocabulary tiles.
3. Statistics: the first three emitted tokens of a K = 3 chain follow the target (chi-square), q given and
   one-hot; the mean number of kept drafts is the exact expectation, above token-level's; and the same check
   rejects a block verifier with the token-level residual.
4. opcheck, and a bad scheme name raising.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher
from chain_cases import OFFSETS, assert_same, markov_tables, normalized_args, random_case
from stats_helpers import N_DRAWS, P_VALUE_MIN, chisquare_pvalue

import specops
from specops import reference

chain_verify_triton = triton_launcher("chain_verify")

Z_MAX = 3.29  # two-sided normal test at level 1e-3


def run(impl: str, args: tuple, offset: int = 0, scheme: str = "block", block_v: int | None = None):
    if impl == "reference":
        return reference.chain_verify(*args, offset, scheme=scheme)
    if impl == "cpp":
        return torch.ops.specops.chain_verify(*args, offset, True, scheme)
    if impl == "triton":
        moved = [None if a is None else a.to(TRITON_DEVICE) for a in args]
        out, kept = chain_verify_triton(*moved, offset, scheme=scheme, block_v=block_v)
        return out.cpu(), kept.cpu()
    raise AssertionError(impl)


# ==== 0. The derivation, exactly ====

def block_outcomes(p_rows, q_rows, drafts, residual="block"):
    """{(kept, emitted token): probability} of block verification for one chain: p_rows [K+1] and q_rows [K]
    float64 distributions, drafts [K]. residual="token" is a wrong variant: it samples the token-level
    residual max(0, p - q) where block verification's is max(0, W_k p - q)."""
    k_max = len(drafts)
    weights = reference.block_weights([p_rows[j][d] for j, d in enumerate(drafts)],
                                      [q_rows[j][d] for j, d in enumerate(drafts)])
    masses, residuals = [], []
    for k in range(k_max + 1):
        if k == k_max:
            r = p_rows[k] * weights[k]
        else:
            scale = weights[k] if residual == "block" else 1.0
            r = torch.clamp(scale * p_rows[k] - q_rows[k], min=0.0)
        residuals.append(r)
        masses.append(float(r.sum()))
    keep = [None] + [masses[k] / (masses[k] + 1 - weights[k]) if masses[k] + 1 - weights[k] > 0 else 0.0
                     for k in range(1, k_max)] + ([weights[k_max]] if k_max else [])
    outcomes, stay = {}, 1.0
    for k in range(k_max, -1, -1):
        here = stay * (keep[k] if k else 1.0)
        stay *= 1 - keep[k] if k else 0.0
        if here > 0:
            r = residuals[k] if masses[k] > 0 else p_rows[k]
            for y, prob in enumerate((r / r.sum()).tolist()):
                if prob > 0:
                    outcomes[(k, y)] = outcomes.get((k, y), 0.0) + here * prob
    return outcomes


def sequence_law(target, drafter, vocab: int, k: int, residual: str = "block"):
    """The probability of every (k + 1)-token sequence when one verification step's output is continued by
    the target, and the expected number of kept drafts."""
    law, kept = {}, 0.0
    for chain in itertools.product(range(vocab), repeat=k):
        q_chain = math.prod(float(drafter[chain[:j]][chain[j]]) for j in range(k))
        if q_chain == 0:
            continue
        p_rows = [target[chain[:j]] for j in range(k + 1)]
        q_rows = [drafter[chain[:j]] for j in range(k)]
        for (n, y), prob in block_outcomes(p_rows, q_rows, list(chain), residual).items():
            kept += q_chain * prob * n
            law[chain[:n] + (y,)] = law.get(chain[:n] + (y,), 0.0) + q_chain * prob
    full = {}
    for seq in itertools.product(range(vocab), repeat=k + 1):
        full[seq] = sum(law.get(seq[:n], 0.0) * math.prod(float(target[seq[:j]][seq[j]]) for j in range(n, k + 1))
                        for n in range(1, k + 2))
    return full, kept


def token_level_kept(target, drafter, vocab: int, k: int) -> float:
    """Expected drafts kept by token-level verification: sum over chains of q(chain) * sum_k prod min(1, p/q)."""
    total = 0.0
    for chain in itertools.product(range(vocab), repeat=k):
        q_chain = math.prod(float(drafter[chain[:j]][chain[j]]) for j in range(k))
        if q_chain == 0:
            continue
        run_, survive = 0.0, 1.0
        for j in range(k):
            survive *= min(1.0, float(target[chain[:j]][chain[j]]) / float(drafter[chain[:j]][chain[j]]))
            run_ += survive
        total += q_chain * run_
    return total


@pytest.mark.parametrize("vocab, k, zeros", [(2, 1, False), (3, 2, False), (3, 3, True), (4, 2, True), (2, 4, False)])
def test_block_verification_is_lossless_and_keeps_more(vocab, k, zeros):
    target = markov_tables(vocab, k + 1, seed=vocab * 10 + k, zeros=zeros)
    drafter = markov_tables(vocab, k + 1, seed=vocab * 10 + k + 5, zeros=zeros)
    law, kept = sequence_law(target, drafter, vocab, k)
    for seq, prob in law.items():
        want = math.prod(float(target[seq[:j]][seq[j]]) for j in range(k + 1))
        assert prob == pytest.approx(want, abs=1e-12), seq
    assert kept >= token_level_kept(target, drafter, vocab, k) - 1e-12


def test_the_token_level_residual_is_not_lossless():
    """The check above can fail: block verification's keep rule with max(0, p - q) as the residual."""
    vocab, k = 3, 2
    target = markov_tables(vocab, k + 1, seed=32, zeros=False)
    drafter = markov_tables(vocab, k + 1, seed=37, zeros=False)
    law, _ = sequence_law(target, drafter, vocab, k, residual="token")
    worst = max(abs(prob - math.prod(float(target[s[:j]][s[j]]) for j in range(k + 1))) for s, prob in law.items())
    assert worst > 1e-3


def test_the_papers_two_token_example():
    """Sun et al., Sec. 3: p = (1/3, 2/3), q = (2/3, 1/3) at every position, two drafts: token-level
    verification keeps 10/9 drafts in expectation, block verification 11/9."""
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    tables_p = {pre: p for n in range(4) for pre in itertools.product(range(2), repeat=n)}
    tables_q = {pre: q for n in range(4) for pre in itertools.product(range(2), repeat=n)}
    assert token_level_kept(tables_p, tables_q, 2, 2) == pytest.approx(10 / 9)
    _, kept = sequence_law(tables_p, tables_q, 2, 2)
    assert kept == pytest.approx(11 / 9)
    # reference.expected_accepted, per chain, averaged over the four chains with their probabilities
    chains = torch.tensor(list(itertools.product(range(2), repeat=2)))
    weight = q[chains].prod(1)
    rows_p, rows_q = p.expand(4, 3, 2), q.expand(4, 2, 2)
    for scheme, want in (("token", 10 / 9), ("block", 11 / 9)):
        got = float((reference.expected_accepted(rows_p, rows_q, chains, scheme) * weight).sum())
        assert got == pytest.approx(want)


# ==== 1. Exact ====

@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_rows_are_the_token_schemes(impl):
    gen = torch.Generator().manual_seed(5)
    args = random_case(gen, 6, 3, 40, torch.float32, True)
    args = args[:4] + (torch.zeros(6),) + args[5:]
    assert_same(run(impl, args, 3), run(impl, args, 3, scheme="token"))


@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
@pytest.mark.parametrize("impl", IMPLS)
def test_one_hot_target_keeps_its_drafts(impl, with_probs):
    # p is one-hot on the drafts: W stays 1, the whole chain is kept, the bonus is the last row's token.
    hot = torch.tensor([[3, 1, 4, 2], [0, 0, 5, 5]])
    logits = torch.full((2, 4, 8), float("-inf")).scatter(-1, hot.unsqueeze(-1), 0.5)
    probs = torch.softmax(torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)), -1) if with_probs else None
    args = normalized_args(logits, hot[:, :3].clone(), probs, temperature=0.9)
    out, kept = run(impl, args)
    assert out.tolist() == hot.tolist() and kept.tolist() == [3, 3]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_draft_the_target_never_emits_ends_what_is_kept(impl):
    # Draft 1 of every request has p = 0 (filtered by top-k 2): at most draft 0 is kept, whatever the seed.
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 16, 10
    logits = torch.randn(batch, 4, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (batch, 3), generator=gen)
    drafts[:, 1] = logits[:, 1].argmin(-1)
    probs = torch.softmax(torch.randn(batch, 3, vocab, generator=gen), -1)
    args = normalized_args(logits, drafts, probs, top_k=2, seed=torch.randint(0, 2**62, (batch,), generator=gen))
    _, kept = run(impl, args)
    assert kept.max() <= 1


@pytest.mark.parametrize("impl", IMPLS)
def test_one_draft_decides_as_the_token_scheme(impl):
    # K = 1: keep iff u < min(1, p/q), the token rule; the residual is max(0, p - q) in both.
    gen = torch.Generator().manual_seed(3)
    args = random_case(gen, 24 if impl != "triton" else 8, 1, 30, torch.float32, True)
    assert_same(run(impl, args, 9), run(impl, args, 9, scheme="token"))


# ==== 2. Agreement, same seeds ====

@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_cpp_matches_reference(with_probs):
    gen = torch.Generator().manual_seed(70 + with_probs)
    for i, (batch, k, vocab) in enumerate([(6, 4, 7), (5, 3, 300), (4, 2, 2049), (3, 5, 5000), (3, 2, 1), (4, 0, 9)]):
        for dtype in (torch.float32, torch.bfloat16):
            args = random_case(gen, batch, k, vocab, dtype, with_probs)
            offset = OFFSETS[i % len(OFFSETS)]
            assert_same(run("cpp", args, offset), run("reference", args, offset), f"case {i} {dtype}: ")


@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_cpp_top_p_blocks_match_reference_at_a_large_vocabulary(with_probs):
    """Chains at 262,144 ids under top-p, block verification: where the cut keeps few tokens the C++ kernel
    computes a position's normalizer and residual max(0, W p - q) over those alone and draws by inverse CDF
    in id order; the same tokens as the reference, chains kept whole, cut short and cut at the first draft,
    with one-hot q and with q given, beside rows whose cut the histogram finds (dense passes)."""
    gen = torch.Generator().manual_seed(31)
    vocab, rows, k = 262_144, 8, 3
    # a few likely tokens over a spread of unlikely ones; the last two rows flat (the histogram's cut)
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    likely = torch.randint(0, vocab, (rows, k + 1, 6), generator=gen)
    logits.scatter_(-1, likely, 16.0 + 2 * torch.rand(rows, k + 1, 6, generator=gen))
    logits.scatter_(-1, likely[..., :1], 19.0)  # the first likely token the likeliest, and mostly drafted
    logits[-2:] *= 0.1
    other = torch.randint(1, 6, (rows, k, 1), generator=gen)
    which = torch.where(torch.rand(rows, k, 1, generator=gen) < 0.8, 0, other)
    drafts = likely[:, :k].gather(-1, which)[..., 0]
    drafts[:, 1] = torch.where(torch.rand(rows, generator=gen) < 0.3, 0, drafts[:, 1])  # some unlikely ones
    q = torch.softmax(logits[:, :k] + torch.randn(rows, k, vocab, generator=gen), -1) if with_probs else None
    args = normalized_args(logits, drafts, q, num_draft=torch.tensor([3, 3, 2, 1, 3, 0, 3, 3]),
                           temperature=torch.tensor([1.0, 0.8, 0.8, 1.3, 0.5, 1.0, 0.8, 1.0]),
                           top_k=torch.tensor([0, 0, 1000, 0, 0, 50_000, 0, 0]),
                           top_p=torch.tensor([0.95, 0.9, 0.95, 0.5, 0.999, 0.7, 0.95, 0.9]), seed=5)
    kept = []
    for offset in range(6):
        got = run("cpp", args, offset)
        assert_same(got, run("reference", args, offset), f"offset {offset}: ")
        kept.append(got[1])
    kept = torch.stack(kept)
    assert bool((kept == 0).any()) and bool((kept >= 2).any())


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_triton_matches_reference(with_probs):
    # One tile, then several (block_v 32 over V = 100, the last tile partial).
    gen = torch.Generator().manual_seed(80 + with_probs)
    for i, (batch, k, vocab, block_v) in enumerate([(5, 3, 40, None), (4, 4, 100, 32), (3, 1, 1, None)]):
        args = random_case(gen, batch, k, vocab, torch.float32, with_probs)
        offset = OFFSETS[(i + 1) % len(OFFSETS)]
        assert_same(run("triton", args, offset, block_v=block_v), run("reference", args, offset), f"case {i}: ")


@pytest.mark.parametrize("impl", KERNELS)
def test_overflowing_rows_are_point_masses(impl):
    # logits / T overflows on some rows (T = 1e-45): p is a point mass on the argmax there, inside a chain.
    gen = torch.Generator().manual_seed(4)
    batch, k, vocab = 8, 3, 12
    logits = 4 * torch.randn(batch, k + 1, vocab, generator=gen)
    probs = torch.softmax(logits[:, :k] + torch.randn(batch, k, vocab, generator=gen), -1)
    drafts = torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).view(batch, k)
    drafts[::2, 0] = logits[::2, 0].argmax(-1)
    temperature = torch.where(torch.arange(batch) % 3 == 0, 1e-45, 1.0)
    args = normalized_args(logits, drafts, probs, temperature=temperature,
                           seed=torch.randint(0, 2**62, (batch,), generator=gen))
    assert_same(run(impl, args, 5, block_v=4 if impl == "triton" else None), run("reference", args, 5))


def test_wrapper_takes_the_scheme(device):
    gen = torch.Generator().manual_seed(6)
    args = random_case(gen, 5, 3, 50, torch.float32, True)
    logits, drafts, probs, num_draft, temperature, top_k, top_p, seed = (a.to(device) for a in args)
    out = specops.ops.chain_verify(logits, drafts, probs, num_draft=num_draft, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed, offset=2, scheme="block")
    assert_same(tuple(t.cpu() for t in out), run("reference", args, 2))


# ==== 3. Statistics ====

def markov_chain_batch(vocab: int, k: int, seed: int):
    """N_DRAWS requests of a K-draft chain from an order-1 Markov drafter, with the order-1 Markov target's
    rows along each chain: (logits [N, K+1, V], drafts [N, K], q [N, K, V], target rows [V+1, V] (the last
    is the first position's), drafter rows likewise)."""
    gen = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(vocab + 1, vocab, generator=gen)  # row v: after token v; row V: the first
    drafter = torch.softmax(target + 0.8 * torch.randn(vocab + 1, vocab, generator=gen), -1)
    previous = torch.full((N_DRAWS,), vocab)
    drafts = []
    for _ in range(k):
        drafts.append(torch.multinomial(drafter[previous], 1, generator=gen)[:, 0])
        previous = drafts[-1]
    drafts = torch.stack(drafts, 1)
    context = torch.cat([torch.full((N_DRAWS, 1), vocab), drafts], 1)  # the row each position is read after
    return target[context], drafts, drafter[context[:, :k]], target, drafter


def first_tokens(out, kept, target_logits, vocab: int, length: int, seed: int) -> torch.Tensor:
    """Each request's first `length` tokens as one index in [0, V**length): the emitted ones, continued by
    sampling the target where a request emitted fewer (what later steps would give)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(target_logits.double(), -1)
    tokens = out[:, :length].clone()
    for j in range(length):
        missing = tokens[:, j] < 0
        if missing.any():
            after = tokens[missing, j - 1] if j else torch.full((int(missing.sum()),), vocab)
            tokens[missing, j] = torch.multinomial(probs[after], 1, generator=gen)[:, 0]
    index = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for j in range(length):
        index = index * vocab + tokens[:, j]
    return index


def joint_law(target_logits, vocab: int, length: int) -> torch.Tensor:
    probs = torch.softmax(target_logits.double(), -1)
    law = probs[vocab]
    for _ in range(length - 1):
        law = (law[:, None] * probs[(torch.arange(law.numel()) % vocab)]).flatten()
    return law


def vectorized_block(logits, drafts, q, gen, residual="block"):
    """Block verification over many requests at once, T = 1 (the test's own implementation, for the wrong
    variant): (out [N, K+1], kept [N])."""
    n, k1, vocab = logits.shape
    k = k1 - 1
    p = torch.softmax(logits.double(), -1)
    q = q.double()
    p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    w = [torch.ones(n, dtype=torch.float64)]
    for j in range(k):
        w.append(torch.clamp(w[-1] * p_d[:, j] / q_d[:, j], max=1.0))
    w = torch.stack(w, 1)
    scale = w[:, :k, None] if residual == "block" else torch.ones_like(w[:, :k, None])
    r = torch.cat([torch.clamp(scale * p[:, :k] - q, min=0.0), p[:, k:]], 1)
    s = r.sum(-1)
    h = torch.where(s + 1 - w > 0, s / (s + 1 - w), torch.zeros_like(s))
    h[:, k] = w[:, k]
    coins = torch.rand(n, k1, generator=gen, dtype=torch.float64) < h
    coins[:, 0] = True
    kept = (coins * torch.arange(k1)).amax(1)
    rows = r[torch.arange(n), kept]
    token = torch.multinomial(rows.float() + 1e-30 * (rows.sum(-1, keepdim=True) == 0), 1, generator=gen)[:, 0]
    out = torch.full((n, k1), -1)
    for j in range(k1):
        out[:, j] = torch.where(j < kept, drafts[:, min(j, k - 1)], torch.where(j == kept, token, -1))
    return out, kept


@pytest.mark.slow
@pytest.mark.parametrize("with_probs", [True, False], ids=["q_given", "q_one_hot"])
def test_first_three_tokens_follow_the_target(device, with_probs):
    vocab, k = 5, 3
    logits, drafts, q, target, _ = markov_chain_batch(vocab, k, seed=11 + with_probs)
    seeds = torch.arange(N_DRAWS, dtype=torch.int64)
    out, kept = specops.ops.chain_verify(logits.to(device), drafts.to(device), q.to(device) if with_probs else None,
                                         seed=seeds.to(device), scheme="block")
    out, kept = out.cpu(), kept.cpu()
    index = first_tokens(out, kept, target, vocab, 3, seed=1)
    assert chisquare_pvalue(index, joint_law(target, vocab, 3)) > P_VALUE_MIN
    assert int((kept == k).sum()) > 1000  # chains are kept whole, not only cut short
    if with_probs:
        # The mean kept is block verification's exact expectation for these chains, above token-level's.
        p = torch.softmax(logits.double(), -1)
        block = float(reference.expected_accepted(p, q, drafts, "block").mean())
        token = float(reference.expected_accepted(p, q, drafts, "token").mean())
        sd = float(kept.double().std()) / math.sqrt(N_DRAWS)
        assert abs(float(kept.double().mean()) - block) < Z_MAX * sd
        assert block > token + 10 * sd


@pytest.mark.slow
@pytest.mark.parametrize("with_probs", [True, False], ids=["q_given", "q_one_hot"])
def test_first_three_tokens_follow_the_target_under_top_p(with_probs):
    """Top-p 0.8 (where the C++ kernel keeps each position's residual on the kept ids): the first three tokens
    follow the filtered target's joint law."""
    vocab, k, top_p = 5, 3, 0.8
    logits, drafts, q, target, _ = markov_chain_batch(vocab, k, seed=21 + with_probs)
    rows = vocab + 1
    filtered = reference.filter_logits(target, torch.ones(rows), torch.zeros(rows, dtype=torch.int64),
                                       torch.full((rows,), top_p))
    seeds = torch.arange(N_DRAWS, dtype=torch.int64)
    out, kept = specops.ops.chain_verify(logits, drafts, q if with_probs else None, seed=seeds, top_p=top_p,
                                         scheme="block")
    index = first_tokens(out, kept, filtered, vocab, 3, seed=2)
    assert chisquare_pvalue(index, joint_law(filtered, vocab, 3)) > P_VALUE_MIN
    assert int((kept == k).sum()) > 1000
    # the same check fails where the law is the unfiltered target's
    assert chisquare_pvalue(index, joint_law(target, vocab, 3)) < P_VALUE_MIN


@pytest.mark.slow
def test_the_check_rejects_the_token_level_residual():
    """The chi-square above rejects block verification with max(0, p - q) as its residual, and passes this
    implementation's correct variant with the same random numbers."""
    vocab, k = 5, 3
    logits, drafts, q, target, _ = markov_chain_batch(vocab, k, seed=11 + 1)
    law = joint_law(target, vocab, 3)
    for residual, passes in (("block", True), ("token", False)):
        out, kept = vectorized_block(logits, drafts, q, torch.Generator().manual_seed(3), residual)
        pvalue = chisquare_pvalue(first_tokens(out, kept, target, vocab, 3, seed=1), law)
        assert (pvalue > P_VALUE_MIN) == passes, (residual, pvalue)


# ==== 4. opcheck, bad input ====

def test_opcheck(device):
    gen = torch.Generator().manual_seed(600)
    args = tuple(a.to(device) for a in random_case(gen, 4, 3, 12, torch.float32, True))
    torch.library.opcheck(torch.ops.specops.chain_verify.default, args + (5, True, "block"))


def test_an_unknown_scheme_raises(device):
    logits = torch.randn(2, 3, 8, device=device)
    drafts = torch.zeros(2, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="scheme must be 'token' or 'block', got 'blocks'"):
        specops.ops.chain_verify(logits, drafts, scheme="blocks")
    with pytest.raises(ValueError, match="scheme must be 'token' or 'block'"):
        torch.ops.specops.chain_verify(logits.cpu(), drafts.cpu(), None, torch.full((2,), 2), torch.ones(2),
                                       torch.zeros(2, dtype=torch.int64), torch.ones(2),
                                       torch.zeros(2, dtype=torch.int64), 0, True, "blocks")
