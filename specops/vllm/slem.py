"""`SlemProposer`: a drafter with another vocabulary for vLLM (paper 000 Alg 2, string-level exact match).

    SPECOPS_DRAFTER=smollm2-135m vllm serve "$(specops models path gemma-3-270m)" \\
        --speculative-config '{"model": "specops.vllm.SlemProposer", "num_speculative_tokens": 8}'

The drafter, a transformers causal LM with any tokenizer, runs inside vLLM's worker process through
specops' engine: it drafts text greedily, the text is re-encoded in the target's tokens behind a look-behind
of the request's last target tokens (`retokenize.Retokenizer`), and vLLM verifies those as one-hot drafts,
so the output is vLLM's own. After each step the drafter keeps the longest run of its drafts whose text the
target emitted and reads the rest of that text in its own tokens (`Retokenizer.realign`), so its KV cache
follows every request across steps: one batched cache for all running requests, requests joining
(`KVState.join`) and leaving (`KVState.select`) at any step, identified by their tokens
(`_requests.Requests`). The number of drafter tokens per step comes from measured costs and acceptance
(one `DraftLength` for every batch size, its step costs read at the batch size they price, as
`specops.decode` has it): none where drafting cannot pay, with the decoder's probes to come back.

A request joins the drafter only at a step that drafts, never on its own first step (`_join`), and a step
drafts only if what drafting saves on the tokens the requests have left (the mean output of the requests that
finished so far; 64 before any did) repays reading what the drafter has not read yet: the prompts of
requests it never drafted for, and what every request emitted since the drafter last ran
(`cost_model.CatchUp`, priced from a timed read at start-up; a probe may catch up for an eighth of the plain
steps since the last probe; a fixed SPECOPS_DRAFT_LENGTH drafts every step). Joining every
request as it arrived made the drafter read 8 prompts submitted together before the first draft: 1.4 s on
two cores of a 5 s run, where vLLM decoded plain at 7.8 tokens a step anyway (0.42x plain vLLM,
docs/vllm.md).

Settings, from the environment of the vLLM process:
- SPECOPS_DRAFTER: an embedded model ("smollm2-135m", int8 weights by default; "smollm2-135m:float32" and
  the other suffixes of `specops.models`) or a transformers model folder (its tokenizer beside it);
- SPECOPS_DRAFT_LENGTH: "auto" (the default) or a fixed number of drafter tokens per step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from specops.decoding.cost_model import DraftLength
from specops.decoding.engine import CausalLM, KVState
from specops.decoding.retokenize import Retokenizer
from specops.vllm._requests import Requests, as_arrays
from specops.vllm._trace import Trace
from specops.vllm.ngram import draft_length_setting, speculative_tokens

__all__ = ["SlemProposer"]

_HISTORY = 16  # target tokens kept per request for the look-behind
_HORIZON = 64  # target tokens a request is assumed to have left before any request finished


def load_drafter(name: str | None):
    """(model, tokenizer) of SPECOPS_DRAFTER: an embedded name or a transformers model folder."""
    from specops import models

    if not name:
        raise ValueError("specops.vllm.SlemProposer: set SPECOPS_DRAFTER to the drafter, an embedded model "
                         f"({', '.join(models.names())}) or a transformers model folder")
    base = models.split_weights(name)[0]
    try:
        models.check_name(base)
        embedded = True
    except ValueError:
        embedded = False
    if embedded:
        return models.load_drafter(name, progress=False)
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ValueError(f"specops.vllm.SlemProposer: SPECOPS_DRAFTER={name!r} is neither an embedded model "
                         f"({', '.join(models.names())}) nor a folder that exists")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(folder))


class SlemProposer:
    """vLLM `custom_class` proposer: a drafter with any vocabulary drafts text (module docstring)."""

    def __init__(self, vllm_config):
        from transformers import AutoTokenizer

        from specops import vocab

        self.max_drafts = speculative_tokens(vllm_config, "SlemProposer")
        self.trace = Trace("SlemProposer")
        self.setting = draft_length_setting(self.max_drafts)
        self.max_model_len = vllm_config.model_config.max_model_len
        drafter, drafter_tokenizer = load_drafter(os.environ.get("SPECOPS_DRAFTER"))
        model_config = vllm_config.model_config
        target_tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer,
                                                         trust_remote_code=model_config.trust_remote_code)
        self.lm = CausalLM(drafter, "drafter")
        self.vmap = vocab.vocab_map(target_tokenizer, drafter_tokenizer)
        self.text = Retokenizer(self.vmap, target_tokenizer, drafter_tokenizer)
        self.state = KVState(self.lm, 0)
        self.order: list[int] = []  # the request of each row of the drafter's state
        self.history: dict[int, list[int]] = {}  # request -> its last target tokens
        self.pending: dict[int, list[int]] = {}  # request -> drafter ids it has not read
        self.drafted: dict[int, list[int]] = {}  # request -> the drafter's drafts of the last step
        self.proposed: dict[int, int] = {}  # request -> target tokens proposed at the last step
        self.length = DraftLength(self.setting, max_drafts=self.max_drafts)
        self.ratio = 1.0  # drafter tokens per target token, as joins measured it
        self.born: dict[int, int] = {}  # request -> its length when first seen
        self.reached: dict[int, int] = {}  # request -> its length at the last step
        self.outputs: list[int] = []  # target tokens each finished request emitted while proposed for
        self.requests = Requests()
        self.k = 0  # drafter tokens drafted at the last step
        self.fresh: set[int] = set()  # requests on their first step (they join the drafter from the next)
        self.propose_seconds = 0.0
        self.draft_seconds: float | None = None  # per drafter forward, at the last drafting step
        if self.length.fixed is None:
            self.length.catch_up.time_read(self._read_alone)

    @torch.inference_mode()
    def _read_alone(self, tokens: int) -> None:
        """One request's read of `tokens` drafter tokens, in a state of its own (prices reads at start-up)."""
        KVState(self.lm, 1).prefill([[self.text.stand_in] * tokens])

    def load_model(self, *args, **kwargs) -> None:
        """Nothing more to load: the drafter was loaded with the proposer, so a bad SPECOPS_DRAFTER fails at
        start-up."""

    @torch.inference_mode()
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None) -> list[list[int]]:
        """Drafts for every row of vLLM's input batch ([] where none); counted where SPECOPS_VLLM_TRACE asks
        (_trace.py)."""
        return self.trace.call(self._propose, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

    def _propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                 token_ids_cpu: np.ndarray) -> list[list[int]]:
        start = time.perf_counter()
        num_tokens_no_spec, token_ids_cpu = as_arrays(num_tokens_no_spec, token_ids_cpu)
        ids, gone, seconds = self.requests.step(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        self._observe(ids, sampled_token_ids, seconds)
        self._leave(gone | {r for r in self.order if r not in set(ids)})
        # What each request emitted since the last proposal: this step's tokens, or more after steps vLLM ran
        # without proposing (_requests.py).
        self._realign(ids, self.requests.emitted)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        self.proposed = {}
        live = [r for r in ids if r is not None]
        self.k = self._choose(ids, num_tokens_no_spec) if live else 0
        if self.k:
            self._join(ids, num_tokens_no_spec, token_ids_cpu)
            began = time.perf_counter()
            drafted = self._draft(self.k)
            self.draft_seconds = (time.perf_counter() - began) / self.k
            position = {request: row for row, request in enumerate(self.order)}
            for row, request in enumerate(ids):
                if request not in position:  # no request, or one on its first step
                    continue
                self.drafted[request] = drafted[position[request]]
                room = min(self.max_drafts, self.max_model_len - int(num_tokens_no_spec[row]) - 1)
                text = self.vmap.draft.text_bytes(self.drafted[request])
                drafts[row] = self.text.to_target(self.history[request], text)[:max(room, 0)]
                self.proposed[request] = len(drafts[row])
        else:
            self.drafted = {request: [] for request in self.order}
        self.propose_seconds = time.perf_counter() - start
        return drafts

    def _choose(self, ids, lengths) -> int:
        """This step's drafter tokens per request: the chooser's, if drafting repays the drafter's catching
        up (module docstring)."""
        rows = {r: int(lengths[row]) for row, r in enumerate(ids) if r is not None}
        self.fresh = {r for r in rows if r not in self.born}
        for r, length in rows.items():
            self.born.setdefault(r, length)
            self.reached[r] = length
        k = self.length.choose(len(rows))
        joined = set(self.order)
        if not joined and not set(rows) - self.fresh:
            return 0  # every request is on its first step: none may join yet (_join)
        if not k or self.length.fixed is not None or self.length.cost.drafter is None:
            return k  # (the chooser's first drafting step measures the drafter, whatever it reads first)
        backlog = sum(len(self.pending[r]) if r in joined else round(rows[r] * self.ratio)
                      for r in rows if r not in self.fresh)
        expected = sum(self.outputs) / len(self.outputs) if self.outputs else _HORIZON
        left = sum(max(expected - (rows[r] - self.born[r]), 1.0) for r in rows) / len(rows)
        return k if self.length.catch_up.pays(self.length, len(rows), (1,) * k, backlog, left) else 0

    def _observe(self, ids, sampled, seconds) -> None:
        """The step that just ran, if it decoded exactly the requests proposed for: its cost and acceptance."""
        if seconds is None:
            return
        accepted = [len(sampled[row]) - 1 for row, r in enumerate(ids) if r is not None]
        offered = [self.proposed.get(r, 0) for r in ids if r is not None]
        target = max(seconds - self.propose_seconds, 1e-6)
        self.length.observe(self.k, target, self.draft_seconds if self.k else None, 0.0, accepted, offered)

    def _leave(self, gone: set) -> None:
        """Requests that finished (or were preempted) leave the drafter's batch."""
        for r in gone:
            if r in self.born:
                self.outputs = (self.outputs + [self.reached[r] - self.born.pop(r)])[-_HORIZON:]
                self.reached.pop(r)
        if not any(r in gone for r in self.order):
            return
        keep = [row for row, r in enumerate(self.order) if r not in gone]
        self.state.select(torch.tensor(keep, dtype=torch.long))
        self.order = [self.order[row] for row in keep]
        for r in gone:
            for table in (self.history, self.pending, self.drafted, self.proposed):
                table.pop(r, None)

    def _realign(self, ids, rows_emitted) -> None:
        """Each running request's drafter keeps the drafts the target emitted (`rows_emitted`: per row, the
        tokens since the last proposal) and queues the rest."""
        if not self.order:
            return
        emitted = {r: rows_emitted[row] for row, r in enumerate(ids) if r is not None}
        keep = []
        for r in self.order:
            tokens = emitted[r]
            self.history[r] = (self.history[r] + tokens)[-_HISTORY:]
            kept, self.pending[r] = self.text.realign(self.drafted.get(r, []), self.vmap.target.text_bytes(tokens),
                                                      self.pending[r])
            keep.append(kept)
        if self.k > 1:
            self.state.rollback(self.k - 1, torch.tensor(keep, dtype=torch.long))

    def _join(self, ids, lengths, tokens) -> None:
        """Requests new to the drafter read their text so far in a state of their own, joined to the batch
        (all of it but the last token, which the next read takes with everyone's pending tokens). Not on a
        request's first step: vLLM admits a group of requests over its first steps, and the first alone
        looked like one request decoding, where drafting pays; its prompt was read (0.42 s on a 2-vCPU Xeon)
        for drafts that the full batch of 4, a step later, did not verify."""
        known = set(self.order) | self.fresh
        new = [(row, r) for row, r in enumerate(ids) if r is not None and r not in known]
        if not new:
            return
        texts = {}
        for row, r in new:
            target = tokens[row, :int(lengths[row])].tolist()
            self.history[r] = target[-_HISTORY:]
            texts[r] = self.text.to_drafter(self.vmap.target.text_bytes(target)) or [self.text.stand_in]
            self.ratio = 0.9 * self.ratio + 0.1 * len(texts[r]) / max(len(target), 1)
        read = [r for _, r in new if len(texts[r]) > 1]
        for group in (read, [r for _, r in new if len(texts[r]) == 1]):
            if not group:
                continue
            joined = KVState(self.lm, len(group))
            if group is read:
                began = time.perf_counter()
                joined.prefill([texts[r][:-1] for r in group])
                self.length.catch_up.observe(sum(len(texts[r]) - 1 for r in group), time.perf_counter() - began)
            self.state.join(joined)
            self.order += group
            for r in group:
                self.pending[r] = texts[r][-1:] if group is read else texts[r]
                self.drafted[r] = []

    def _draft(self, k: int) -> list[list[int]]:
        """k greedy drafter tokens per row of the drafter's state, after its pending tokens."""
        logits = self.state.extend([self.pending[r] for r in self.order])
        for r in self.order:
            self.pending[r] = []
        columns = []
        words = len(self.vmap.draft.token_bytes)  # LM heads may have rows past the tokenizer's ids
        for i in range(k):
            token = logits[:, :words].argmax(-1)
            columns.append(token)
            if i + 1 < k:
                logits = self.state.append(token.unsqueeze(1))[:, -1]
        return torch.stack(columns, dim=1).tolist()
