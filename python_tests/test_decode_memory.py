"""decode(..., memory=) and decode(..., num_samples=): n-gram drafting from a specops.NgramMemory stays exact
(greedy: the target's own tokens; sampled: its distribution, chi-square, and the same text as sampled "ar" for
the same seed), fills the memory with prompts and outputs as it decodes, drafts longer where matches are long;
num_samples decodes each prompt several times from one prefill. Wrong combinations are refused."""

from __future__ import annotations

import threading

import pytest
import torch

import specops
from specops.decoding import model_ngrams
from specops.decoding.cost_model import StepCost
from specops.decoding.engine import KVState
from stats_helpers import ALPHA, N_SEQUENCES, _fit, assert_follows_target, mass_moved
from stats_helpers import SD_STAT_NEW as STAT_NEW
from stats_helpers import SD_STAT_PROMPTS as STAT_PROMPTS
from stats_helpers import SD_TARGET_TABLE as TARGET_TABLE
from toy_models import (LETTERS, START, TableLM, byte_tokenizer, letter_tokenizer, sequence_distribution,
                        tiny_gemma3, tiny_llama)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["abcabcabcabc abc", "Hello", "the cat sat; the cat sat; the cat", "ünï ✓ 42", "a"]
MAX_NEW = 16
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TARGETS = {
    "llama": lambda: tiny_llama(layers=4, seed=0),
    "gemma-sw8": lambda: tiny_gemma3(layers=4, seed=0, sliding_window=8, layer_types=MIXED),
}


@pytest.fixture(scope="module", autouse=True)
def ngram_cache(tmp_path_factory):
    """Model bigrams built by decode() go to a temporary cache, never to ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECOPS_CACHE", str(tmp_path_factory.mktemp("specops-cache")))
        yield


@pytest.fixture(scope="module")
def targets():
    return {name: make() for name, make in TARGETS.items()}


@pytest.fixture(scope="module")
def greedy(targets):
    return {name: specops.decode(PROMPTS, target=model, tokenizer=byte_tokenizer(), method="ar",
                                 max_new_tokens=MAX_NEW) for name, model in targets.items()}


# ---- greedy: the target's own tokens ----

@pytest.mark.parametrize("shape", [(4, 4), (1, 16), "auto"], ids=str)
@pytest.mark.parametrize("name", list(TARGETS))
def test_greedy_with_memory_equals_ar(targets, greedy, name, shape):
    memory = specops.NgramMemory()
    for _ in range(3):  # an empty memory, then one holding these very outputs: long matches, long drafts
        result = specops.decode(PROMPTS, target=targets[name], tokenizer=byte_tokenizer(), method="ngram",
                                max_new_tokens=MAX_NEW, num_draft_tokens=shape, memory=memory)
        assert result.tokens == greedy[name].tokens and result.text == greedy[name].text
    assert memory.stats()["runs"] == 3 * len(PROMPTS)  # each call: every request's prompt and output


def test_memory_lets_later_calls_draft_longer(greedy):
    """The same prompts again: the memory holds what follows every context, so auto drafts long chains and
    the call takes far fewer target forwards than the first. Step times are a fixed function of the step's
    size here (a step of n tokens in flight costs 10 ms + 0.1 ms per token, as a forward that reads its
    weights once would), so the cost model's choices, and so the test, do not follow this machine's load: a
    CI run under load once took the last call's 15 tokens in steps of 7 and 6. A fresh model object (the same
    weights as the fixture's) starts with no costs or acceptance learned by other tests."""
    real = StepCost.observe

    def fixed(self, requests, tokens, target_seconds, drafter_seconds=None, outside_seconds=None):
        real(self, requests, tokens, 0.01 + 1e-4 * tokens, drafter_seconds,
             None if outside_seconds is None else 1e-4)

    memory, model = specops.NgramMemory(), TARGETS["llama"]()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepCost, "observe", fixed)
        first = specops.decode(PROMPTS, target=model, tokenizer=byte_tokenizer(), max_new_tokens=MAX_NEW,
                               memory=memory).stats
        calls = []
        for _ in range(4):  # costs and acceptance start unlearned: drafts grow over the first calls
            again = specops.decode(PROMPTS, target=model, tokenizer=byte_tokenizer(), max_new_tokens=MAX_NEW,
                                   memory=memory)
            assert again.tokens == greedy["llama"].tokens and again.stats.method == "ngram"
            calls.append(again.stats)
    assert calls[-1].target_calls < first.target_calls / 2
    # rows longer than the 8 tokens ngram drafts without a memory, from the second call again on
    assert all(max(stats.draft_lengths) > 8 for stats in calls[1:])


def test_requests_of_one_call_draft_from_each_other(targets):
    """Request B's prompt is request A's prompt and the first 4 tokens A will emit, so B decodes 4 tokens ahead
    of A: A's lookups find its whole context in B's run with tokens after it, which only B's output written
    into the memory during this call can hold (A's own run has nothing after its last token; B's prompt ends 4
    tokens in)."""
    model, tok = targets["llama"], byte_tokenizer()
    prompt = "the cat sat"
    ahead = specops.decode(prompt, target=model, tokenizer=tok, method="ar", max_new_tokens=MAX_NEW)
    prompt_ids = tok(prompt)["input_ids"]
    prompts = [prompt_ids, prompt_ids + ahead.tokens[:4]]
    seen = []
    real = specops.NgramMemory.lookup

    def spy(self, contexts, lengths, **kwargs):
        found = real(self, contexts, lengths, **kwargs)
        seen.append((int(lengths[0]), int(found.match[0]), int(found.candidates[0, 0, 0])))
        return found

    from specops.decoding import _decode

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(specops.NgramMemory, "lookup", spy)
        batch, _ = _decode(prompts, target=model, drafter=None, method="ngram", tokenizer=tok, drafter_tokenizer=None,
                           max_new_tokens=MAX_NEW, temperature=0.0, top_k=0, top_p=1.0, num_draft_tokens=(1, 2),
                           seed=None, stop=None, stream=None, options=None, memory=specops.NgramMemory())
    assert batch.generated[0] == ahead.tokens and batch.generated[1] == ahead.tokens[4:] + batch.generated[1][-4:]
    assert any(length > len(prompt_ids) + 4 and match == min(length, 64) and token >= 0
               for length, match, token in seen)


# ---- sampled: the target's distribution, and sampled ar's text for the same seed ----

@pytest.mark.parametrize("name", list(TARGETS))
def test_same_seed_gives_ar_text(targets, name):
    model = targets[name]
    memory = specops.NgramMemory()
    for seed in (3, 4):
        ar = specops.decode(PROMPTS, target=model, tokenizer=byte_tokenizer(), method="ar", max_new_tokens=MAX_NEW,
                            temperature=0.9, top_p=0.95, seed=seed)
        for _ in range(2):
            result = specops.decode(PROMPTS, target=model, tokenizer=byte_tokenizer(), method="ngram",
                                    max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=seed, memory=memory)
            assert result.tokens == ar.tokens


TOY_BIGRAM = torch.cat([torch.argsort(-TARGET_TABLE[START, :, :len(LETTERS)], dim=-1),
                        torch.arange(len(LETTERS))[None]])
_samples: dict = {}


def _memory_samples(scheme: str):
    """N_SEQUENCES sampled continuations of the toy target, drafted from a memory that already holds samples
    of it (so matches are long and drafts often accepted, sometimes not), and from each other as they go."""
    if scheme not in _samples:
        target, tok = TableLM(TARGET_TABLE), letter_tokenizer()
        memory = specops.NgramMemory()
        seed_texts = specops.decode(STAT_PROMPTS * 50, target=target, tokenizer=tok, method="ar",
                                    max_new_tokens=12, temperature=1.0, seed=99).text
        memory.add_texts([p + t for p, t in zip(STAT_PROMPTS * 50, seed_texts)], tok)
        prompts = [STAT_PROMPTS[i % len(STAT_PROMPTS)] for i in range(N_SEQUENCES)]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_ngrams, "bigram", lambda model, tokenizer, top, **kwargs: TOY_BIGRAM)
            result = specops.decode(prompts, target=TableLM(TARGET_TABLE), tokenizer=tok, method="ngram",
                                    max_new_tokens=STAT_NEW, temperature=1.0, seed=4321, num_draft_tokens=(4, 2),
                                    memory=memory, options={"tables": "bigram", "scheme": scheme})
        assert all(len(t) == STAT_NEW for t in result.tokens)
        _samples[scheme] = result
    return _samples[scheme]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["auto", "joint"])
def test_sampled_with_memory_follows_target(scheme):
    result = _memory_samples(scheme)
    assert_follows_target(result.text, 1.0, 0)
    assert 0 < result.stats.accepted < result.stats.drafted


@pytest.mark.slow
def test_chisquare_on_memory_samples_can_fail():
    """The same check rejects these samples against a target with 1% of mass moved between its two likeliest
    sequences."""
    samples = _memory_samples("auto").text
    exact = sequence_distribution(TARGET_TABLE, "ab", STAT_NEW)
    assert _fit(samples, exact)[0] > ALPHA
    shifted = mass_moved(exact)
    assert _fit(samples, shifted)[0] < ALPHA


# ---- num_samples ----

@pytest.mark.parametrize("method", ["ar", "ngram"])
def test_num_samples_is_the_prompt_list_repeated(targets, method):
    model, tok = targets["gemma-sw8"], byte_tokenizer()
    kwargs = dict(target=model, tokenizer=tok, method=method, max_new_tokens=10, temperature=1.0, seed=11)
    forked = specops.decode(PROMPTS, num_samples=3, **kwargs)
    listed = specops.decode([p for p in PROMPTS for _ in range(3)], **kwargs)
    assert len(forked.tokens) == len(PROMPTS) and all(len(s) == 3 for s in forked.tokens)
    assert [t for group in forked.tokens for t in group] == listed.tokens
    assert [t for group in forked.text for t in group] == listed.text
    assert forked.stats.requests == 3 * len(PROMPTS)
    assert len({tuple(t) for t in forked.tokens[1]}) > 1  # the samples of a prompt differ


def test_num_samples_reads_each_prompt_once(targets, monkeypatch):
    fed = []
    real = KVState.prefill

    def spy(self, rows):
        fed.append(len(rows))
        return real(self, rows)

    monkeypatch.setattr(KVState, "prefill", spy)
    result = specops.decode(PROMPTS, target=targets["llama"], tokenizer=byte_tokenizer(), method="ar",
                            max_new_tokens=4, num_samples=4, temperature=1.0)
    # The probes run first (once per model); the decoding reads the prompts once, never their 4 copies each.
    assert fed[-1] == len(PROMPTS) and 4 * len(PROMPTS) not in fed and len(result.tokens) == len(PROMPTS)
    single = specops.decode("Hello", target=targets["llama"], tokenizer=byte_tokenizer(), method="ar",
                            max_new_tokens=4, num_samples=2)
    assert len(single.text) == 2 and single.tokens[0] == single.tokens[1]  # greedy samples agree


def test_num_samples_greedy_with_memory(targets, greedy):
    memory = specops.NgramMemory()
    result = specops.decode(PROMPTS, target=targets["llama"], tokenizer=byte_tokenizer(), max_new_tokens=MAX_NEW,
                            num_samples=3, memory=memory)
    assert result.tokens == [[t] * 3 for t in greedy["llama"].tokens]
    assert memory.stats()["runs"] == len(PROMPTS) * 3  # every sample, with its prompt


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_num_samples_must_be_a_positive_int(targets, value):
    with pytest.raises(ValueError, match="num_samples must be an int >= 1"):
        specops.decode("a", target=targets["llama"], tokenizer=byte_tokenizer(), num_samples=value)


# ---- refusals ----

def test_memory_goes_only_to_methods_that_draft_from_it(targets):
    model, tok = targets["llama"], byte_tokenizer()
    memory = specops.NgramMemory()
    with pytest.raises(ValueError, match="method 'ar' does not draft from a memory; methods that do: ngram"):
        specops.decode("a", target=model, tokenizer=tok, method="ar", memory=memory)
    with pytest.raises(ValueError, match="method 'auto' picked 'sd' here"):
        specops.decode("a", target=model, tokenizer=tok, drafter=tiny_llama(layers=1, seed=1),
                       drafter_tokenizer=tok, memory=memory, max_new_tokens=2)
    with pytest.raises(TypeError, match="memory must be a specops.NgramMemory"):
        specops.decode("a", target=model, tokenizer=tok, memory={})
    result = specops.decode("a", target=model, tokenizer=tok, memory=memory, max_new_tokens=2)
    assert result.stats.method == "ngram"


def test_memory_of_another_vocabulary_is_refused(targets):
    memory = specops.NgramMemory()
    specops.decode("ab", target=TableLM(TARGET_TABLE), tokenizer=letter_tokenizer(), memory=memory,
                   max_new_tokens=2)
    with pytest.raises(ValueError, match="the memory holds token ids of another vocabulary"):
        specops.decode("ab", target=targets["llama"], tokenizer=byte_tokenizer(), memory=memory, max_new_tokens=2)


def test_two_threads_share_one_memory(greedy):
    memory = specops.NgramMemory()
    out, errors = {}, []

    # One model per thread (built here: building seeds torch's global generator); the memory is shared.
    models = [tiny_llama(layers=4, seed=0) for _ in range(2)]

    def work(i):
        try:
            model = models[i]
            for _ in range(3):
                out[i] = specops.decode(PROMPTS, target=model, tokenizer=byte_tokenizer(), max_new_tokens=MAX_NEW,
                                        memory=memory).tokens
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert out[0] == out[1] == greedy["llama"].tokens
    assert memory.stats()["running"] == 0


# ---- the command line ----

def test_command_line_memory(targets, tmp_path, monkeypatch, capsys):
    """--memory FILE: created on the first run, loaded and saved back by the next; `specops memory add` seeds
    one from text files, `specops memory show` tells what it holds; bad combinations exit with status 2."""
    from specops import cli, models

    monkeypatch.setattr(models, "load", lambda name, **kwargs: (targets["llama"], byte_tokenizer()))
    path = tmp_path / "mem.bin"
    assert cli.main(["generate", "the cat sat", "--max-new-tokens", "8", "--memory", str(path)]) == 0
    first = capsys.readouterr()
    assert "auto chose ngram" in first.err and path.exists()
    runs = specops.NgramMemory.load(path).stats()["runs"]
    assert runs == 1  # the prompt and its output
    assert cli.main(["generate", "the cat sat", "--max-new-tokens", "8", "--memory", str(path),
                     "--num-samples", "2", "--temperature", "0.8", "--seed", "3"]) == 0
    out = capsys.readouterr()
    assert out.err.count("--- sample") == 2
    assert specops.NgramMemory.load(path).stats()["runs"] == runs + 2
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n")
    assert cli.main(["memory", "add", str(path), str(corpus)]) == 0
    assert specops.NgramMemory.load(path).stats()["runs"] == runs + 3
    capsys.readouterr()
    assert cli.main(["memory", "show", str(path)]) == 0
    assert f"runs: {runs + 3}" in capsys.readouterr().out
    (tmp_path / "not.bin").write_bytes(b"hello")
    for argv, message in [(["memory", "show", str(tmp_path / "not.bin")], "is not a specops n-gram memory file"),
                          (["memory", "add", str(path)], "needs text files"),
                          (["generate", "x", "--memory-budget", "1M"], "--memory-budget needs --memory FILE"),
                          (["generate", "x", "--memory", str(path), "--method", "ar"], "--memory is read by method"),
                          (["generate", "x", "--num-samples", "0"], "--num-samples: must be an integer >= 1")]:
        try:
            status = cli.main(argv)
        except SystemExit as error:  # argparse's own refusal
            status = error.code
        assert status == 2
        assert message in capsys.readouterr().err


def test_merge_ranks_the_first_list_by_its_discounted_match():
    """merge_candidates(first_discount=d): `first`'s rows (the memory's) rank as if their match were d tokens
    shorter (at least 1), then by count; the levels returned stay the rows' own."""
    from specops.decoding.ngram import merge_candidates

    memory = (torch.tensor([[[7, 7], [8, 8]]]), torch.tensor([[5, 1]]), torch.tensor([[6, 6]]))
    context = (torch.tensor([[[1, 1], [2, 2]]]), torch.tensor([[2, 1]]), torch.tensor([[4, 2]]))
    rows, counts, level = merge_candidates(memory, context, 4)
    assert rows[0, :, 0].tolist() == [7, 8, 1, 2] and level.tolist() == [[6, 6, 4, 2]]
    rows, counts, level = merge_candidates(memory, context, 4, first_discount=2)  # matches of 4: by count
    assert rows[0, :, 0].tolist() == [7, 1, 8, 2]
    rows, counts, level = merge_candidates(memory, context, 4, first_discount=3)
    assert rows[0, :, 0].tolist() == [1, 7, 8, 2] and level.tolist() == [[4, 6, 6, 2]]
    assert counts.tolist() == [[2, 5, 1, 1]]
    rows, _, _ = merge_candidates(memory, context, 4, first_discount=9)  # ranked as a match of 1
    assert rows[0, :, 0].tolist() == [1, 2, 7, 8]
