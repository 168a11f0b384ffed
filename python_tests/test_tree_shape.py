"""Tests of the draft-tree shape chooser (`specops.decoding.tree_shape.TreeShape`, num_draft_tokens="auto"
for rsd-c, rsd-s and specinfer): acceptance counted per number of children from the paths verification
walked, expected tokens, the choice under GPU-like and CPU-like costs, the probe out of plain decoding,
decode() with "auto" equal to greedy "ar" on the toy models, and a same-tokenizer drafter whose LM head has
padding rows (never drafted)."""

from __future__ import annotations

import pytest
import torch

import specops
from specops.decoding.rsd import _path
from specops.decoding.tree_shape import TreeShape, nodes
from stats_helpers import SD_DRAFTER_TABLE as DRAFTER_TABLE
from stats_helpers import SD_TARGET_TABLE as TARGET_TABLE
from toy_models import TableLM, letter_tokenizer


def _measured(beams: bool, target_cost, draft_cost: float, accept_first: float, steps: int = 400) -> TreeShape:
    """A chooser fed `steps` synthetic observations: the target forward costs target_cost(nodes + 1), a
    drafter forward draft_cost, and the first child of every path node is accepted with probability
    accept_first (else the second, half as often), on (2, 2) trees or (2, 2) beams."""
    chooser = TreeShape(beams, (2, 2))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        path, level = [], 0
        while level < 2:
            u = float(torch.rand((), generator=gen))
            rank = 1 if u < accept_first else 2 if u < accept_first + (1 - accept_first) / 2 else 0
            path.append((2, rank))
            if not rank:
                break
            level += 1
        if level == 2:
            path.append((0, 0))
        chooser.observe((2, 2), target_cost(nodes((2, 2), beams) + 1), draft_cost, 1e-4, [path])
        chooser.observe((), target_cost(1), None, 1e-4, [])
    return chooser


def test_acceptance_counts_each_prefix_of_children():
    chooser = TreeShape(False, (2, 2))
    # root: 3 children, the second accepted; then 2 children, none accepted
    chooser.observe((3, 2), 0.01, 0.001, 0.0, [[(3, 2), (2, 0)]])
    assert chooser.seen[1:4].tolist() == [2, 2, 1]
    assert chooser.hits[1:4].tolist() == [0, 1, 1]
    # a(2) = (1 + 1) / (2 + 2) with the Beta(1, 1) prior
    assert chooser.acceptance(2) == pytest.approx(0.5)
    # past the widest measured (3): independent children, 1 - (1 - a(3)) (1 - a(1))^(b - 3)
    a3, a1 = 2 / 3, 1 / 4
    assert chooser.acceptance(4) == pytest.approx(1 - (1 - a3) * (1 - a1))


def test_expected_tokens_of_a_branching():
    chooser = TreeShape(False, (2,))
    chooser.seen[1:3] = 1e6
    chooser.hits[1], chooser.hits[2] = 0.5e6, 0.75e6
    a1, a2 = chooser.acceptance(1), chooser.acceptance(2)
    assert chooser.expected_tokens((2, 1)) == pytest.approx(1 + a2 + a2 * a1)
    assert chooser.expected_tokens(()) == 1


def test_flat_costs_choose_a_big_tree_and_steep_costs_plain_decoding():
    for beams in (False, True):
        gpu = _measured(beams, lambda n: 0.010, 0.0005, 0.8)  # a forward of 40 tokens costs one of 1
        shape = gpu.choose()
        assert shape and nodes(shape, beams) >= 6, shape
        cpu = _measured(beams, lambda n: 0.010 * n, 0.008, 0.8)  # cost grows with every token
        assert cpu.choose() == ()


def test_plain_decoding_probes_a_one_node_tree():
    cpu = _measured(False, lambda n: 0.010 * n, 0.008, 0.8)
    shapes = [cpu.choose() for _ in range(9)]
    assert shapes[:7] == [()] * 7 and (1,) in shapes


def test_path_from_emitted_tokens():
    # root -> children 1 (token 5), 2 (token 6); node 2 -> child 3 (token 7)
    tokens, parents = [0, 5, 6, 7], [0, 0, 0, 2]
    assert _path(tokens, parents, [6, 7, 9], 2) == [(2, 2), (1, 1), (0, 0)]
    assert _path(tokens, parents, [4], 0) == [(2, 0)]


@pytest.mark.parametrize("method", ["rsd-c", "rsd-s", "specinfer"])
def test_auto_greedy_equals_ar(method):
    tok = letter_tokenizer()
    prompts = ["ab", "ba", "abab"]
    kwargs = dict(target=TableLM(TARGET_TABLE), tokenizer=tok, max_new_tokens=12)
    expected = specops.decode(prompts, method="ar", **kwargs).tokens
    result = specops.decode(prompts, method=method, drafter=TableLM(DRAFTER_TABLE), drafter_tokenizer=tok,
                            num_draft_tokens="auto", **kwargs)
    assert result.tokens == expected
    assert result.stats.draft_lengths[0] > 0  # the first step measures a tree


@pytest.mark.parametrize("method", ["rsd-c", "rsd-s"])
def test_drafter_with_a_padded_head_equals_ar(method):
    """The target's tokenizer over a drafter LM head with more rows (padding): the rows past the target's
    vocabulary are never drafted, and greedy output equals ar's."""
    from toy_models import BYTE_VOCAB, byte_tokenizer, tiny_llama

    tok = byte_tokenizer()
    target = tiny_llama(layers=2, seed=0, vocab=BYTE_VOCAB + 1)
    drafter = tiny_llama(layers=1, seed=1, vocab=BYTE_VOCAB + 9)
    with torch.no_grad():  # the padding rows would win most draws if they could be drafted
        drafter.lm_head.weight[BYTE_VOCAB + 1:] *= 100
    prompts = ["abcab", "the cat; the cat; "]
    expected = specops.decode(prompts, target=target, tokenizer=tok, method="ar", max_new_tokens=10).tokens
    result = specops.decode(prompts, target=target, tokenizer=tok, drafter=drafter, drafter_tokenizer=tok,
                            method=method, num_draft_tokens=(2, 2), max_new_tokens=10)
    assert result.tokens == expected
    assert result.stats.drafted > 0
