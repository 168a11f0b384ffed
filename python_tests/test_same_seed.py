"""Same seed, same text: sampled decoding draws the target's token at every position from random numbers
keyed by the row's seed and the position alone (specops.decoding.verify.positional) and accepts a draft
when it equals that token; drafts from a drafter's q are drawn with the same numbers (TokenDrafter). So
it gives, token for token, what sampled "ar" gives with that seed, whatever draft shapes "auto" picks
from its timings, and however the batch is split.

The target is toy_models.TableLM with a cycle table (its likeliest next letter has probability 0.85), so
that n-gram drafts from the repeating context are often accepted and the equality says something: each
case checks that drafts were accepted and rejected."""

from __future__ import annotations

import pytest
import torch

import specops
from specops._seeds import position_seeds, row_seeds
from toy_models import TableLM, cycle_table, letter_tokenizer

PROMPTS = ["abcdabcdab", "aab", "cdabcdabcdabcdab", "dd"]  # ragged
NEW = 40


def _decode(method: str, seed: int, temperature: float = 1.0, top_p: float = 1.0, prompts=PROMPTS, **kwargs):
    return specops.decode(prompts, target=TableLM(cycle_table()), tokenizer=letter_tokenizer(), method=method,
                          max_new_tokens=NEW, temperature=temperature, top_p=top_p, seed=seed, **kwargs)


@pytest.mark.parametrize("shape", ["auto", 3, 6, (2, 3), (3, 4)])
@pytest.mark.parametrize("seed, temperature, top_p", [(123, 1.0, 1.0), (7, 0.8, 0.95), (2**63 - 1, 1.5, 0.9)])
def test_sampled_ngram_equals_sampled_ar(shape, seed, temperature, top_p):
    ar = _decode("ar", seed, temperature, top_p)
    ngram = _decode("ngram", seed, temperature, top_p, num_draft_tokens=shape, options={"tables": "none"})
    assert ngram.tokens == ar.tokens
    if shape != "auto":  # auto follows timings: it may stop drafting, or have no draft rejected
        assert 0 < ngram.stats.accepted < ngram.stats.drafted  # accepted and rejected drafts: the check bites


def test_the_same_seed_gives_the_same_text_twice_and_another_seed_other_text():
    first = _decode("ngram", 11, options={"tables": "none"})
    assert _decode("ngram", 11, options={"tables": "none"}).tokens == first.tokens
    assert _decode("ngram", 12, options={"tables": "none"}).tokens != first.tokens


def test_a_request_alone_gets_the_text_it_gets_in_a_batch():
    batch = _decode("ngram", 5, options={"tables": "none"}, num_draft_tokens=(2, 3))
    seeds = row_seeds(5, len(PROMPTS), "cpu")
    for i, prompt in enumerate(PROMPTS):
        alone = specops.decode([prompt], target=TableLM(cycle_table()), tokenizer=letter_tokenizer(),
                               method="ngram", max_new_tokens=NEW, temperature=1.0, seed=seeds[i:i + 1],
                               options={"tables": "none"}, num_draft_tokens=4)
        assert alone.tokens[0] == batch.tokens[i]


def test_position_seeds_key_rows_and_positions_apart():
    seeds = row_seeds(3, 2, "cpu")
    keys = position_seeds(seeds, torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert len(set(keys.flatten().tolist()) | set(seeds.tolist())) == 8  # none equal, none a row's own seed
    stride = 0xD1B54A32D192ED03
    want = [((int(s) + (p + 1) * stride + 2**63) % 2**64) - 2**63 for s in seeds.tolist() for p in range(3)]
    assert keys.flatten().tolist() == want


@pytest.mark.parametrize("shape", ["auto", 2, 5])
@pytest.mark.parametrize("seed, temperature, top_p", [(123, 1.0, 1.0), (7, 0.8, 0.95)])
def test_sampled_sd_equals_sampled_ar(shape, seed, temperature, top_p):
    """sd's drafts are drawn from the drafter's q with the uniform number of the target's token at the same
    position (TokenDrafter), and verified by matching it: the text is sampled ar's, whatever the lengths."""
    drafter = TableLM(cycle_table(0.6))
    ar = _decode("ar", seed, temperature, top_p)
    sd = _decode("sd", seed, temperature, top_p, drafter=drafter, drafter_tokenizer=letter_tokenizer(),
                 num_draft_tokens=shape)
    assert sd.tokens == ar.tokens
    if shape != "auto":
        assert 0 < sd.stats.accepted < sd.stats.drafted  # accepted and rejected drafts: the check bites


def test_coupled_drafts_are_accepted_more_often_than_independent_ones():
    """The coupling is what makes sampled sd fast: drafts drawn from q with the target's own uniform number
    are accepted far more often than p(x) averaged over x ~ q (independent drafts). With the target's and
    drafter's tables at 0.85 and 0.6 on the likeliest letter, independent acceptance is at most
    0.85 * 0.6 + 0.15 * 0.4 = 0.57; coupled, P(x = y) is about 0.75 (one uniform number: both pick the
    likeliest letter below 0.6)."""
    sd = specops.decode(PROMPTS, target=TableLM(cycle_table()), tokenizer=letter_tokenizer(), method="sd",
                        drafter=TableLM(cycle_table(0.6)), drafter_tokenizer=letter_tokenizer(), max_new_tokens=200,
                        temperature=1.0, seed=3, num_draft_tokens=1)
    assert sd.stats.drafted > 400
    assert sd.stats.accepted / sd.stats.drafted > 0.66  # 0.74 measured; independent: 0.57 at most
