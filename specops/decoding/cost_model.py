"""How much to draft: one cost model that chains, draft trees and n-gram shapes all ask.

Cost (`StepCost`). A step that carries n tokens in flight for r requests and runs the drafter d times costs

    seconds(r, n, d) = target(r, n) + d * drafter + outside,

where target(r, n) = a + b r + c (n - r) + e r (n - r) + g [n > r], slopes >= 0, is fitted by decayed least
squares to every step's target forward (`CostPlane`; g is what having drafts at all costs), and drafter (one
drafter forward) and outside (the step's time outside forwards) are moving averages. On a CPU a forward over
8 tokens costs about 2.4x one over 1, and the fit finds short drafts or none; where a forward reads its
weights once for any few tokens (a GPU; a CPU through skinny_linear) the fit stays nearly flat and drafts
grow. One surface fitted to every step, rather
than a point per size, keeps one slow step from shutting a size out for good (step times scatter 10-20 %
on a CPU) and prices a batch size before any step of it ran. Where the engine's step time is no plane in the
tokens in flight (vLLM's CPU engine: 3 draft tokens cheaper than none), specops.vllm's n-gram proposer also
prices each size measured lately by its own decayed mean (`StepCost(per_size=True)`), and pads a step with
filler draft tokens where a larger size measured cheaper (ngram_shape._padded).

Acceptance (`Acceptance`), of a draft-tree node by how many children it had: a(b) = P(one of its first b
children is accepted | the node was reached), pooled over depths. Recursive rejection sampling tries a
node's children in draw order, so a node with c children tells, for every b <= c, whether one of its first
b was accepted; every path node of every step (the root, then each accepted draft) is one such observation.
Past the widest b measured, each further child is assumed to catch what one alone would of the mass left:
1 - a(b) = (1 - a(B)) (1 - a(1))^(b - B), independent children, pessimistic for RSD. A path through nodes
with c_1, c_2, ... children emits E = 1 + sum_l prod_{j <= l} a(c_j) tokens; a chain of K drafts is the path
(1, ..., 1), E = (1 - a^(K+1)) / (1 - a).

The choice (`ShapeChooser`): among the candidate shapes, the most expected tokens per predicted second.
Steps are priced at most at twice the most tokens in flight any step carried, so sizes never measured are
explored by doubling (priced at the largest measured cost, specops.vllm's n-gram proposer with 8 requests
on a CPU once tried 32 and 64 tokens in flight after 16 had cost 1.4 plain steps). The first step drafts
(to measure the drafter), the second is plain (so the fit has a slope), and so is the first step of a batch
size no plain step ran near (`StepCost.measured_plain`). Drafts at a batch size no drafting step ran near
cost at least a plain step's share per token in flight until one does (`ShapeChooser.rates`). While plain
decoding wins, the smallest drafting shape is probed now and then, at doubling intervals, if it could pay at
all (plain decoding measures no acceptance, so an unlucky start would otherwise lock drafting out for good).

Who asks: chains (`DraftLength`: sd, tli, slem, slrs and specops.vllm's slem proposer), trees (`TreeShape`:
rsd-c, rsd-s, specinfer), and n-gram drafting (ngram_shape.py), which scores its own acceptance per rows x
tokens, counterfactually, and asks the same `StepCost`. What a decode call learned starts the next call
with the same target, drafter and method in the process (costs as measured; acceptance worth at most
_MEMORY_WEIGHT observations), so a serving process does not explore again for every request.

Catching up (`CatchUp`). A drafter that has not read a request's tokens (a request it never drafted for, or
plain steps since it last did) must read them before it drafts again: r * t seconds for t tokens at r seconds
a token, measured from the reads themselves. Drafting k a step pays for that only if the seconds it saves on
the tokens the requests have left exceed it: n requests with L tokens left each save
n L (1 / rate(plain) - 1 / rate(k)), rates in tokens per second from the chooser. A probe (drafting that
plain decoding is predicted to beat) may catch up for at most _PROBE_SHARE of the plain steps since the last
probe, so probing costs a bounded share wherever it happens. specops.vllm's drafter proposer met this at 8
requests together: reading their prompts cost its drafter 1.4-2.8 s of a 5 s run.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import weakref

import numpy as np
import torch

from specops._kept import per_object

__all__ = ["Acceptance", "CatchUp", "CostPlane", "DraftLength", "Probe", "ShapeChooser", "StepCost", "TreeShape"]

_EMA = 0.3  # weight of a new measurement
_EXPLORE = 2  # a step is priced at most at this many times the most tokens in flight measured
_SIZE_TRUSTED = 2.0  # decayed steps of a size for StepCost(per_size=True) to price it by its own mean
_SIZE_FORGOTTEN = 0.01  # ... and below which its mean is dropped (one step, after 919 steps of other sizes)
_SIZE_DECAY = 0.995  # per step, of a size's weight: three steps of a size stay trusted for 80 steps of others
_SIZE_FOLLOW = 1 / 8  # the least weight of a new step in its size's mean: the mean follows a drifting host
_PROBE_EVERY = 8  # plain steps before the first probe of drafting
_PROBE_MAX = 64  # the interval doubles after each probe that does not bring drafting back
_LONG_READ = 32  # tokens a drafter's read must have for CatchUp to price reads by it
_PROBE_SHARE = 1 / 8  # of the plain steps since the last probe, what a probe's catching up may cost
_MEMORY_WEIGHT = 16.0  # one-child observations' worth of acceptance carried into the next decode call

# Tree candidates: rsd-c / specinfer branchings and rsd-s beams.
_MAX_WIDTH = 4  # children per node of a branching
_MAX_BEAMS = 6
_MAX_DEPTH = 6
_MAX_NODES = 48

# target model -> {(drafter key, method): the chooser of the last call}
_LEARNED: weakref.WeakKeyDictionary[object, dict] = per_object(
    "draft lengths", "draft lengths and tree shapes learned from earlier calls' steps, per drafter and method")


def ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


def swap_learned(store: weakref.WeakKeyDictionary, target, drafter_key, method: str, new):
    """Keep `new` as what decoding with this target, drafter and method learns, and return what the last
    such call learned (None: none, or a target that cannot be weakly referenced, which has no memory).
    drafter_key: the drafter model, or a string such as "self:6"."""
    try:
        table = store.setdefault(target, {})
    except TypeError:
        return None
    key = (drafter_key if isinstance(drafter_key, str) else id(drafter_key), method)
    old = table.get(key)
    table[key] = new
    return old


class CostPlane:
    """Seconds per target forward as a + b * requests + c * drafts + e * requests * drafts + g * [drafts > 0]
    (slopes >= 0), fitted by decayed least squares to steps of every batch size at once. What a draft token
    costs, learned with one request, prices drafts at eight before any step there; the product term lets a
    draft token cost more in a bigger batch (vLLM on this CPU: 4.4 ms with one request, 7.5 ms with eight).
    The last term is what a step pays for having drafts at all, however many: vLLM sampling at temperature
    0.8 on the 2-vCPU EPYC took 102 ms for a plain step, 137 ms with one draft token and 144 ms with four (its
    rejection sampler and a second top-p pass). A line through those prices one draft at 9 ms, and a proposer
    then drafts single tokens accepted a third of the time, at a loss. A term enters the fit only once the
    steps seen tell it apart from the terms before it (the order 1, drafts, requests, product; with one batch
    size the product is the drafts term again), so before any step with drafts they cost nothing: the first
    drafts look free, optimism that gets them measured. The jump and the drafts term cannot be told apart
    while one draft length was measured; the fit is then read both ways (`coefficients(jump_first=)`: the
    jump before the drafts term, or after the rest), and a step is priced at the cheaper reading
    (`StepCost.at`), so longer and shorter drafts both look cheap until measured. (Read only as a line, a
    probe of one draft token priced four at four times its cost, and no longer draft was ever tried; read
    only as a jump, one draft cost what the eight measured did.)

    Read at a batch size, the fit weighs each step by how near its batch size is: a factor of two away counts
    e^-2 of a step at that size, a factor of 32 e^-10. The surface is no plane across batch sizes on a CPU: a
    step is bound by reading the weights up to some 8-16 tokens in flight and by arithmetic past them (on the
    2-vCPU EPYC, a draft token cost 5 ms with one request and 14 ms with 32), and one plane through both
    priced 14 tokens in flight for 7 requests at twice a plain step. Where only distant batch sizes were
    measured, they decide alone, as before. The sums are NumPy float64: solved once per step and batch size,
    torch's per-call overhead on 5 x 5 systems was most of a vLLM proposer's 2.4 ms a step."""

    TERMS = 5
    _ORDER = (0, 2, 1, 3, 4)  # 1, drafts, requests, requests x drafts, any drafts
    _JUMP_FIRST = (0, 4, 2, 1, 3)  # 1, any drafts, drafts, requests, requests x drafts
    _APART = 1e-6  # a term's share of its spread that the terms before it must leave unexplained
    _NEAR = math.log(2.0) / 2  # a step's weight falls by e for every factor of this in batch size

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        # Decayed sums of x x^T and x * seconds over the steps of each batch size.
        self.by_requests: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Until the next step: the sums read at a batch size, and the fit per batch size and order.
        self._sums: dict[int | None, tuple[np.ndarray, np.ndarray]] = {}
        self._fits: dict[tuple, tuple[float, ...]] = {}

    @staticmethod
    def features(requests: int, tokens: int) -> np.ndarray:
        drafts = tokens - requests
        return np.array([1.0, requests, drafts, requests * drafts, float(drafts > 0)])

    def observe(self, requests: int, tokens: int, seconds: float) -> None:
        x = self.features(requests, tokens)
        for size, (xx, xy) in list(self.by_requests.items()):  # a snapshot: StepCost's docstring
            self.by_requests[size] = (self.decay * xx, self.decay * xy)
        xx, xy = self.by_requests.get(requests, (0.0, 0.0))
        self.by_requests[requests] = (xx + np.outer(x, x), xy + x * seconds)
        self._sums, self._fits = {}, {}

    def copy(self) -> CostPlane:
        new = CostPlane(self.decay)
        new.by_requests = {size: (xx.copy(), xy.copy()) for size, (xx, xy) in list(self.by_requests.items())}
        return new

    def coefficients(self, requests: int | None = None, jump_first: bool = False) -> torch.Tensor | None:
        """(a, b, c, e, g) read at `requests` requests (None: every step alike), or None before any step. A
        term the steps cannot tell apart from the ones before it is 0 (jump_first: the jump comes before the
        drafts term); a slope that fits below 0 is noise: 0, the rest refitted. Solved once per observation,
        batch size and order: a choice prices many sizes."""
        fit = self.fit(requests, jump_first)
        return None if fit is None else torch.tensor(fit, dtype=torch.float64)

    def fit(self, requests: int | None = None, jump_first: bool = False) -> tuple[float, ...] | None:
        """`coefficients` as Python floats, kept until the next step: an n-gram step prices its shapes
        through here two to four times, and tensors made and read back cost more than the arithmetic."""
        if not self.by_requests:
            return None
        key = (requests, jump_first)
        fit = self._fits.get(key)
        if fit is None:
            sums = self._sums.get(requests)
            if sums is None:
                xx = np.zeros((self.TERMS, self.TERMS))
                xy = np.zeros(self.TERMS)
                for size, (size_xx, size_xy) in list(self.by_requests.items()):
                    near = (1.0 if requests is None else
                            math.exp(-abs(math.log(size / max(requests, 1))) / self._NEAR))
                    xx, xy = xx + near * size_xx, xy + near * size_xy
                sums = self._sums[requests] = (xx, xy)
            order = self._JUMP_FIRST if jump_first else self._ORDER
            fit = self._fits[key] = tuple(self._solve(*sums, order).tolist())
        return fit

    def _solve(self, xx: np.ndarray, xy: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
        """Least squares over the terms in `order` that the steps tell apart, slopes >= 0. A Cholesky factor
        grown one term at a time: a term's pivot is what the terms before it leave unexplained, and the same
        factor then solves. In Python floats: on these 5 x 5 sums NumPy's per-call overhead made each solve
        2.4x slower (two solves a step, every step of a vLLM proposer)."""
        a, y = xx.tolist(), xy.tolist()
        free, rows = _cholesky(a, order, self._APART)
        while True:
            n = len(free)
            z: list[float] = []
            for r in range(n):
                z.append((y[free[r]] - sum(rows[r][c] * z[c] for c in range(r))) / rows[r][r])
            solved = [0.0] * n
            for r in reversed(range(n)):
                solved[r] = (z[r] - sum(rows[c][r] * solved[c] for c in range(r + 1, n))) / rows[r][r]
            negative = [i for i, v in zip(free, solved) if i > 0 and v < 0]
            if not negative:
                out = np.zeros(self.TERMS)
                out[free] = solved
                return out
            free.remove(negative[0])
            free, rows = _cholesky(a, free, None)


def _cholesky(a: list[list[float]], terms, apart: float | None) -> tuple[list[int], list[list[float]]]:
    """The terms of a (a symmetric positive semi-definite matrix as lists) taken in order, each kept where the
    ones kept before it leave more than `apart` of its diagonal unexplained (None: all kept), and the rows of
    the lower Cholesky factor of a over the kept terms."""
    free: list[int] = []
    rows: list[list[float]] = []
    for j in terms:
        v = []
        for r, i in enumerate(free):
            row = rows[r]
            v.append((a[i][j] - sum(row[c] * v[c] for c in range(r))) / row[r])
        left = a[j][j] - sum(x * x for x in v)
        if apart is None or (left > apart * a[j][j] and left > 0):
            free.append(j)
            rows.append(v + [math.sqrt(max(left, 0.0))])
    return free, rows


class StepCost:
    """Predicted seconds of a step from the requests it carries, its tokens in flight and its drafter
    forwards (module docstring). Shared: a decode call's chooser, n-gram shapes per model and device, and a
    vLLM proposer's own steps. Two threads decoding one model share its n-gram StepCost, so every loop over
    the sizes and sums measured reads a snapshot (taken whole under the GIL): a loop over the live set
    stopped a reader with "Set changed size during iteration" when another thread's step added a size. A
    step observed in two threads at once may lose one of the two (a measurement, never an output)."""

    def __init__(self, decay: float = 0.97, per_size: bool = False):
        """per_size: also keep each size's own mean, decayed as the fit's sums are, and price a size by it
        while its weight is at least _SIZE_TRUSTED steps. For engines whose step time is no plane in the
        tokens in flight: vLLM's CPU engine on a 2-vCPU AMD EPYC (Zen 4), Gemma-3-270M, one request, took a
        plain step in 81-82 ms, one with one draft token in 99-100, with 3 in 71 and with 7-8 in 94-96
        (medians, 2026-12-05); the fit through them priced 8 drafts at 95 and 3 at 85, and specops.vllm's
        NgramProposer drafted 8 where 4 made its tokens/s 1.2x. The shape is the engine's (its products pick
        their kernel by rows) and holds while the host's speed drifts, so a size's weight decays slowly
        (_SIZE_DECAY: three steps of a size stay trusted for 80 steps of others; at the fit's 0.97 they were
        forgotten after 12, and sizes the chooser visits now and then, 4 drafts among them, were priced by the
        fit again) while its mean follows each new step by at least _SIZE_FOLLOW. A size between two trusted
        ones that no step measured lately is priced at most at the cheaper neighbour's mean (at least at its
        own single step's, where it has one): optimism that gets it measured. A size no step measured for long
        falls back to the fit, so one slow spell cannot shut it out for good; its mean is dropped once its
        weight is below _SIZE_FORGOTTEN."""
        self.target = CostPlane(decay)
        self.drafter: float | None = None  # seconds per drafter forward
        self.outside: float | None = None  # seconds per step outside forwards
        self.sizes: set[tuple[int, int]] = set()  # (requests, tokens in flight) of the steps measured
        # (requests, tokens in flight) -> [decayed mean target seconds, decayed weight in steps]
        self.per_size: dict[tuple[int, int], list] | None = {} if per_size else None

    def observe(self, requests: int, tokens: int, target_seconds: float, drafter_seconds: float | None = None,
                outside_seconds: float | None = None) -> None:
        """One step: its requests and tokens in flight, its target forward's seconds, and (where measured)
        the seconds of one drafter forward and of the step outside forwards."""
        self.target.observe(requests, tokens, target_seconds)
        self.sizes.add((requests, tokens))
        if self.per_size is not None:
            for size, entry in list(self.per_size.items()):
                entry[1] *= _SIZE_DECAY
                # a serving process meets ever more sizes: keep the recent ones
                if entry[1] < _SIZE_FORGOTTEN:
                    del self.per_size[size]
            entry = self.per_size.setdefault((requests, tokens), [0.0, 0.0])
            entry[1] += 1.0
            entry[0] += (target_seconds - entry[0]) * max(1 / entry[1], _SIZE_FOLLOW)
        if drafter_seconds is not None:
            self.drafter = ema(self.drafter, drafter_seconds)
        if outside_seconds is not None:
            self.outside = ema(self.outside, outside_seconds)

    def largest(self) -> int:
        """The most tokens in flight any measured step carried (0 before any)."""
        return max((tokens for _, tokens in tuple(self.sizes)), default=0)

    def reach(self) -> int:
        """The most tokens in flight a step may be priced at: sizes never measured are explored by doubling."""
        return _EXPLORE * self.largest()

    def measured_plain(self, requests: int | None = None) -> bool:
        """Whether a plain step ran (with `requests`: with between half and twice that many requests). The fit
        prices a plain step of a batch size it never saw plain by extrapolation: the n-gram memory, whose
        first steps with 8 requests all drafted, priced their plain step at 88 ms where it took 72 (2-vCPU
        Xeon, Gemma-3-270M), and drafted every step at a loss."""
        return any(seen == tokens and (requests is None or (requests <= 2 * seen and seen <= 2 * requests))
                   for seen, tokens in tuple(self.sizes))

    def measured_drafts(self, requests: int) -> bool:
        """Whether a step with drafts ran with between half and twice `requests` requests: the fit prices drafts
        at other batch sizes by extrapolation only."""
        return any(tokens > seen and requests <= 2 * seen and seen <= 2 * requests
                   for seen, tokens in tuple(self.sizes))

    def at(self, requests: int, tokens: torch.Tensor, forwards: torch.Tensor | int = 0) -> torch.Tensor | None:
        """Predicted seconds [same shape as tokens, float64] of steps with `requests` requests, `tokens` in
        flight and `forwards` drafter forwards (CPU tensors or numbers); None before any step. In NumPy: a
        vLLM proposer prices every step twice, and torch's per-call overhead on these few numbers was most of
        the 0.3 ms each pricing took (2-vCPU Xeon)."""
        if self.target.fit(requests) is None:
            return None
        drafts = np.asarray(tokens, dtype=np.float64) - requests
        readings = []
        for jump_first in (False, True):  # the same fit once two draft lengths were measured (CostPlane)
            a, b, c, e, g = self.target.fit(requests, jump_first)
            readings.append(a + b * requests + (c + e * requests) * drafts + g * (drafts > 0))
        seconds = np.maximum(np.minimum(*readings), 1e-9)
        if self.per_size:
            seconds = self._by_size(requests, np.asarray(tokens), seconds)
        seconds = seconds + np.asarray(forwards, dtype=np.float64) * (self.drafter or 0.0) + (self.outside or 0.0)
        return torch.from_numpy(np.asarray(seconds, dtype=np.float64))

    def _by_size(self, requests: int, tokens: np.ndarray, fitted: np.ndarray) -> np.ndarray:
        """`fitted` seconds of steps with `requests` requests and `tokens` in flight, each size measured lately
        priced by its own mean instead, and each size between two such sizes at most at the cheaper one's
        (at least at its own single step's, where it has one): the class docstring. Vectorized: a vLLM
        proposer prices 20-60 sizes every step, and a Python loop over them took 0.37-0.56 ms a step under a
        line profiler, this pass 0.11 (2-vCPU AMD EPYC, 2026-12-06)."""
        entries = sorted((size, mean, weight) for (r, size), (mean, weight) in list(self.per_size.items())
                         if r == requests)
        if not entries:
            return fitted
        size, mean, weight = (np.array(column) for column in zip(*entries))
        trusted = weight >= _SIZE_TRUSTED
        at = np.minimum(np.searchsorted(size, tokens), len(size) - 1)
        own = size[at] == tokens  # a size with a mean of its own, trusted or not
        kept_size, kept_mean = size[trusted], mean[trusted]
        if len(kept_size) >= 2:  # between two trusted sizes: optimism, so that it gets measured
            right = np.searchsorted(kept_size, tokens)
            inside = (right > 0) & (right < len(kept_size))
            right = np.clip(right, 1, len(kept_size) - 1)
            guess = np.minimum(kept_mean[right - 1], kept_mean[right])
            guess = np.where(own, np.maximum(guess, mean[at]), guess)
            fitted = np.where(inside, np.minimum(fitted, guess), fitted)
        return np.where(own & trusted[at], mean[at], fitted)

    def __call__(self, requests: int, tokens: int, forwards: int = 0) -> float | None:
        seconds = self.at(requests, torch.tensor(tokens), forwards)
        return None if seconds is None else float(seconds)

    def copy(self) -> StepCost:
        new = StepCost(self.target.decay)
        new.target = self.target.copy()
        new.drafter, new.outside, new.sizes = self.drafter, self.outside, set(self.sizes)
        if self.per_size is not None:
            new.per_size = {size: list(entry) for size, entry in self.per_size.items()}
        return new


class Probe:
    """When to draft although the fit says plain decoding wins: plain decoding measures neither acceptance nor
    what drafts cost at this batch size, so a fit misled once (a plane fitted to one batch size and
    extrapolated to another: 64 tokens in flight for 32 requests priced at 1.5 s where a plain step of 32 took
    0.2 s) would lock drafting out for good. After `_PROBE_EVERY` plain steps in a row a probe is due; each
    probe that does not bring drafting back doubles the interval, up to `_PROBE_MAX`."""

    def __init__(self):
        self.plain_steps = 0  # plain steps since drafting was last chosen or probed
        self.interval = _PROBE_EVERY
        self.gap = 0  # plain steps before the last probe that came due

    def due(self) -> bool:
        """Count one more plain step; True when a probe is due (the interval then doubles)."""
        self.plain_steps += 1
        if self.plain_steps < self.interval:
            return False
        self.gap, self.plain_steps = self.plain_steps, 0
        self.interval = min(2 * self.interval, _PROBE_MAX)
        return True

    def drafted(self) -> None:
        """The fit chose drafting: probes start over from the shortest interval."""
        self.plain_steps, self.interval = 0, _PROBE_EVERY

    def resume(self, last: Probe) -> None:
        """Count on from the last call's probe: one call's plain steps alone may never reach the interval,
        and a call that starts afresh probes at its 8th and 24th plain steps however often that found nothing."""
        self.interval, self.plain_steps = last.interval, last.plain_steps


class Acceptance:
    """a(b) for b children of a node, counted from the path nodes verification walked (module docstring),
    with a Beta(1, 1) prior per b."""

    def __init__(self, widest: int):
        self.hits = torch.zeros(widest + 1, dtype=torch.float64)
        self.seen = torch.zeros_like(self.hits)
        self._table: list[float] | None = None  # a(b) for every b up to widest + 1, until the next observation

    def observe(self, path: list[tuple[int, int]]) -> None:
        """One request's path nodes as (children, rank of the accepted child, 0 for none)."""
        self._table = None
        top = len(self.hits) - 1
        for children, rank in path:
            for b in range(1, min(children, top) + 1):
                self.seen[b] += 1
                self.hits[b] += 1 if 0 < rank <= b else 0

    def __call__(self, width: float) -> float:
        """a(width); a fractional width interpolates between the whole numbers around it."""
        whole = int(width)
        if whole != width:
            return self(whole) + (width - whole) * (self(whole + 1) - self(whole))
        if width <= 0:
            return 0.0
        if self._table is None:
            self._table = [self._rate(b) for b in range(len(self.hits) + 1)]
        return self._table[whole] if whole < len(self._table) else self._rate(whole)

    def _rate(self, width: int) -> float:
        if width <= 0:
            return 0.0
        seen, hits = self.seen.tolist(), self.hits.tolist()
        measured = max((b for b, n in enumerate(seen) if n > 0), default=0)
        widest = min(width, measured)
        if widest == 0:
            return 1 - 0.5 ** width  # nothing measured yet: a(1) = 1/2
        rate = (hits[widest] + 1) / (seen[widest] + 2)
        single = (hits[1] + 1) / (seen[1] + 2)
        return 1 - (1 - rate) * (1 - single) ** (width - widest)

    def expected(self, path: list[float]) -> float:
        """Expected tokens a step emits when its path nodes have path[0], path[1], ... children."""
        total, reach = 1.0, 1.0
        for children in path:
            reach *= self(children)
            total += reach
        return total

    def carried(self, weight: float) -> Acceptance:
        """A copy worth at most `weight` one-child observations."""
        new = Acceptance(len(self.hits) - 1)
        scale = min(1.0, weight / max(1.0, float(self.seen[1])))
        new.hits, new.seen = self.hits * scale, self.seen * scale
        return new


class ShapeChooser:
    """Chooses the draft shape every step (module docstring). A shape is a tuple; () is plain decoding.
    Subclasses say what a shape holds: its draft nodes, its drafter forwards and the children along the
    path verification walks."""

    def __init__(self, candidates: list[tuple] | tuple[tuple, ...], initial: tuple, widest: int):
        self.candidates = candidates
        self.initial = self.current = initial
        self.cost = StepCost()
        self.acceptance = Acceptance(widest)
        self.probe = Probe()
        self.catch_up = CatchUp()
        self._sizes = torch.tensor([self.nodes(s) for s in candidates], dtype=torch.long)
        self._forwards = torch.tensor([self.forwards(s) for s in candidates], dtype=torch.long)

    def nodes(self, shape: tuple) -> int:
        raise NotImplementedError

    def forwards(self, shape: tuple) -> int:
        """Drafter forwards of a step that drafts `shape`: one per level."""
        return len(shape)

    def path(self, shape: tuple) -> list[float]:
        """Children of each node along the path verification walks."""
        return list(shape)

    def expected_tokens(self, shape: tuple) -> float:
        return self.acceptance.expected(self.path(shape)) if shape else 1.0

    def remember(self, target, drafter_key, method: str) -> ShapeChooser | None:
        """Start from what the last call with this target, drafter and method learned, and keep what this
        one learns for the next (drafter_key: the drafter model, or a string such as "self:6"). Returns the
        last call's chooser (None: none)."""
        old = swap_learned(_LEARNED, target, drafter_key, (type(self).__name__, method), self)
        if old is None or type(old) is not type(self):
            return None
        self.cost = old.cost.copy()
        self.acceptance = old.acceptance.carried(_MEMORY_WEIGHT)
        self.probe.resume(old.probe)
        self.current = old.current
        self.catch_up.per_token = old.catch_up.per_token
        return old

    def rates(self, requests: int) -> torch.Tensor | None:
        """Predicted tokens per second of every candidate with `requests` requests; -inf past the sizes
        explored; None before any step."""
        tokens = requests * (1 + self._sizes)
        seconds = self.cost.at(requests, tokens, self._forwards)
        if seconds is None:
            return None
        if not self.cost.measured_drafts(requests):
            # No step drafted near this batch size, so the fit only extrapolates what drafts cost here: priced
            # from one request's steps, one drafter token for each of 4 requests in vLLM looked 1.5x as fast
            # as plain decoding and was 0.85x (docs/vllm.md). Until a step measures them, every token in
            # flight costs at least a plain step's share per request (a CPU's worst case); probes measure.
            plain = self.cost.at(requests, torch.tensor(requests))
            drafter = self._forwards * (self.cost.drafter or 0.0)
            seconds = torch.maximum(seconds, plain * tokens / requests + drafter)
        expected = torch.tensor([self.expected_tokens(s) for s in self.candidates], dtype=torch.float64)
        reachable = tokens <= max(self.cost.reach(), requests)
        return torch.where(reachable, requests * expected / seconds, float("-inf"))

    def choose(self, requests: int = 1) -> tuple:
        """This step's shape for a batch of `requests` requests."""
        if self.cost.drafter is None:  # first measure a drafted step (its cost and the drafter's) ...
            return self.current or self.initial
        if not self.cost.measured_plain(requests):  # ... then a plain step at about this batch size
            return ()
        rates = self.rates(requests)
        best = self.candidates[int(rates.argmax())]  # the first best: candidates run from small to large
        if not best:
            # Plain decoding measures no acceptance: probe the smallest drafting shape now and then, if it
            # could pay at all (every draft accepted). A probe costs more than its drafts (the drafter first
            # reads every token since it last ran), so probes that keep confirming plain decoding come less
            # and less often.
            if self.probe.due():
                probe = self.candidates[1]
                tokens = requests * (1 + self.nodes(probe))
                best_case = (1 + len(self.path(probe))) / self.cost(requests, tokens, self.forwards(probe))
                if best_case > float(rates[0]) / requests:
                    best = probe
        else:
            self.probe.drafted()
        self.current = best
        return best

    def observe(self, shape: tuple, requests: int, target_seconds: float, drafter_seconds: float | None,
                outside_seconds: float, paths: list[list[tuple[int, int]]]) -> None:
        """One step: the shape drawn for `requests` requests, its target forward's seconds, one drafter
        forward's (None for a plain step), the step's outside forwards, and per request the path nodes as
        (children, rank of the accepted child, 0 for none)."""
        tokens = requests * (1 + self.nodes(shape))
        self.cost.observe(requests, tokens, target_seconds, drafter_seconds if shape else None, outside_seconds)
        for path in paths:
            self.acceptance.observe(path)


class DraftLength(ShapeChooser):
    """Chooses the number of drafts per step of a chain: fixed, or "auto" (module docstring). Its shapes are
    chains (1,) * K."""

    def __init__(self, setting, max_drafts: int = 8, initial: int = 3):
        if setting == "auto":
            self.fixed = None
        elif isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
            self.fixed = setting
        else:
            raise ValueError(f"num_draft_tokens must be 'auto' or an int >= 1, got {setting!r}")
        self.max_drafts = max(max_drafts, self.fixed or 0)
        chains = [(1,) * k for k in range(self.max_drafts + 1)]
        super().__init__(chains, (1,) * (self.fixed or min(initial, max_drafts)), widest=1)

    @classmethod
    def remembered(cls, setting, target, drafter_key, method: str) -> DraftLength:
        """A DraftLength that starts from what the last call with this target, drafter and method learned."""
        new = cls(setting)
        new.remember(target, drafter_key, method)
        return new

    def nodes(self, shape: tuple) -> int:
        return len(shape)

    def choose(self, requests: int = 1) -> int:
        return self.fixed if self.fixed is not None else len(super().choose(requests))

    def observe(self, drafts: int, target_seconds: float, drafter_seconds: float | None, outside_seconds: float,
                accepted: list[int], num_draft: list[int]) -> None:
        """One step: K, the target forward's seconds, one drafter forward's, the step's outside forwards,
        and per request the accepted count and the number of drafts it could accept."""
        paths = [[(1, 1)] * n + ([(1, 0)] if n < k else []) for n, k in zip(accepted, num_draft)]
        super().observe((1,) * drafts, max(len(accepted), 1), target_seconds, drafter_seconds, outside_seconds,
                        paths)


class CatchUp:
    """What reading a drafter's backlog costs, and whether drafting repays it (module docstring)."""

    def __init__(self):
        self.per_token: float | None = None  # seconds a drafter takes to read one token of a backlog

    def observe(self, tokens: int, seconds: float) -> None:
        """A read of `tokens` backlog tokens that took `seconds`. Reads shorter than _LONG_READ tokens are not
        counted: their time is mostly a forward's fixed cost (a warm-up prompt of 7 tokens priced a read at
        3-4 times its per-token cost, and kept a drafter from ever reading a real prompt)."""
        if tokens >= _LONG_READ:
            self.per_token = ema(self.per_token, seconds / tokens)

    def time_read(self, read, tokens: int = 2 * _LONG_READ) -> None:
        """Prices reads before the first real one: `read(tokens)` reads that many tokens; it runs twice and
        the second is observed (the first warms the drafter). Without it the first catch-up is free to the
        chooser: in vLLM the drafter's first read of 4 prompts took 0.8 s of a 14 s run, for a draft that
        never paid (docs/vllm.md)."""
        read(tokens)
        began = time.perf_counter()
        read(tokens)
        self.observe(tokens, time.perf_counter() - began)

    def pays(self, chooser: ShapeChooser, requests: int, shape: tuple, backlog: int, tokens_left: float) -> bool:
        """Whether drafting `shape` (one of the chooser's candidates) a step for `requests` requests with
        `tokens_left` tokens left each repays reading `backlog` tokens first. Yes where nothing says otherwise
        yet (the first read measures it)."""
        if not shape or backlog <= 0 or self.per_token is None:
            return True
        rates = chooser.rates(requests)
        if rates is None:
            return True
        plain, drafting = float(rates[0]), float(rates[chooser.candidates.index(shape)])
        if not drafting > plain:  # a probe: a share of the plain steps since the last one
            return backlog * self.per_token <= _PROBE_SHARE * chooser.probe.gap * requests / plain
        saved = requests * tokens_left * (1 / plain - 1 / drafting)
        return saved > backlog * self.per_token


@functools.cache
def _branchings() -> tuple[tuple[int, ...], ...]:
    """Non-increasing branchings of depth 0.._MAX_DEPTH, at most _MAX_NODES nodes, fewest nodes first (built
    once per process: every rsd-c or specinfer decode call with "auto" asks)."""
    shapes = [()]
    for depth in range(1, _MAX_DEPTH + 1):
        for shape in itertools.product(range(1, _MAX_WIDTH + 1), repeat=depth):
            if list(shape) == sorted(shape, reverse=True) and nodes(shape, False) <= _MAX_NODES:
                shapes.append(shape)
    return tuple(sorted(shapes, key=lambda s: nodes(s, False)))


def nodes(shape: tuple[int, ...], beams: bool) -> int:
    """Draft nodes of a shape: W * L for beams (W, L), sum of the level widths for a branching."""
    if beams:
        return shape[0] * shape[1] if shape else 0
    return sum(math.prod(shape[:level + 1]) for level in range(len(shape)))


class TreeShape(ShapeChooser):
    """Chooses the draft tree's shape every step: a branching (b1, ..., bL) for rsd-c and specinfer, whose
    path node at level j has b_j children, or (W, L) beams for rsd-s, whose root has W children and a deeper
    path node as many as its beam kept, measured per W (starting from W / 2)."""

    def __init__(self, beams: bool, initial: tuple[int, ...]):
        self.beams = beams
        self.kept: dict[int, float] = {}  # rsd-s: W -> mean children of a path node below the root
        candidates = ([()] + sorted(((w, d) for w in range(1, _MAX_BEAMS + 1) for d in range(1, _MAX_DEPTH + 1)
                                     if w * d <= _MAX_NODES), key=lambda s: s[0] * s[1])
                      if beams else _branchings())
        super().__init__(candidates, initial, widest=_MAX_BEAMS if beams else _MAX_WIDTH)

    @classmethod
    def remembered(cls, beams: bool, initial, target, drafter_key, method: str) -> TreeShape:
        """A TreeShape that starts from what the last call with this target, drafter and method learned."""
        new = cls(beams, initial)
        new.remember(target, drafter_key, method)
        return new

    def remember(self, target, drafter_key, method: str) -> ShapeChooser | None:
        old = super().remember(target, drafter_key, method)
        if old is not None:
            self.kept = dict(old.kept)
        return old

    def nodes(self, shape: tuple[int, ...]) -> int:
        return nodes(shape, self.beams)

    def forwards(self, shape: tuple[int, ...]) -> int:
        return (shape[1] if self.beams else len(shape)) if shape else 0

    def path(self, shape: tuple[int, ...]) -> list[float]:
        if not self.beams:
            return list(shape)
        width, depth = shape
        return [width] + [self.kept.get(width, max(1.0, width / 2))] * (depth - 1)

    def observe(self, shape: tuple[int, ...], requests: int, target_seconds: float, drafter_seconds: float | None,
                outside_seconds: float, paths: list[list[tuple[int, int]]]) -> None:
        super().observe(shape, requests, target_seconds, drafter_seconds, outside_seconds, paths)
        if self.beams and shape:
            for path in paths:
                for level, (children, _) in enumerate(path):
                    if 0 < level < shape[1]:  # a beam's node above the last level
                        self.kept[shape[0]] = ema(self.kept.get(shape[0]), children)
