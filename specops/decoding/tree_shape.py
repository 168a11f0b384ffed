"""Draft-tree shape for the drafter tree methods (rsd-c, specinfer, rsd-s) with num_draft_tokens="auto": the
shape that maximizes expected tokens per second from measured costs and measured acceptance.

Acceptance: recursive rejection sampling tries a node's children in draw order, so a node that had c children
tells, for every b <= c, whether one of its first b children was accepted; the outcome does not depend on
whether more children were drawn. Every path node of every step (the root, then each accepted draft) is
such an observation, scored from the emitted tokens, so a(b) = P(one of b children accepted | node reached)
is measured for every b up to the widest tried, pooled over depths, from every shape ever used. Past the
widest measured b each further child is assumed to catch what one alone would of the mass left,
1 - a(b) = (1 - a(B)) (1 - a(1))^(b - B): independent children, pessimistic for RSD. A tree whose path
nodes have c_1, c_2, ... children emits E = 1 + sum_l prod_{j <= l} a(c_j) tokens. For rsd-c and specinfer
c_j is the branching of level j. For rsd-s the root has W children and a deeper path node as many as its
beam kept, measured per W (starting from W / 2).

Cost: the target forward as a function of the tokens it carries (a `CostCurve` over tree nodes + 1), one
drafter forward per level, and the step's time outside forwards. Depth 0 is plain decoding; while it wins,
a one-node tree is probed now and then (doubling intervals), as `DraftLength` probes one draft. Costs and
acceptance are kept per target, drafter and method for the life of the process.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch

from specops.decoding.draft_length import CostCurve, _ema, swap_learned

__all__ = ["TreeShape"]

_PRIOR = (1.0, 1.0)  # Beta prior (hits, misses) of each a(b)
_MAX_WIDTH = 4  # children per node considered by rsd-c / specinfer
_MAX_BEAMS = 6
_MAX_DEPTH = 6
_MAX_NODES = 48
_PROBE_EVERY, _PROBE_MAX = 8, 64
_MEMORY_WEIGHT = 32.0  # observations' worth of acceptance carried into the next decode call

_LEARNED: weakref.WeakKeyDictionary[object, dict] = weakref.WeakKeyDictionary()


def _branching_shapes() -> list[tuple[int, ...]]:
    """Non-increasing branchings of depth 0.._MAX_DEPTH, at most _MAX_NODES nodes."""
    shapes = [()]
    for depth in range(1, _MAX_DEPTH + 1):
        for shape in itertools.product(range(1, _MAX_WIDTH + 1), repeat=depth):
            if list(shape) == sorted(shape, reverse=True) and nodes(shape, False) <= _MAX_NODES:
                shapes.append(shape)
    return shapes


def nodes(shape: tuple[int, ...], beams: bool) -> int:
    """Draft nodes of a shape: W * L for beams (W, L), sum of the level widths for a branching."""
    if beams:
        return shape[0] * shape[1] if shape else 0
    return sum(math.prod(shape[:level + 1]) for level in range(len(shape)))


class TreeShape:
    """Chooses the tree shape every step (module docstring). Shapes: a branching tuple (b1, ..., bL), or
    (W, L) for beams; () is plain decoding."""

    def __init__(self, beams: bool, initial: tuple[int, ...]):
        self.beams = beams
        self.candidates = ([()] + [(w, d) for w in range(1, _MAX_BEAMS + 1) for d in range(1, _MAX_DEPTH + 1)
                                   if w * d <= _MAX_NODES] if beams else _branching_shapes())
        self.initial = self.current = initial
        self.hits = torch.zeros(_MAX_BEAMS + 1 if beams else _MAX_WIDTH + 1, dtype=torch.float64)
        self.seen = torch.zeros_like(self.hits)
        self._table: list[float] | None = None  # acceptance by width, until the next observation
        self.kept: dict[int, float] = {}  # rsd-s: W -> mean children of a path node below the root
        self.target_cost = CostCurve()  # tokens carried (nodes + 1) -> seconds per target forward
        self.draft_cost: float | None = None  # seconds per drafter forward
        self.step_cost: float | None = None  # seconds per step outside forwards
        self.plain_steps = 0
        self.probe_interval = _PROBE_EVERY

    @classmethod
    def remembered(cls, beams: bool, initial, target, drafter_key, method: str) -> TreeShape:
        """A TreeShape that starts from what the last call with this target, drafter and method learned."""
        new = cls(beams, initial)
        old = swap_learned(_LEARNED, target, drafter_key, method, new)
        if old is not None:
            new.target_cost.points = dict(old.target_cost.points)
            new.draft_cost, new.step_cost, new.kept = old.draft_cost, old.step_cost, dict(old.kept)
            scale = min(1.0, _MEMORY_WEIGHT / max(1.0, float(old.seen[1])))
            new.hits, new.seen = old.hits * scale, old.seen * scale
            new.current = old.current
        return new

    def acceptance(self, width: int) -> float:
        """a(width): P(one of `width` children accepted | node reached)."""
        if width <= 0:
            return 0.0
        if self._table is None:  # every width a shape can ask for (+1 to interpolate), once per observation
            self._table = [self._acceptance(b) for b in range(len(self.hits) + 1)]
        return self._table[width] if width < len(self._table) else self._acceptance(width)

    def _acceptance(self, width: int) -> float:
        if width <= 0:
            return 0.0
        seen, hits = self.seen.tolist(), self.hits.tolist()
        measured = max((b for b, n in enumerate(seen) if n > 0), default=0)
        widest = min(width, measured, len(seen) - 1)
        if widest == 0:
            return 1 - 0.5 ** width  # nothing measured yet: a(1) = 1/2
        rate = (hits[widest] + _PRIOR[0]) / (seen[widest] + sum(_PRIOR))
        single = (hits[1] + _PRIOR[0]) / (seen[1] + sum(_PRIOR))
        return 1 - (1 - rate) * (1 - single) ** (width - widest)

    def expected_tokens(self, shape: tuple[int, ...]) -> float:
        if not shape:
            return 1.0
        if self.beams:
            width, depth = shape
            below = self.kept.get(width, max(1.0, width / 2))
            path = [width] + [below] * (depth - 1)
        else:
            path = list(shape)
        total, reach = 1.0, 1.0
        for c in path:
            whole = int(c)
            # a fractional number of children: interpolate between the two whole numbers around it
            a = self.acceptance(whole) + (c - whole) * (self.acceptance(whole + 1) - self.acceptance(whole))
            reach *= a
            total += reach
        return total

    def rate(self, shape: tuple[int, ...]) -> float | None:
        """Predicted tokens per second with `shape` (None while a cost it needs is unknown)."""
        target = self.target_cost(nodes(shape, self.beams) + 1)
        if target is None or (shape and self.draft_cost is None):
            return None
        depth = (shape[1] if self.beams else len(shape)) if shape else 0
        return self.expected_tokens(shape) / (target + depth * (self.draft_cost or 0.0) + (self.step_cost or 0.0))

    def choose(self) -> tuple[int, ...]:
        if self.draft_cost is None:  # first measure a tree (its cost and the drafter's) ...
            return self.current or self.initial
        if 1 not in self.target_cost:  # ... then a plain step, so the cost model has a slope
            return ()
        rates = {shape: self.rate(shape) for shape in self.candidates}
        if any(r is None for r in rates.values()):
            return self.current
        best = max(rates, key=rates.get)
        if not best:
            self.plain_steps += 1
            if self.plain_steps >= self.probe_interval:
                self.plain_steps = 0
                self.probe_interval = min(2 * self.probe_interval, _PROBE_MAX)
                best = (1, 1) if self.beams else (1,)
        else:
            self.plain_steps = 0
            self.probe_interval = _PROBE_EVERY
        self.current = best
        return best

    def observe(self, shape: tuple[int, ...], target_seconds: float, draft_seconds: float | None,
                outside_seconds: float, paths: list[list[tuple[int, int]]]) -> None:
        """One step: its shape and costs, and per request the path nodes as (children, rank of the accepted
        child, 0 for none)."""
        self.target_cost.observe(nodes(shape, self.beams) + 1, target_seconds)
        if draft_seconds is not None and shape:
            self.draft_cost = _ema(self.draft_cost, draft_seconds)
        self.step_cost = _ema(self.step_cost, outside_seconds)
        self._table = None
        top = len(self.hits) - 1
        for path in paths:
            for level, (children, rank) in enumerate(path):
                for b in range(1, min(children, top) + 1):
                    self.seen[b] += 1
                    self.hits[b] += 1 if 0 < rank <= b else 0
                if self.beams and shape and 0 < level < shape[1]:  # a beam's node above the last level
                    self.kept[shape[0]] = _ema(self.kept.get(shape[0]), children)
