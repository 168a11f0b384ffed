"""Learning-free n-gram drafting (method "ngram"; paper 001): drafts that cost almost nothing, taken
from the context and from the model's own weights, k rows of w tokens verified in one target forward.

Each step fills k draft rows (section 4.3, mixed strategy): first the context n-grams that continue the
last tokens (`specops.ops.ngram_match`: longest match first, then most frequent, then most recent), a
match cut short by the end of the context extended with the model bigram; the remaining rows from the
extended model bigram (the bigram's top-k after the last token, each continued with top-1 lookups), or
from the model unigram when no bigram table is given. The rows form one token tree per request (shared
prefixes once), which the target scores in a single forward over its KV cache, without copying the
cache per row. The whole tree is checked as deterministic drafts (q one-hot): every row gets its chance,
a sampled token is accepted whenever the target's own draw would land in the tree, greedy output equals
greedy decoding and sampled output follows the target exactly. The cache keeps the accepted path,
compacted. k and w come from ngram_shape.DraftShape.

Option "scheme" (`verify.SCHEMES`) says how sampled trees are verified: "positional" walks the tree through
the target's own tokens, drawn with the random numbers of their positions (verify._match_tree), so the
text is sampled "ar"'s for the same seed; "token" and "joint" hand the tree to `tree_verify` (recursive
rejection sampling, traversal verification) with a one-hot q (a step of one row to `chain_verify`).
With one-hot q all three keep a draft with the target's probability of it, the most any verifier can
(docs/verification.md), so "auto" (the default) is "positional", which reads only the nodes it walks.
"""

from __future__ import annotations

import torch

from specops import ops
from specops.decoding import model_ngrams
from specops.decoding.tree_forward import is_transformers_model
from specops.decoding.batch import Batch
from specops.decoding.ngram_shape import DraftShape
from specops.decoding.model_ngrams import extend, successors
from specops.decoding.protocol import Method, Proposal, Proposer, Setup, StepResult, TreeDraft
from specops.decoding.tree import build_tree
from specops.decoding.verify import resolve_scheme, scheme_option
from specops.ops.ngram import MEMORY_MAX_OCCURRENCES, MEMORY_MAX_WIDTH

__all__ = ["MEMORY_SOURCES", "DraftTables", "NgramDrafter", "NgramProposer", "match_source", "merge_candidates"]

TABLES = ("auto", "bigram", "unigram", "none")
_MEMORY_WIDTH = 16  # the longest draft row with a memory (its matches run long)
# The memory's rows rank against the context's as if their match were this many tokens shorter: the memory
# holds the other requests' text too, and a match there predicts less than one as long in the request's own.
# With 8 unrelated prompts together the memory's drafts outranked the context's 4-grams with matches of 5-7
# tokens from the other prompts; 4 took the memory from 0.91x to 0.99x `ngram` there, and left the workloads
# that repeat themselves as they were (docs/memory.md, 2026-12-04 evening).
_MEMORY_DISCOUNT = 4


class DraftTables:
    """Draft rows from contexts: context n-grams first, then the model bigram (or unigram); one piece for
    every caller that holds contexts of its own (this method, specops.vllm.NgramProposer)."""

    def __init__(self, bigram: torch.Tensor | None, unigram: torch.Tensor | None, device,
                 min_ngram: int = 1, max_ngram: int = 4, follow: torch.Tensor | None = None):
        """follow: successors(bigram, depth) computed before (model_ngrams.bigram_successors), else built here on
        first use."""
        self.bigram = None if bigram is None else bigram.to(device=device, dtype=torch.int64)
        self.unigram = None if unigram is None else unigram.to(device=device, dtype=torch.int64)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.follow = None if follow is None else follow.to(device)

    def _follow(self, w: int) -> torch.Tensor:
        """successors(bigram, w - 1): the first w - 1 columns of a deeper table are the same."""
        if self.follow is None or self.follow.shape[1] < w - 1:
            self.follow = successors(self.bigram, w - 1)
        return self.follow[:, :w - 1]

    def propose(self, contexts: torch.Tensor, lengths: torch.Tensor, k: int, w: int, memory=None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft rows [B, k, w] (-1 past a row's end) for contexts [B, C] int64 of lengths [B] (each >= 1), the
        length of each request's first row's match [B] (0 if it came from the model n-grams, or if there is
        none) and that row's share [B] of the occurrences its candidates hold at that match length (how often
        what followed the match went that way). With a memory (specops.NgramMemory) its continuations join
        the context's (`merge_candidates`)."""
        candidates, counts, level = ops.ngram_match(contexts, lengths, min_ngram=self.min_ngram,
                                                    max_ngram=self.max_ngram, num_candidates=k, width=w,
                                                    validate=False)
        if memory is not None:
            found = memory.lookup(contexts, lengths, num_candidates=min(k, MEMORY_MAX_OCCURRENCES),
                                  width=min(w, MEMORY_MAX_WIDTH))
            _, got, width = found.candidates.shape  # padded to k rows of w tokens, as the context's
            rows = torch.nn.functional.pad(found.candidates, (0, w - width, 0, k - got), value=-1)
            found_counts = torch.nn.functional.pad(found.counts, (0, k - got))
            candidates, counts, level = merge_candidates(
                (rows, found_counts, torch.where(found_counts > 0, found.match[:, None], 0)),
                (candidates, counts, level), k, first_discount=_MEMORY_DISCOUNT)
        batch = candidates.shape[0]
        last = contexts[torch.arange(batch, device=contexts.device), lengths - 1]
        if self.bigram is not None:
            follow = self._follow(w)
            if w > 1:  # a match cut short by the end of the context: continue it with the bigram
                size = (candidates >= 0).sum(-1, keepdim=True)  # a row is its first `size` tokens
                tail = candidates.gather(-1, (size - 1).clamp(min=0))  # its last token
                after = torch.arange(w, device=last.device) - size  # [B, k, w]: successor index
                more = follow[tail.clamp(min=0)].squeeze(-2).gather(-1, after.clamp(0, w - 2))
                candidates = torch.where((after >= 0) & (size > 0), more, candidates)
            fill = extend(self.bigram[last, :k], follow)  # [B, min(k, top), w]
        elif self.unigram is not None:
            fill = torch.full((batch, min(k, self.unigram.numel()), w), -1, dtype=torch.int64,
                              device=last.device)
            fill[:, :, 0] = self.unigram[:fill.shape[1]]
        else:
            fill = torch.full((batch, 0, w), -1, dtype=torch.int64, device=last.device)
        # Row r: the r-th context candidate while there are any, then the fill from its start.
        found = (counts > 0).sum(1, keepdim=True)
        order = torch.arange(k, device=last.device)[None]
        from_fill = (order - found).clamp(min=0)
        filled = torch.full((batch, k, w), -1, dtype=torch.int64, device=last.device)
        if fill.shape[1]:
            usable = from_fill < fill.shape[1]
            taken = fill.gather(1, from_fill.clamp(max=fill.shape[1] - 1)[:, :, None].expand(-1, -1, w))
            filled = torch.where(usable[:, :, None], taken, filled)
        rows = torch.where((order < found)[:, :, None], candidates, filled)
        first = torch.where(found[:, 0] > 0, level[:, 0], 0)
        alike = torch.where(level == level[:, :1], counts, 0).sum(1).clamp(min=1)
        return rows, first, counts[:, 0] / alike


def _earlier(n: int, device) -> torch.Tensor:
    """[n, n] bool, [r, s] True where s < r. Not `torch.ones(n, n).tril(-1)`: torch's CPU tril enters a
    parallel region at any size, and with the other core of a 2-vCPU host busy (a compiler there) a 2 x 2
    tril waited about 3 ms for its second thread (2.7 us on one thread). A replay of vLLM NgramProposer's
    calls then took 5.4 ms a call with the tril and 1.3 ms without; on the quiet host 0.96 ms either way (AMD
    EPYC, 2026-12-05)."""
    index = torch.arange(n, device=device)
    return index[None, :] < index[:, None]


def merge_candidates(first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...], k: int,
                     first_discount: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two candidate lists (candidates [B, k1, w], counts [B, k1] with 0 for none, level [B, k1]: the match
    length each came from) as one of k rows: longest match first (`first`'s ranked as if `first_discount`
    tokens shorter, at least 1), then the most frequent, `first` before `second` on ties; a row equal to one
    ranked before it leaves (the memory holds a request's own context too, so both lists often hold it). The
    levels returned are the rows' own."""
    candidates = torch.cat([first[0], second[0]], 1)
    counts = torch.cat([first[1], second[1]], 1)
    level = torch.cat([first[2], second[2]], 1)
    rows = candidates.shape[1]
    rank = torch.cat([(first[2] - first_discount).clamp(min=1), second[2]], 1)
    key = torch.where(counts > 0, rank * 2**40 + counts.clamp(max=2**40 - 1), -1)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    candidates = candidates.gather(1, order[:, :, None].expand_as(candidates))
    counts, level = counts.gather(1, order), level.gather(1, order)
    same = (candidates[:, :, None, :] == candidates[:, None, :, :]).all(-1)  # [B, r, s]
    repeated = (same & _earlier(rows, candidates.device) & (counts > 0)[:, None, :]).any(2) | (counts == 0)
    keep = torch.sort(repeated.long(), dim=1, stable=True).indices[:, :k]  # kept rows first, in rank order
    take = ~repeated.gather(1, keep)
    width = candidates.shape[2]
    candidates = torch.where(take[:, :, None], candidates.gather(1, keep[:, :, None].expand(-1, -1, width)), -1)
    return candidates, torch.where(take, counts.gather(1, keep), 0), torch.where(take, level.gather(1, keep), 0)


class NgramDrafter:
    """The running contexts of a decode call and their draft rows (DraftTables).

    contexts [B, C] int64 hold each request's prompt and generated tokens, right-padded; lengths [B]."""

    def __init__(self, batch: Batch, bigram: torch.Tensor | None, unigram: torch.Tensor | None, device,
                 min_ngram: int = 1, max_ngram: int = 4, follow: torch.Tensor | None = None):
        prompts = batch.prompt_rows
        self.prompt_lengths = [len(p) for p in prompts]
        self.contexts = torch.zeros(batch.rows, max(self.prompt_lengths) + batch.max_new_tokens + 1,
                                    dtype=torch.int64, device=device)
        for b, p in enumerate(prompts):
            self.contexts[b, :len(p)] = torch.tensor(p, dtype=torch.int64)
        self.lengths = torch.tensor(self.prompt_lengths, dtype=torch.int64, device=device)
        self.tables = DraftTables(bigram, unigram, device, min_ngram, max_ngram, follow)

    def extend_contexts(self, new_tokens: list[list[int]]) -> None:
        """Append each request's new tokens to its context."""
        if self.contexts.device.type != "cpu":
            self._extend_on_device(new_tokens)
            return
        # Row by row into a NumPy view: on the CPU, a third of the time of the tensor ops below.
        count = [len(t) for t in new_tokens]
        contexts, at = self.contexts.numpy(), self.lengths.tolist()
        for b, tokens in enumerate(new_tokens):
            contexts[b, at[b]:at[b] + count[b]] = tokens
        self.lengths = self.lengths + torch.tensor(count, dtype=torch.int64)

    def _extend_on_device(self, new_tokens: list[list[int]]) -> None:
        """extend_contexts in a few tensor operations, for contexts on an accelerator."""
        width = max(len(t) for t in new_tokens)
        tokens = torch.tensor([t + [0] * (width - len(t)) for t in new_tokens], dtype=torch.int64)
        count = torch.tensor([len(t) for t in new_tokens], dtype=torch.int64, device=self.lengths.device)
        index = self.lengths[:, None] + torch.arange(width, device=self.lengths.device)
        keep = torch.arange(width, device=self.lengths.device)[None] < count[:, None]
        rows = torch.arange(len(new_tokens), device=self.lengths.device)[:, None].expand_as(index)
        self.contexts[rows[keep], index[keep]] = tokens.to(self.contexts.device)[keep]
        self.lengths = self.lengths + count

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.contexts.device)
        self.contexts, self.lengths = self.contexts[rows], self.lengths[rows]

    def propose(self, k: int, w: int, memory=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft rows [B, k, w], each request's first row's match length and share (DraftTables.propose)."""
        return self.tables.propose(self.contexts, self.lengths, k, w, memory)


class NgramProposer(Proposer):
    """Verifier "tree"; a step whose trees are all one row goes to the chain verifier: the same tokens
    for the same seeds (chain_verify is tree_verify's chain case), through the plain forward, which
    costs less than a tree's (no tree mask, no gather of the accepted path in every layer's cache).

    With a memory (specops.NgramMemory), every request is written into it as it decodes (a run per request: its
    prompt, then its output step by step), its drafts merge the memory's continuations with the context's, and
    each request gets its own draft shape (`DraftShape.shapes`)."""

    verifier = "tree"

    def __init__(self, setup: Setup, bigram: torch.Tensor | None, unigram: torch.Tensor | None, shape: DraftShape,
                 follow: torch.Tensor | None = None):
        self.batch = setup.batch
        self.contexts = NgramDrafter(setup.batch, bigram, unigram, setup.target.device, follow=follow)
        self.shape = shape
        self.scheme = resolve_scheme(setup.options, seeded=setup.seeded, carries_q=False)
        self.memory = setup.memory
        self.handles: list[int | None] = []  # per row: the memory's handle of its run,
        self.requests: list[int] = []  # the request it decodes,
        self.written: list[int] = []  # and how many of its tokens are in the memory

    def start(self, first: list[int]) -> None:
        self.contexts.extend_contexts([[t] for t in first])
        if self.memory is not None:  # a run per request: its prompt, then its output as it is emitted
            batch = self.batch
            self.handles = self.memory.open([[]] * batch.rows, [len(p) + batch.max_new_tokens for p in batch.prompt_rows])
            self.memory.extend(self.handles, batch.prompt_rows)
            self.requests = list(batch.index)
            self.written = [0] * batch.rows

    def _write(self, rows: list[int]) -> None:
        """Write what these rows' requests emitted since they were last written into their runs (tokens a stop
        cut off are never emitted, so never written)."""
        generated = [self.batch.generated[self.requests[row]] for row in rows]
        self.memory.extend([self.handles[row] for row in rows],
                           [g[self.written[row]:] for row, g in zip(rows, generated)])
        for row, g in zip(rows, generated):
            self.written[row] = len(g)

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        if self.shape.resting():  # drafting was far from paying a step ago: plain, unexamined
            return Proposal.empty(self.batch.rows, self.contexts.contexts.device)
        # The full draft list (for the acceptance record), then the rows this step can afford.
        rows, source, share = self.contexts.propose(self.shape.k_max, self.shape.w_max, self.memory)
        if self.memory is not None:
            source = match_source(source, MEMORY_SOURCES, share)
        batch = self.batch
        self.shape.record(list(batch.index), [len(batch.generated[i]) for i in batch.index], source, rows)
        lead = budget.max() - budget  # tokens each request is ahead of the one with the most left
        if self.memory is None:
            k, w = self.shape.choose(rows, source, lead)
            if k == 0:  # a plain step: most steps of a batch where drafting does not pay
                return Proposal.empty(batch.rows, rows.device)
            shapes = torch.tensor([[k, w]], dtype=torch.long).expand(rows.shape[0], 2)
        else:
            shapes = self.shape.shapes(rows, source, lead)
        k, w = int(shapes[:, 0].max()), int(shapes[:, 1].max())
        if k == 0:
            return Proposal.empty(batch.rows, rows.device)
        rows = rows[:, :k, :w].clone()
        shapes = shapes.to(rows.device)
        beyond = ((torch.arange(k, device=rows.device)[None, :, None] >= shapes[:, None, None, 0])
                  | (torch.arange(w, device=rows.device)[None, None, :] >= shapes[:, None, None, 1])
                  | (torch.arange(w, device=rows.device)[None, None, :] >= budget[:, None, None]))
        rows = rows.masked_fill(beyond, -1)
        w = int((rows >= 0).long().cumprod(-1).sum(-1).max())  # a step is as wide as its longest draft row
        if w == 0:
            return Proposal.empty(batch.rows, rows.device)
        rows = rows[:, :, :w]
        if k == 1:  # every tree is one row: a chain, which tree_verify and chain_verify accept alike
            drafts = rows[:, 0]
            return Proposal(drafts, (drafts >= 0).long().cumprod(1).sum(1), size=w, scheme=self.scheme.op("chain"))
        tree = build_tree(last, rows)
        return Proposal(tree=TreeDraft(tree.tokens, tree.parent, tree.valid.sum(1), scheme=self.scheme.op("tree"),
                                       closure=tree))

    def accept(self, result: StepResult) -> None:
        self.contexts.extend_contexts(result.emitted)
        if self.memory is not None:
            self._write(list(range(len(self.handles))))
        self.shape.observe_cost(len(result.emitted), len(result.emitted) * (result.size + 1), result.step_seconds)
        self.shape.resolve(self.batch.generated, result.finished)

    def select(self, rows: torch.Tensor) -> None:
        self.contexts.select(rows)
        if self.memory is not None:
            kept = rows.tolist()
            done = sorted(set(range(len(self.handles))) - set(kept))
            self._write(done)
            self.memory.close([self.handles[r] for r in done])
            self.handles, self.requests, self.written = ([values[r] for r in kept] for values in
                                                         (self.handles, self.requests, self.written))

    def finish(self) -> None:
        if self.memory is not None and self.handles:
            self._write(list(range(len(self.handles))))
            self.memory.close(self.handles)
            self.handles = []


# Draft-shape sources with a memory: no match (the model n-grams), then matches of 1-3, 4-15 and 16+ tokens,
# each split by whether at least half of what followed the match went the first row's way, so that long and
# agreed matches earn long drafts. Without one, 0 and any context match (DraftShape's docstring).
MEMORY_SOURCES = (1, 4, 16)
_AGREED = 0.5


def match_source(level: torch.Tensor, bounds: tuple[int, ...], share: torch.Tensor) -> torch.Tensor:
    """The draft-shape source of each request [B] from its first row's match length (which of the increasing
    `bounds` it reaches; 0: none) and its share of the occurrences: 0 for no match, then two sources per length
    bucket, the second for a share of at least one half. Sources: 2 * len(bounds) + 1."""
    bucket = (level[:, None] >= torch.tensor(bounds, device=level.device)).sum(1)
    return torch.where(bucket > 0, 2 * bucket - 1 + (share >= _AGREED).long(), 0)


_SCHEME = scheme_option()


def _check(options: dict) -> None:
    if options["tables"] not in TABLES:
        raise ValueError(f"decode: option 'tables' of method ngram must be one of {', '.join(TABLES)}, "
                         f"got {options['tables']!r}")
    _SCHEME["check"](options)


def _make(setup: Setup) -> Proposer:
    model = setup.target.model
    fixed = DraftShape.check(setup.num_draft_tokens)
    k_max = fixed[0] if fixed else DraftShape.K_MAX
    bigram = unigram = None  # built (once per model) before the clock starts
    tables, top = setup.options["tables"], max(8, k_max)
    # Prompts given as token ids (specops.hf) may come without a tokenizer: their own BOS says it.
    bos = None if setup.tokenizer is not None else model_ngrams.prompts_bos(model, setup.batch.prompt_rows)
    if tables == "auto":  # the bigram when it is cached or quick to build, else the context alone
        ready = (is_transformers_model(model)
                 and model_ngrams.bigram_ready(model, setup.tokenizer, top, bos=bos))
        tables = "bigram" if ready else "none"
    if tables == "bigram":
        bigram = model_ngrams.bigram(model, setup.tokenizer, top=top, bos=bos)
    elif tables == "unigram":
        unigram = model_ngrams.unigram(model, top=k_max)
    # Acceptance depends on the sampling settings, the tables and whether a memory drafts too: what a call
    # learns is kept under them.
    params = setup.params
    learned = (f"T={params.temperature}|top_k={params.top_k}|top_p={params.top_p}|tables={tables}"
               f"|memory={setup.memory is not None}")
    if setup.memory is None:
        shape = DraftShape(setup.num_draft_tokens, model, setup.target.device, memory=learned)
    else:  # longer rows for long matches, sources by match length
        shape = DraftShape(setup.num_draft_tokens, model, setup.target.device, w_max=_MEMORY_WIDTH,
                           sources=2 * len(MEMORY_SOURCES) + 1, memory=learned)
    follow = None
    if bigram is not None and shape.w_max > 1:  # the extended bigram's table, kept with the model's tables
        follow = model_ngrams.bigram_successors(model, setup.tokenizer, shape.w_max - 1, top=top, bos=bos)
    return NgramProposer(setup, bigram, unigram, shape, follow)


METHODS = [Method("ngram", "drafts from the context, the model's own n-grams and a memory of earlier requests "
                  "(memory=), verified as a token tree", _make, memory=True,
                  trees=("target",), options={"tables": "auto", "scheme": "auto"}, check=_check,
                  option_help={"tables": "model-derived n-grams for rows the context cannot fill: bigram is "
                               "computed once per model (7 to 25 minutes for gemma-3-270m on two CPU cores, "
                               "seconds on a GPU, with a progress bar) and cached; auto uses it when cached or "
                               "quick to build, else the context alone; unigram: from the embeddings, at once; none: "
                               "the context alone",
                               **_SCHEME["option_help"]},
                  option_choices={"tables": TABLES, **_SCHEME["option_choices"]},
                  auto=lambda given: not given.drafter and not given.ensemble and given.trees,
                  draft_setting=DraftShape.check)]
