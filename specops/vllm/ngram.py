"""`NgramProposer`: learning-free n-gram drafts (paper 001) for vLLM, through `specops.ops.ngram_match`.

    LLM(model=..., speculative_config={"model": "specops.vllm.NgramProposer",
                                       "num_speculative_tokens": 8})

Each step, every decoding request gets the continuation of the most recent, longest, most frequent earlier
occurrence of its last tokens (`ngram_match` over the batch in one call); a continuation cut short by the end
of the context goes on with the model's bigram table, and a request whose context has no match gets the
extended bigram after its last token (`specops.decoding.ngram.DraftTables`, as `specops.decode`'s ngram
method drafts). How many of those tokens to
propose is decided every step from measurements, as `specops.decode`'s ngram method does (`DraftShape`):

- acceptance: every step's full draft list is scored against the tokens that followed it, for every
  length at once (drafts are a function of the context, and vLLM verifies them as one-hot drafts, so a
  draft is accepted exactly when the target emits it: greedy or sampled, the score is unbiased), kept
  apart by where the draft came from: a context match of 1, 2, 3 or 4 tokens, or the bigram. A proposer
  lives as long as the engine, so each of the five gathers enough steps to be told apart (on HumanEval
  with Gemma-3-270M the best lengths of up to 16 in hindsight were 1, 3, 3, 4 and 14 tokens from the bigram
  to 4-token matches; in a replay of the same outputs one length for every match gave 6 % fewer tokens/s);
- cost: the wall time of each engine step, from one proposal to the next, against the requests and draft
  tokens it carried (a + b * requests + c * drafts + e * requests * drafts, fitted to every step that
  decoded the same requests the last one proposed for, `StepCost`): vLLM's batch changes at every step, and
  a line per batch size had to be measured again at each size, drafts and all, before it could stop drafting
  there. On this CPU a draft token costs about 4.4 ms with one request and 7.5 ms with eight, on a 110-160
  ms step, hence a requests x drafts term. Each size measured lately is priced by its own mean besides:
  vLLM's CPU step time is no plane (on a 2-vCPU Zen 4, one request: 80 ms plain, 97-101 with one draft
  token, 65-69 with three or four), and where a step with more tokens measured cheaper, a request short of
  useful drafts sends filler (its last token again) up to that size: vLLM verifies it as any draft, so the
  output is unchanged and the step cheaper.

Each request gets its own length (vLLM verifies ragged chains): the step's draft tokens go where they are
worth most, so a request continuing a long context match drafts many while one drafting from the bigram
drafts few or none (`DraftShape.widths`); none at all when drafting cannot pay at this batch size.
Requests that started decoding within two steps of each other (a batch submitted at once) are valued as a
group that is done when its slowest member is: their drafts count by how far they move that member.
Valued one by one, 8 requests together on a CPU drafted for the few on long matches, which finished
first, and left the rest to a tail of steps that cost nearly a full batch's (0.90x plain vLLM).
num_speculative_tokens is the most it proposes. vLLM verifies the drafts, so the output is vLLM's own:
greedy tokens identical to decoding without speculation, sampled tokens from the same distribution.

A memory across requests (`specops.NgramMemory`), one per engine: every request's prompt and output go into it
as they are decoded, and drafts merge its continuations (matches up to 64 tokens long, with how often each
followed) with the request's own context n-grams, longest match first. So requests draft from each other,
the n samples of one prompt (SamplingParams(n=...)) among them, and from everything the engine decoded
before, within the memory's byte budget (least recently used requests leave first). Acceptance is then kept
apart by match length (0: the bigram; 1-2, 3-7, 8-15 and 16+ tokens) and by whether at least half of what
followed the match went the draft's way.

Settings come from the environment of the vLLM process (vLLM passes a custom class no options of its own,
and sets prompt_lookup_min/max to 0 for it): SPECOPS_DRAFT_LENGTH "auto" (the default) or a fixed number
of tokens; SPECOPS_NGRAM_TABLES "auto" (the default: the target's bigram table when it is cached, or quick to
build for a small model), "bigram" (built at start-up when missing: 7 to 25 minutes for Gemma-3-270M on two
CPU cores, seconds on a GPU; cached under ~/.cache/specops/ngrams; `specops models bigram NAME|FOLDER` builds
it ahead) or "none" (context n-grams only); SPECOPS_NGRAM_MEMORY, a memory file to seed the memory from (when
it exists) and to save it to (every 64 finished requests, and when the engine's process exits);
SPECOPS_NGRAM_MEMORY_BYTES, its budget (default 256M; K, M, G suffixes); SPECOPS_NGRAM_MEMORY=off turns the
memory off (context n-grams of 1 to 4 tokens, as before it existed).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np
import torch

from specops.decoding import model_ngrams
from specops.decoding.cost_model import StepCost
from specops.decoding.ngram_shape import DraftShape
from specops.decoding.ngram import DraftTables, match_source
from specops.memory import NgramMemory, vocabulary_fingerprint
from specops.vllm._requests import Requests, as_arrays
from specops.vllm._trace import Trace

__all__ = ["NgramProposer"]

MIN_NGRAM, MAX_NGRAM = 1, 4  # match lengths, as specops.decode's ngram method has them
_TOGETHER = 2  # steps apart that requests may start decoding and still count as submitted together
BIGRAM_TOP = 8  # the table specops.decode's ngram method builds (and shares through the cache)
_SOURCES = (1, 3, 8, 16)  # acceptance kept apart by match length and agreement (the module docstring)
_SAVE_EVERY = 64  # finished requests between saves of the memory file
_BUDGET = 256 << 20


def tables_setting() -> str:
    """SPECOPS_NGRAM_TABLES: "auto", "bigram" or "none" (raises otherwise, at start-up)."""
    value = os.environ.get("SPECOPS_NGRAM_TABLES", "auto").strip().lower()
    if value not in ("auto", "bigram", "none"):
        raise ValueError(f"SPECOPS_NGRAM_TABLES must be auto, bigram or none, got {value!r}")
    return value


def draft_length_setting(maximum: int) -> str | int:
    """SPECOPS_DRAFT_LENGTH: "auto", or a fixed length in 1..maximum (raises otherwise, at start-up)."""
    value = os.environ.get("SPECOPS_DRAFT_LENGTH", "auto").strip().lower()
    if value == "auto":
        return "auto"
    if not value.isdigit() or not 1 <= int(value) <= maximum:
        raise ValueError(f"SPECOPS_DRAFT_LENGTH must be 'auto' or an integer in 1..{maximum} "
                         f"(num_speculative_tokens), got {value!r}")
    return int(value)


def memory_settings() -> tuple[bool, str | None, int]:
    """(memory on, SPECOPS_NGRAM_MEMORY's file or None, SPECOPS_NGRAM_MEMORY_BYTES); raises for a bad budget."""
    path = os.environ.get("SPECOPS_NGRAM_MEMORY", "").strip()
    text = os.environ.get("SPECOPS_NGRAM_MEMORY_BYTES", "").strip()
    budget = _BUDGET
    if text:
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale > 1 else text
        if not digits.isdigit() or int(digits) == 0:
            raise ValueError(f"SPECOPS_NGRAM_MEMORY_BYTES must be a byte count > 0 (K, M or G suffixes), got {text!r}")
        budget = int(digits) * scale
    if path.lower() == "off":
        return False, None, budget
    return True, path or None, budget


def _save(memory: NgramMemory, path: str) -> None:
    try:
        memory.save(path)
    except OSError:  # at exit, nowhere to report it; the next save tries again
        pass


def speculative_tokens(vllm_config, proposer: str) -> int:
    """num_speculative_tokens of the config, checked: the most tokens a proposer may return per request."""
    spec = vllm_config.speculative_config
    count = getattr(spec, "num_speculative_tokens", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"specops.vllm.{proposer}: num_speculative_tokens must be an integer >= 1 (the most "
                         f"tokens proposed per request and step), got {count!r}")
    return count


class NgramProposer:
    """vLLM `custom_class` proposer: context n-gram drafts of measured length (module docstring)."""

    def __init__(self, vllm_config):
        self.max_drafts = speculative_tokens(vllm_config, "NgramProposer")
        self.trace = Trace("NgramProposer")
        self.max_model_len = vllm_config.model_config.max_model_len
        setting = draft_length_setting(self.max_drafts)
        bigram = model_ngrams.folder_bigram(vllm_config.model_config.model, BIGRAM_TOP, tables=tables_setting())
        self.tables = DraftTables(bigram, None, "cpu", MIN_NGRAM, MAX_NGRAM)
        self.memory, self.memory_path = self._open_memory(vllm_config)
        if self.memory_path:  # saved when the proposer goes, and at the process's exit if it has not gone
            weakref.finalize(self, _save, self.memory, self.memory_path)
        self.runs: dict[int, list] = {}  # request -> [its handle in the memory, its tokens written there]
        self.finished = 0  # requests finished since the memory was last saved
        # One row of drafts per request (vLLM verifies chains); costs are this proposer's own steps.
        # Acceptance kept per source: the match length (bucketed with a memory), 0 for the bigram.
        # seconds per step from its requests and tokens in flight; each size measured priced by its own mean
        # where that is below the fit (vLLM's step time is no plane in the tokens in flight: StepCost)
        self.costs = StepCost(per_size=True)
        sources = MAX_NGRAM + 1 if self.memory is None else 2 * len(_SOURCES) + 1
        self.shape = DraftShape(setting, model=self, device="vllm", k_max=1, w_max=self.max_drafts,
                                sources=sources, cost=self.costs)
        self.requests = Requests()
        self.pending: dict[int, list[tuple[int, torch.Tensor, int]]] = {}  # request -> (at, rows, source)
        self.seen: dict[int, tuple[int, np.ndarray]] = {}  # request -> (start, its tokens from there)
        self.joined: dict[int, tuple[int, int]] = {}  # request -> (step, its length) when first seen decoding
        self.steps = 0  # proposals made
        self.step_tokens = 0  # tokens the step now running carries: 1 + drafts per request
        self.step_requests = 0  # requests it carries

    @staticmethod
    def _open_memory(vllm_config) -> tuple[NgramMemory | None, str | None]:
        """The engine's memory (seeded from SPECOPS_NGRAM_MEMORY when that file exists) bound to the target's
        vocabulary, and that file, or (None, None) with SPECOPS_NGRAM_MEMORY=off."""
        on, path, budget = memory_settings()
        if not on:
            return None, None
        memory = (NgramMemory.load(path, budget_bytes=budget) if path and Path(path).exists()
                  else NgramMemory(budget_bytes=budget))
        model_config = vllm_config.model_config
        size = getattr(model_config, "get_vocab_size", None)
        if callable(size):
            tokenizer = None
            try:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, local_files_only=True,
                                                          trust_remote_code=model_config.trust_remote_code)
            except (OSError, ValueError):
                pass
            memory.bind(int(size()), vocabulary_fingerprint(tokenizer), who="specops.vllm.NgramProposer")
        return memory, path

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: the drafts come from the context and the bigram table (read at construction)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None) -> list[list[int]]:
        """Drafts for every row of vLLM's input batch ([] where none); counted where SPECOPS_VLLM_TRACE asks
        (_trace.py)."""
        return self.trace.call(self._propose, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

    def _propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                 token_ids_cpu: np.ndarray) -> list[list[int]]:
        num_tokens_no_spec, token_ids_cpu = as_arrays(num_tokens_no_spec, token_ids_cpu)
        ids, gone, seconds = self.requests.step(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        if seconds is not None and self.step_tokens:
            self.costs.observe(self.step_requests, self.step_tokens, seconds)
        self._score(ids, gone, num_tokens_no_spec, token_ids_cpu)
        if self.memory is not None:
            self._remember(ids, gone, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows = [row for row, request in enumerate(ids)
                if request is not None and num_tokens_no_spec[row] + 1 < self.max_model_len]
        self.step_tokens = self.step_requests = len(rows)
        if not rows:
            return drafts
        lengths = torch.from_numpy(num_tokens_no_spec[rows].astype(np.int64))
        contexts = torch.from_numpy(token_ids_cpu[rows, :int(lengths.max())].astype(np.int64))
        candidates, source, share = self.tables.propose(contexts, lengths, 1, self.max_drafts, self.memory)
        if self.memory is not None:
            source = match_source(source, _SOURCES, share)
        widths = self.shape.widths(candidates, source, self._leads([ids[row] for row in rows], lengths))
        for b, row in enumerate(rows):
            request, at = ids[row], int(lengths[b])
            self.pending.setdefault(request, []).append((at, candidates[b], int(source[b])))
            room = self.max_model_len - at - 1  # the target must still place a token after the drafts
            width = min(widths[b], room)
            draft = candidates[b, 0, :width].tolist()
            draft = draft[:draft.index(-1)] if -1 in draft else draft
            if self.shape.fixed is None:  # filler where a larger step costs less (DraftShape.widths)
                draft += [draft[-1] if draft else int(contexts[b, at - 1])] * (width - len(draft))
            drafts[row] = draft
            self.step_tokens += len(draft)
        return drafts

    def _remember(self, ids, gone, sampled, lengths, tokens) -> None:
        """Write every decoding request's new tokens into the memory (all of them, prompt included, when it is
        first seen decoding), and finish the runs of the requests that left."""
        new_handles, new_tokens = [], []
        for row, request in enumerate(ids):
            if request is None:
                continue
            length = int(lengths[row])
            run = self.runs.get(request)
            if run is None:  # a run per request: its prompt and what it emits, grown as it goes
                run = self.runs[request] = [self.memory.open([[]], [None])[0], 0]
            if length > run[1]:
                new_handles.append(run[0])
                new_tokens.append(tokens[row, run[1]:length].tolist())
                run[1] = length
        self.memory.extend(new_handles, new_tokens)
        done = [self.runs.pop(request)[0] for request in gone if request in self.runs]
        self.memory.close(done)
        self.finished += len(done)
        if self.memory_path and self.finished >= _SAVE_EVERY:
            self.finished = 0
            _save(self.memory, self.memory_path)

    def _leads(self, requests: list[int], lengths: torch.Tensor) -> torch.Tensor:
        """Per request, -1 if it decodes on its own, else how many tokens it has emitted since it joined
        beyond the slowest member of its group (DraftShape.widths): the largest set of at least two running
        requests that started decoding together, i.e. at steps no more than _TOGETHER apart (a batch
        submitted at once, split over prefill chunks), which is done when its slowest member is."""
        self.steps += 1
        joined = [self.joined.setdefault(r, (self.steps, int(n))) for r, n in zip(requests, lengths)]
        order = sorted(range(len(requests)), key=lambda b: joined[b][0])
        groups, last = [], None
        for b in order:
            if last is None or joined[b][0] - last > _TOGETHER:
                groups.append([])
            groups[-1].append(b)
            last = joined[b][0]
        lead = torch.full((len(requests),), -1, dtype=torch.long)
        group = max(groups, key=len)
        if len(group) >= 2:
            emitted = torch.tensor([int(lengths[b]) - joined[b][1] for b in group])
            lead[group] = emitted - emitted.min()
        return lead

    def _score(self, ids, gone, lengths, tokens) -> None:
        """Score the draft lists whose continuation is known: max_drafts tokens later, or when the request
        left (with what it emitted until then)."""
        rows, sources, followed = [], [], []
        for row, request in enumerate(ids):
            if request is None or request not in self.pending:
                continue
            length, keep = int(lengths[row]), []
            start = min(at for at, _, _ in self.pending[request])
            self.seen[request] = (start, tokens[row, start:length].copy())
            for at, draft, source in self.pending[request]:
                if length - at >= self.max_drafts:
                    rows.append(draft)
                    sources.append(source)
                    followed.append(tokens[row, at:at + self.max_drafts])
                else:
                    keep.append((at, draft, source))
            self.pending[request] = keep
        for request in gone:
            self.joined.pop(request, None)
            start, emitted = self.seen.pop(request, (0, np.zeros(0, dtype=np.int32)))
            for at, draft, source in self.pending.pop(request, []):
                rows.append(draft)
                sources.append(source)
                followed.append(emitted[at - start:at - start + self.max_drafts])
        if rows:
            self.shape.score(rows, sources, followed)
