"""End-to-end tests of decoding from an ensemble of models (paper 004): `target=[m1, m2, ...]` with
`specops.WeightedEnsemble` / `specops.ContrastiveEnsemble`, methods "se" (the members propose to each
other), "ensemble" (every member scores every token) and "sd" / "tli" with a drafter verifying against the
ensemble; nothing downloads.

1. Exactness: sampled continuations follow the ensemble's exact sequence distribution, computed here from
   the members' trigram tables (toy_models.TableLM): per position softmax of the ensemble logits (the
   mixture log sum_i w_i p_i, or contrastive decoding's (log p_e - max) - mu (log p_a - max) on the
   expert's alpha-plausible tokens), then temperature, top-k and top-p applied to those logits as to one
   model's. Chi-square over whole continuations (rare ones pooled, as test_decode_hetero.py), for "se" and
   "ensemble" (weighted 2 and 3 members, contrastive, top-k at T = 1 and T = 0.7), "se" with other draft
   lengths and top-p, ensemble-SD ("sd", and "tli" with a drafter of another vocabulary), and with an EOS
   that ends requests at different steps. Every check is sized to catch SHIFT = 3% of probability moved
   between its two likeliest cells with power >= 0.99 (`assert_powered`).
2. Members with another vocabulary: the second member's distribution restricted to the tokens both
   vocabularies share, renormalized, read in its own token space (its own prompt encoding, and each
   emitted token as its own token(s) for the same text, two tokens for one the first member has alone).
3. The same check rejects samples from a wrong distribution (swapped weights, the first member alone, the
   exact ensemble with SHIFT moved).
4. Greedy: "se" (several draft lengths) == "ensemble" == ensemble-SD token for token on tiny transformers
   models of several architectures (sliding windows included) on a ragged batch, equal to a reference
   computed here (each prompt alone, full forwards, `specops.reference.ensemble_logits`, argmax); and with
   members of other vocabularies (byte-level and multi-byte tokens, both orders).
5. A model ensembled with itself is that model: its own greedy "ar" output.
6. Statistics: one forward count per member; "se" of a model with itself accepts everything and costs
   about one member forward per token. Engine behaviours: max_new_tokens, stop strings, result shapes,
   reproducibility from a seed.
7. Bad input raises a clear exception before any model runs.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from scipy import stats as scipy_stats

import arch_zoo
import specops
from specops import reference
from toy_models import (BYTE_VOCAB, EOS_ID, LETTERS, TableLM, byte_tokenizer, letter_tokenizer,
                        merged_byte_tokenizer, random_table, tiny_gemma3, tiny_llama, token_tokenizer)

ALPHA = 1e-3  # chi-square significance level (as test_decode.py)
MIN_EXPECTED = 5  # sequences expected fewer times share one chi-square cell (Cochran's rule)
SHIFT = 0.03  # mass moved between the two likeliest cells that every check must catch with power >= 0.99


pytestmark = pytest.mark.usefixtures("one_torch_thread", "private_specops_cache")


# ---- exact distributions ----

def _row(table: torch.Tensor, context: list[int]) -> torch.Tensor:
    """A TableLM's next-token probabilities after token ids `context` (>= 1 token; one reads START)."""
    n = table.shape[1]
    return table[context[-2] if len(context) >= 2 else n, context[-1]]


def weighted_logits(probs: list[torch.Tensor], weights) -> torch.Tensor:
    return sum(w * p for w, p in zip(weights, probs)).log()


def contrastive_logits(expert: torch.Tensor, amateur: torch.Tensor, mu: float,
                       alpha: float | None) -> torch.Tensor:
    """(log p_e - max) - mu (log p_a - max) on the tokens both can produce with p_e >= alpha max p_e; -inf
    elsewhere (the expert's plausible set alone if nothing is left)."""
    e, a = expert.log(), amateur.log()
    e, a = e - e.max(), a - a.max()
    cut = expert >= (alpha or 0.0) * expert.max()
    keep = cut & (expert > 0) & (amateur > 0)
    if not bool(keep.any()):
        return torch.where(cut & (expert > 0), e, -math.inf)
    return torch.where(keep, e - mu * torch.where(keep, a, 0.0), -math.inf)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0) -> torch.Tensor:
    """softmax of the ensemble logits / T after top-k (ties at the k-th value kept) and top-p (the likeliest
    tokens up to the first whose running sum reaches top_p): chain_verify's filter."""
    x = logits / temperature
    if top_k:
        kth = x.sort(descending=True).values[top_k - 1]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, -1)
    if top_p < 1:
        ordered = probs.sort(descending=True).values
        cum = ordered.cumsum(0)
        last = int((cum < top_p).sum())
        assert (cum - top_p).abs().min() > 1e-4, "top_p too close to a running sum: float32 may cut elsewhere"
        probs = torch.where(probs >= ordered[last], probs, 0.0)
        probs = probs / probs.sum()
    return probs


def exact_sequences(next_logits, tokens: int, length: int, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, eos: int | None = None) -> dict:
    """Exact probability of every continuation (a tuple of up to `length` token ids below `tokens`; one that
    reaches `eos` ends there) when next_logits(continuation so far) gives the ensemble's logits for the next
    token (float64). Continuations of probability 0 included."""
    out = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in out.items():
            if seq and seq[-1] == eos:
                grown[seq] = p
                continue
            probs = filtered_probs(next_logits(seq), temperature, top_k, top_p)
            for t in range(tokens):
                grown[seq + (t,)] = p * float(probs[t])
        out = grown
    assert abs(sum(out.values()) - 1) < 1e-9
    return out


# ---- chi-square ----

def _pool(exact: dict, n: int) -> tuple[dict, set]:
    rare = {seq for seq, p in exact.items() if 0 < p * n < MIN_EXPECTED}
    pooled = {seq: p for seq, p in exact.items() if seq not in rare}
    pooled["rare"] = sum(exact[seq] for seq in rare)
    return pooled, rare


def assert_powered(exact: dict, n: int) -> None:
    """n samples catch SHIFT of mass moved between the two likeliest cells with power >= 0.99."""
    pooled, _ = _pool(exact, n)
    probs = sorted((p for p in pooled.values() if p > 0), reverse=True)
    df = len(probs) - 1
    noncentrality = n * SHIFT**2 * (1 / probs[0] + 1 / probs[1])
    power = scipy_stats.ncx2.sf(scipy_stats.chi2.isf(ALPHA, df), df, noncentrality)
    assert power >= 0.99, f"{n} samples cannot catch a {SHIFT:.0%} error (power {power:.3f})"


def shifted(exact: dict, n: int, shift: float = SHIFT) -> dict:
    """`exact` with `shift` of mass moved between the two likeliest cells of its chi-square at n samples
    (the pooled cell of rare sequences is scaled as a whole): the error assert_powered sizes."""
    pooled, rare = _pool(exact, n)
    out = dict(exact)
    for key, delta in zip(sorted(pooled, key=pooled.get, reverse=True)[:2], (-shift, shift)):
        assert pooled[key] + delta > 0
        if key == "rare":
            out.update({seq: exact[seq] * (1 + delta / pooled["rare"]) for seq in rare})
        else:
            out[key] += delta
    return out


def fit(samples: list[list[int]], exact: dict) -> tuple[float, int]:
    """(chi-square p-value of the sampled continuations against `exact`, pooling cells expected fewer than
    MIN_EXPECTED times, and the number of samples of probability 0)."""
    pooled, rare = _pool(exact, len(samples))
    counts = collections.Counter("rare" if tuple(s) in rare else tuple(s) for s in samples)
    impossible = sum(c for seq, c in counts.items() if pooled.get(seq, 0.0) == 0.0)
    support = [seq for seq, p in pooled.items() if p > 0]
    observed = [counts[seq] for seq in support]
    expected = [pooled[seq] * sum(observed) for seq in support]
    return float(scipy_stats.chisquare(observed, expected).pvalue), impossible


def assert_follows(samples: list[list[int]], exact: dict) -> None:
    assert_powered(exact, len(samples))
    pvalue, impossible = fit(samples, exact)
    assert impossible == 0, f"{impossible} sampled sequences have probability 0 under the ensemble"
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}"


# ---- 1. exactness on members over one vocabulary ----

TABLES = [random_table(11), random_table(12), random_table(13)]
DRAFTER_TABLE = random_table(14)
# A drafter with another vocabulary for "tli" against the ensemble: the four letters shared, "ab" and "ba"
# its own.
TLI_DRAFTER_TOKENS = ["a", "b", "c", "d", "ab", "ba"]
TLI_DRAFTER_TABLE = random_table(15, zeros=8, tokens=len(TLI_DRAFTER_TOKENS))
# Prompts of different lengths ending in the same two letters: one exact distribution, ragged padding.
PROMPTS = ["ab", "cab", "dddab", "bab"]
CONTEXT = [LETTERS.index("a"), LETTERS.index("b")]
NEW = 4  # 4^4 = 256 continuations
N = 4000  # sequences per check (assert_powered: they catch a SHIFT error)

RULES = {
    "w2": (2, specops.WeightedEnsemble([0.7, 0.3])),
    "w3": (3, specops.WeightedEnsemble([0.5, 0.3, 0.2])),
    "w2-swapped": (2, specops.WeightedEnsemble([0.3, 0.7])),
    "cd": (2, specops.ContrastiveEnsemble(0.5, alpha=0.1)),
}


def letter_exact(rule: str, temperature: float = 1.0, top_k: int = 0, tables=TABLES, top_p: float = 1.0,
                 eos: int | None = None) -> dict:
    count, ensemble = RULES[rule]

    def next_logits(seq):
        probs = [_row(t, CONTEXT + list(seq)) for t in tables[:count]]
        if isinstance(ensemble, specops.ContrastiveEnsemble):
            return contrastive_logits(probs[0], probs[1], ensemble.mu, ensemble.alpha)
        return weighted_logits(probs, ensemble.weights)

    return exact_sequences(next_logits, len(LETTERS), NEW, temperature, top_k, top_p, eos)


_samples: dict = {}


def _draws(method: str) -> tuple[str, str | None]:
    """"se-alternate" / "se-mixture": method se with that draws option ("se-token": the alternate
    proposals' scheme "token"); other names as they are."""
    name, _, draws = method.partition("-")
    return (name, draws) if name == "se" and draws else (method, None)


def _mixture(method: str, rule: str, temperature: float, top_k: int, k) -> bool:
    """Whether se draws members (no drafts) for these settings: draws="auto" picks it where exact."""
    name, draws = _draws(method)
    exact = isinstance(RULES[rule][1], specops.WeightedEnsemble) and temperature == 1.0 and top_k == 0
    return name == "se" and (draws == "mixture" or (draws is None and exact and k == "auto"))


def letter_samples(method: str, rule: str, temperature: float = 1.0, top_k: int = 0, k="auto", seed: int = 7,
                   top_p: float = 1.0, eos: int | None = None, n: int = N):
    """N continuations of PROMPTS from the ensemble `rule` of TableLMs over letters (cached); eos: the first
    member's EOS token (the ensemble's), which ends a request."""
    key = (method, rule, temperature, top_k, k, seed, top_p, eos, n)
    if key not in _samples:
        count, ensemble = RULES[rule]
        tok = letter_tokenizer()
        kwargs = {}
        method, draws = _draws(method)
        if draws in ("token", "joint"):
            kwargs["options"] = {"scheme": draws}
        elif draws:
            kwargs["options"] = {"draws": draws}
        if method in ("sd", "tli"):
            drafter_tok = tok if method == "sd" else token_tokenizer(TLI_DRAFTER_TOKENS)
            table = DRAFTER_TABLE if method == "sd" else TLI_DRAFTER_TABLE
            kwargs = dict(drafter=TableLM(table), drafter_tokenizer=drafter_tok, num_draft_tokens=k)
        elif method == "se":
            kwargs["num_draft_tokens"] = k
        members = [TableLM(t) for t in TABLES[:count]]
        members[0].generation_config.eos_token_id = eos
        result = specops.decode([PROMPTS[i % len(PROMPTS)] for i in range(n)], target=members,
                                tokenizer=[tok] * count, ensemble=ensemble, method=method, max_new_tokens=NEW,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **kwargs)
        if eos is None:
            assert all(len(t) == NEW for t in result.tokens)
        else:
            assert all(len(t) == NEW or t[-1] == eos for t in result.tokens)
            assert all(eos not in t[:-1] for t in result.tokens)
        assert len(result.stats.member_calls) == count
        _samples[key] = result
    return _samples[key]


STAT_CASES = [
    (method, rule, temperature, top_k, "auto")
    for method in ("se", "ensemble")
    for rule, temperature, top_k in (("w2", 1.0, 0), ("w3", 1.0, 0), ("cd", 1.0, 0), ("w2", 1.0, 3),
                                     ("w2", 0.7, 3))
] + [("se", "w2", 1.0, 0, 2), ("se", "w2", 1.0, 0, (1, 3)), ("se", "w3", 0.7, 3, (2, 1, 1)),
     # se's chains verified token by token (auto: block verification, the cases above)
     ("se-token", "w2", 1.0, 0, (1, 3)), ("se-token", "w3", 0.7, 3, (2, 1, 1)),
     ("se-alternate", "w2", 1.0, 0, "auto"), ("se-alternate", "w3", 1.0, 0, "auto"),
     ("se-mixture", "w3", 1.0, 0, "auto"), ("sd", "w2", 1.0, 0, 2), ("tli", "w3", 1.0, 0, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("method,rule,temperature,top_k,k", STAT_CASES,
                         ids=[f"{m}-{r}-T{t}-topk{tk}-k{k}" for m, r, t, tk, k in STAT_CASES])
def test_sampled_sequences_follow_ensemble(method, rule, temperature, top_k, k):
    result = letter_samples(method, rule, temperature, top_k, k)
    assert_follows(result.tokens, letter_exact(rule, temperature, top_k))
    if _mixture(method, rule, temperature, top_k, k):  # mixture draws: no drafts, one member per token
        assert result.stats.drafted == 0
    elif method != "ensemble":  # drafts were made, and rejected sometimes
        assert 0 < result.stats.accepted < result.stats.drafted


def test_sampled_top_p_follows_ensemble():
    """top-p applies to the ensemble's logits (here after temperature 0.8), as to one model's."""
    result = letter_samples("se", "w2", 0.8, k=2, top_p=0.8)
    assert_follows(result.tokens, letter_exact("w2", 0.8, top_p=0.8))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["se", "se-mixture", "ensemble"])
def test_sampled_with_eos_follows_ensemble(method):
    """The first member's EOS ends requests at different steps (rows leave the batch: every member's cache
    and se's pending bonus drafts are cut to the rows left); the continuations still follow the ensemble,
    each ending at its first EOS."""
    eos = LETTERS.index("a")
    # Short continuations are likely: more samples to see a SHIFT error among those large cells.
    result = letter_samples(method, "w2", k="auto" if method == "se-mixture" else (2, 1), eos=eos, n=6000)
    lengths = collections.Counter(len(t) for t in result.tokens)
    assert set(lengths) == {1, 2, 3, 4}, lengths
    assert result.stats.new_tokens == sum(len(t) for t in result.tokens)
    assert_follows(result.tokens, letter_exact("w2", eos=eos))


# ---- 2. members with another vocabulary ----

# The first member over {a, b, c, d, ab, cd}; the second over {a, b, c, d, ba, ab, abc}: shared {a, b, c, d,
# ab}. The second member's "ba" and "abc" get mass in its table (renormalized away); the first member's
# "cd" is one it lacks (the second member gives it nothing and reads it as its own c, d).
FIRST_TOKENS = ["a", "b", "c", "d", "ab", "cd"]
SECOND_TOKENS = ["a", "b", "c", "d", "ba", "ab", "abc"]
FIRST_TABLE = random_table(21, zeros=12, tokens=len(FIRST_TOKENS))
SECOND_TABLE = random_table(22, zeros=12, tokens=len(SECOND_TOKENS))
# Every prompt is (..., b, ab) for the first tokenizer and (..., ba, b) for the second.
HETERO_PROMPTS = ["bab", "cbab", "ddbab", "dbab"]
HETERO_NEW = 3  # 6^3 = 216 continuations
HETERO_WEIGHTS = (0.6, 0.4)


@pytest.fixture(scope="module")
def hetero_toks():
    return token_tokenizer(FIRST_TOKENS), token_tokenizer(SECOND_TOKENS)


HETERO_CONTRASTIVE = specops.ContrastiveEnsemble(0.5, alpha=0.05)


def hetero_exact(hetero_toks, prompt: str, weights=HETERO_WEIGHTS, contrastive: bool = False) -> dict:
    first_tok, second_tok = hetero_toks
    first_context = first_tok(prompt)["input_ids"]
    second_context = second_tok(prompt)["input_ids"]
    # Each first-member token as the second member's tokens: the shared id, else its encoding of the text.
    crossing = [second_tok(t)["input_ids"] for t in FIRST_TOKENS]
    assert crossing[FIRST_TOKENS.index("cd")] == [SECOND_TOKENS.index("c"), SECOND_TOKENS.index("d")]
    shared = [SECOND_TOKENS.index(t) if t in SECOND_TOKENS else -1 for t in FIRST_TOKENS]

    def next_logits(seq):
        first = _row(FIRST_TABLE, first_context + list(seq))
        own = _row(SECOND_TABLE, second_context + [i for t in seq for i in crossing[t]])
        second = torch.zeros_like(first)
        for t, s in enumerate(shared):
            if s >= 0:
                second[t] = own[s]
        # mass renormalized away
        assert own[[SECOND_TOKENS.index("ba"), SECOND_TOKENS.index("abc")]].sum() > 0
        if contrastive:  # the amateur lacks "cd": the expert's "cd" is never kept
            return contrastive_logits(first, second / second.sum(), HETERO_CONTRASTIVE.mu,
                                      HETERO_CONTRASTIVE.alpha)
        return weighted_logits([first, second / second.sum()], weights)

    return exact_sequences(next_logits, len(FIRST_TOKENS), HETERO_NEW)


def test_hetero_prompts_share_one_distribution(hetero_toks):
    first_tok, second_tok = hetero_toks
    assert {tuple(first_tok(p)["input_ids"][-2:]) for p in HETERO_PROMPTS} == {(1, 4)}  # b, ab
    assert {tuple(second_tok(p)["input_ids"][-2:]) for p in HETERO_PROMPTS} == {(4, 1)}  # ba, b
    exacts = [hetero_exact(hetero_toks, p) for p in HETERO_PROMPTS]
    assert all(e == exacts[0] for e in exacts[1:])
    # Sequences with "cd" are possible (the first member's token) and some sequences are impossible.
    cd = FIRST_TOKENS.index("cd")
    assert sum(p for seq, p in exacts[0].items() if cd in seq) > 0.05
    assert any(p == 0 for p in exacts[0].values())


def hetero_samples(hetero_toks, method: str, k="auto", seed: int = 8, contrastive: bool = False):
    key = ("hetero", method, k, seed, contrastive)
    if key not in _samples:
        method, draws = _draws(method)
        kwargs = dict(num_draft_tokens=k) if method == "se" else {}
        if draws:
            kwargs["options"] = {"draws": draws}
        ensemble = HETERO_CONTRASTIVE if contrastive else specops.WeightedEnsemble(list(HETERO_WEIGHTS))
        result = specops.decode([HETERO_PROMPTS[i % len(HETERO_PROMPTS)] for i in range(N)],
                                target=[TableLM(FIRST_TABLE), TableLM(SECOND_TABLE)],
                                tokenizer=list(hetero_toks), ensemble=ensemble, method=method,
                                max_new_tokens=HETERO_NEW, temperature=1.0, seed=seed, **kwargs)
        assert all(len(t) == HETERO_NEW for t in result.tokens)
        _samples[key] = result
    return _samples[key]


HETERO_CASES = [("se", "auto", False), ("se-alternate", "auto", False), ("se", 2, False), ("ensemble", "auto", False),
                ("se", "auto", True)]


@pytest.mark.slow
@pytest.mark.parametrize("method,k,contrastive", HETERO_CASES,
                         ids=[f"{m}-k{k}-{'contrastive' if c else 'weighted'}" for m, k, c in HETERO_CASES])
def test_hetero_sampled_sequences_follow_ensemble(hetero_toks, method, k, contrastive):
    result = hetero_samples(hetero_toks, method, k, contrastive=contrastive)
    exact = hetero_exact(hetero_toks, HETERO_PROMPTS[0], contrastive=contrastive)
    assert_follows(result.tokens, exact)
    if contrastive:  # "cd" is never emitted
        cd = FIRST_TOKENS.index("cd")
        assert all(p == 0 for seq, p in exact.items() if cd in seq)
    if method.startswith("se") and (k != "auto" or contrastive or method == "se-alternate"):
        assert 0 < result.stats.accepted < result.stats.drafted
    elif method == "se":  # mixture draws
        assert result.stats.drafted == 0


@pytest.mark.slow
def test_hetero_mixture_draws_catching_up_follow_ensemble(hetero_toks):
    """Mixture draws in batches of 2: a member no request chose sits a step out and then reads the
    tokens it missed (each as its own tokens, across vocabularies) in one forward; the continuations
    still follow the ensemble."""
    members = [TableLM(FIRST_TABLE), TableLM(SECOND_TABLE)]
    tokens, calls, steps = [], [0, 0], 0
    for start in range(0, N, 2):
        result = specops.decode([HETERO_PROMPTS[(start + i) % len(HETERO_PROMPTS)] for i in range(2)],
                                target=members, tokenizer=list(hetero_toks),
                                ensemble=specops.WeightedEnsemble(list(HETERO_WEIGHTS)), method="se",
                                max_new_tokens=HETERO_NEW, temperature=1.0, seed=start)
        tokens += result.tokens
        calls = [a + b - 1 for a, b in zip(calls, result.stats.member_calls)]  # less the prefill
        steps += result.stats.steps
    assert all(len(t) == HETERO_NEW for t in tokens)
    assert_follows(tokens, hetero_exact(hetero_toks, HETERO_PROMPTS[0]))
    assert all(0 < c < steps for c in calls)  # each member sat out some steps and ran in others


# ---- 3. the check can fail ----

@pytest.mark.slow
def test_chisquare_can_fail(hetero_toks):
    """The same check rejects wrong distributions: the weighted ensemble's samples against the mixture with
    swapped weights, against the first member alone and against the exact distribution with SHIFT of mass
    moved between its two likeliest sequences; samples of the first member alone against the ensemble; and
    on the other-vocabulary pair, the samples against swapped weights and against the first member alone."""
    samples = letter_samples("se", "w2").tokens
    exact = letter_exact("w2")
    assert fit(samples, exact)[0] > ALPHA
    for wrong in (letter_exact("w2-swapped"), letter_exact("w2", tables=[TABLES[0], TABLES[0]])):
        pvalue, impossible = fit(samples, wrong)
        assert impossible > 0 or pvalue < ALPHA
    assert fit(samples, shifted(exact, len(samples)))[0] < ALPHA

    tok = letter_tokenizer()
    alone = specops.decode([PROMPTS[i % len(PROMPTS)] for i in range(N)], target=TableLM(TABLES[0]),
                           tokenizer=tok, method="ar", max_new_tokens=NEW, temperature=1.0, seed=9).tokens
    own = letter_exact("w2", tables=[TABLES[0], TABLES[0]])
    assert fit(alone, own)[0] > ALPHA  # its own distribution fits
    pvalue, impossible = fit(alone, exact)
    assert impossible > 0 or pvalue < ALPHA  # the ensemble's does not

    hetero = hetero_samples(hetero_toks, "se").tokens
    assert fit(hetero, hetero_exact(hetero_toks, HETERO_PROMPTS[0]))[0] > ALPHA
    for weights in ((0.4, 0.6), (1.0, 0.0)):
        pvalue, impossible = fit(hetero, hetero_exact(hetero_toks, HETERO_PROMPTS[0], weights))
        assert impossible > 0 or pvalue < ALPHA, weights


# ---- 4. greedy: se == ensemble == ensemble-SD == a reference ----

# Ragged: 5, 18 and 31 bytes.
GREEDY_PROMPTS = ["abcab", "the cat; the cat; ", "Hello hello, Hello hello, Hello"]
GREEDY_NEW = 16


def _members(case: str) -> list:
    if case == "llama+gemma3":  # tiny_gemma3: every layer sliding, window 6
        return [tiny_llama(layers=2, seed=0), tiny_gemma3(layers=2, seed=1, sliding_window=6)]
    if case == "qwen3+mistral":  # mistral: every layer sliding
        return [arch_zoo.qwen3(seed=2, layers=2), arch_zoo.mistral(seed=3, layers=2)]
    if case == "gpt_neox+gemma3":  # arch_zoo.gemma3: sliding and full layers alternating
        return [arch_zoo.gpt_neox(seed=4, layers=2), arch_zoo.gemma3(seed=5, layers=2)]
    if case == "llama+qwen3+gemma3":
        return [arch_zoo.llama(seed=6, layers=2), arch_zoo.qwen3(seed=7, layers=2),
                arch_zoo.gemma3(seed=8, layers=2)]
    raise KeyError(case)


GREEDY_CASES = [
    ("llama+gemma3", specops.WeightedEnsemble([0.5, 0.5])),
    ("qwen3+mistral", specops.WeightedEnsemble([0.7, 0.3])),
    ("gpt_neox+gemma3", specops.ContrastiveEnsemble(0.1)),
    ("llama+gemma3", specops.ContrastiveEnsemble(0.1, alpha=0.1)),
    ("llama+qwen3+gemma3", specops.WeightedEnsemble([0.5, 0.3, 0.2])),
]


@pytest.fixture(scope="module")
def member_models():
    return {case: _members(case) for case in {c for c, _ in GREEDY_CASES}}


def reference_greedy(models, ensemble, prompt: str, tok, new: int) -> list[int]:
    """Greedy decoding of the ensemble from full forwards of the prompt alone, combined by
    specops.reference.ensemble_logits (float64)."""
    ids = tok(prompt)["input_ids"]
    for _ in range(new):
        with torch.no_grad():
            logits = [m(input_ids=torch.tensor([ids])).logits[0, -1].float() for m in models]
        if isinstance(ensemble, specops.WeightedEnsemble):
            combined = reference.ensemble_logits(logits, torch.tensor(ensemble.weights), reference.WEIGHTED)
        else:
            combined = reference.ensemble_logits(logits, torch.empty(0), reference.CONTRASTIVE, ensemble.mu,
                                                 ensemble.alpha or 0.0)
        ids.append(int(combined.argmax()))
        if ids[-1] == EOS_ID:  # the first member's EOS ends the request (and is part of its tokens)
            break
    return ids[len(tok(prompt)["input_ids"]):]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(GREEDY_CASES)), ids=[f"{c}-{e}" for c, e in GREEDY_CASES])
def test_greedy_se_equals_ensemble(member_models, index):
    """Greedy "ensemble" equals the reference; "se" (gamma 1, 2, and one per member), "auto" and "sd" (a
    drafter verified against the ensemble) equal "ensemble" token for token."""
    case, ensemble = GREEDY_CASES[index]
    models = member_models[case]
    tok = byte_tokenizer()
    toks = [tok] + [byte_tokenizer() for _ in models[1:]]  # equal vocabularies in other tokenizer objects

    def run(method, **kwargs):
        return specops.decode(GREEDY_PROMPTS, target=models, tokenizer=toks, ensemble=ensemble, method=method,
                              max_new_tokens=GREEDY_NEW, **kwargs)

    expected = run("ensemble")
    assert expected.tokens == [reference_greedy(models, ensemble, p, tok, GREEDY_NEW) for p in GREEDY_PROMPTS]
    calls = expected.stats.member_calls  # every member scores every token: the prefill, then a step per token
    assert calls == [calls[0]] * len(models) and calls[0] <= GREEDY_NEW
    assert expected.stats.target_calls == sum(expected.stats.member_calls)
    for k in ("auto", 2, tuple(range(1, len(models) + 1))):
        result = run("se", num_draft_tokens=k)
        assert result.tokens == expected.tokens, k
        assert len(result.stats.member_calls) == len(models)
        assert result.stats.target_calls == sum(result.stats.member_calls)
        assert result.stats.drafted > 0
    assert run("auto").tokens == expected.tokens  # "auto" without a drafter is se
    # ensemble-SD: the first member's first layer, or an independent model, drafting for the ensemble
    drafter = "self:1" if index % 2 == 0 else tiny_llama(layers=1, seed=9)
    result = run("sd", drafter=drafter, drafter_tokenizer=None if isinstance(drafter, str) else tok,
                 num_draft_tokens=3)
    assert result.tokens == expected.tokens
    assert result.stats.drafted > 0 and result.stats.drafter_calls > 0
    assert len(result.stats.member_calls) == len(models)


# Members with other vocabularies: a byte-level model and one whose multi-byte tokens win most of the time
# (test_decode_hetero.py's _multi_byte), in both orders: the ensemble lives on the first member's vocabulary,
# and the other member reads each emitted token as its own token(s).
MERGED_WORDS = ["Ġthe", "Ġcat", "Hello", "hello", "abc", "ab", "ca", "ll", "lo", "he", "Ġt"]


def _multi_byte(model):
    with torch.no_grad():
        model.lm_head.weight[BYTE_VOCAB:] *= 2
    return model


@pytest.mark.parametrize("first", ["byte", "merged"])
def test_greedy_se_equals_ensemble_other_vocabulary(first):
    merged = merged_byte_tokenizer(MERGED_WORDS)
    byte_model, byte_tok = tiny_llama(layers=2, seed=0), byte_tokenizer()
    merged_model = _multi_byte(tiny_llama(layers=2, seed=1, vocab=len(merged)))
    models, toks = [byte_model, merged_model], [byte_tok, merged]
    if first == "merged":
        models, toks = models[::-1], toks[::-1]
    ensemble = specops.WeightedEnsemble([0.6, 0.4])

    def run(method, **kwargs):
        return specops.decode(GREEDY_PROMPTS, target=models, tokenizer=toks, ensemble=ensemble, method=method,
                              max_new_tokens=GREEDY_NEW, **kwargs)

    expected = run("ensemble")
    if first == "merged":  # multi-byte tokens are emitted, and the byte-level member reads them as bytes
        assert any(t >= BYTE_VOCAB for row in expected.tokens for t in row)
    for k in ("auto", 3):
        result = run("se", num_draft_tokens=k)
        assert result.tokens == expected.tokens, k
        assert result.stats.drafted > 0
    assert run("tli", drafter=tiny_llama(layers=1, seed=9), drafter_tokenizer=byte_tok,
               num_draft_tokens=2).tokens == expected.tokens


# ---- 5. a model ensembled with itself is itself ----

@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_self_ensemble_equals_ar(model):
    m = tiny_llama(layers=2, seed=0) if model == "llama" else tiny_gemma3(layers=2, seed=1, sliding_window=6)
    tok = byte_tokenizer()
    expected = specops.decode(GREEDY_PROMPTS, target=m, tokenizer=tok, method="ar", max_new_tokens=GREEDY_NEW)
    for method in ("ensemble", "se"):
        result = specops.decode(GREEDY_PROMPTS, target=[m, m], tokenizer=[tok, tok],
                                ensemble=specops.WeightedEnsemble([0.5, 0.5]), method=method,
                                max_new_tokens=GREEDY_NEW)
        assert result.tokens == expected.tokens, method
        assert result.text == expected.text


def test_contrastive_mu_zero_is_the_expert():
    """mu = 0 (no alpha cut) scores the expert alone: greedy, the expert's own "ar" output."""
    expert, amateur = arch_zoo.qwen3(seed=2, layers=2), arch_zoo.mistral(seed=3, layers=2)
    tok = byte_tokenizer()
    expected = specops.decode(GREEDY_PROMPTS, target=expert, tokenizer=tok, method="ar",
                              max_new_tokens=GREEDY_NEW)
    for method in ("ensemble", "se"):
        result = specops.decode(GREEDY_PROMPTS, target=[expert, amateur], tokenizer=[tok, tok], method=method,
                                ensemble=specops.ContrastiveEnsemble(0.0), max_new_tokens=GREEDY_NEW)
        assert result.tokens == expected.tokens, method


# ---- 6. statistics ----

def test_se_stats_self_ensemble():
    """se of a model with itself: every draft accepted, and one member forward per token (the other's
    bonus verified in the same forward), against one forward per member per token for "ensemble"."""
    m = tiny_llama(layers=2, seed=0)
    tok = byte_tokenizer()
    results = {method: specops.decode(GREEDY_PROMPTS, target=[m, m], tokenizer=[tok, tok], method=method,
                                      max_new_tokens=GREEDY_NEW)
               for method in ("ensemble", "se")}
    se, ens = results["se"].stats, results["ensemble"].stats
    assert results["se"].tokens == results["ensemble"].tokens
    for s in (se, ens):
        assert len(s.member_calls) == 2 and all(c >= 1 for c in s.member_calls)
        assert s.target_calls == sum(s.member_calls)
        assert s.new_tokens == len(GREEDY_PROMPTS) * GREEDY_NEW
        assert "by member" in s.summary()
    assert ens.member_calls == [GREEDY_NEW, GREEDY_NEW]  # the prefill, then a step per token
    assert ens.drafted == 0
    assert se.drafted > 0 and se.accepted == se.drafted
    assert sum(se.member_calls) <= GREEDY_NEW + 2 < 2 * GREEDY_NEW
    assert abs(se.member_calls[0] - se.member_calls[1]) <= 2  # the members take turns


def test_mixture_draws_member_calls():
    """se's mixture draws at batch 1: every step runs exactly one member, member i on a share w_i of the
    steps (within 5 standard errors of the binomial; the draws are reproducible from the seed), and the
    member that catches up reads every token it missed in that one forward. A batch runs, per step, each
    member some request chose (never more than one forward per member)."""
    tok = letter_tokenizer()
    weights = [0.5, 0.3, 0.2]
    new = 400
    result = specops.decode("cab", target=[TableLM(t) for t in TABLES], tokenizer=[tok] * 3,
                            ensemble=specops.WeightedEnsemble(weights), method="se", max_new_tokens=new,
                            temperature=1.0, seed=11)
    s = result.stats
    steps = new - 1  # the first token comes from the prefill, which every member ran
    assert s.steps == steps and s.drafted == 0 and len(result.tokens) == new
    assert sum(s.member_calls) == 3 + steps
    for calls, w in zip(s.member_calls, weights):
        share = calls - 1
        assert abs(share - w * steps) <= 5 * math.sqrt(steps * w * (1 - w)), (s.member_calls, weights)
    batched = specops.decode(PROMPTS * 4, target=[TableLM(t) for t in TABLES], tokenizer=[tok] * 3,
                             ensemble=specops.WeightedEnsemble(weights), method="se", max_new_tokens=6,
                             temperature=1.0, seed=11).stats
    assert batched.drafted == 0 and all(c <= 1 + batched.steps for c in batched.member_calls)


def test_member_calls_for_ensemble_sd():
    tok = letter_tokenizer()
    result = specops.decode(PROMPTS, target=[TableLM(t) for t in TABLES], tokenizer=[tok] * 3,
                            ensemble=specops.WeightedEnsemble([0.5, 0.3, 0.2]), method="sd",
                            drafter=TableLM(DRAFTER_TABLE), drafter_tokenizer=tok, num_draft_tokens=2,
                            max_new_tokens=6, temperature=1.0, seed=1)
    s = result.stats
    assert len(s.member_calls) == 3 and len(set(s.member_calls)) == 1  # every member scores every step
    assert s.target_calls == sum(s.member_calls) and s.drafter_calls > 0


# ---- engine behaviours with an ensemble ----

def _toy_ensemble(method, prompts=PROMPTS, rule="w2", **kwargs):
    count, ensemble = RULES[rule]
    tok = letter_tokenizer()
    return specops.decode(prompts, target=[TableLM(t) for t in TABLES[:count]], tokenizer=[tok] * count,
                          ensemble=ensemble, method=method, **kwargs)


@pytest.mark.parametrize("rule", ["w3", "cd"])
def test_greedy_max_new_tokens_and_stop(rule):
    """Greedy se stops at max_new_tokens exactly (its chunks of drafts and bonus tokens cut to the budget)
    and at stop strings, as "ensemble" does, for every draft-length setting."""
    full = _toy_ensemble("ensemble", rule=rule, max_new_tokens=9)
    assert all(len(t) == 9 for t in full.tokens)
    count = RULES[rule][0]
    for max_new in (1, 2, 3, 9):
        for k in ("auto", 3, (3,) + (1,) * (count - 1)):
            result = _toy_ensemble("se", rule=rule, max_new_tokens=max_new, num_draft_tokens=k)
            assert result.tokens == [t[:max_new] for t in full.tokens], (max_new, k)
    # A stop string the first request meets after a few tokens (its first occurrence there).
    text = full.text[0]
    at, stop = next((i, text[i:i + n]) for n in (2, 3, 4, 5) for i in range(1, 5)
                    if text.find(text[i:i + n]) == i)
    expected = _toy_ensemble("ensemble", rule=rule, max_new_tokens=9, stop=stop)
    assert expected.text[0] == text[:at]
    for k in ("auto", 3):
        result = _toy_ensemble("se", rule=rule, max_new_tokens=9, stop=stop, num_draft_tokens=k)
        assert result.text == expected.text, k


def test_single_prompt_result_shape():
    result = _toy_ensemble("se", prompts="cab", max_new_tokens=5, temperature=1.0, seed=3)
    assert isinstance(result.text, str) and len(result.text) == 5
    assert isinstance(result.tokens, list) and len(result.tokens) == 5
    assert all(isinstance(t, int) for t in result.tokens)
    assert result.stats.new_tokens == 5


@pytest.mark.parametrize("method, k, temperature", [("se", 2, 1.0), ("se", "auto", 1.0), ("se", "auto", 0.7),
                                                    ("ensemble", None, 1.0)])
def test_sampling_reproducible_from_seed(method, k, temperature):
    """The same seed gives the same text: se's "auto" (gamma 1 per member; mixture draws at T = 1, the members
    proposing in turn at 0.7) decides nothing from timings."""
    prompts = PROMPTS * 16
    kwargs = dict(max_new_tokens=6, temperature=temperature, **({"num_draft_tokens": k} if method == "se" else {}))
    first = _toy_ensemble(method, prompts, seed=5, **kwargs).tokens
    assert _toy_ensemble(method, prompts, seed=5, **kwargs).tokens == first
    assert _toy_ensemble(method, prompts, seed=6, **kwargs).tokens != first


# ---- 7. bad input ----

def _toy():
    """Three TableLMs (each counts its forwards in .calls: the tests assert none ran) and their tokenizer."""
    return TableLM(TABLES[0]), TableLM(TABLES[1]), TableLM(TABLES[2]), letter_tokenizer()


def test_ensemble_objects_reject_bad_settings():
    with pytest.raises(ValueError, match="sum to 1"):
        specops.WeightedEnsemble([0.6, 0.3])
    with pytest.raises(ValueError, match="sum to 1"):
        specops.WeightedEnsemble([0.7, 0.7])
    for weights in ([1.0, 0.0], [1.2, -0.2], [0.5, 0.5, 0.0]):
        with pytest.raises(ValueError, match="every weight must be > 0"):
            specops.WeightedEnsemble(weights)
    for weights in ([], "0.5,0.5", [0.5, "0.5"], [float("nan"), 0.5], 1.0):
        with pytest.raises(ValueError, match="weights must be a list of numbers"):
            specops.WeightedEnsemble(weights)
    for mu in (-0.1, float("inf"), float("nan"), "1"):
        with pytest.raises(ValueError, match="mu must be a finite number >= 0"):
            specops.ContrastiveEnsemble(mu)
    for alpha in (0, 0.0, 1, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"alpha must be None or in \(0, 1\)"):
            specops.ContrastiveEnsemble(0.5, alpha=alpha)
    specops.ContrastiveEnsemble(0.0)  # mu = 0 is the expert alone: allowed
    specops.WeightedEnsemble((0.1,) * 10)  # sums to 1 within rounding


def _bad_cases():
    a, b, c, tok = _toy()
    w = specops.WeightedEnsemble
    return [
        ("wrong-weight-count", dict(target=[a, b], tokenizer=[tok, tok], ensemble=w([0.5, 0.3, 0.2])),
         ValueError, "has 3 weights for 2 members"),
        ("wrong-weight-count-3", dict(target=[a, b, c], tokenizer=[tok] * 3, ensemble=w([0.5, 0.5])),
         ValueError, "has 2 weights for 3 members"),
        ("one-member", dict(target=[a], tokenizer=[tok]), ValueError, "at least 2 members"),
        ("one-member-tuple", dict(target=(a,), tokenizer=(tok,), method="se"), ValueError,
         "at least 2 members"),
        ("tokenizers-short", dict(target=[a, b, c], tokenizer=[tok, tok]), ValueError,
         "tokenizer must be a list of 3"),
        ("tokenizers-long", dict(target=[a, b], tokenizer=[tok] * 3), ValueError,
         "tokenizer must be a list of 2"),
        ("tokenizer-not-list", dict(target=[a, b], tokenizer=tok), ValueError,
         "tokenizer must be a list of 2"),
        ("tokenizer-none", dict(target=[a, b], tokenizer=None), ValueError, r"target\[0\] is a model object"),
        ("tokenizer-list-single-target", dict(target=a, tokenizer=[tok, tok]), ValueError,
         "a list of tokenizers needs a list of targets"),
        ("ensemble-single-target", dict(target=a, tokenizer=tok, ensemble=w([0.5, 0.5])), ValueError,
         "ensemble= needs an ensemble of targets"),
        ("contrastive-3",
         dict(target=[a, b, c], tokenizer=[tok] * 3, ensemble=specops.ContrastiveEnsemble(0.5)), ValueError,
         "exactly 2 members"),
        ("se-single", dict(target=a, tokenizer=tok, method="se"), ValueError, "'se' decodes an ensemble"),
        ("ensemble-single", dict(target=a, tokenizer=tok, method="ensemble"), ValueError,
         "'ensemble' decodes an ensemble"),
        ("ngram", dict(target=[a, b], tokenizer=[tok, tok], method="ngram"), ValueError,
         "'ngram' does not take an ensemble"),
        ("slem", dict(target=[a, b], tokenizer=[tok, tok], method="slem", drafter=c, drafter_tokenizer=tok),
         ValueError, "'slem' does not take an ensemble"),
        ("rsd-s", dict(target=[a, b], tokenizer=[tok, tok], method="rsd-s", drafter=c, drafter_tokenizer=tok,
                       num_draft_tokens=(2, 2)), ValueError, "'rsd-s' does not take an ensemble"),
        ("ensemble-not-object", dict(target=[a, b], tokenizer=[tok, tok], ensemble=[0.5, 0.5]), TypeError,
         "ensemble must be specops.WeightedEnsemble"),
        ("ensemble-string", dict(target=[a, b], tokenizer=[tok, tok], ensemble="weighted"), TypeError,
         "ensemble must be"),
        ("se-gammas-short", dict(target=[a, b, c], tokenizer=[tok] * 3, method="se", num_draft_tokens=(1, 2)),
         ValueError, "has 2 values for 3 members"),
        ("se-gammas-long", dict(target=[a, b], tokenizer=[tok, tok], method="se", num_draft_tokens=(1, 2, 3)),
         ValueError, "has 3 values for 2 members"),
        ("se-gamma-zero", dict(target=[a, b], tokenizer=[tok, tok], method="se", num_draft_tokens=0),
         ValueError, "num_draft_tokens for method 'se'"),
        ("se-gamma-tuple-zero",
         dict(target=[a, b], tokenizer=[tok, tok], method="se", num_draft_tokens=(1, 0)), ValueError,
         "num_draft_tokens for method 'se'"),
        ("se-with-drafter",
         dict(target=[a, b], tokenizer=[tok, tok], method="se", drafter=c, drafter_tokenizer=tok), ValueError,
         "does not use a drafter"),
        ("se-draws-unknown", dict(target=[a, b], tokenizer=[tok, tok], method="se", options={"draws": "both"}),
         ValueError, "se's draws must be one of auto, alternate, mixture"),
        ("se-mixture-contrastive",
         dict(target=[a, b], tokenizer=[tok, tok], method="se", ensemble=specops.ContrastiveEnsemble(0.5),
              options={"draws": "mixture"}), ValueError, "draws='mixture' samples a weighted ensemble"),
        ("se-mixture-top-k", dict(target=[a, b], tokenizer=[tok, tok], method="se", top_k=3,
                                  options={"draws": "mixture"}), ValueError, "without top-k or top-p"),
        ("se-mixture-gamma", dict(target=[a, b], tokenizer=[tok, tok], method="se", num_draft_tokens=2,
                                  options={"draws": "mixture"}), ValueError, "drafts nothing"),
    ], (a, b, c)


BAD_IDS = [case[0] for case in _bad_cases()[0]]


@pytest.mark.parametrize("index", range(len(BAD_IDS)), ids=BAD_IDS)
def test_bad_ensemble_input(index):
    cases, models = _bad_cases()
    _, kwargs, error, match = cases[index]
    with pytest.raises(error, match=match):
        specops.decode(PROMPTS, max_new_tokens=4, temperature=1.0, seed=1, **kwargs)
    assert all(m.calls == 0 for m in models), "a model ran before the input was refused"


def test_missing_member_tokenizer_message():
    """target=[model, model] with no tokenizers names the member and the tokenizer=[...] keyword, not the
    drafter's keyword."""
    a, b, _, _ = _toy()
    with pytest.raises(ValueError, match=r"target\[0\] is a model object") as info:
        specops.decode(PROMPTS, target=[a, b], max_new_tokens=4)
    assert "drafter_tokenizer" not in str(info.value) and "tokenizer=[...]" in str(info.value), str(info.value)


def test_ensemble_of_position_shifting_members_decodes_apart_with_member_calls():
    """Members whose positions left padding would shift (BartForCausalLM takes no position_ids) decode a
    ragged batch one request at a time: each row equals that prompt alone, and the forwards per member are
    summed over the requests, not dropped."""
    import transformers

    def bart(seed):
        torch.manual_seed(seed)
        config = transformers.BartConfig(
            vocab_size=BYTE_VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=2, encoder_layers=1,
            encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=128,
            is_decoder=True, is_encoder_decoder=False, pad_token_id=0, eos_token_id=EOS_ID, bos_token_id=2)
        return transformers.BartForCausalLM(config).eval()

    models, prompts = [bart(1), bart(2)], ["abcab", "the cat; the cat; ", "Hello"]

    def run(prompt):
        return specops.decode(prompt, target=models, tokenizer=[byte_tokenizer(), byte_tokenizer()],
                              method="ensemble", max_new_tokens=6)

    together = run(prompts)
    alone = [run(p) for p in prompts]
    assert together.tokens == [r.tokens for r in alone]
    assert together.stats.member_calls == [sum(r.stats.member_calls[m] for r in alone) for m in range(2)]
    assert together.stats.target_calls == sum(together.stats.member_calls)
