"""End-to-end tests of `specops.decode` (methods "ar" and "sd") on tiny models; nothing downloads.

1. Greedy exactness: greedy "sd" equals greedy "ar" token for token (float32) on ragged batches, for
   tiny Llama and Gemma3 targets, with "self:N" drafters, the target itself as drafter (everything
   accepted: the bonus / catch-up path), independent random drafters (mostly rejected), fixed and
   "auto" draft lengths, and a scripted draft-length sequence with plain (K = 0) steps. Batched output
   equals each prompt decoded alone.
2. Statistics: sampled "sd" sequences follow the target's exact distribution (chi-square on the joint
   distribution of whole continuations, table-defined toy LMs from toy_models.py), at T = 1 and at
   T = 0.7 with top-k; "ar" passes the same check; the check rejects the drafter's distribution and a
   target shifted by 1%, so it can fail.
3. Engine behaviours: EOS, max_new_tokens, stop strings, streaming, statistics, result shapes,
   reproducibility from a seed.
4. Bad input raises ValueError / TypeError naming the problem.
5. The draft-length controller (cost_model.DraftLength) on synthetic CPU-like and GPU-like costs.
"""

from __future__ import annotations

import collections
import random

import pytest

import specops
from specops._threads import auto_threads, decoding_threads
from specops.decoding.cost_model import CatchUp, DraftLength
from stats_helpers import (ALPHA, N_SEQUENCES, PROMPTS, STEP_COST, _fit, _simulate, _true_rate,
                           assert_follows_target, check_stats, cpu_like)
from stats_helpers import SD_DRAFTER_TABLE as DRAFTER_TABLE
from stats_helpers import mass_moved
from stats_helpers import SD_STAT_NEW as STAT_NEW
from stats_helpers import SD_STAT_PROMPTS as STAT_PROMPTS
from stats_helpers import SD_TARGET_TABLE as TARGET_TABLE
from toy_models import (EOS_ID, LETTERS, TableLM, byte_tokenizer, cycle_table, greedy_cycle, letter_tokenizer,
                        sequence_distribution, tiny_gemma3, tiny_llama)

# PROMPTS (ragged, 1 to 43 bytes) and check_stats: stats_helpers.py.
MAX_NEW = 20


# ---- fixtures: tiny transformers models and their greedy autoregressive reference ----

@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def models():
    """Targets and independent (random, differently seeded, shallower) drafters."""
    return {
        "llama": tiny_llama(layers=4, seed=0),
        "llama-drafter": tiny_llama(layers=2, seed=1),
        "gemma": tiny_gemma3(layers=4, seed=0),
        "gemma-drafter": tiny_gemma3(layers=2, seed=1),
    }


@pytest.fixture(scope="module")
def ar_reference(models, tok):
    """Greedy autoregressive tokens of PROMPTS, decoded as one batch, per target."""
    return {name: specops.decode(PROMPTS, target=models[name], tokenizer=tok, method="ar",
                                 max_new_tokens=MAX_NEW).tokens
            for name in ("llama", "gemma")}


# ---- 1. greedy exactness ----

GREEDY_CASES = [
    # (target, drafter, num_draft_tokens): "same" = the target object itself (everything accepted),
    # "other" = an independent random model (nearly everything rejected), "self:N" in between.
    ("llama", "self:3", 2),
    ("llama", "self:1", 1),
    ("llama", "self:2", "auto"),
    ("llama", "same", 5),
    ("llama", "other", "auto"),
    ("llama", "other", 2),
    ("gemma", "self:3", 5),
    ("gemma", "self:1", "auto"),
    ("gemma", "same", 1),
    ("gemma", "other", 2),
]


def _drafter(models, target: str, drafter: str):
    if drafter == "same":
        return models[target], byte_tokenizer()  # an equal vocabulary in another tokenizer object
    if drafter == "other":
        return models[target + "-drafter"], byte_tokenizer()
    return drafter, None


@pytest.mark.parametrize("target,drafter,k", GREEDY_CASES, ids=[f"{t}-{d}-k{k}" for t, d, k in GREEDY_CASES])
def test_greedy_sd_equals_ar(models, tok, ar_reference, target, drafter, k):
    draft_model, draft_tok = _drafter(models, target, drafter)
    result = specops.decode(PROMPTS, target=models[target], tokenizer=tok, drafter=draft_model,
                            drafter_tokenizer=draft_tok, method="sd", max_new_tokens=MAX_NEW,
                            num_draft_tokens=k)
    assert result.tokens == ar_reference[target]
    check_stats(result, "sd")
    assert max(result.stats.draft_lengths) <= (k if k != "auto" else 8)
    if drafter == "same":  # every draft is the target's own greedy choice
        assert result.stats.accepted == result.stats.drafted > 0
    if (target, drafter, k) == ("llama", "self:3", 2):  # both paths taken: some accepted, some rejected
        assert 0 < result.stats.accepted < result.stats.drafted


def test_greedy_batched_equals_alone(models, tok, ar_reference):
    target = models["llama"]
    for i, prompt in enumerate(PROMPTS):
        alone_ar = specops.decode(prompt, target=target, tokenizer=tok, method="ar", max_new_tokens=MAX_NEW)
        alone_sd = specops.decode(prompt, target=target, tokenizer=tok, drafter="self:3",
                                  max_new_tokens=MAX_NEW, num_draft_tokens=2)
        assert alone_ar.tokens == ar_reference["llama"][i], prompt
        assert alone_sd.tokens == ar_reference["llama"][i], prompt


def test_greedy_sd_with_plain_steps_equals_ar(models, tok, ar_reference, monkeypatch):
    """Draft lengths 0 (a plain decoding step, the drafter falls behind and catches up later), 1, 3
    and 6, in a fixed order, so the K = 0 path runs deterministically (the script alone decides: the
    catch-up's pricing is told every read pays)."""
    script = [0, 3, 0, 0, 1, 6, 0, 2]
    calls = iter(range(10_000))
    monkeypatch.setattr(DraftLength, "choose", lambda self, requests=1: script[next(calls) % len(script)])
    monkeypatch.setattr(CatchUp, "pays", lambda self, *args: True)
    result = specops.decode(PROMPTS, target=models["llama"], tokenizer=tok, drafter="self:3",
                            max_new_tokens=MAX_NEW, num_draft_tokens="auto")
    assert result.tokens == ar_reference["llama"]
    assert 0 in result.stats.draft_lengths and 6 in result.stats.draft_lengths
    check_stats(result, "sd")


def test_a_drafter_whose_reading_cannot_pay_falls_back_to_plain_steps(tok, monkeypatch):
    """num_draft_tokens="auto" prices the drafter's reading of what it has not read (cost_model.CatchUp): with
    every read measured at a second a token, the first drafting step reads the prompts (nothing was measured
    yet) and every later step is plain, probes included (a probe may catch up for an eighth of the plain steps
    since the last one, a few milliseconds here); the tokens are ar's."""
    target, drafter = tiny_llama(layers=2, seed=11), tiny_llama(layers=1, seed=12)
    expected = specops.decode(PROMPTS, target=target, tokenizer=tok, method="ar", max_new_tokens=40).tokens
    monkeypatch.setattr(CatchUp, "observe", lambda self, tokens, seconds: setattr(self, "per_token", 1.0))
    result = specops.decode(PROMPTS, target=target, tokenizer=tok, drafter=drafter, drafter_tokenizer=tok,
                            max_new_tokens=40, num_draft_tokens="auto")
    assert result.tokens == expected
    lengths = result.stats.draft_lengths
    assert lengths[0] > 0 and not any(lengths[1:]), lengths
    monkeypatch.undo()
    free = specops.decode(PROMPTS, target=target, tokenizer=tok, drafter=drafter, drafter_tokenizer=tok,
                          max_new_tokens=40, num_draft_tokens=3)  # a fixed length drafts every step whatever a read costs
    assert free.tokens == expected and all(n == 3 for n in free.stats.draft_lengths[:5])


def test_greedy_sd_equals_ar_sliding_window(tok):
    target = tiny_gemma3(layers=4, seed=0, sliding_window=8)
    expected = specops.decode(PROMPTS[:2], target=target, tokenizer=tok, method="ar",
                              max_new_tokens=30).tokens
    result = specops.decode(PROMPTS[:2], target=target, tokenizer=tok, drafter="self:3", max_new_tokens=30,
                            num_draft_tokens=3)
    assert result.tokens == expected


# ---- 2. statistics: sampled sequences follow the target's distribution ----

# The toy pair (TARGET_TABLE, DRAFTER_TABLE), STAT_NEW, STAT_PROMPTS, N_SEQUENCES, ALPHA and the
# chi-square (_assert_powered, _fit, assert_follows_target): stats_helpers.py.


def _stat_prompts():
    return [STAT_PROMPTS[i % len(STAT_PROMPTS)] for i in range(N_SEQUENCES)]


_samples_cache: dict = {}


def _sample(method: str, k, temperature: float = 1.0, top_k: int = 0, target_table=TARGET_TABLE,
            seed: int = 1234):
    """Decode N_SEQUENCES continuations of STAT_PROMPTS (cached: several tests share the samples)."""
    key = (method, k, temperature, top_k, id(target_table), seed)
    if key not in _samples_cache:
        tok = letter_tokenizer()
        kwargs = {}
        if "+" in method:  # "sd+joint": sd with option scheme "block"; "rsd-c+token"
            method, scheme = method.split("+")
            kwargs["options"] = {"scheme": scheme}
        if method in ("sd", "rsd-c", "rsd-s", "specinfer"):  # (after the "+" is split off)
            kwargs.update(drafter=TableLM(DRAFTER_TABLE), drafter_tokenizer=tok, num_draft_tokens=k)
        result = specops.decode(_stat_prompts(), target=TableLM(target_table), tokenizer=tok, method=method,
                                max_new_tokens=STAT_NEW, temperature=temperature, top_k=top_k, seed=seed,
                                **kwargs)
        assert all(len(t) == STAT_NEW for t in result.tokens)
        _samples_cache[key] = result
    return _samples_cache[key]


STAT_CASES = [
    ("ar", None, 1.0, 0),
    ("sd", 1, 1.0, 0),
    ("sd", 2, 1.0, 0),  # 2 is the longest chain 4 new tokens allow (the first comes from the prefill)
    ("sd", 2, 0.7, 3),
    # Drafts drawn from q, verified token by token and by block verification (option "scheme").
    ("sd+token", 2, 1.0, 0),
    ("sd+joint", 2, 1.0, 0),
    ("sd+joint", 2, 0.7, 3),
    # Draft trees from the drafter, verified by recursive rejection sampling (option scheme "token";
    # with a seed "auto" is positional matching, test_same_seed.py): siblings drawn without replacement
    # (RSD-C) and i.i.d. (SpecInfer); (3,) is one level of three siblings.
    ("rsd-c+token", (2, 2), 1.0, 0),
    ("rsd-c+token", (3,), 0.7, 3),
    ("specinfer+token", (2, 2), 1.0, 0),
    # Stochastic Beam Search trees (RSD-S): (W, L) = 2 beams of 2 levels; 3 beams of one level at T = 0.7.
    ("rsd-s+token", (2, 2), 1.0, 0),
    ("rsd-s+token", (3, 1), 0.7, 3),
    # The same trees verified from the leaves (traversal verification: option scheme "joint", "auto" without
    # a seed).
    ("rsd-c+joint", (2, 2), 1.0, 0),
    ("specinfer+joint", (2, 2), 0.7, 3),
    ("rsd-s+joint", (2, 2), 1.0, 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("method,k,temperature,top_k", STAT_CASES,
                         ids=[f"{m}-k{k}-T{t}-topk{tk}" for m, k, t, tk in STAT_CASES])
def test_sampled_sequences_follow_target(method, k, temperature, top_k):
    result = _sample(method, k, temperature, top_k)
    assert_follows_target(result.text, temperature, top_k)
    if method != "ar":  # the drafter was really used, and rejected sometimes
        assert 0 < result.stats.accepted < result.stats.drafted


@pytest.mark.slow
def test_rsd_accepts_more_than_specinfer():
    """Same tree shape, same toy pair: siblings drawn without replacement are never wasted on a token
    already rejected, so RSD-C accepts more drafts per target call than SpecInfer's i.i.d. siblings."""
    rsd, specinfer = _sample("rsd-c+token", (2, 2)).stats, _sample("specinfer+token", (2, 2)).stats
    assert rsd.accepted / rsd.target_calls > 1.02 * specinfer.accepted / specinfer.target_calls


@pytest.mark.slow
def test_block_verification_keeps_more_drafts():
    """Same drafts' law, same toy pair: block verification keeps more drafts per target call than token-level
    verification (and this pair's gap is large enough to see at N_SEQUENCES requests)."""
    block, token = _sample("sd+joint", 2).stats, _sample("sd+token", 2).stats
    assert block.accepted / block.target_calls > token.accepted / token.target_calls


@pytest.mark.parametrize("seed, scheme, expected, reason", [
    (7, None, ["positional"], "auto: a seed was given"), (None, None, ["block"], "auto: no seed given"),
    (7, "joint", ["block"], "asked for"), (None, "token", ["token"], "asked for")])
def test_scheme_auto_is_positional_with_a_seed_and_joint_without(monkeypatch, seed, scheme, expected, reason):
    """Option "scheme" "auto" (the default): a seed asks for the same text back (positional matching, q not
    handed to the verifier); without one, "joint" (block verification on a chain). An explicit scheme is
    kept. The stats name the scheme that ran and why."""
    from specops.decoding import verify

    seen = []
    chain_verify = verify.ops.chain_verify

    def spy(logits, drafts, probs=None, **kwargs):  # the public op, by its named argument
        if drafts.shape[1]:
            seen.append("positional" if probs is None else kwargs["scheme"])
        return chain_verify(logits, drafts, probs, **kwargs)

    def spy_positional(logits, *args, _positional=verify.positional):
        if logits.shape[1] > 1:  # a step with drafts (a plain step draws its token this way in every scheme)
            seen.append("positional")
        return _positional(logits, *args)

    monkeypatch.setattr(verify.ops, "chain_verify", spy)
    monkeypatch.setattr(verify, "positional", spy_positional)
    tok = letter_tokenizer()
    result = specops.decode(PROMPTS[:2], target=TableLM(TARGET_TABLE), tokenizer=tok,
                            drafter=TableLM(DRAFTER_TABLE), drafter_tokenizer=tok, method="sd", num_draft_tokens=2,
                            max_new_tokens=6, temperature=1.0, seed=seed,
                            options=None if scheme is None else {"scheme": scheme})
    assert sorted(set(seen)) == expected
    named = {"positional": "positional", "block": "joint", "token": "token"}[expected[0]]
    assert result.stats.scheme == named and result.stats.scheme_reason.startswith(reason)
    assert f"verified by scheme {named} ({reason}" in result.stats.summary()


@pytest.mark.slow
def test_sampled_sd_with_plain_steps_follows_target(monkeypatch):
    """Scripted draft lengths with plain (K = 0) steps between drafting steps, ragged across rows."""
    script = [0, 2, 1, 0, 2]
    calls = iter(range(10_000))
    monkeypatch.setattr(DraftLength, "choose", lambda self, requests=1: script[next(calls) % len(script)])
    tok = letter_tokenizer()
    result = specops.decode(_stat_prompts(), target=TableLM(TARGET_TABLE), tokenizer=tok,
                            drafter=TableLM(DRAFTER_TABLE), drafter_tokenizer=tok, max_new_tokens=STAT_NEW,
                            temperature=1.0, seed=99)
    assert 0 in result.stats.draft_lengths
    pvalue, impossible = _fit(result.text, sequence_distribution(TARGET_TABLE, "ab", STAT_NEW))
    assert impossible == 0 and pvalue > ALPHA, (pvalue, impossible)


@pytest.mark.slow
def test_chisquare_can_fail():
    """The same check rejects (a) sequences sampled from the drafter, and (b) the target's own sd samples
    compared with a target distribution that has 1% of mass moved between its two likeliest sequences."""
    exact = sequence_distribution(TARGET_TABLE, "ab", STAT_NEW)
    drafter_exact = sequence_distribution(DRAFTER_TABLE, "ab", STAT_NEW)
    drafter_samples = _sample("ar", None, target_table=DRAFTER_TABLE).text
    assert _fit(drafter_samples, drafter_exact)[0] > ALPHA  # the drafter's own distribution fits...
    pvalue, impossible = _fit(drafter_samples, exact)
    assert impossible > 0 or pvalue < ALPHA  # ...the target's does not

    shifted = mass_moved(exact)
    sd_samples = _sample("sd", 2).text
    assert _fit(sd_samples, exact)[0] > ALPHA
    assert _fit(sd_samples, shifted)[0] < ALPHA


def test_sampling_reproducible_from_seed():
    tok = letter_tokenizer()
    prompts = STAT_PROMPTS * 8

    def run(method, seed):
        kwargs = {}
        if method == "sd":
            kwargs = dict(drafter=TableLM(DRAFTER_TABLE), drafter_tokenizer=tok, num_draft_tokens=2)
        return specops.decode(prompts, target=TableLM(TARGET_TABLE), tokenizer=tok, method=method,
                              max_new_tokens=6, temperature=1.0, seed=seed, **kwargs).tokens

    for method in ("ar", "sd"):
        assert run(method, 7) == run(method, 7)
        assert run(method, 7) != run(method, 8)
    # ar draws each request's tokens from its own seed: request 0 does not depend on its batch.
    alone = specops.decode(prompts[0], target=TableLM(TARGET_TABLE), tokenizer=tok, method="ar",
                           max_new_tokens=6, temperature=1.0, seed=7).tokens
    assert alone == run("ar", 7)[0]


# ---- 3. engine behaviours (on the cycle table: its greedy text is known, see toy_models.greedy_cycle) ----

def _cycle_decode(prompts, method="ar", k=5, drafter="same", **kwargs):
    tok = letter_tokenizer()
    target = TableLM(cycle_table())
    extra = {}
    if method == "sd":
        extra = dict(drafter=target if drafter == "same" else TableLM(DRAFTER_TABLE), drafter_tokenizer=tok,
                     num_draft_tokens=k)
    return target, specops.decode(prompts, target=target, tokenizer=tok, method=method, **extra, **kwargs)


# ar; sd with everything accepted (chunks of 6 tokens overshoot every limit); sd with a random drafter.
ENGINE_METHODS = [("ar", None, None), ("sd", 5, "same"), ("sd", 2, "random")]
ENGINE_IDS = ["ar", "sd-accepted", "sd-rejected"]


@pytest.mark.parametrize("method,k,drafter", ENGINE_METHODS, ids=ENGINE_IDS)
def test_eos_stops_row(method, k, drafter):
    tok = letter_tokenizer()
    target = TableLM(cycle_table())
    target.generation_config.eos_token_id = LETTERS.index("a")
    extra = {}
    if method == "sd":
        extra = dict(drafter=target if drafter == "same" else TableLM(DRAFTER_TABLE), drafter_tokenizer=tok,
                     num_draft_tokens=k)
    prompts = ["ab", "bc", "cd", "aa"]
    result = specops.decode(prompts, target=target, tokenizer=tok, method=method, max_new_tokens=12, **extra)
    # "aa" repeats "a" = EOS at once; the others run until their first "a", which ends the row.
    assert result.text == ["cda", "da", "a", "a"]
    assert result.tokens == [[2, 3, 0], [3, 0], [0], [0]]
    check_stats(result, method)


def test_eos_from_generation_config_tiny_llama(models, tok, ar_reference):
    """A transformers model's generation_config.eos_token_id ends rows (here a byte the model emits)."""
    reference = ar_reference["llama"]
    eos = reference[0][5]
    expected = [row[: row.index(eos) + 1] if eos in row else row for row in reference]
    target = tiny_llama(layers=4, seed=0)  # the same weights as models["llama"], its own config
    target.generation_config.eos_token_id = [EOS_ID, eos]
    for drafter in (None, "self:3"):
        result = specops.decode(PROMPTS, target=target, tokenizer=tok, drafter=drafter,
                                max_new_tokens=MAX_NEW, num_draft_tokens=3)
        assert result.tokens == expected


def test_accepted_counts_only_emitted_drafts():
    tok = letter_tokenizer()
    target = TableLM(cycle_table())
    target.generation_config.eos_token_id = LETTERS.index("a")
    result = specops.decode(["ab", "bc", "cd", "aa"], target=target, tokenizer=tok, drafter=target,
                            drafter_tokenizer=tok, max_new_tokens=12, num_draft_tokens=5)
    assert result.stats.new_tokens == 7
    # Each token after a row's first comes from a verification step, as an accepted draft or the one
    # token a step adds; so accepted drafts can never outnumber the generated tokens.
    assert result.stats.accepted <= result.stats.new_tokens - len(result.tokens)


@pytest.mark.parametrize("method,k,drafter", ENGINE_METHODS, ids=ENGINE_IDS)
@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_exact(method, k, drafter, max_new):
    prompts = ["ab", "aa", "bcd", "c"]
    for temperature in (0.0, 1.0):
        _, result = _cycle_decode(prompts, method, k, drafter, max_new_tokens=max_new,
                                  temperature=temperature, seed=3)
        assert [len(t) for t in result.tokens] == [max_new] * len(prompts)
        assert [len(t) for t in result.text] == [max_new] * len(prompts)
        if temperature == 0:
            assert result.text == [greedy_cycle(p, max_new) for p in prompts]
        check_stats(result, method)


def test_max_new_tokens_zero():
    for method in ("ar", "sd"):
        target, result = _cycle_decode(["ab", "c"], method, max_new_tokens=0)
        assert result.text == ["", ""] and result.tokens == [[], []]
        assert result.stats.new_tokens == 0 and result.stats.target_calls == 0 and target.calls == 0
        _, single = _cycle_decode("ab", method, max_new_tokens=0)
        assert single.text == "" and single.tokens == []


def test_model_calls_counted():
    """stats.target_calls / drafter_calls are the models' real forward counts; ar costs one per token."""
    tok = letter_tokenizer()
    target, drafter = TableLM(TARGET_TABLE), TableLM(DRAFTER_TABLE)
    result = specops.decode(["ab", "bab"], target=target, tokenizer=tok, method="ar", max_new_tokens=9,
                            temperature=1.0, seed=0)
    assert result.stats.target_calls == target.calls == 9
    target.calls = 0
    result = specops.decode(["ab", "bab"], target=target, tokenizer=tok, drafter=drafter,
                            drafter_tokenizer=tok, max_new_tokens=9, temperature=1.0, seed=0,
                            num_draft_tokens=3)
    assert result.stats.target_calls == target.calls
    assert result.stats.drafter_calls == drafter.calls
    assert result.stats.target_calls == result.stats.steps + 1  # prefill + one verification per step
    check_stats(result, "sd")


STOP_PROMPTS = ["ab", "aa", "bc", "cd"]  # greedy: "cdabcd...", "aaaa...", "dabcda...", "abcdab..."


@pytest.mark.parametrize("method,k,drafter", ENGINE_METHODS, ids=ENGINE_IDS)
def test_stop_strings(method, k, drafter):
    _, result = _cycle_decode(STOP_PROMPTS, method, k, drafter, max_new_tokens=12, stop="bcd")
    # The stop string is cut off (excluded); "aa" never meets it and runs to max_new_tokens.
    assert result.text == ["cda", "a" * 12, "da", "a"]
    assert len(result.tokens[1]) == 12
    _, result = _cycle_decode(STOP_PROMPTS, method, k, drafter, max_new_tokens=12, stop=["zz", "dab"])
    assert result.text == ["c", "a" * 12, "", "abc"]
    _, single = _cycle_decode("ab", method, k, drafter, max_new_tokens=12, stop="bcd")
    assert single.text == "cda"


def test_stop_tokens_same_for_sd_and_ar():
    _, ar = _cycle_decode(STOP_PROMPTS, "ar", max_new_tokens=12, stop="bcd")
    _, sd = _cycle_decode(STOP_PROMPTS, "sd", 5, "same", max_new_tokens=12, stop="bcd")
    assert sd.text == ar.text
    assert sd.tokens == ar.tokens


def test_stop_order_same_for_sd_and_ar():
    _, ar = _cycle_decode("ab", "ar", max_new_tokens=12, stop=["cdab", "da"])
    _, sd = _cycle_decode("ab", "sd", 5, "same", max_new_tokens=12, stop=["cdab", "da"])
    assert ar.text == "c"
    assert sd.text == ar.text


def _streamed(decode):
    pieces = collections.defaultdict(list)

    def stream(index, text):
        assert isinstance(text, str) and text
        pieces[index].append(text)

    result = decode(stream)
    return result, {i: "".join(p) for i, p in pieces.items()}


@pytest.mark.parametrize("method,k,drafter", ENGINE_METHODS, ids=ENGINE_IDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_concatenates_to_text(method, k, drafter, temperature):
    for stop in (None, "d"):  # a one-letter stop string cannot span tokens
        result, streamed = _streamed(lambda stream: _cycle_decode(
            STOP_PROMPTS, method, k, drafter, max_new_tokens=10, temperature=temperature, seed=5, stop=stop,
            stream=stream)[1])
        assert [streamed.get(i, "") for i in range(len(STOP_PROMPTS))] == result.text
        if stop is None:
            assert all(len(t) == 10 for t in result.text)


def test_stream_with_multi_token_stop():
    result, streamed = _streamed(lambda stream: _cycle_decode("ab", "ar", max_new_tokens=12, stop="bcd",
                                                               stream=stream)[1])
    assert result.text == "cda"
    assert streamed[0] == result.text


def test_stream_flushes_incomplete_utf8(models, tok, ar_reference):
    prompt = PROMPTS[1]
    result, streamed = _streamed(lambda stream: specops.decode(
        prompt, target=models["llama"], tokenizer=tok, method="ar", max_new_tokens=MAX_NEW, stream=stream))
    assert result.text.endswith("\ufffd")  # precondition: this greedy text ends in a broken byte sequence
    assert streamed.get(0, "") == result.text


def test_result_shapes():
    for method in ("ar", "sd"):
        _, single = _cycle_decode("ab", method, max_new_tokens=3)
        assert single.text == "cda" and single.tokens == [2, 3, 0]
        _, batch = _cycle_decode(["ab"], method, max_new_tokens=3)
        assert batch.text == ["cda"] and batch.tokens == [[2, 3, 0]]
        _, batch = _cycle_decode(("ab", "bc"), method, max_new_tokens=3)
        assert batch.text == ["cda", "dab"] and batch.tokens == [[2, 3, 0], [3, 0, 1]]
        assert isinstance(batch, specops.DecodeResult)


def test_auto_method_and_draft_length(models, tok, ar_reference):
    """method="auto" is ngram without a drafter (ar for a model that cannot score trees) and sd with one;
    "auto" draft lengths stay within 0..8."""
    tok_l = letter_tokenizer()
    target = TableLM(cycle_table())
    plain = specops.decode(["ab", "bc"], target=target, tokenizer=tok_l, max_new_tokens=8)
    assert plain.stats.drafter_calls == 0 and plain.text == ["cdabcdab", "dabcdabc"]
    assert plain.stats.method == "ngram"
    import arch_zoo

    # GPT-Neo's local attention bypasses transformers' attention registry: no draft trees, so plain ar.
    neo = specops.decode("ab", target=arch_zoo.gpt_neo(), tokenizer=tok, max_new_tokens=2)
    assert neo.stats.method == "ar"
    drafted = specops.decode(["ab", "bc"], target=target, tokenizer=tok_l, drafter=target,
                             drafter_tokenizer=tok_l, max_new_tokens=40)
    assert drafted.stats.drafter_calls > 0
    assert drafted.text == [greedy_cycle("ab", 40), greedy_cycle("bc", 40)]
    assert all(0 <= k <= 8 for k in drafted.stats.draft_lengths)
    check_stats(drafted, "sd")


# ---- 4. bad input ----

@pytest.fixture(scope="module")
def llama(models):
    return models["llama"]


@pytest.mark.parametrize("prompt,match", [
    ("", "empty prompt"),
    (["ok", ""], "empty prompt"),
    ([], "non-empty"),
    (42, "non-empty string or a non-empty list of strings"),
    (["ok", 3], "list of strings"),
    (None, "prompt must be"),
])
def test_bad_prompt(llama, tok, prompt, match):
    with pytest.raises(ValueError, match=match):
        specops.decode(prompt, target=llama, tokenizer=tok, max_new_tokens=2)


def test_prompt_without_tokens():
    with pytest.raises(ValueError, match="encodes to no tokens"):
        specops.decode(["ab", "xyz"], target=TableLM(cycle_table()), tokenizer=letter_tokenizer(),
                       max_new_tokens=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=-1), "max_new_tokens must be an int >= 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(top_k=2.0), "top_k"),
    (dict(num_draft_tokens=0), "num_draft_tokens must be 'auto' or an int >= 1"),
    (dict(num_draft_tokens="x"), "num_draft_tokens"),
    (dict(num_draft_tokens=-3), "num_draft_tokens"),
    (dict(method="beam"), "unknown method 'beam'; available: auto, ar, sd"),
    (dict(method="sd"), "method 'sd' needs a drafter"),
    (dict(method="ar", drafter="self:2"), "method 'ar' does not use a drafter"),
    (dict(drafter="self:0"), r"self:N needs 1 <= N < 4"),
    (dict(drafter="self:99"), r"self:N needs 1 <= N < 4 \(the target has 4 layers\), got 99"),
    (dict(drafter="self:x"), "must be 'self:N' with N a number of layers"),
    (dict(drafter="self:-1"), "must be 'self:N'"),
    (dict(stop=""), "stop must be a non-empty string"),
    (dict(stop=["ok", 3]), "stop must be"),
])
def test_bad_arguments(llama, tok, kwargs, match):
    with pytest.raises(ValueError, match=match):
        specops.decode("hi", target=llama, tokenizer=tok, **{"max_new_tokens": 2, **kwargs})


def test_stream_not_callable(llama, tok):
    with pytest.raises(TypeError, match="stream must be callable"):
        specops.decode("hi", target=llama, tokenizer=tok, max_new_tokens=2, stream="print")


def test_model_without_tokenizer(llama, tok, models):
    with pytest.raises(ValueError, match=r"target is a model object, so its tokenizer must be given "
                                         r"\(tokenizer="):
        specops.decode("hi", target=llama, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"drafter_tokenizer=\.\.\."):
        specops.decode("hi", target=llama, tokenizer=tok, drafter=models["llama-drafter"], max_new_tokens=2)


def test_not_a_model(tok):
    with pytest.raises(TypeError, match="target must be a transformers causal LM, got int"):
        specops.decode("hi", target=42, tokenizer=tok, max_new_tokens=2)


def test_drafter_with_other_vocabulary(llama, tok):
    other = TableLM(cycle_table())
    with pytest.raises(ValueError, match=r"vocabulary differs.*another vocabulary: 'tli', 'union', 'slem', 'slrs'"):
        specops.decode("hi", target=llama, tokenizer=tok, drafter=other, drafter_tokenizer=letter_tokenizer(),
                       method="sd", max_new_tokens=2)


def test_drafter_lm_head_size_differs(llama, tok):
    wide = tiny_llama(layers=1, seed=2, vocab=300)
    with pytest.raises(ValueError, match="LM head has 300 outputs but the target's has 258"):
        specops.decode("hi", target=llama, tokenizer=tok, drafter=wide, drafter_tokenizer=tok,
                       max_new_tokens=2)


def test_self_draft_needs_decoder_layers():
    tok = letter_tokenizer()
    with pytest.raises(ValueError, match="self:N drafting needs a decoder with `model.layers`"):
        specops.decode("ab", target=TableLM(cycle_table()), tokenizer=tok, drafter="self:1", max_new_tokens=2)


def test_self_draft_view_is_kept_per_target():
    """self:N is one view per target and N, so what is probed once per model is probed once per view: the same
    object on the next call, another for another N or once a layer on its way was replaced; what specops
    keeps keeps no target alive, and sd through the rebuilt view still gives ar's tokens."""
    import gc
    import weakref

    from specops.decoding.self_draft import truncated

    tok = byte_tokenizer()
    target = tiny_llama(layers=4, seed=3)
    view = truncated(target, 2)
    assert truncated(target, 2) is view and truncated(target, 3) is not view
    assert len(view.model.layers) == 2 and view.model.layers[0] is target.model.layers[0]
    sd = dict(tokenizer=tok, drafter="self:2", method="sd", max_new_tokens=6)
    first = specops.decode("hi", target=target, **sd)
    target.model.layers[1] = tiny_llama(layers=4, seed=4).model.layers[1]
    rebuilt = truncated(target, 2)
    assert rebuilt is not view and rebuilt.model.layers[1] is target.model.layers[1]
    again = specops.decode("hi", target=target, **sd)
    plain = specops.decode("hi", target=target, tokenizer=tok, method="ar", max_new_tokens=6)
    assert again.tokens == plain.tokens and first.tokens
    gone = weakref.ref(target)
    del target, view, rebuilt
    gc.collect()
    assert gone() is None  # nothing specops keeps per model holds the model (a fused forward once did)


def test_drafter_on_other_device(llama, tok):
    meta = tiny_llama(layers=2, seed=1).to("meta")
    with pytest.raises(ValueError, match="target is on cpu but drafter is on meta"):
        specops.decode("hi", target=llama, tokenizer=tok, drafter=meta, drafter_tokenizer=tok,
                       max_new_tokens=2)


def test_unknown_embedded_model(tok):
    with pytest.raises(ValueError,
                       match=r"unknown model 'no-such-model'; known models: .*gemma-3-270m.*smollm2-135m"):
        specops.decode("hi", target="no-such-model", max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown model 'no-such-drafter'"):
        specops.decode("hi", target=TableLM(cycle_table()), tokenizer=letter_tokenizer(),
                       drafter="no-such-drafter", max_new_tokens=2)


# ---- 5. the draft-length controller ----

# cpu_like, STEP_COST, _true_rate and _simulate: stats_helpers.py.


def gpu_like(n: int) -> float:
    return 0.05


@pytest.mark.parametrize("cost,draft_cost,acceptance,low,high", [
    (cpu_like, 0.02, 0.1, 0, 0),  # poor drafter: plain decoding
    (cpu_like, 0.02, 0.5, 0, 1),
    (cpu_like, 0.02, 0.8, 1, 2),  # verification is not free on a CPU: short drafts
    (cpu_like, 0.02, 0.9, 1, 3),
    (gpu_like, 0.005, 0.5, 1, 3),
    (gpu_like, 0.005, 0.8, 5, 8),  # flat verification cost: long drafts
    (gpu_like, 0.005, 0.9, 7, 8),
], ids=["cpu-a0.1", "cpu-a0.5", "cpu-a0.8", "cpu-a0.9", "gpu-a0.5", "gpu-a0.8", "gpu-a0.9"])
def test_draft_length_converges(cost, draft_cost, acceptance, low, high):
    chosen = _simulate(cost, draft_cost, acceptance)
    settled = chosen[-50:]
    k = max(set(settled), key=settled.count)
    # Settled on one K, except that plain decoding (K = 0) probes one draft every 8th step so that it
    # keeps measuring acceptance.
    probes = [j for j in settled if j != k]
    assert not probes or (k == 0 and set(probes) == {1} and len(probes) <= len(settled) // 8 + 1), (
        f"did not settle: {settled}")
    assert low <= k <= high, chosen
    best = max(_true_rate(cost, draft_cost, acceptance, j) for j in range(9))
    assert _true_rate(cost, draft_cost, acceptance, k) >= 0.97 * best


def test_draft_length_cpu_shorter_than_gpu():
    assert _simulate(cpu_like, 0.01, 0.85)[-1] < _simulate(gpu_like, 0.01, 0.85)[-1]


def test_draft_length_fixed_is_honoured():
    for k in (1, 2, 5, 12):
        controller = DraftLength(k)
        for _ in range(20):
            assert controller.choose() == k
            controller.observe(k, cpu_like(k + 1), 0.02, STEP_COST, [0, 0], [k, k])


def test_draft_length_fixed_in_decode():
    _, result = _cycle_decode(["ab", "aa", "bc"], "sd", 2, "random", max_new_tokens=15, temperature=1.0,
                              seed=1)
    # Shorter (even 0) only where a row's remaining budget leaves no room: the last token of a request
    # comes from the verification itself.
    assert max(result.stats.draft_lengths) == 2 and result.stats.draft_lengths.count(2) >= 3


@pytest.mark.parametrize("setting", [0, -1, 2.5, "x", "", None, True, "8"])
def test_draft_length_bad_setting(setting):
    with pytest.raises(ValueError, match="num_draft_tokens must be 'auto' or an int >= 1"):
        DraftLength(setting)


def test_draft_length_recovers_from_unlucky_start():
    controller = DraftLength("auto")
    assert controller.choose() == 3  # a drafted step measures the drafter ...
    controller.observe(3, cpu_like(4), 0.02, STEP_COST, [0], [3])
    assert controller.choose() == 0  # ... a plain one gives the cost a slope
    controller.observe(0, cpu_like(1), None, STEP_COST, [0], [0])
    rng = random.Random(0)
    chosen = []
    for _ in range(200):  # from here on the drafter is good: acceptance 0.9
        k = controller.choose()
        chosen.append(k)
        n = 0
        while n < k and rng.random() < 0.9:
            n += 1
        controller.observe(k, cpu_like(k + 1), 0.02 if k else None, STEP_COST, [n], [k])
    assert chosen[-1] >= 1, chosen[:20]


def test_command_line_offers_every_method():
    """The command line lists its methods without importing the registry (so --help stays light): they
    must be the registry's."""
    import argparse

    from specops import cli
    from specops.decoding import registry

    parser = cli._generate_parser(argparse.ArgumentParser())
    method = next(a for a in parser._actions if a.dest == "method")
    assert tuple(method.choices) == registry.NAMES


def test_max_new_tokens_zero_summary():
    _, result = _cycle_decode(["ab"], "ar", max_new_tokens=0)
    assert "no tokens generated" in result.stats.summary()
    assert "outside forwards" not in result.stats.summary()


def test_command_line_checks_settings_before_loading(monkeypatch, capsys):
    """A typo exits with status 2 and a one-line message before any model loads; --threads sets torch's."""
    import torch

    from specops import cli, models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(models, "load", refuse)
    monkeypatch.setattr(models, "load_drafter", refuse)
    for argv, message in [(["--drafter", "smolm2"], "unknown model 'smolm2'"),
                          (["--method", "sd"], "needs a drafter"),
                          (["--max-new-tokens", "-1"], "max_new_tokens"),
                          (["--drafter", "self:x"], "self:N"),
                          (["--target", "gemma-3-270m,smollm2-135m", "--ensemble", "weighted:0.4,0.4"], "sum"),
                          (["--ensemble", "weighted:0.5,0.5"], "several targets"),
                          (["--method", "ngram", "--drafter", "self:2"], "does not use a drafter"),
                          (["--se-draws", "mixture"], "options ['draws'] belong to se, and method 'auto' picks"),
                          (["--target", "gemma-3-270m,smollm2-135m", "--method", "ensemble", "--se-draws",
                            "alternate"], "--se-draws is an option of method se, not ensemble"),
                          (["--method", "ar", "--ngram-tables", "none"], "--ngram-tables is an option of method ngram"),
                          (["--method", "slrs", "--drafter", "smollm2-135m", "--slrs-max-nodes", "0"],
                           "option 'max_nodes' of method slrs must be an int >= 1")]:
        assert cli.main(["generate", "x", *argv]) == 2
        assert message in capsys.readouterr().err
    assert cli.main(["generate", "x", "--max-new-tokens", "0"]) == 0  # nothing to generate, nothing loads
    assert "nothing generated" in capsys.readouterr().err
    before = torch.get_num_threads()
    try:
        cli._set_threads(1)
        assert torch.get_num_threads() == 1
        assert 1 <= auto_threads(window=0.05) <= before
    finally:
        torch.set_num_threads(before)


def test_stop_and_stream_with_an_embedded_name(models, tok, monkeypatch):
    """A target named by string brings its tokenizer: stop strings and streaming need no tokenizer=."""
    from specops import models as embedded

    monkeypatch.setattr(embedded, "load", lambda name, **kwargs: (models["llama"], tok))
    pieces = []
    result = specops.decode(PROMPTS[:2], target="gemma-3-270m", max_new_tokens=6, stop=["zz"],
                            stream=lambda request, text: pieces.append((request, text)))
    ar = specops.decode(PROMPTS[:2], target=models["llama"], tokenizer=tok, method="ar", max_new_tokens=6)
    assert result.tokens == ar.tokens
    assert "".join(text for request, text in pieces if request == 0) == result.text[0]


def test_decode_leaves_torch_threads_alone_unless_asked(monkeypatch):
    """decode() keeps torch's thread count as the user has it (no measurement, no change) unless threads= asks:
    an int for the call, "auto" the cores other processes leave; restored afterwards either way; nothing
    changes off the CPU; anything else is refused before decoding."""
    import torch

    import specops._threads as cpu

    given = torch.get_num_threads()
    monkeypatch.setattr(cpu, "_DECIDED", [])
    measured = []
    monkeypatch.setattr(cpu, "auto_threads", lambda window: measured.append(window) or 1)
    seen = []
    try:
        torch.set_num_threads(2)
        with decoding_threads(torch.device("cpu")):
            seen.append(torch.get_num_threads())
        assert not measured  # None: not even measured
        with decoding_threads(torch.device("cpu"), "auto"):
            seen.append(torch.get_num_threads())
        with decoding_threads(torch.device("cpu"), 3):
            seen.append(torch.get_num_threads())
        with decoding_threads(torch.device("meta"), 1):
            seen.append(torch.get_num_threads())
        assert seen == [2, 1, 3, 2] and torch.get_num_threads() == 2 and measured == [0.1]
        model = tiny_llama(layers=1)
        specops.decode("ab", target=model, tokenizer=byte_tokenizer(), method="ar", max_new_tokens=2)
        assert torch.get_num_threads() == 2 and measured == [0.1]
        for bad in (0, -1, 1.5, "two", True):
            with pytest.raises(ValueError, match="threads must be None, 'auto' or an int >= 1"):
                specops.decode("ab", target=model, tokenizer=byte_tokenizer(), method="ar", threads=bad)
    finally:
        torch.set_num_threads(given)
