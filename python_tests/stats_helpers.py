"""Statistical helpers and the table-defined toy distributions that the decoding tests share.

- SD_*: the same-vocabulary toy pair of test_decode.py (trigram tables over "abcd") and its chi-square on
  whole continuations (N_SEQUENCES, ALPHA, _assert_powered, _fit, assert_follows_target), plus
  check_stats, the invariants of every result's statistics, and PROMPTS, its ragged byte prompts.
- The draft-length controller's synthetic costs and simulation (cpu_like, _true_rate, _simulate).
- TLI_*: the pair with different vocabularies of test_decode_hetero.py (TARGET_TOKENS / DRAFTER_TOKENS,
  TLI_TARGET_TABLE, CLOSE_TABLE) and its pooled chi-square (_exact, _pooled_fit).
- The per-token chi-square of the kernel tests (N_DRAWS, P_VALUE_MIN, chisquare_pvalue).

Test modules import these by name (`from stats_helpers import ...`: python_tests is on sys.path), not
from one another.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch
from scipy import stats as scipy_stats

from specops.decoding.cost_model import DraftLength
from toy_models import random_table, sequence_distribution, token_sequence_distribution

# ==== test_decode.py: the same-vocabulary toy pair ====

# Ragged on purpose: 1 to 43 bytes, multi-byte UTF-8 included.
PROMPTS = ["Hello world", "a", "The quick brown fox jumps over the lazy dog", "ünïcödé ✓ 42"]


def check_stats(result, method: str):
    """Invariants every result's statistics satisfy."""
    s = result.stats
    tokens = result.tokens if result.tokens and isinstance(result.tokens[0], list) else [result.tokens]
    assert s.new_tokens == sum(len(t) for t in tokens)
    assert s.target_calls >= 1
    assert 0 <= s.accepted <= s.drafted
    assert s.seconds > 0
    for part in (s.draft_seconds, s.verify_seconds, s.forward_seconds, s.other_seconds):
        assert part >= 0
    assert s.draft_seconds + s.verify_seconds <= s.seconds * 1.001 + 1e-6
    assert s.forward_seconds <= s.seconds * 1.001 + 1e-6
    assert 0 <= s.overhead_fraction <= 1
    assert s.tokens_per_second == pytest.approx(s.new_tokens / s.seconds)
    assert isinstance(s.summary(), str)
    if method == "ar":
        assert s.drafted == s.accepted == s.drafter_calls == 0
    else:  # the drafter reads the prompt with its first draft: a request that never drafts never runs it
        assert s.drafter_calls >= (1 if s.drafted else 0)
        assert len(s.draft_lengths) == s.steps


# The toy target and drafter: trigram tables over "abcd" with some exact zeros, in different places,
# so drafts the target never produces occur (always rejected) and target tokens the drafter never
# proposes occur (only reachable through the residual).
SD_TARGET_TABLE = random_table(1)
SD_DRAFTER_TABLE = random_table(2)
SD_STAT_NEW = 4  # new tokens per sequence: 4^4 = 256 joint outcomes (224 possible under the target)
# Prompts of different lengths ending in the same two letters: one exact distribution, ragged padding.
SD_STAT_PROMPTS = ["ab", "cab", "dddab", "bab"]
# Sequences drawn per check. The hardest 1% error to see in a chi-square on the joint distribution is
# 1% of probability mass moved between the two most likely sequences (the noncentrality
# N * 0.01^2 * (1/p1 + 1/p2) is smallest there); at N = 30000 a test at alpha = 1e-3 catches it
# with power >= 0.99 (asserted in `_assert_powered`, and shown on real samples in
# test_decode.py's test_chisquare_can_fail).
N_SEQUENCES = 30_000
ALPHA = 1e-3


def _assert_powered(exact: dict[str, float]):
    probs = sorted((p for p in exact.values() if p > 0), reverse=True)
    df = len(probs) - 1
    noncentrality = N_SEQUENCES * 0.01**2 * (1 / probs[0] + 1 / probs[1])
    power = scipy_stats.ncx2.sf(scipy_stats.chi2.isf(ALPHA, df), df, noncentrality)
    assert power >= 0.99, f"N = {N_SEQUENCES} cannot catch a 1% error (power {power:.3f})"


def _fit(texts: list[str], exact: dict[str, float]) -> tuple[float, int]:
    """(chi-square p-value over the possible sequences, number of impossible sequences drawn)."""
    counts = collections.Counter(texts)
    assert sum(counts.values()) == len(texts)
    impossible = sum(n for seq, n in counts.items() if exact.get(seq, 0.0) == 0.0)
    support = [seq for seq, p in exact.items() if p > 0]
    observed = [counts[seq] for seq in support]
    expected = [exact[seq] * sum(observed) for seq in support]
    return float(scipy_stats.chisquare(observed, expected).pvalue), impossible


def mass_moved(exact: dict[str, float], amount: float = 0.01) -> dict[str, float]:
    """`exact` with `amount` of probability moved from its likeliest sequence to the next: the wrong target a
    check that can fail must reject."""
    shifted = dict(exact)
    first, second = sorted(exact, key=exact.get, reverse=True)[:2]
    shifted[first] -= amount
    shifted[second] += amount
    return shifted


def assert_follows_target(texts: list[str], temperature: float, top_k: int) -> None:
    """Chi-square of sampled continuations against the exact sequence distribution of SD_TARGET_TABLE."""
    exact = sequence_distribution(SD_TARGET_TABLE, "ab", SD_STAT_NEW, temperature, top_k)
    _assert_powered(exact)
    pvalue, impossible = _fit(texts, exact)
    assert impossible == 0, "sequences with probability 0 under the target were produced"
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}"


# ==== test_decode.py: the draft-length controller on synthetic costs ====

def cpu_like(n: int) -> float:
    """Target forward over n tokens: 50 ms for one, growing linearly to 2.4x at n = 8."""
    return 0.05 * (1 + 1.4 * (n - 1) / 7)


STEP_COST = 0.002


def _true_rate(cost, draft_cost: float, acceptance: float, k: int) -> float:
    expected = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    return expected / (k * draft_cost + cost(k + 1) + STEP_COST)


def _simulate(cost, draft_cost: float, acceptance: float, steps: int = 200, rows: int = 4, seed: int = 0):
    """Run the controller against synthetic costs; each row accepts drafts independently with
    probability `acceptance` until the first rejection. Returns the chosen K per step."""
    rng = random.Random(seed)
    controller = DraftLength("auto")
    chosen = []
    for _ in range(steps):
        k = controller.choose(rows)
        chosen.append(k)
        accepted = []
        for _ in range(rows):
            n = 0
            while n < k and rng.random() < acceptance:
                n += 1
            accepted.append(n)
        controller.observe(k, cost(k + 1), draft_cost if k else None, STEP_COST, accepted, [k] * rows)
    return chosen


# ==== test_decode_hetero.py: the pair with different vocabularies ====

TARGET_TOKENS = ["a", "b", "c", "d", "ab", "cd"]
DRAFTER_TOKENS = ["a", "b", "c", "d", "ba", "ab", "abc"]
# Each drafter id's target id (-1: drafter-only), what vocab_map must find.
DRAFT_TO_TARGET = [TARGET_TOKENS.index(t) if t in TARGET_TOKENS else -1 for t in DRAFTER_TOKENS]


def _drafter_table(seed: int, mirror: float, target_table: torch.Tensor) -> torch.Tensor:
    """A drafter table: `mirror` of the target's next-token distribution moved into drafter ids (where
    the drafter's two previous tokens are target tokens too), plus 1 - mirror of a random table that
    also drafts "ba" and "abc". mirror = 0 is unrelated to the target."""
    n = len(DRAFTER_TOKENS)
    random = random_table(seed, zeros=16, tokens=n)
    mirrored = random.clone()
    shared = [d for d in range(n) if DRAFT_TO_TARGET[d] >= 0]
    start_t = len(TARGET_TOKENS)
    for prev2 in range(n + 1):
        for prev1 in range(n):
            t2 = start_t if prev2 == n else DRAFT_TO_TARGET[prev2]
            t1 = DRAFT_TO_TARGET[prev1]
            if t2 < 0 or t1 < 0:
                continue
            row = torch.zeros(n + 1, dtype=torch.float64)
            row[shared] = target_table[t2, t1, [DRAFT_TO_TARGET[d] for d in shared]]
            if row.sum() > 0:
                mirrored[prev2, prev1] = row / row.sum()
    return mirror * mirrored + (1 - mirror) * random


def _sharpened(table: torch.Tensor, power: float) -> torch.Tensor:
    table = table**power
    return table / table.sum(-1, keepdim=True)


# Exact zeros in different places in the target and the drafter: drafts the target never emits, and
# target tokens (besides the target-only "cd") the drafter never proposes. Squared, so the likeliest
# 4-token continuations have probability > 1% (a 1% error can be moved between them, section 3 of
# test_decode_hetero.py).
TLI_TARGET_TABLE = _sharpened(random_table(21, zeros=16, tokens=len(TARGET_TOKENS)), 2)
CLOSE_TABLE = _drafter_table(22, 0.6, TLI_TARGET_TABLE)

# Tiny random transformers models: a byte-level vocabulary against one with multi-byte tokens, both ways.
MERGED_WORDS = ["Ġthe", "Ġqu", "Ġw", "he", "ll", "or", "ow", "Ã¼"]

# Prompts ending in the same two target tokens (b, ab), of different lengths; the drafter reads them
# differently ("bab" is ba·b for it), so its contexts vary while the target's exact distribution is one.
TLI_STAT_PROMPTS = ["bab", "cbab", "ddbab", "dbab"]
STAT_CONTEXT = [TARGET_TOKENS.index("b"), TARGET_TOKENS.index("ab")]
TLI_STAT_NEW = 4  # 6^4 = 1296 target token sequences; a draft length of 2 makes chains of two drafts
STAT_K = 2
MIN_EXPECTED = 5  # sequences expected fewer times share one chi-square cell (Cochran's rule)


def _exact(temperature: float = 1.0, top_k: int = 0) -> dict:
    return token_sequence_distribution(TLI_TARGET_TABLE, STAT_CONTEXT, TLI_STAT_NEW, temperature, top_k)


def _pooled_fit(tokens: list[list[int]], exact: dict) -> tuple[float, int]:
    """_fit after pooling the sequences expected < MIN_EXPECTED times into one cell; a
    sequence of probability 0 stays itself, so it still counts as impossible."""
    rare = {seq for seq, p in exact.items() if 0 < p * len(tokens) < MIN_EXPECTED}
    pooled = {seq: p for seq, p in exact.items() if seq not in rare}
    pooled["rare"] = sum(exact[seq] for seq in rare)
    _assert_powered(pooled)
    return _fit(["rare" if tuple(t) in rare else tuple(t) for t in tokens], pooled)


# ==== test_chain_verify.py: per-token chi-square of the kernel tests ====
#
# N = 200,000 draws per test. A 1% absolute error moving mass between two tokens of probabilities
# a + b <= 1 gives the chi-square statistic a noncentrality of N * 0.01**2 * (1/a + 1/b) >= 4e-4 * N
# = 80, which the test at level 1e-3 detects with probability > 0.99998 for up to 9 degrees of
# freedom (scipy.stats.ncx2). For a correct sampler the p-value is uniform, so a fixed seed fails
# with probability 1e-3; the tests' seeds are fixed, so every run computes the same p-values.
N_DRAWS = 200_000
P_VALUE_MIN = 1e-3


def chisquare_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of `tokens` to `probs` over the tokens with positive probability."""
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts[support].sum()
    return float(scipy_stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)
