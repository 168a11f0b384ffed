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


TREE_SHAPES = {"rsd-c": ["auto", (2, 2), (3, 1, 1)], "specinfer": ["auto", (2, 2)], "rsd-s": ["auto", (2, 3), (3, 1)]}


@pytest.mark.parametrize("method, shape", [(m, s) for m, shapes in TREE_SHAPES.items() for s in shapes])
@pytest.mark.parametrize("seed, temperature, top_p", [(123, 1.0, 1.0), (7, 0.8, 0.95)])
def test_sampled_draft_trees_equal_sampled_ar(method, shape, seed, temperature, top_p):
    """Draft trees under scheme "auto" with a seed (positional, rsd.TreeDrafter): every node's first child is
    drawn from q with the uniform number of the target's token at its position (rsd-c, specinfer), the tree
    goes to the verifier without q, and the child that is the target's token is kept. The text is sampled
    ar's with the same seed, whatever the shapes."""
    drafter = TableLM(cycle_table(0.6))
    ar = _decode("ar", seed, temperature, top_p)
    tree = _decode(method, seed, temperature, top_p, drafter=drafter, drafter_tokenizer=letter_tokenizer(),
                   num_draft_tokens=shape)
    assert tree.tokens == ar.tokens
    if shape != "auto":
        assert 0 < tree.stats.accepted < tree.stats.drafted  # accepted and rejected drafts: the check bites


@pytest.mark.parametrize("method", ["rsd-c", "specinfer", "rsd-s"])
def test_draft_trees_with_scheme_token_are_not_sampled_ar(method):
    """The same call with scheme "token" verifies the trees by recursive rejection sampling: the target's
    law, not ar's text (the equality above is the scheme's doing, not the toy tables')."""
    drafter = TableLM(cycle_table(0.6))
    ar = _decode("ar", 123)
    tree = _decode(method, 123, drafter=drafter, drafter_tokenizer=letter_tokenizer(), num_draft_tokens=(2, 2),
                   options={"scheme": "token"})
    assert tree.tokens != ar.tokens


@pytest.mark.parametrize("seed, scheme, expected", [(7, None, "positional"), (None, None, "traversal"),
                                                    (7, "token", "recursive"), (None, "positional", "positional"),
                                                    (7, "joint", "traversal")])
def test_tree_scheme_auto_is_positional_with_a_seed_and_joint_without(monkeypatch, seed, scheme, expected):
    """Option "scheme" of the draft-tree methods: "auto" (the default) matches positional tokens when a seed
    is given and hands q to tree_verify for traversal verification ("joint") when not; "token" reaches
    tree_verify as recursive rejection sampling, "joint" as traversal verification."""
    from specops.decoding import verify

    seen = set()
    match_tree = verify._match_tree

    def spy(logits, tokens, *args):
        if tokens.shape[1] > 1:  # a tree with drafts (a plain step draws its token this way in every scheme)
            seen.add("positional")
        return match_tree(logits, tokens, *args)

    def spy_verify(*args, _tree_verify=specops.ops.tree_verify, **kwargs):
        seen.add(kwargs["scheme"])
        return _tree_verify(*args, **kwargs)

    monkeypatch.setattr(verify, "_match_tree", spy)
    monkeypatch.setattr(verify.ops, "tree_verify", spy_verify)
    specops.decode(PROMPTS[:2], target=TableLM(cycle_table()), tokenizer=letter_tokenizer(), method="rsd-c",
                   drafter=TableLM(cycle_table(0.6)), drafter_tokenizer=letter_tokenizer(), num_draft_tokens=(2, 2),
                   max_new_tokens=6, temperature=1.0, seed=seed, options=None if scheme is None else {"scheme": scheme})
    assert seen == {expected}


@pytest.mark.parametrize("method, shape", [("sd", 3), ("rsd-c", (2, 2))])
@pytest.mark.parametrize("scheme", ["token", "joint"])
def test_schemes_against_q_repeat_themselves_for_a_fixed_draft_setting(method, shape, scheme):
    """docs/methods.md, "Reproducible and fast": with a seed and a fixed num_draft_tokens, "token" and "joint"
    give the same text on every call (keyed by step: not sampled ar's), and another seed other text."""
    kwargs = dict(drafter=TableLM(cycle_table(0.6)), drafter_tokenizer=letter_tokenizer(), num_draft_tokens=shape,
                  options={"scheme": scheme})
    first = _decode(method, 31, **kwargs)
    assert 0 < first.stats.accepted < first.stats.drafted and first.stats.scheme == scheme
    assert _decode(method, 31, **kwargs).tokens == first.tokens
    assert _decode(method, 32, **kwargs).tokens != first.tokens
    assert first.tokens != _decode("ar", 31).tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_one_child_trees_draft_what_sd_drafts(prompt):
    """Under "positional", a node's first child (rsd-c, specinfer) and the lead beam's child (rsd-s) are the
    drafter's draw with the target's positional number, as sd's chain drafts are: trees of one child per
    level draft exactly sd's chain, so each accepts exactly as many drafts."""
    common = dict(drafter=TableLM(cycle_table(0.6)), drafter_tokenizer=letter_tokenizer(), prompts=[prompt])
    sd = _decode("sd", 31, num_draft_tokens=3, **common)
    assert 0 < sd.stats.accepted < sd.stats.drafted
    for method, shape in (("rsd-c", (1, 1, 1)), ("specinfer", (1, 1, 1)), ("rsd-s", (1, 3))):
        tree = _decode(method, 31, num_draft_tokens=shape, **common)
        assert tree.tokens == sd.tokens
        assert (tree.stats.accepted, tree.stats.drafted) == (sd.stats.accepted, sd.stats.drafted), method


def test_lead_beam_is_kept_among_wider_beams():
    """rsd-s with W = 3 holds the coupled chain (the lead beam) and two beams besides: from any position its
    tree contains the chain that W = 1 draws from there, so each step keeps at least as many drafts; over
    this run the wide trees need no more target calls."""
    common = dict(drafter=TableLM(cycle_table(0.6)), drafter_tokenizer=letter_tokenizer(), prompts=[PROMPTS[0]])
    chain = _decode("rsd-s", 8, num_draft_tokens=(1, 3), **common)
    wide = _decode("rsd-s", 8, num_draft_tokens=(3, 3), **common)
    assert wide.tokens == chain.tokens
    assert wide.stats.accepted / wide.stats.target_calls >= chain.stats.accepted / chain.stats.target_calls
