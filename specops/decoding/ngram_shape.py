"""Draft shape for n-gram drafting: how many rows k and how many tokens w per row, chosen every step to
maximize expected tokens per second from measured costs and measured acceptance.

Cost: the wall time of a whole step from the requests it carries and its tokens in flight (rows of the
batch x nodes of the draft tree), the one cost model every draft-size choice asks (cost_model.StepCost, whose
module docstring says how it is fitted and how sizes never measured are explored). Where a forward reads its
weights once for any few tokens (a GPU; a CPU through skinny_linear) the fit stays nearly flat and the
choice grows to trees; where compute dominates it climbs, and the choice settles on one short row or on
plain decoding. Costs are kept per model for the life of the process, so later decode calls start from what
earlier ones measured.

Acceptance: drafts are a deterministic function of the context, so every step's full k_max x w_max draft
list is kept and, once the tokens that followed are known, scored for every (k, w) at once: a(k, w) =
min(w, longest prefix any of the first k rows shares with what was emitted). For greedy decoding this
is exact. When sampling it is unbiased: `tree_verify` with one-hot q accepts a node's child exactly when
the token the target emits there is that child (a rejected child leaves the residual with no mass on
it), so a tree accepts the longest prefix of the emitted tokens it holds, and the emitted tokens follow
the target whatever the tree was. The score needs no probing and keeps learning during plain steps.
Scores are kept per source of the first row: a context match, or the model bigram (source 0; `sources`
> 2 would split matches by length, but with 50-100 steps per decode call the finer estimates were too
noisy to rank shapes: sampled ngram at T = 1 took 0.77 target calls per token with 8 sources against
0.72 with 2, and greedy decoding gained nothing). The past fades once per step, however many requests the
step scored, so a batch's estimates are as steady as one request's over as many steps. What a call learned
starts the next call with the same model and sampling settings (worth at most _CARRIED lists per source).

A step's shape is valued by what it drafts (`DraftShape._expected`): k rows of which only d differ in their
first w tokens, the longest holding h < w, are worth a(d, h). The chooser picks the best of many estimates,
so it is biased toward ones that happen to be high; pricing shapes by rows that add nothing made that worse
(bench/bench_draft_calibration.py, docs/memory.md).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from specops._kept import per_object
from specops.decoding.cost_model import Probe, StepCost, swap_learned

__all__ = ["DraftShape", "distinct_rows", "tree_nodes"]

_DECAY = 0.97  # weight of the past per step that scores a source: acceptance drifts within a text
_PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior
_PRIOR_ACCEPTED = 0.5  # prior accepted tokens for any k, w >= 1: worth trying while drafting is cheap

# What a token a group member emits beyond its group's slowest is worth (DraftShape.widths; and in a decode
# call, a request ahead of the one with the most tokens left: `_worth`): it shortens the group's later steps
# only if the slowest catches up with it, and frees a slot early for requests that may arrive. With 8 requests
# on a CPU where a draft token costs 30 % of a request's share of a step, drafts beyond the group then cannot
# pay; where drafting is nearly free (a GPU at small batches) they still do.
_AHEAD_WORTH = 0.25
_LEAD_FREE = None  # per-request shapes: leads of up to this many tokens count whole (None: w_max)

# A step is padded with filler draft tokens up to a larger size measured to cost at most this share of its
# own (DraftShape.widths): below a 3 % difference two sizes' step times are not told apart on a CPU.
_PAD_SHARE = 0.97
_PROBE_GAIN = 1.01  # a probe where drafts were measured must be able to beat plain decoding by this much
# A step whose best shape makes less than _REST_BELOW of plain decoding's tokens per second is followed by
# _REST_STEPS plain steps taken without drafting or looking (`DraftShape.resting`): the look costs about
# 1.2 ms of a 50 ms step of 8 requests (the draft list, its pricing and scoring), and where one step is that
# far below plain the next two were too. Replayed over 562 steps of 8 sampled completions of a prompt and 141
# of 8 prompts together (HumanEval, Gemma-3-270M, 2-vCPU AMD EPYC Zen 4, 2026-12-06): 42 % and 48 % of the
# steps rest, none of them one where the chooser would have drafted at a rate above plain's. `choose` only:
# with a memory (`shapes`), one request at a time took 200 steps where it took 178-180 without rests, two runs
# each (a match in the memory appears from one step to the next), and 8 together rested too seldom to gain.
_REST_BELOW = 0.8
_REST_STEPS = 2
_CARRIED = 16.0  # draft lists' worth of acceptance per source carried into the next decode call
# target model -> {(device and settings, "ngram"): the DraftShape of the last call}
_LEARNED: weakref.WeakKeyDictionary = per_object(
    "n-gram acceptance", "n-gram draft shapes' acceptance learned from earlier calls, per sampling setting")
_COSTS: "weakref.WeakKeyDictionary[object, dict[str, StepCost]]" = per_object(
    "n-gram step costs", "n-gram steps' costs measured in earlier calls, per device")


def _shared_cost(model, device) -> StepCost:
    """The step cost of a model on a device, shared by every decode call in this process."""
    try:
        per_model = _COSTS.setdefault(model, {})
    except TypeError:  # not weak-referenceable: measure per call
        return StepCost()
    return per_model.setdefault(str(device), StepCost())


def _padded(costs: np.ndarray) -> np.ndarray:
    """Per count of draft tokens in flight (costs[n]: a step's predicted seconds with n), the count a step
    should send instead: the cheapest count at or above it where that costs at most _PAD_SHARE of costs[n],
    else n. A plane fitted to step times never falls with more tokens; an engine's measured step times can:
    vLLM's CPU engine on a 2-vCPU AMD EPYC (Zen 4), Gemma-3-270M, one request, took 80 ms for a plain
    step, 97-101 ms with one draft token and 65-69 with three or four (its oneDNN products pick another kernel
    by rows; 2026-12-05), so a step with three filler tokens beats one with none or one."""
    best = np.arange(len(costs))
    for n in range(len(costs) - 2, -1, -1):
        if costs[best[n + 1]] < costs[best[n]]:
            best[n] = best[n + 1]
    return np.where(costs[best] <= _PAD_SHARE * costs, best, np.arange(len(costs)))


def _pad(widths: list[int], extra: int, w_max: int) -> list[int]:
    """`extra` more tokens spread over the requests, the shortest widths first, none past w_max."""
    widths = list(widths)
    while extra > 0:
        room = [b for b, w in enumerate(widths) if w < w_max]
        if not room:
            break
        b = min(room, key=lambda b: widths[b])
        widths[b] += 1
        extra -= 1
    return widths


def _worth(lead: torch.Tensor | None, batch: int, free: int = 0) -> np.ndarray:
    """[batch] float64: what an accepted draft of each request is worth to a decode call, whose batch is done
    when its request with the most tokens left is. lead[b]: how many fewer tokens request b has left than that
    request (None, or one request: every draft is worth a token). A request ahead of it gets there sooner
    but ends the call no sooner; it only leaves the batch earlier, and on a CPU a step's rows cost little
    each (one request's step takes 0.7 of eight's), so its drafts count _AHEAD_WORTH. Counted whole, the
    drafts of 8 requests together went to those on long matches, they finished first, and the call ended in
    a tail of steps of 1-3 requests: `ngram` made 0.90-0.93x `ar`, 0.95-0.97x so (docs/benchmarks.md).
    free: leads of up to this many tokens count whole (`DraftShape.shapes`: one longest draft row, within
    which a request's drafts may still decide which request ends the call)."""
    if lead is None or batch < 2:
        return np.ones(batch)
    return np.where(_array(lead) > free, _AHEAD_WORTH, 1.0)


def _array(values) -> np.ndarray:
    """A CPU tensor or array as a NumPy array (a view where it can be). The shape choice works in NumPy:
    on [8, 8, 8] draft lists torch's per-call overhead made `choose` 0.6-0.7 ms of a step, about 2 % of
    a plain step of 8 requests on the 2-vCPU EPYC (Zen 4, 2026-12-06)."""
    return values.cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)


def _new_nodes(rows: np.ndarray) -> np.ndarray:
    """new[b, r, j]: row r of rows [B, K, W] (-1 past its end) adds a tree node at depth j, its first j + 1
    tokens being present and unlike those of every row before it."""
    k_max = rows.shape[1]
    present = np.logical_and.accumulate(rows >= 0, axis=-1)  # a row ends at its first -1
    # same[b, r, s, j]: rows r and s agree on their first j + 1 tokens
    same = np.logical_and.accumulate(rows[:, :, None, :] == rows[:, None, :, :], axis=-1)
    before = np.tri(k_max, k=-1, dtype=bool)  # [r, s]: s < r
    return present & ~(same & before[None, :, :, None]).any(2)


def _tree_nodes(new: np.ndarray) -> np.ndarray:
    return new.cumsum(1).cumsum(2)


def _distinct_rows(new: np.ndarray) -> np.ndarray:
    return (new.cumsum(2) > 0).cumsum(1)


def tree_nodes(rows: torch.Tensor) -> torch.Tensor:
    """nodes[b, k-1, w-1]: draft-tree nodes (root excluded) of the first k rows of rows [B, K, W] cut to
    w tokens, i.e. the distinct non-empty prefixes of length <= w among them."""
    return torch.from_numpy(_tree_nodes(_new_nodes(_array(rows))))


def distinct_rows(rows: torch.Tensor) -> torch.Tensor:
    """distinct[b, k-1, w-1]: how many of the first k rows of rows [B, K, W] differ from every row before them
    in their first w tokens (a row that repeats an earlier one there adds no node and catches nothing more)."""
    return torch.from_numpy(_distinct_rows(_new_nodes(_array(rows))))


class DraftShape:
    """Chooses (k, w) each step: fixed, or "auto" (module docstring). (0, 0) is plain decoding."""

    K_MAX = W_MAX = 8  # the largest "auto" shape

    def __init__(self, setting, model, device, k_max: int = K_MAX, w_max: int = W_MAX, sources: int = 2,
                 memory: str | None = None, cost: StepCost | None = None):
        """memory: what acceptance depends on besides the model (sampling settings, tables); "auto" keeps
        what this call learns under it and starts from what the last such call learned, worth at most
        _CARRIED lists per source (None: start from the prior). cost: the steps' cost model (None: the one
        this model on this device shares in the process)."""
        self.fixed = self.check(setting)
        self.k_max, self.w_max = self.fixed or (k_max, w_max)
        self.cost = cost if cost is not None else _shared_cost(model, device)
        self.sources = sources
        self.accepted = torch.zeros(sources, self.k_max, self.w_max, dtype=torch.float64)
        self.weight = torch.zeros(sources, dtype=torch.float64)
        self.pending: list[tuple[int, int, int, np.ndarray]] = []  # request, at, source, rows
        self.probe = Probe()
        self.rest = 0  # plain steps left to take unexamined (`resting`)
        if memory is not None and self.fixed is None:
            last = swap_learned(_LEARNED, model, f"{device}|{memory}", "ngram", self)
            if last is not None and last.accepted.shape == self.accepted.shape:
                scale = (_CARRIED / last.weight.clamp(min=_CARRIED)).clamp(max=1.0)
                self.accepted = last.accepted * scale[:, None, None]
                self.weight = last.weight * scale
            if last is not None:  # as for chains and trees (8 samples of a prompt: docs/memory.md)
                self.probe.resume(last.probe)

    @staticmethod
    def check(setting) -> tuple[int, int] | None:
        """The fixed shape a num_draft_tokens setting asks for (None for "auto"); raises for anything else."""
        if setting == "auto":
            return None
        if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
            return 1, setting
        if (isinstance(setting, tuple) and len(setting) == 2 and
                all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in setting)):
            return setting
        raise ValueError("num_draft_tokens for method 'ngram' must be 'auto', an int w >= 1 (one row of w "
                         f"tokens) or a tuple (k, w) of rows and tokens per row, got {setting!r}")

    def expected_accepted(self) -> torch.Tensor:
        """[sources, k_max, w_max] expected accepted tokens of each shape."""
        weight = self.weight.numpy()[:, None, None]
        prior = _PRIOR_WEIGHT * _PRIOR_ACCEPTED
        return torch.from_numpy((self.accepted.numpy() + prior) / (weight + _PRIOR_WEIGHT))

    def _expected(self, rows, source, new: np.ndarray | None = None) -> np.ndarray:
        """[B, k_max, w_max] expected accepted tokens of each shape for this step's rows [B, k_max, w_max] (on
        the CPU) and sources [B] (tensors or arrays; new: `_new_nodes(rows)` where computed). A shape is worth
        what the shape it drafts is worth: the first k rows cut to w tokens are as many rows as are distinct
        among them there (rows that repeat earlier ones add nothing, and draft lists hold such rows often), as
        wide as the longest of them. Priced at k rows of w tokens, a one-node draft of eight alike rows was
        worth what eight rows catch, and a row of 3 tokens what a row of 10 catches, which padded a step of 62
        requests to 10 tokens each."""
        rows, source = _array(rows), _array(source)
        batch, _, w_max = rows.shape
        table = self.expected_accepted().numpy()[np.minimum(source, self.sources - 1)]  # [B, k_max, w_max]
        # [B, k]: the longest of the first k rows
        held = np.maximum.accumulate(np.logical_and.accumulate(rows >= 0, axis=-1).sum(-1), axis=1)
        width = np.minimum(held[:, :, None], np.arange(1, w_max + 1)[None, None, :])
        # the same at w as at the width the rows hold
        distinct = _distinct_rows(_new_nodes(rows) if new is None else new)
        index = np.maximum((distinct - 1) * w_max + width - 1, 0).reshape(batch, -1)
        value = np.take_along_axis(table.reshape(batch, -1), index, 1).reshape(distinct.shape)
        return np.where(distinct > 0, value, 0.0)

    def choose(self, rows: torch.Tensor, source: torch.Tensor,
               lead: torch.Tensor | None = None) -> tuple[int, int]:
        """The shape for this step, given its full draft list rows [B, k_max, w_max] and the source of
        each request's first row [B]; lead [B] (None: none ahead): how many fewer tokens each request has left
        than the one with the most, whose drafts count whole, the others' _AHEAD_WORTH (`_worth`)."""
        if self.fixed is not None:
            return self.fixed
        batch = rows.shape[0]
        plain = self._plain(batch)
        if plain is None:
            return 0, 0  # measure plain decoding (at about this batch size) first
        rows = _array(rows)
        new = _new_nodes(rows)
        tokens = (self._expected(rows, source, new) * _worth(lead, batch)[:, None, None]).sum(0) + batch
        sizes = batch * (1 + _tree_nodes(new).max(0))  # tokens in flight of each shape
        cost = self.cost.at(batch, sizes).numpy()  # the fit, also past the largest size measured
        rate = np.where(sizes <= self.cost.reach(), tokens / cost, -np.inf)
        best_rate = rate.max()
        if not float(best_rate) > batch / plain:
            drafts = int((rows[:, 0, 0] >= 0).sum())  # requests with a one-token draft
            if drafts and self._probe(batch, drafts, plain):
                return 1, 1
            self._rest_after(float(best_rate), batch / plain)
            return 0, 0
        self.probe.drafted()
        # Among shapes of the best rate: the fewest tokens in flight, then the fewest rows.
        rank = sizes * sizes.size + np.arange(sizes.size).reshape(sizes.shape)
        index = int(np.where(rate == best_rate, rank, rank.max() + 1).argmin())
        return index // self.w_max + 1, index % self.w_max + 1

    def shapes(self, rows: torch.Tensor, source: torch.Tensor,
               lead: torch.Tensor | None = None) -> torch.Tensor:
        """(k, w) per request [B, 2] for this step, each request its own: rows [B, k_max, w_max] is the full
        draft list (-1 past a row's end), source [B] the source of each request's first row. A step's trees are
        padded to its largest, so it costs what B requests of N nodes each cost: for every N, each request takes
        the shape of at most N nodes with the most expected accepted tokens (no more than its rows hold), and
        the N with the most expected tokens per second under the step cost wins; (0, 0) everywhere where
        plain decoding wins. A request with a long match thus drafts a long chain while one with several
        likely continuations takes a wider tree of the same size. lead [B] (None: none ahead) as for `choose`,
        but a request's drafts count a quarter only once it is more than w_max tokens ahead (`_worth`):
        with the memory, 8 requests revising earlier answers together made 75.1-79.3 tokens/s with every
        request ahead counted a quarter against 79.0-87.9 whole (three runs each way, 2-vCPU AMD EPYC,
        2026-12-06): their drafts are long and accepted, and the weight shortened all of them. Counted whole,
        among 8 unrelated prompts the requests whose output repeated a line over and over drafted long chains
        from their 64-token matches in the memory, got far ahead and shortened nothing of the call
        (docs/memory.md, 2026-12-07)."""
        batch, k_max, w_max = rows.shape
        if self.fixed is not None:
            return torch.tensor([self.fixed] * batch, dtype=torch.long).view(batch, 2)
        none = torch.zeros(batch, 2, dtype=torch.long)
        plain = self._plain(batch)
        if plain is None:
            return none  # measure plain decoding (at about this batch size) first
        rows = _array(rows)
        new = _new_nodes(rows)
        nodes = _tree_nodes(new)  # [B, k, w]
        # at most the depth held
        worth = _worth(lead, batch, self.w_max if _LEAD_FREE is None else _LEAD_FREE)[:, None, None]
        value = np.where(nodes > 0, self._expected(rows, source, new) * worth, 0.0).reshape(batch, -1)
        nodes = nodes.reshape(batch, -1)
        largest = int(nodes.max())
        sizes = np.arange(largest + 1)
        # best[N, b]: request b's most value in at most N nodes (a running maximum over node counts: with
        # 16-token rows, a [N + 1, B, k * w] table of which shapes fit took 0.4 ms a step)
        best = np.zeros((batch, largest + 1))
        np.maximum.at(best, (np.arange(batch)[:, None], nodes), value)
        best = np.maximum.accumulate(best, axis=1).T  # [N + 1, B]
        tokens = batch + best.sum(1)
        in_flight = batch * (1 + sizes)
        rate = tokens / self.cost.at(batch, in_flight).numpy()
        rate = np.where(in_flight <= self.cost.reach(), rate, -np.inf)
        size = int(rate.argmax())  # the first best: the fewest nodes
        if size == 0 or not float(rate[size]) > batch / plain:
            if largest == 0 or not self._probe(batch, float((best[1] > 0).sum()), plain):
                return none
            size = 1  # a probe: each request's best one-node draft
        else:
            self.probe.drafted()
        # Each request's shape at that size: the most value, then the fewest nodes, then the fewest rows.
        rank = nodes * nodes.shape[1] + np.arange(nodes.shape[1])[None]
        top = best[size][:, None]
        pick = np.where((nodes <= size) & (value == top) & (top > 0), rank, rank.max() + 1).argmin(1)
        chosen = np.stack([pick // w_max + 1, pick % w_max + 1], 1)
        return torch.from_numpy(np.where((best[size] > 0)[:, None], chosen, 0).astype(np.int64))

    def resting(self) -> bool:
        """Whether this step is plain without a look at its drafts: one of the _REST_STEPS after a step whose
        best shape `choose` found below _REST_BELOW of plain decoding's rate. The caller then neither drafts
        nor records (acceptance is learned from the steps that look). Counts the step."""
        if self.rest <= 0:
            return False
        self.rest -= 1
        return True

    def _rest_after(self, best_rate: float, plain_rate: float) -> None:
        """A plain step's choice: rest for the next _REST_STEPS where its best shape was far from paying."""
        if best_rate < _REST_BELOW * plain_rate:
            self.rest = _REST_STEPS

    def _plain(self, batch: int) -> float | None:
        """A plain step's predicted seconds with `batch` requests; None until a plain step ran near that size
        (StepCost.measured_plain): then a plain step is what to do."""
        return self.cost(batch, batch) if self.cost.measured_plain(batch) else None

    def _probe(self, batch: int, drafts: float, plain: float) -> bool:
        """Whether this plain step should draft one token per request instead: at once where drafts were never
        measured at about this batch size (the fit only extrapolates there), else when a probe is due
        (cost_model.Probe) and its best case (`drafts` of its tokens, all accepted) would beat plain decoding."""
        if not self.cost.measured_drafts(batch):
            return True
        if not self.probe.due():
            return False
        best_case = (batch + drafts) / float(self.cost.at(batch, torch.tensor(2 * batch)))
        return best_case > _PROBE_GAIN * batch / plain

    def widths(self, rows: torch.Tensor, source: torch.Tensor, lead: torch.Tensor | None = None) -> list[int]:
        """Draft length per request for one chain each (k_max 1; rows [B, 1, w_max], -1 past a row's end;
        source [B]), for engines that verify ragged chains (vLLM): the lengths with the most expected
        tokens per second under the step cost, 0 for all where no drafting beats plain decoding.

        Alone (lead None, or lead[b] < 0), a request's w-th draft token is worth its expected gain
        P(its first w drafts are accepted) = e(w) - e(w - 1) for its source, made non-increasing along the
        row. Requests with lead[b] >= 0 decode as a group that is done when its slowest member is (a batch
        submitted together, `LLM.generate(prompts)`); lead[b] is how many tokens member b has emitted beyond
        the group's slowest. A group drafted to depth t (member b gets t - lead[b] tokens) advances at the
        pace of its weakest prospect: 1 + sum over s <= t of the least P(member b reaches s) among the
        members, b reaching s for sure when s <= lead[b] and with its gain at s - lead[b] otherwise; that
        advance counts once per member, and every other token a member is expected to emit counts
        _AHEAD_WORTH. The least, not the product of the members' chances: leads carry over, so a member
        that falls behind in one step drafts more in the next, and the group keeps the pace of the member
        whose drafts hold least. (The product, the chance that every member reaches s in this one step,
        priced 7 requests accepting 92 % of their first draft tokens at 0.56 a step, and kept them on one
        draft token for a dozen steps of self-refinement where vLLM's suffix drafted 8: docs/memory.md.)
        (Valued token by token, the drafts went to the requests on long context matches, those finished
        first, and the rest decoded in a tail of steps costing nearly a full batch's on a CPU: 0.90x plain
        vLLM with 8 requests submitted together.) Tokens beyond the group depth go where they are worth
        most, as for requests alone.

        Every group depth is tried; for each, the extra tokens are spent best first (a request's gains are
        non-increasing, so its chosen tokens stay a prefix of its chain), over every total the exploration
        rule allows (at most twice the largest measured step size).

        Where the step cost says a step with more tokens in flight is cheaper (per-size means of an engine
        whose products pick their kernel by rows: `_padded`), a total is priced at that cheaper size and the
        widths grow to it (the shortest first); the caller fills a width past its row's tokens with filler
        (vLLM verifies whatever it is sent: output unchanged, the step cheaper)."""
        batch, k_max, w_max = rows.shape
        if k_max != 1:
            raise ValueError(f"DraftShape.widths: one row per request (k_max 1), got {k_max}")
        if self.fixed is not None:
            return [self.fixed[1]] * batch
        if not self.cost.measured_plain(batch):
            return [0] * batch  # measure plain decoding (at about this batch size) first
        budget = max(self.cost.reach() - batch, 0)
        costs = self.cost.at(batch, torch.arange(batch, batch + budget + 1)).numpy()  # by drafts in flight
        padded = _padded(costs)  # by drafts in flight worth something: the count a step sends
        costs = costs[padded]
        plain = float(costs[0])
        # NumPy from here: a vLLM proposer asks once per engine step, and torch's per-call overhead on these
        # [B, w_max] arrays cost it 1.8 ms of its 4.4 ms a step (0.9 ms in NumPy; 8 requests, 2-vCPU Xeon).
        source = source.cpu().clamp(max=self.sources - 1).numpy()
        expected = self.expected_accepted()[:, 0].numpy()[source]  # [B, w_max]
        gain = np.minimum.accumulate(np.diff(expected, axis=-1, prepend=0.0), axis=-1).clip(min=0.0)
        drafted = np.cumprod(rows[:, 0].cpu().numpy() >= 0, axis=-1).sum(-1)  # tokens each row holds
        position = np.arange(w_max)
        gain = np.where(position[None] < drafted[:, None], gain, 0.0)
        lead = np.full(batch, -1) if lead is None else lead.cpu().numpy().astype(np.int64)
        member = lead >= 0
        if int(member.sum()) < 2:
            member[:] = False
        worth = np.where(member, _AHEAD_WORTH, 1.0)[:, None]  # of each request's own gains
        valued = (gain * worth).ravel()
        best_rate, best_widths = batch / plain, [0] * batch
        group_depths = int(w_max + lead[member].max()) if member.any() else 0
        for depth in range(group_depths + 1):
            base = np.where(member, np.minimum(np.clip(depth - lead, 0, None), drafted), 0)
            below = (position[None] < base[:, None]).ravel()
            tokens = batch + float(valued[below].sum())
            if member.any():
                steps = np.arange(1, depth + 1)[:, None] - lead[member][None]  # [depth, m]
                held = np.take_along_axis(gain[member], (steps.T - 1).clip(0, w_max - 1), 1).T
                reach = np.where(steps <= 0, 1.0, np.where(steps > w_max, 0.0, held)).min(1, initial=1.0)
                if depth and not float(reach[-1]) > 0:
                    break  # the group's slowest cannot get this far: deeper only costs more
                tokens += (1 - _AHEAD_WORTH) * int(member.sum()) * float(reach.sum())
            spent = int(base.sum())
            if spent > budget:
                break
            extra = np.where(below, 0.0, valued)
            order = np.argsort(-extra, kind="stable")  # largest first, ties in request order
            values = extra[order]
            usable = min(int((values > 0).sum()), budget - spent)
            total = tokens + np.concatenate([[0.0], np.cumsum(values[:usable])])
            rate = total / costs[spent:spent + usable + 1]
            pick = int(rate.argmax())  # the first best: the fewest tokens in flight
            if float(rate[pick]) > best_rate:
                widths = base + np.bincount(order[:pick] // w_max, minlength=batch)
                best_rate, best_widths = float(rate[pick]), widths.tolist()
        return _pad(best_widths, int(padded[sum(best_widths)]) - sum(best_widths), w_max)

    def observe_cost(self, requests: int, tokens: int, seconds: float) -> None:
        """A step's wall time with `requests` requests and `tokens` in flight."""
        self.cost.observe(requests, tokens, seconds)

    def record(self, requests: list[int], at: list[int], source: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep this step's draft lists: request r's rows predict its tokens from index at[r] on."""
        if self.fixed is not None:
            return
        rows, source = np.array(_array(rows)), _array(source).tolist()  # a copy: kept until scored
        for b, request in enumerate(requests):
            self.pending.append((request, at[b], source[b], rows[b]))

    def resolve(self, generated: list[list[int]], finished: set[int]) -> None:
        """Score the draft lists whose continuation is now known (or will never grow)."""
        ready, rest = [], []
        for entry in self.pending:
            request, at, _, _ = entry
            known = len(generated[request]) - at
            (ready if known >= self.w_max or request in finished else rest).append(entry)
        self.pending = rest
        if ready:
            self.score([entry[3] for entry in ready], [entry[2] for entry in ready],
                       [generated[request][at:at + self.w_max] for request, at, _, _ in ready])

    def score(self, rows: list[torch.Tensor], sources: list[int], followed: list) -> None:
        """Score draft lists, each [k_max, w_max] with the source of its first row, against the tokens that
        followed them (a sequence of up to w_max ids; shorter where the request ended first). A fixed
        shape learns nothing."""
        if self.fixed is not None:
            return
        truth = np.full((len(rows), self.w_max), -2, dtype=np.int64)
        for i, seen in enumerate(followed):
            seen = np.asarray(seen, dtype=np.int64)[:self.w_max]
            truth[i, :len(seen)] = seen
        rows = np.stack([_array(r) for r in rows])  # [E, k_max, w_max]
        shared = np.logical_and.accumulate(rows == truth[:, None, :], axis=-1).sum(-1)  # [E, k_max]
        best = np.maximum.accumulate(shared, axis=1)  # longest over the first k rows
        width = np.arange(1, self.w_max + 1)
        accepted = np.minimum(best[:, :, None], width[None, None, :]).astype(np.float64)  # [E, k_max, w_max]
        # The past of each source fades once per call (a step's lists), however many requests it holds.
        index = np.minimum(np.asarray(sources, dtype=np.int64), self.sources - 1)
        seen = np.bincount(index, minlength=self.sources)
        fade = np.where(seen > 0, _DECAY, 1.0)
        new = np.zeros(self.accepted.shape)
        np.add.at(new, index, accepted)
        self.accepted = torch.from_numpy(fade[:, None, None] * self.accepted.numpy() + new)
        self.weight = torch.from_numpy(fade * self.weight.numpy() + seen)
