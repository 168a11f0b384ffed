"""Draft length from measured costs: the K that maximizes expected tokens per second.

With a per-draft acceptance rate a (drafts accepted independently until the first rejection), a step
with K drafts emits E(K) = (1 - a^(K+1)) / (1 - a) tokens and costs K * c_draft + c_target(K + 1) +
c_step, where c_target(n) is the measured cost of a target forward over n new tokens. K = 0 is plain
decoding (no drafter call). The same rule finds short drafts on a CPU, where a forward over 8 tokens
costs 2.4x one over 1, and long ones on a GPU, where it costs about the same.

What a decode call learned is kept for the next call with the same target, drafter and method in the
process (costs as measured; acceptance as a prior worth at most _PRIOR_WEIGHT drafts), so a serving
process does not explore again for every request.
"""

from __future__ import annotations

import weakref

import torch

_EMA = 0.3  # weight of a new measurement
_PROBE_EVERY = 8  # plain steps before the first one-draft probe of the acceptance rate
_PROBE_MAX = 64  # the interval doubles after each probe that does not bring drafting back
_PRIOR_WEIGHT = 16.0  # drafts' worth of acceptance evidence carried into the next decode call

# target model -> {(drafter key, method): the DraftLength of the last call}
_LEARNED: weakref.WeakKeyDictionary[object, dict] = weakref.WeakKeyDictionary()


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


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


class CostCurve:
    """Measured seconds per forward (or per step) as a function of the tokens it carries: an EMA per
    measured size, linear between measured sizes and beyond them."""

    def __init__(self):
        self.points: dict[int, float] = {}

    def __contains__(self, n: int) -> bool:
        return n in self.points

    def __len__(self) -> int:
        return len(self.points)

    def observe(self, n: int, seconds: float) -> None:
        self.points[n] = _ema(self.points.get(n), seconds)

    def largest(self) -> int:
        return max(self.points, default=0)

    def __call__(self, n: int) -> float | None:
        """Predicted cost at n: measured, or linear between / beyond the nearest measured sizes (flat
        from a single point); None before any measurement."""
        if n in self.points:
            return self.points[n]
        known = sorted(self.points)
        if not known:
            return None
        below = [m for m in known if m < n]
        above = [m for m in known if m > n]
        if below and above:
            lo, hi = below[-1], above[0]
        elif len(known) >= 2:
            lo, hi = (known[-2], known[-1]) if below else (known[0], known[1])
        else:
            return self.points[known[0]]
        slope = (self.points[hi] - self.points[lo]) / (hi - lo)
        return max(self.points[lo] + slope * (n - lo), 1e-9)


class CostLine:
    """Measured seconds per step as a line a + b * n in the tokens n it carries, fitted by least squares to
    every observation (older ones weigh `decay` less per new one; b >= 0). Step times scatter by 10-20 %
    from step to step on a CPU; a point per size, measured once, can shut a size out for good on one
    unlucky step, where a line pools every size's steps. With one size measured the line is flat."""

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.sums = [0.0] * 5  # weighted: 1, n, n^2, y, n * y
        self.sizes: set[int] = set()

    def __contains__(self, n: int) -> bool:
        return n in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def observe(self, n: int, seconds: float) -> None:
        terms = (1.0, n, n * n, seconds, n * seconds)
        self.sums = [self.decay * total + term for total, term in zip(self.sums, terms)]
        self.sizes.add(n)

    def largest(self) -> int:
        return max(self.sizes, default=0)

    def _fit(self) -> tuple[float, float, float] | None:
        """(mean n, mean seconds, slope) of the weighted observations; None before any."""
        weight, sum_n, sum_nn, sum_y, sum_ny = self.sums
        if not weight:
            return None
        mean_n, mean_y = sum_n / weight, sum_y / weight
        spread = sum_nn / weight - mean_n * mean_n
        slope = max((sum_ny / weight - mean_n * mean_y) / spread, 0.0) if spread > 1e-9 else 0.0
        return mean_n, mean_y, slope

    def __call__(self, n: int) -> float | None:
        """Predicted seconds at n (None before any measurement)."""
        fit = self._fit()
        return None if fit is None else max(fit[1] + fit[2] * (n - fit[0]), 1e-9)

    def at(self, n: torch.Tensor) -> torch.Tensor:
        """Predicted seconds at every size in n (float64; after at least one measurement)."""
        mean_n, mean_y, slope = self._fit()
        return (mean_y + slope * (n.double() - mean_n)).clamp(min=1e-9)


class CostPlane:
    """Measured seconds per step as a + b * requests + c * drafts + e * requests * drafts (slopes >= 0),
    fitted by decayed least squares to steps of every batch size at once, for an engine whose batch
    changes at every step (vLLM). What a draft token costs, learned with one request, prices drafts at
    eight before any step there; the product term lets a draft token cost more in a bigger batch (vLLM on
    this CPU: 4.4 ms with one request, 7.5 ms with eight). A term enters the fit only once the steps seen
    tell it apart from the terms before it (the order 1, drafts, requests, product; with one batch size
    the product is the drafts term again), so before any step with drafts they cost nothing (the first
    drafts look free: optimism that gets them measured). `at_requests(r)` is the CostLine-like view at r
    requests that DraftShape reads (tokens in flight n = r + drafts)."""

    _ORDER = (0, 2, 1, 3)  # 1, drafts, requests, requests x drafts
    _APART = 1e-6  # a term's share of its spread that the terms before it must leave unexplained

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.xx = torch.zeros(4, 4, dtype=torch.float64)  # weighted sums of x x^T
        self.xy = torch.zeros(4, dtype=torch.float64)
        self.largest_tokens = 0

    def observe(self, requests: int, tokens: int, seconds: float) -> None:
        drafts = tokens - requests
        x = torch.tensor([1.0, requests, drafts, requests * drafts], dtype=torch.float64)
        self.xx = self.decay * self.xx + torch.outer(x, x)
        self.xy = self.decay * self.xy + x * seconds
        self.largest_tokens = max(self.largest_tokens, tokens)

    def coefficients(self) -> torch.Tensor | None:
        """(a, b, c, e), or None before any step. A term the steps cannot tell apart is 0; a slope that
        fits below 0 is noise: 0, the rest refitted."""
        if not self.xx[0, 0]:
            return None
        free = [0]
        for j in self._ORDER[1:]:
            inner = self.xx[free][:, free]
            cross = self.xx[free, j]
            left = float(self.xx[j, j] - cross @ torch.linalg.solve(inner, cross))
            if left > self._APART * float(self.xx[j, j]) and left > 0:
                free.append(j)
        while True:
            solved = torch.linalg.solve(self.xx[free][:, free], self.xy[free])
            negative = [i for i, v in zip(free, solved.tolist()) if i > 0 and v < 0]
            if not negative:
                out = torch.zeros(4, dtype=torch.float64)
                out[free] = solved
                return out
            free.remove(negative[0])

    def at_requests(self, requests: int) -> "_PlaneView":
        return _PlaneView(self, requests)


class _PlaneView:
    """CostPlane at a fixed number of requests, as a CostLine in the tokens n in flight."""

    def __init__(self, plane: CostPlane, requests: int):
        self.plane, self.requests = plane, requests
        self.fit = plane.coefficients()

    def largest(self) -> int:
        return self.plane.largest_tokens

    def __call__(self, n: int) -> float | None:
        return None if self.fit is None else float(self.at(torch.tensor(n)))

    def at(self, n: torch.Tensor) -> torch.Tensor:
        a, b, c, e = self.fit.tolist()
        drafts = n.double() - self.requests
        return (a + b * self.requests + (c + e * self.requests) * drafts).clamp(min=1e-9)


class DraftLength:
    """Chooses the number of drafts per step: fixed, or "auto" from measured costs and acceptance."""

    def __init__(self, setting, max_drafts: int = 8, initial: int = 3):
        if setting == "auto":
            self.fixed = None
        elif isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
            self.fixed = setting
        else:
            raise ValueError(f"num_draft_tokens must be 'auto' or an int >= 1, got {setting!r}")
        self.max_drafts = max(max_drafts, self.fixed or 0)
        self.current = self.fixed or min(initial, max_drafts)
        self.target_cost = CostCurve()  # new tokens -> seconds per target forward
        self.draft_cost: float | None = None  # seconds per drafter forward
        self.step_cost: float | None = None  # seconds per step outside forwards
        self.accepted = 1.0  # Beta(1, 1) prior on the acceptance rate
        self.rejected = 1.0
        self.plain_steps = 0  # plain steps since drafting was last chosen or probed
        self.probe_interval = _PROBE_EVERY

    @classmethod
    def remembered(cls, setting, target, drafter_key, method: str) -> DraftLength:
        """A DraftLength that starts from what the last call with this target, drafter and method
        learned (drafter_key: the drafter model, or a string such as "self:6")."""
        new = cls(setting)
        old = swap_learned(_LEARNED, target, drafter_key, method, new)
        if old is not None:
            new.target_cost.points = dict(old.target_cost.points)
            new.draft_cost, new.step_cost = old.draft_cost, old.step_cost
            new.probe_interval = old.probe_interval
            scale = min(1.0, _PRIOR_WEIGHT / (old.accepted + old.rejected))
            new.accepted, new.rejected = old.accepted * scale, old.rejected * scale
        return new

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, drafts: int, target_seconds: float, draft_seconds_per_call: float | None,
                step_seconds: float, accepted: list[int], num_draft: list[int]) -> None:
        """One step's measurements: K, target forward time, drafter time per call, time outside
        forwards, and per row the accepted count and the number of drafts it could accept."""
        self.target_cost.observe(drafts + 1, target_seconds)
        if draft_seconds_per_call is not None:
            self.draft_cost = _ema(self.draft_cost, draft_seconds_per_call)
        self.step_cost = _ema(self.step_cost, step_seconds)
        for n, k in zip(accepted, num_draft):
            self.accepted += n
            self.rejected += 1 if n < k else 0

    def rate(self, k: int) -> float | None:
        """Predicted tokens per second with k drafts (None while its cost is unknown)."""
        target = self.target_cost(k + 1)
        if target is None or (k > 0 and self.draft_cost is None):
            return None
        a = self.acceptance
        expected = (1 - a ** (k + 1)) / (1 - a)
        return expected / (k * (self.draft_cost or 0.0) + target + (self.step_cost or 0.0))

    def _could_pay(self) -> bool:
        """Whether one draft would beat plain decoding even if it were always accepted."""
        plain = self.rate(0)
        single = self.target_cost(2)
        return plain is None or single is None or 2.0 / (
            (self.draft_cost or 0.0) + single + (self.step_cost or 0.0)) > plain

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if len(self.target_cost) == 1 and 2 not in self.target_cost:
            self.current = 1  # a second cost point, so the cost model has a slope
            return 1
        rates = {k: self.rate(k) for k in range(self.max_drafts + 1)}
        if any(r is None for r in rates.values()):
            return self.current
        best = max(rates, key=rates.get)
        # Plain decoding measures no acceptance: probe one draft now and then, or an unlucky start would
        # lock decoding into K = 0 for good.
        # A probe costs more than its one draft (the drafter first reads every token since it last ran),
        # so probes that keep confirming plain decoding come less and less often.
        if best == 0:
            self.plain_steps += 1
            if self.plain_steps >= self.probe_interval and self._could_pay():
                self.plain_steps = 0
                self.probe_interval = min(2 * self.probe_interval, _PROBE_MAX)
                return 1
        else:
            self.plain_steps = 0
            self.probe_interval = _PROBE_EVERY
        # Measure an unmeasured neighbour before settling: extrapolated costs can mislead.
        for k in (best - 1, best + 1):
            if 0 <= k <= self.max_drafts and k + 1 not in self.target_cost:
                self.current = k
                return k
        self.current = best
        return best
