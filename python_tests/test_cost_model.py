"""Tests of the cost model every draft-size choice asks (`specops.decoding.cost_model`): the fitted step
cost (CostPlane, StepCost), acceptance counted per number of children from the paths verification walked,
expected tokens, the tree chooser (`TreeShape`, num_draft_tokens="auto" for rsd-c, rsd-s and specinfer)
under GPU-like and CPU-like costs, the probe out of plain decoding, what a call carries to the next, decode()
with "auto" equal to greedy "ar" on the toy models, and a same-tokenizer drafter whose LM head has padding
rows (never drafted). The chain chooser (`DraftLength`) is driven in test_decode.py, n-gram shapes in
test_decode_ngram.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import specops
from specops.decoding.rsd import _path
from specops.decoding.cost_model import CatchUp, CostPlane, DraftLength, StepCost, TreeShape, nodes
from stats_helpers import SD_DRAFTER_TABLE as DRAFTER_TABLE
from stats_helpers import SD_TARGET_TABLE as TARGET_TABLE
from toy_models import TableLM, letter_tokenizer


def _measured(beams: bool, target_cost, draft_cost: float, accept_first: float, steps: int = 400) -> TreeShape:
    """A chooser fed `steps` synthetic observations: the target forward costs target_cost(nodes + 1), a
    drafter forward draft_cost, and the first child of every path node is accepted with probability
    accept_first (else the second, half as often), on (2, 2) trees or (2, 2) beams."""
    chooser = TreeShape(beams, (2, 2))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        path, level = [], 0
        while level < 2:
            u = float(torch.rand((), generator=gen))
            rank = 1 if u < accept_first else 2 if u < accept_first + (1 - accept_first) / 2 else 0
            path.append((2, rank))
            if not rank:
                break
            level += 1
        if level == 2:
            path.append((0, 0))
        chooser.observe((2, 2), 1, target_cost(nodes((2, 2), beams) + 1), draft_cost, 1e-4, [path])
        chooser.observe((), 1, target_cost(1), None, 1e-4, [])
    return chooser


def test_acceptance_counts_each_prefix_of_children():
    chooser = TreeShape(False, (2, 2))
    # root: 3 children, the second accepted; then 2 children, none accepted
    chooser.observe((3, 2), 1, 0.01, 0.001, 0.0, [[(3, 2), (2, 0)]])
    acceptance = chooser.acceptance
    assert acceptance.seen[1:4].tolist() == [2, 2, 1]
    assert acceptance.hits[1:4].tolist() == [0, 1, 1]
    # a(2) = (1 + 1) / (2 + 2) with the Beta(1, 1) prior
    assert acceptance(2) == pytest.approx(0.5)
    # past the widest measured (3): independent children, 1 - (1 - a(3)) (1 - a(1))^(b - 3)
    a3, a1 = 2 / 3, 1 / 4
    assert acceptance(4) == pytest.approx(1 - (1 - a3) * (1 - a1))
    assert acceptance(2.5) == pytest.approx(0.5 + 0.5 * (a3 - 0.5))  # fractional: interpolated


def test_expected_tokens_of_a_branching():
    chooser = TreeShape(False, (2,))
    acceptance = chooser.acceptance
    acceptance.seen[1:3] = 1e6
    acceptance.hits[1], acceptance.hits[2] = 0.5e6, 0.75e6
    a1, a2 = acceptance(1), acceptance(2)
    assert chooser.expected_tokens((2, 1)) == pytest.approx(1 + a2 + a2 * a1)
    assert chooser.expected_tokens(()) == 1
    # a chain is the path (1, ..., 1): E = (1 - a^(K+1)) / (1 - a)
    chain = DraftLength("auto")
    chain.acceptance.hits[1], chain.acceptance.seen[1] = 0.8e6 - 1, 1e6 - 2
    assert chain.expected_tokens((1,) * 4) == pytest.approx((1 - 0.8 ** 5) / (1 - 0.8))


def test_flat_costs_choose_a_big_tree_and_steep_costs_plain_decoding():
    for beams in (False, True):
        gpu = _measured(beams, lambda n: 0.010, 0.0005, 0.8)  # a forward of 40 tokens costs one of 1
        shape = gpu.choose()
        assert shape and nodes(shape, beams) >= 6, shape
        cpu = _measured(beams, lambda n: 0.010 * n, 0.008, 0.8)  # cost grows with every token
        assert cpu.choose() == ()


def test_plain_decoding_probes_a_one_node_tree():
    """A poor drafter where one node could pay if always accepted: plain decoding, with a one-node probe
    after 8 plain steps; where even that could not pay (every token costs a plain step), no probe."""
    poor = _measured(False, lambda n: 0.010 * (1 + 0.5 * (n - 1)), 0.004, 0.1)
    shapes = [poor.choose() for _ in range(9)]
    assert shapes[:7] == [()] * 7 and (1,) in shapes
    steep = _measured(False, lambda n: 0.010 * n, 0.008, 0.8)
    assert [steep.choose() for _ in range(20)] == [()] * 20


def test_a_batch_size_never_seen_plain_decodes_a_plain_step_first():
    """A plain step is priced by extrapolation only where none ran near its batch size: the memory's first
    steps with 8 requests all drafted, priced plain steps at 88 ms where they took 72, and drafted at a loss.
    So a chooser asked at such a size decodes one plain step there first, for chains as for n-gram shapes."""
    from specops.decoding.ngram_shape import DraftShape

    cost = StepCost()
    for _ in range(4):
        cost.observe(1, 1, 0.040)  # plain with one request
        cost.observe(1, 4, 0.050)  # and with drafts
    assert cost.measured_plain() and cost.measured_plain(1) and cost.measured_plain(2)
    assert not cost.measured_plain(8) and not cost.measured_plain(3)
    chooser = DraftLength("auto", max_drafts=4)
    chooser.cost = cost
    chooser.cost.drafter = 0.001
    assert chooser.choose(8) == 0
    shape = DraftShape("auto", None, "cpu", cost=cost)
    rows = torch.arange(8 * 8 * 8).view(8, 8, 8)  # eight requests, every row a full draft
    assert shape.choose(rows, torch.ones(8, dtype=torch.long)) == (0, 0)
    assert not shape.shapes(rows, torch.ones(8, dtype=torch.long)).any()
    assert shape.widths(rows[:, :1], torch.ones(8, dtype=torch.long)) == [0] * 8
    cost.observe(8, 8, 0.072)
    assert cost.measured_plain(8) and cost.measured_plain(5) and not cost.measured_plain(17)
    assert shape.choose(rows, torch.ones(8, dtype=torch.long)) != (0, 0)  # one plain step was enough


def test_path_from_emitted_tokens():
    # root -> children 1 (token 5), 2 (token 6); node 2 -> child 3 (token 7)
    tokens, parents = [0, 5, 6, 7], [0, 0, 0, 2]
    assert _path(tokens, parents, [6, 7, 9], 2) == [(2, 2), (1, 1), (0, 0)]
    assert _path(tokens, parents, [4], 0) == [(2, 0)]


@pytest.mark.parametrize("method", ["rsd-c", "rsd-s", "specinfer"])
def test_auto_greedy_equals_ar(method):
    tok = letter_tokenizer()
    prompts = ["ab", "ba", "abab"]
    kwargs = dict(target=TableLM(TARGET_TABLE), tokenizer=tok, max_new_tokens=12)
    expected = specops.decode(prompts, method="ar", **kwargs).tokens
    result = specops.decode(prompts, method=method, drafter=TableLM(DRAFTER_TABLE), drafter_tokenizer=tok,
                            num_draft_tokens="auto", **kwargs)
    assert result.tokens == expected
    assert result.stats.draft_lengths[0] > 0  # the first step measures a tree


@pytest.mark.parametrize("method", ["rsd-c", "rsd-s"])
def test_drafter_with_a_padded_head_equals_ar(method):
    """The target's tokenizer over a drafter LM head with more rows (padding): the rows past the target's
    vocabulary are never drafted, and greedy output equals ar's."""
    from toy_models import BYTE_VOCAB, byte_tokenizer, tiny_llama

    tok = byte_tokenizer()
    target = tiny_llama(layers=2, seed=0, vocab=BYTE_VOCAB + 1)
    drafter = tiny_llama(layers=1, seed=1, vocab=BYTE_VOCAB + 9)
    with torch.no_grad():  # the padding rows would win most draws if they could be drafted
        drafter.lm_head.weight[BYTE_VOCAB + 1:] *= 100
    prompts = ["abcab", "the cat; the cat; "]
    expected = specops.decode(prompts, target=target, tokenizer=tok, method="ar", max_new_tokens=10).tokens
    result = specops.decode(prompts, target=target, tokenizer=tok, drafter=drafter, drafter_tokenizer=tok,
                            method=method, num_draft_tokens=(2, 2), max_new_tokens=10)
    assert result.tokens == expected
    assert result.stats.drafted > 0


# ---- the step cost ----

def test_step_cost_fits_and_pools():
    """With one request: None before any step, flat through one size, the exact line through two or more, a
    slope never below 0, newer steps weighing more; a noisy step at one size moves that size's prediction
    only by its share of all the steps; drafter forwards and the time outside forwards add on."""
    cost = StepCost()
    assert cost(1, 3) is None and cost.largest() == 0 and cost.reach() == 0 and not cost.measured_plain()
    cost.observe(1, 2, 0.04)
    assert cost(1, 2) == pytest.approx(0.04) and cost(1, 9) == pytest.approx(0.04)
    assert cost.reach() == 4 and not cost.measured_plain()
    for n in (1, 4, 8):
        cost.observe(1, n, 0.03 + 0.005 * n)
    assert cost(1, 16) == pytest.approx(0.11) and cost(1, 1) == pytest.approx(0.035)
    assert cost.at(1, torch.tensor([[1, 16]]))[0].tolist() == pytest.approx([0.035, 0.11])
    assert cost.largest() == 8 and (1, 4) in cost.sizes and len(cost.sizes) == 4 and cost.measured_plain()
    cost.observe(1, 1, 0.035, drafter_seconds=0.01, outside_seconds=0.002)
    assert cost(1, 4, forwards=3) == pytest.approx(0.05 + 3 * 0.01 + 0.002)
    copied = cost.copy()
    copied.observe(1, 1, 1.0, 1.0, 1.0)
    assert cost(1, 4, forwards=3) == pytest.approx(0.05 + 3 * 0.01 + 0.002)  # a copy, not a view
    falling = StepCost()
    for n, seconds in ((1, 0.05), (4, 0.04)):
        falling.observe(1, n, seconds)
    assert falling(1, 1) == falling(1, 4) == pytest.approx((0.97 * 0.05 + 0.04) / 1.97)  # falling is noise: flat
    drifting = StepCost(decay=0.5)
    drifting.observe(1, 1, 0.10)
    drifting.observe(1, 1, 0.02)
    assert drifting(1, 1) == pytest.approx((0.5 * 0.10 + 0.02) / 1.5)
    pooled = StepCost()
    for step in range(40):
        pooled.observe(1, 1 + step % 8, 0.05 + 0.001 * (1 + step % 8))
    pooled.observe(1, 3, 0.5)  # one step ten times too slow
    assert pooled(1, 3) < 0.08 and pooled(1, 8) < 0.09


def _least_squares_reference(xx, xy, order, apart=CostPlane._APART):
    """CostPlane's fit by the definition: a term enters where the terms before it leave more than `apart` of its
    spread unexplained (a Schur complement through numpy.linalg.solve), then least squares over those terms,
    dropping the first slope that fits below 0 and solving again."""
    import numpy as np

    free = [0]
    for j in order[1:]:
        inner, cross = xx[np.ix_(free, free)], xx[free, j]
        left = float(xx[j, j] - cross @ np.linalg.solve(inner, cross))
        if left > apart * float(xx[j, j]) and left > 0:
            free.append(j)
    while True:
        solved = np.linalg.solve(xx[np.ix_(free, free)], xy[free])
        negative = [i for i, v in zip(free, solved.tolist()) if i > 0 and v < 0]
        if not negative:
            out = np.zeros(CostPlane.TERMS)
            out[free] = solved
            return out
        free.remove(negative[0])


def test_step_cost_read_while_another_thread_observes():
    """Two threads decoding one model share its n-gram StepCost: one prices steps while the other's steps add
    sizes and sums. A loop over the live set of sizes stopped the reader with "Set changed size during
    iteration"; the loops read snapshots. The interpreter switches threads every microsecond here (restored
    after), so the old loops failed at every run of this test."""
    import sys
    import threading

    cost = StepCost()
    cost.observe(1, 1, 0.01)
    errors: list[BaseException] = []

    def observe():
        try:
            for i in range(600):
                cost.observe(1 + i % 120, 1 + i % 120 + i % 5, 0.01)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def price():
        try:
            for _ in range(600):
                cost.at(8, [8, 16], 1)
                cost.reach(), cost.measured_plain(8), cost.measured_drafts(8), cost.copy()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=observe), threading.Thread(target=price)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert cost.largest() == 124 and cost(8, 8) is not None


def test_cost_plane_solve_equals_its_definition():
    """The Cholesky fit (Python floats) gives the coefficients of the definition to 1e-9 on 300 random step
    histories of mixed batch sizes, draft lengths, falling and rising costs, read at several batch sizes and
    in both term orders; the histories hit every branch (terms left out, negative slopes dropped)."""
    import math
    import random

    import numpy as np

    rng = random.Random(0)
    dropped = 0
    for _ in range(300):
        plane = CostPlane()
        for _ in range(rng.randint(1, 40)):
            requests = rng.choice([1, 1, 2, 4, 8])
            drafts = rng.choice([0, 0, 1, 3, 8]) * requests
            slope = rng.choice([0.004, -0.001])
            plane.observe(requests, requests + drafts, 0.1 + 0.002 * requests + slope * drafts + rng.gauss(0, 0.01))
        for requests in (None, 1, 8):
            for order in (CostPlane._ORDER, CostPlane._JUMP_FIRST):
                xx, xy = np.zeros((5, 5)), np.zeros(5)
                for size, (size_xx, size_xy) in plane.by_requests.items():
                    near = 1.0 if requests is None else math.exp(-abs(math.log(size / requests)) / CostPlane._NEAR)
                    xx, xy = xx + near * size_xx, xy + near * size_xy
                want = _least_squares_reference(xx, xy, order)
                dropped += int((want[1:] == 0).any())
                assert plane._solve(xx, xy, order).tolist() == pytest.approx(want.tolist(), rel=1e-9, abs=1e-12)
    assert dropped > 100


def test_cost_plane_fits_requests_and_drafts():
    """CostPlane: None before any step; only plain steps: drafts cost 0 (optimism); one batch size: the
    requests and product terms are 0 (they cannot be told apart from the others yet); the exact surface
    through steps of several sizes, read at any number of requests; a slope fitted below 0 is 0."""
    plane = CostPlane()
    assert plane.coefficients() is None
    plane.observe(1, 1, 0.111)
    plane.observe(1, 1, 0.111)
    assert plane.coefficients().tolist() == pytest.approx([0.111, 0.0, 0.0, 0.0, 0.0])
    for drafts in (2, 5):
        plane.observe(1, 1 + drafts, 0.111 + 0.0045 * drafts)
    assert plane.coefficients().tolist() == pytest.approx([0.111, 0.0, 0.0045, 0.0, 0.0], abs=1e-6)
    cost = StepCost()
    cost.target = plane
    assert cost(8, 16) == pytest.approx(0.111 + 0.0045 * 8, abs=1e-6)  # nothing else known yet
    for requests, drafts in ((8, 0), (4, 3), (8, 8), (2, 0)):
        plane.observe(requests, requests + drafts, 0.105 + 0.006 * requests + 0.004 * drafts +
                      0.0005 * requests * drafts)
    assert plane.coefficients().tolist() == pytest.approx([0.105, 0.006, 0.004, 0.0005, 0.0], abs=1e-6)
    assert cost.at(8, torch.tensor([8, 16])).tolist() == pytest.approx([0.153, 0.217])
    falling = CostPlane()
    for drafts, seconds in ((0, 0.1), (4, 0.09)):
        falling.observe(1, 1 + drafts, seconds)
    fit = falling.coefficients()
    assert fit[2] == 0.0 and fit[0] == pytest.approx((0.97 * 0.1 + 0.09) / 1.97)


def test_cost_plane_prices_having_drafts_at_all():
    """A step with any drafts pays a jump over a plain one (vLLM sampling on a CPU: 102 ms plain, 137 ms with
    one draft token, 144 ms with four): the fit finds the jump once two draft lengths tell it from the slope,
    and prices one draft at what it costs rather than on the line through every step; with one draft length
    measured, the fit reads it as a line or (jump_first) as a jump, and a step is priced at the cheaper:
    shorter and longer drafts both look cheap until measured; a jump that fits below 0 is 0."""
    def seconds(drafts: int) -> float:
        return 0.102 + (0.033 + 0.0025 * drafts if drafts else 0.0)

    plane = CostPlane()
    for _ in range(4):
        for drafts in (0, 1):
            plane.observe(1, 1 + drafts, seconds(drafts))
    assert plane.coefficients().tolist() == pytest.approx([0.102, 0.0, 0.0355, 0.0, 0.0], abs=1e-9)
    jump = plane.coefficients(1, jump_first=True).tolist()
    assert jump == pytest.approx([0.102, 0.0, 0.0, 0.0, 0.0355], abs=1e-9)
    one_length = StepCost()
    one_length.target = plane.copy()
    assert one_length(1, 4) == pytest.approx(seconds(1))  # three drafts: the jump reading, no dearer than one
    four = StepCost()
    for _ in range(4):
        for drafts in (0, 4):
            four.observe(1, 1 + drafts, seconds(drafts))
    assert four(1, 2) == pytest.approx(seconds(0) + (seconds(4) - seconds(0)) / 4)  # one draft: the line
    assert four(1, 9) == pytest.approx(seconds(4))  # eight: the jump reading
    for _ in range(4):
        plane.observe(1, 5, seconds(4))
    for jump_first in (False, True):  # told apart: one fit
        fit = plane.coefficients(1, jump_first).tolist()
        assert fit == pytest.approx([0.102, 0.0, 0.0025, 0.0, 0.033], abs=1e-9)
    cost = StepCost()
    cost.target = plane
    assert cost.at(1, torch.tensor([1, 2, 9])).tolist() == pytest.approx([seconds(0), seconds(1), seconds(8)])
    assert cost(1, 2) > 1.3 * cost(1, 1)
    dearer_plain = CostPlane()  # plain steps slower than one draft's: noise, no negative jump
    for drafts, step in ((0, 0.11), (1, 0.10), (4, 0.12)):
        dearer_plain.observe(1, 1 + drafts, step)
    assert dearer_plain.coefficients()[4] == 0.0


def test_step_cost_per_size_prices_measured_sizes_by_their_means():
    """StepCost(per_size=True): a size measured lately (a decayed weight of at least two steps) is priced at
    its own mean (vLLM's CPU engine, one request: 82 ms plain, 99 ms with one draft, 71-72 with 3-4, 94 with
    7-8); a size between two of those, measured once or never, at most at the cheaper neighbour's mean (so it
    gets measured), or at its own once-measured mean where that is dearer; a size outside them at the fit.
    Weights decay slowly (three steps stay trusted for 80 steps of other sizes), yet the means follow the
    machine; a size no step measured for long falls back to the fit, so a dear spell does not shut it out for
    good, and one not measured for longer is dropped; off by default; the means survive a copy."""
    measured = {0: 0.082, 1: 0.099, 3: 0.072, 4: 0.071, 7: 0.094, 8: 0.094}
    fitted, per_size = StepCost(), StepCost(per_size=True)
    for _ in range(6):
        for drafts, seconds in measured.items():
            fitted.observe(1, 1 + drafts, seconds)
            per_size.observe(1, 1 + drafts, seconds)
    per_size.observe(1, 7, 0.050)  # six drafts, once: not trusted, and cheaper than its neighbours
    per_size.observe(1, 6, 0.090)  # five drafts, once: not trusted, and dearer than its cheaper neighbour
    fitted.observe(1, 7, 0.050)
    fitted.observe(1, 6, 0.090)
    sizes = torch.arange(1, 10)
    plane, priced = fitted.at(1, sizes).tolist(), per_size.at(1, sizes).tolist()
    for drafts in range(9):
        if drafts in measured:
            expected = measured[drafts]
        elif drafts == 5:
            expected = min(plane[drafts], 0.090)
        else:  # two drafts between 0.099 and 0.072, six between 0.071 and 0.094
            expected = min(plane[drafts], 0.072 if drafts == 2 else 0.071)
        assert priced[drafts] == pytest.approx(expected, rel=1e-9), drafts
    assert priced[3] < plane[3] and priced[1] > plane[1]  # the fit through them is off both ways
    assert priced[2] < plane[2]  # unmeasured between cheap sizes: optimism
    assert per_size.copy()(1, 5) == pytest.approx(0.071) and StepCost().per_size is None
    outside = StepCost(per_size=True)
    for _ in range(3):
        outside.observe(1, 1, 0.080)
        outside.observe(1, 4, 0.070)
    assert outside(1, 6) == pytest.approx(_fit_of(outside)(1, 6))  # past the largest measured: the fit
    for _ in range(40):  # the machine drifts: the mean follows
        per_size.observe(1, 5, 0.080)
    assert per_size(1, 5) == pytest.approx(0.080, abs=1e-3)
    assert per_size(1, 2) == pytest.approx(0.099)  # 40 steps later, still trusted
    for _ in range(250):  # 290 steps of one size: every other size's weight has decayed below two
        per_size.observe(1, 5, 0.080)
    assert per_size(1, 2) == pytest.approx(_fit_of(per_size)(1, 2), rel=1e-9)
    for _ in range(1100):  # a size not measured for 1,390 steps is dropped: the table stays bounded
        per_size.observe(1, 5, 0.080)
    assert list(per_size.per_size) == [(1, 5)]


def _by_size_loop(cost: StepCost, requests: int, sizes: list[int]) -> list[float]:
    """StepCost(per_size=True)'s pricing written out size by size (the rule its vectorized code keeps)."""
    fitted = _fit_of(cost).at(requests, torch.tensor(sizes)).tolist()
    trusted = sorted((size, mean) for (r, size), (mean, weight) in cost.per_size.items()
                     if r == requests and weight >= 2.0)
    out = []
    for size, fit in zip(sizes, fitted):
        own = cost.per_size.get((requests, size))
        if own is not None and own[1] >= 2.0:
            out.append(own[0])
            continue
        right = next((i for i, (s, _) in enumerate(trusted) if s >= size), len(trusted))
        if 0 < right < len(trusted):
            guess = min(trusted[right - 1][1], trusted[right][1])
            fit = min(fit, guess if own is None else max(guess, own[0]))
        out.append(fit)
    return out


def test_step_cost_per_size_pricing_equals_the_rule_size_by_size():
    """Random histories of several batch sizes: every size from 1 to 40 tokens in flight is priced as the rule
    says size by size (trusted means, optimism between trusted sizes, the fit elsewhere), the scalar call as
    the vectorized one. A pricing that took the right neighbour only (or the fit everywhere) fails."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(40):
        cost = StepCost(per_size=True)
        for _ in range(int(torch.randint(1, 120, (1,), generator=rng))):
            requests = int(torch.randint(1, 4, (1,), generator=rng))
            tokens = requests + int(torch.randint(0, 12, (1,), generator=rng))
            cost.observe(requests, tokens, 0.05 + 0.05 * float(torch.rand(1, generator=rng)))
        for requests in (1, 2, 3, 5):
            sizes = list(range(requests, 41))
            priced = cost.at(requests, torch.tensor(sizes)).tolist()
            assert priced == pytest.approx(_by_size_loop(cost, requests, sizes), rel=1e-12), (trial, requests)
            assert cost(requests, sizes[3]) == pytest.approx(priced[3], rel=1e-12)


def _fit_of(cost: StepCost) -> StepCost:
    """A StepCost with `cost`'s fit and no means per size."""
    fit = StepCost()
    fit.target = cost.target
    return fit


def test_cost_plane_reads_near_batch_sizes():
    """A CPU's cost is no plane across batch sizes: bound by the weights up to some 16 tokens in flight, by
    the arithmetic past them (a draft token 2.5 ms with 1 or 8 requests, 9.5 ms with 32). Read at a batch
    size, steps of about that size decide, and a batch size never measured gets what the nearest ones say.
    Every step alike (requests None) is the one plane, which prices drafts for 8 requests far too dear."""
    def seconds(requests: int, tokens: int) -> float:
        return 0.04 + 0.002 * requests + 0.0025 * tokens + 0.007 * max(0, tokens - 16)

    plane = CostPlane()
    steps = [(1, 1), (1, 2), (1, 4), (1, 8), (8, 8), (8, 16), (32, 32), (32, 64)]
    for _ in range(3):
        for requests, tokens in steps:
            plane.observe(requests, tokens, seconds(requests, tokens))
    cost = StepCost()
    cost.target = plane
    for requests, tokens in steps:
        assert cost(requests, tokens) == pytest.approx(seconds(requests, tokens), rel=0.05), (requests, tokens)
    for requests, tokens in ((4, 8), (6, 12), (16, 32)):  # between: what the sizes around say, roughly
        assert cost(requests, tokens) == pytest.approx(seconds(requests, tokens), rel=0.2), (requests, tokens)
    a, b, c, e, g = plane.coefficients().tolist()
    assert a + 8 * b + (c + 8 * e) * 8 + g > 1.2 * seconds(8, 16)  # the one plane
    assert cost(16, 32) > cost(16, 16) * 1.4  # between 8 and 32: dearer, as the steps of 32 say


# ---- the choosers ----

def test_drafts_at_a_batch_size_never_drafted_cost_a_plain_share_per_token():
    """ShapeChooser.rates: where no step drafted near the batch size, a step is priced at least at a plain
    step's share per token in flight (the fit only extrapolates there); once one does, the fit prices it."""
    chooser = DraftLength("auto", max_drafts=4)
    for _ in range(20):  # one request: drafts cost nearly nothing, and all are accepted
        chooser.observe(2, 0.10, 0.001, 0.0, [2], [2])
        chooser.observe(0, 0.10, None, 0.0, [], [])
    chooser.observe(0, 0.10, None, 0.0, [], [])  # a plain step of 4 requests (requests from the paths below)
    chooser.cost.observe(4, 4, 0.10)
    assert chooser.cost.measured_plain(4) and not chooser.cost.measured_drafts(4)
    rates = chooser.rates(4)
    plain = float(rates[0])
    for k in (1, 2):  # (1 + k) plain shares and k drafter forwards
        expected = 4 * chooser.expected_tokens((1,) * k)
        assert float(rates[k]) <= expected / ((1 + k) * 4 / plain + k * 0.001) * 1.0001
    assert chooser.choose(4) == 0  # plain
    chooser.cost.observe(4, 12, 0.11, 0.001)  # a step of 4 requests with 2 drafts each, measured
    assert chooser.cost.measured_drafts(4) and float(chooser.rates(4)[2]) > 1.5 * plain


def test_a_timed_read_prices_the_first_catch_up(monkeypatch):
    """CatchUp.time_read: reads twice and prices reads by the second (the first warms the drafter up, here
    ten times slower), so the first real catch-up is priced. A clock the reads advance, so that no load on
    the machine can move the figure."""
    from specops.decoding import cost_model

    clock = [0.0]
    monkeypatch.setattr(cost_model, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = []

    def read(tokens):
        clock[0] += (0.01 if not calls else 0.001) * tokens
        calls.append(tokens)

    catch_up = CatchUp()
    catch_up.time_read(read)
    assert calls == [64, 64]
    assert catch_up.per_token == pytest.approx(1e-3)


def test_catching_up_pays_only_within_the_tokens_left():
    """CatchUp.pays: drafting that saves s seconds a token on n requests with L tokens left each repays a read
    of t backlog tokens at r seconds a token iff n L s > t r; a probe is priced at its best case; nothing
    measured yet says yes (the first read measures it)."""
    chooser = DraftLength("auto", max_drafts=4)
    for _ in range(40):  # a step: 0.1 s + 0.01 s a draft token; half the drafts accepted
        chooser.observe(2, 0.12, 0.005, 0.0, [1], [2])
        chooser.observe(0, 0.10, None, 0.0, [], [])
    catch_up = CatchUp()
    assert catch_up.pays(chooser, 1, (1, 1), 10_000, 1.0)  # never measured
    catch_up.observe(7, 0.05)  # too short a read to price tokens by
    assert catch_up.per_token is None
    catch_up.observe(100, 0.1)  # a millisecond a token
    assert catch_up.per_token == pytest.approx(1e-3)
    rates = chooser.rates(1)  # tokens per second
    saved = 1 / float(rates[0]) - 1 / float(rates[2])  # seconds drafting 2 saves per token
    assert saved > 0.005
    even = 50 * saved / 1e-3  # the backlog that 50 tokens left just repay
    assert catch_up.pays(chooser, 1, (1, 1), int(even * 0.9), 50.0)
    assert not catch_up.pays(chooser, 1, (1, 1), int(even * 1.1), 50.0)
    assert not catch_up.pays(chooser, 1, (1, 1), 10_000, 1.0) and catch_up.pays(chooser, 1, (1, 1), 0, 1.0)
    assert catch_up.pays(chooser, 1, (), 10_000, 1.0)  # no drafting, nothing to repay
    # Where no draft was ever accepted, a probe (which plain decoding beats as measured) may catch up for an
    # eighth of the plain steps before it came due, whatever the tokens left.
    rejecting = DraftLength("auto", max_drafts=4)
    for _ in range(40):
        rejecting.observe(1, 0.11, 0.005, 0.0, [0], [1])
        rejecting.observe(0, 0.10, None, 0.0, [], [])
    rates = rejecting.rates(1)
    assert float(rates[1]) < float(rates[0])
    rejecting.probe.gap = 16
    even = 16 / 8 * (1 / float(rates[0])) / 1e-3
    assert catch_up.pays(rejecting, 1, (1,), int(even * 0.9), 50.0)
    assert not catch_up.pays(rejecting, 1, (1,), int(even * 1.1), 50.0)


def test_chains_explore_by_doubling():
    """A flat cost and a drafter whose drafts are always accepted: the chain grows, but a step never carries
    more than twice the tokens in flight any step before it did."""
    chooser = DraftLength("auto")
    largest, chosen = 0, []
    for _ in range(12):
        k = chooser.choose(2)
        if largest:
            assert 2 * (k + 1) <= 2 * largest, (k, largest)
        largest = max(largest, 2 * (k + 1))
        chosen.append(k)
        chooser.observe(k, 0.05, 0.001 if k else None, 1e-4, [k, k], [k, k])
    assert chosen[:3] == [3, 0, 7] and chosen[-1] == 8, chosen


class _Key:
    """A weak-referenceable stand-in for a target model."""


def test_what_a_call_learned_starts_the_next():
    """The next call with the same target, drafter and method starts from the costs measured and from the
    acceptance, worth at most 16 one-child observations; another method or drafter starts afresh."""
    target = _Key()
    first = DraftLength.remembered("auto", target, "self:4", "sd")
    for _ in range(40):
        first.observe(2, 0.05, 0.01, 1e-4, [2], [2])  # every draft accepted
        first.observe(0, 0.04, None, 1e-4, [0], [0])
    second = DraftLength.remembered("auto", target, "self:4", "sd")
    assert second.cost(1, 3, 2) == pytest.approx(first.cost(1, 3, 2))
    assert float(second.acceptance.seen[1]) == 16.0 and second.acceptance(1) == pytest.approx(17 / 18)
    assert second.choose() == first.choose()  # no exploration again
    assert DraftLength.remembered("auto", target, "self:4", "tli").cost(1, 1) is None
    assert DraftLength.remembered("auto", target, "self:6", "sd").cost(1, 1) is None
    beams = TreeShape.remembered(True, (2, 2), target, "self:4", "rsd-s")
    beams.observe((4, 3), 1, 0.05, 0.01, 1e-4, [[(4, 1), (3, 1), (2, 0)]])
    again = TreeShape.remembered(True, (2, 2), target, "self:4", "rsd-s")
    assert again.kept == beams.kept == {4: pytest.approx(0.7 * 3 + 0.3 * 2)} and again.cost.drafter == 0.01


@pytest.mark.parametrize("drafted_seconds, rests", [(0.100, True), (0.080, False)])
def test_ngram_shape_rests_after_a_step_far_from_paying(drafted_seconds, rests):
    """A plain step whose best n-gram shape makes less than 0.8 of plain decoding's tokens per second is
    followed by two plain steps taken without a look at their drafts (DraftShape.resting); nearer plain's rate
    every step looks. Eight requests at the prior's 0.5 accepted tokens a draft: 12 tokens a step of 16 in
    flight, at 0.1 s 0.75 of plain's 8 in 0.05 s, at 0.08 s 0.94. The memory's per-request shapes never
    rest."""
    from specops.decoding.ngram_shape import DraftShape

    for per_request in (False, True):
        cost = StepCost()
        for _ in range(6):
            cost.observe(8, 8, 0.050)
            cost.observe(8, 16, drafted_seconds)
        shape = DraftShape("auto", None, "cpu", cost=cost)
        rows = torch.arange(8 * 8 * 8).view(8, 8, 8)  # eight requests, every row a full draft
        source = torch.ones(8, dtype=torch.long)
        assert not shape.resting()
        if per_request:
            assert not shape.shapes(rows, source).any()  # plain
        else:
            assert shape.choose(rows, source) == (0, 0)
        expected = [True, True, False] if rests and not per_request else [False] * 3
        assert [shape.resting() for _ in range(3)] == expected
