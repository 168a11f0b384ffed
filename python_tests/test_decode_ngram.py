"""Tests of method "ngram" (specops/decoding/ngram.py) and the pieces it is built from; nothing downloads.

1. Greedy exactness: greedy "ngram" equals greedy "ar" token for token (float32) on ragged batches, on
   tiny Llama (with and without a BOS-adding tokenizer) and a tiny Gemma3 with a sliding window of 8
   and mixed layer types, for fixed one-row and k-row shapes and "auto", with each model n-gram table;
   with EOS, stop strings and budgets that cut a draft row short. Drafting really saves target calls.
2. Statistics: sampled "ngram" sequences follow the target's exact distribution (chi-square on whole
   continuations of a table-defined toy LM that reads draft trees through the 4-D mask), at T = 1 and
   T = 0.7 with top-k; drafts are both accepted and rejected; the check can fail.
3. Tree pieces on their own: build_tree, and KVState.append_tree + commit against fresh
   runs of the model on the plain token sequence (ragged rows, holes, a sliding window).
4. DraftShape: tree_nodes, settings, and "auto" driven with synthetic costs and acceptance.
5. Model n-grams: unigram order, bigram against the model's own logits (with and without BOS), its
   disk cache and cache key, extend; NgramDrafter's row mix.
6. Bad input.

Threads: every test here runs torch on one thread. Tiny models gain nothing from two, and on a loaded
2-core machine OpenMP's waiting threads make a tiny forward 100x slower or worse.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import specops
from specops.decoding import model_ngrams, ngram_shape
from specops.decoding.batch import Batch
from specops.decoding.cost_model import StepCost
from specops.decoding.ngram_shape import _DECAY, _PRIOR_ACCEPTED, _PRIOR_WEIGHT, DraftShape, distinct_rows, tree_nodes
from specops.decoding.engine import CausalLM, KVState
from specops.decoding.ngram import NgramDrafter
from specops.decoding.tree import build_tree
from stats_helpers import ALPHA, N_SEQUENCES, _fit, assert_follows_target, mass_moved
from stats_helpers import SD_STAT_NEW as STAT_NEW
from stats_helpers import SD_STAT_PROMPTS as STAT_PROMPTS
from stats_helpers import SD_TARGET_TABLE as TARGET_TABLE
from toy_models import (BOS_ID, BYTE_VOCAB, EOS_ID, LETTERS, START, TableLM, byte_tokenizer, cycle_table,
                        greedy_cycle, letter_tokenizer, sequence_distribution, tiny_gemma3, tiny_llama)

NGRAM_TABLES = ("auto", "bigram", "unigram", "none")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def ngram_cache(tmp_path_factory):
    """Model bigrams built by decode() go to a temporary cache, never to ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("specops-cache")
        patch.setenv("SPECOPS_CACHE", str(path))
        yield path


# ---- 1. greedy exactness ----

# Ragged (1 to 33 bytes, multi-byte UTF-8): two repeat themselves, so context n-grams hit at once; the
# others only match once the (repetitive) greedy text of a random tiny model has grown.
PROMPTS = ["abcabcabcabc abc", "Hello", "the cat sat; the cat sat; the cat", "ünï ✓ 42", "a"]
MAX_NEW = 16
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _gemma_sw8():
    return tiny_gemma3(layers=4, seed=0, sliding_window=8, layer_types=MIXED)


TARGETS = {  # name: (model factory, tokenizer factory); the same weights for the same name
    "llama": (lambda: tiny_llama(layers=4, seed=0), byte_tokenizer),
    "llama-bos": (lambda: tiny_llama(layers=4, seed=0, vocab=BYTE_VOCAB + 1),
                  lambda: byte_tokenizer(bos=True)),
    "gemma-sw8": (_gemma_sw8, byte_tokenizer),
}


@pytest.fixture(scope="module")
def targets():
    return {name: (model(), tok()) for name, (model, tok) in TARGETS.items()}


@pytest.fixture(scope="module")
def ar_reference(targets):
    """Greedy autoregressive results of PROMPTS, decoded as one batch, per target."""
    return {name: specops.decode(PROMPTS, target=model, tokenizer=tok, method="ar", max_new_tokens=MAX_NEW)
            for name, (model, tok) in targets.items()}


def check_ngram_stats(result, k: int, w: int):
    """Invariants of an ngram result's statistics; k, w bound the tree size (nodes <= k * w)."""
    s = result.stats
    assert s.new_tokens == sum(len(t) for t in result.tokens)
    assert s.drafter_calls == 0
    assert 0 <= s.accepted <= s.drafted
    assert s.target_calls == s.steps + 1  # the prefill, then one forward per step
    assert len(s.draft_lengths) == s.steps
    assert all(0 <= n <= k * w for n in s.draft_lengths)
    assert s.draft_seconds >= 0 and s.verify_seconds >= 0 and s.forward_seconds <= s.seconds * 1.001 + 1e-6


GREEDY_SHAPES = [(1, 3), (4, 4), 2, "auto"]


def _bounds(shape) -> tuple[int, int]:
    if shape == "auto":
        return 8, 8
    return (1, shape) if isinstance(shape, int) else shape


@pytest.mark.parametrize("tables", NGRAM_TABLES)
@pytest.mark.parametrize("shape", GREEDY_SHAPES, ids=str)
@pytest.mark.parametrize("name", ["llama", "gemma-sw8"])
def test_greedy_ngram_equals_ar(targets, ar_reference, name, shape, tables):
    model, tok = targets[name]
    result = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ngram", max_new_tokens=MAX_NEW,
                            num_draft_tokens=shape, options={"tables": tables})
    assert result.tokens == ar_reference[name].tokens
    assert result.text == ar_reference[name].text
    check_ngram_stats(result, *_bounds(shape))
    if shape != "auto":  # a fixed shape drafts every step (except where the budget leaves no room)
        assert result.stats.drafted > 0 and result.stats.accepted > 0


@pytest.mark.parametrize("shape", [(4, 4), "auto"], ids=str)
def test_greedy_ngram_equals_ar_with_bos(targets, ar_reference, shape):
    """A tokenizer that puts BOS before every prompt: the bigram is taken after BOS, and the context
    n-grams see it."""
    model, tok = targets["llama-bos"]
    assert tok(PROMPTS[0])["input_ids"][0] == BOS_ID
    result = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ngram", max_new_tokens=MAX_NEW,
                            num_draft_tokens=shape)
    assert result.tokens == ar_reference["llama-bos"].tokens


def test_greedy_batched_equals_alone(targets, ar_reference):
    model, tok = targets["gemma-sw8"]
    for i, prompt in enumerate(PROMPTS):
        alone = specops.decode(prompt, target=model, tokenizer=tok, method="ngram", max_new_tokens=MAX_NEW,
                               num_draft_tokens=(4, 4))
        assert alone.tokens == ar_reference["gemma-sw8"].tokens[i], prompt


def test_one_row_steps_take_the_chain_path(targets, ar_reference, monkeypatch):
    """A step whose trees are single rows goes to the chain verifier (no tree mask, no tree_verify); steps
    of plain decoding, one row and several rows, interleaved, still give greedy decoding's tokens."""
    model, tok = targets["gemma-sw8"]
    trees = []
    tree_verify = specops.ops.tree_verify
    monkeypatch.setattr(specops.ops, "tree_verify", lambda *a, **k: trees.append(1) or tree_verify(*a, **k))
    one_row = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ngram", max_new_tokens=MAX_NEW,
                             num_draft_tokens=3)
    assert one_row.tokens == ar_reference["gemma-sw8"].tokens
    assert not trees and one_row.stats.accepted > 0
    shapes = iter([(0, 0), (1, 3), (3, 2)] * MAX_NEW)
    monkeypatch.setattr(DraftShape, "choose", lambda self, rows, source, lead=None: next(shapes))
    mixed = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ngram", max_new_tokens=MAX_NEW)
    assert mixed.tokens == ar_reference["gemma-sw8"].tokens
    assert len(trees) >= 2 and mixed.stats.steps > len(trees)
    assert 0 in mixed.stats.draft_lengths and 3 in mixed.stats.draft_lengths


@pytest.mark.parametrize("tables", NGRAM_TABLES)
def test_drafts_cut_target_calls(targets, tables):
    """Plain decoding needs one target forward per token; where the drafts hit, "ngram" needs fewer."""
    model, tok = targets["llama"]
    prompts = [PROMPTS[0], PROMPTS[2]]
    new = 24
    ar = specops.decode(prompts, target=model, tokenizer=tok, method="ar", max_new_tokens=new)
    assert ar.stats.target_calls == new
    result = specops.decode(prompts, target=model, tokenizer=tok, method="ngram", max_new_tokens=new,
                            num_draft_tokens=(4, 4), options={"tables": tables})
    assert result.tokens == ar.tokens
    assert result.stats.target_calls <= new - 4, result.stats.summary()
    assert result.stats.accepted >= 4


class _Emitted:
    """One row of one Batch.emit call: the request, how many tokens it had before, the tokens offered
    (what verification produced for it) and how many of them were used."""

    def __init__(self, request: int, before: int, offered: list[int], used: int):
        self.request, self.before, self.offered, self.used = request, before, offered, used


def _spy_emit(monkeypatch) -> list[_Emitted]:
    seen = []
    emit = Batch.emit

    def spy(self, row_tokens):
        requests = list(self.index)
        before = [len(self.generated[r]) for r in requests]
        finished, used = emit(self, row_tokens)
        seen.extend(map(_Emitted, requests, before, row_tokens, used))
        return finished, used

    monkeypatch.setattr(Batch, "emit", spy)
    return seen


@pytest.mark.parametrize("name", ["llama", "gemma-sw8"])
def test_greedy_stops_like_ar(targets, ar_reference, monkeypatch, name):
    """max_new_tokens, stop strings and EOS end a request at the same token as in "ar", also when a stop
    string or EOS falls inside an accepted draft row (the rest of the row is dropped)."""
    model, tok = targets[name]
    reference = ar_reference[name]
    seen = _spy_emit(monkeypatch)
    for max_new in (1, 2, 3, 6):
        result = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ngram", max_new_tokens=max_new,
                                num_draft_tokens=(4, 4))
        assert result.tokens == [t[:max_new] for t in reference.tokens]
    # The budget cuts rows before verification (4 drafts when 2 tokens are left), so nothing verified is
    # thrown away; and some step did emit several tokens.
    assert all(e.used == len(e.offered) for e in seen) and max(len(e.offered) for e in seen) > 1

    # Stop strings: printable characters of the reference texts, 4 or more tokens in.
    stops = sorted({c for text in reference.text for c in text[4:] if c.isascii() and c.isprintable()})[:3]
    ar = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ar", max_new_tokens=MAX_NEW, stop=stops)
    assert any(len(t) < MAX_NEW for t in ar.tokens)  # precondition: the stop strings end some requests
    result = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ngram", max_new_tokens=MAX_NEW,
                            num_draft_tokens=(4, 4), stop=stops)
    assert result.tokens == ar.tokens and result.text == ar.text

    # A request that ends inside an accepted draft row: take a step that emitted several tokens at once
    # and end the request at one of them other than the last, by EOS (a token new to the request), and
    # by a stop string (the request's whole text up to there, where that is plain ASCII).
    del seen[:]
    specops.decode(PROMPTS, target=model, tokenizer=tok, method="ngram", max_new_tokens=MAX_NEW,
                   num_draft_tokens=(4, 4))
    inside = [(e.request, e.before + i) for e in seen for i in range(len(e.offered) - 1)]
    tokens = reference.tokens
    eos_case = next(((r, at) for r, at in inside if tokens[r][at] not in tokens[r][:at]), None)
    stop_case = next(((r, at) for r, at in inside if _plain(tok.decode(tokens[r][:at + 1]))), None)
    assert eos_case or stop_case
    if eos_case:
        request, at = eos_case
        eos = reference.tokens[request][at]
        eos_model = TARGETS[name][0]()  # the same weights, its own generation config
        eos_model.generation_config.eos_token_id = [EOS_ID, eos]
        del seen[:]
        result = specops.decode(PROMPTS, target=eos_model, tokenizer=tok, method="ngram",
                                max_new_tokens=MAX_NEW, num_draft_tokens=(4, 4))
        assert result.tokens == [t[: t.index(eos) + 1] if eos in t else t for t in reference.tokens]
        assert len(result.tokens[request]) == at + 1
        assert any(e.request == request and e.used < len(e.offered) for e in seen)
    if stop_case:
        request, at = stop_case
        stop = tok.decode(reference.tokens[request][:at + 1])
        ar = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ar", max_new_tokens=MAX_NEW,
                            stop=stop)
        del seen[:]
        result = specops.decode(PROMPTS, target=model, tokenizer=tok, method="ngram", max_new_tokens=MAX_NEW,
                                num_draft_tokens=(4, 4), stop=stop)
        assert result.tokens == ar.tokens and result.text == ar.text
        assert len(result.tokens[request]) == at + 1 and result.text[request] == ""
        assert any(e.request == request and e.used < len(e.offered) for e in seen)


def _plain(text: str) -> bool:
    return bool(text) and text.isascii() and text.isprintable()


# ---- 2. statistics: sampled sequences follow the target's distribution ----

# TableLM has no bigram of its own (model_ngrams.bigram needs embeddings and at least 8 tokens), so a
# fixed table stands in: row x ranks the letters by the target's p(. | START, x), the target's own
# bigram. Drafts from it and from the context are accepted sometimes and rejected sometimes.
TOY_BIGRAM = torch.cat([torch.argsort(-TARGET_TABLE[START, :, :len(LETTERS)], dim=-1),
                        torch.arange(len(LETTERS))[None]])  # [TOY_VOCAB, 4]; the <pad> row is never used

NGRAM_STAT_CASES = [
    # (k, w), tables, temperature, top_k, scheme. STAT_NEW = 4 tokens: the first comes from the prefill, so
    # a step drafts at most 2 (a request's last token always comes from a verification).
    ((1, 2), "none", 1.0, 0, "auto"),
    ((4, 2), "bigram", 1.0, 0, "auto"),
    ((4, 2), "bigram", 0.7, 3, "auto"),  # top-k 2 leaves too few sequences for the power asserted
    # The same trees through tree_verify with a one-hot q (one-row steps through chain_verify).
    ((4, 2), "bigram", 1.0, 0, "token"),
    ((4, 2), "bigram", 0.7, 3, "joint"),
    ((1, 2), "none", 1.0, 0, "joint"),  # chains: block verification
]

_samples_cache: dict = {}


def _toy_decode(prompts, shape, tables, temperature, top_k, seed, max_new_tokens, table=TARGET_TABLE,
                bigram=TOY_BIGRAM, scheme="auto"):
    target = TableLM(table)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_ngrams, "bigram", lambda model, tokenizer, top, **kwargs: bigram)
        result = specops.decode(prompts, target=target, tokenizer=letter_tokenizer(), method="ngram",
                                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                seed=seed, num_draft_tokens=shape, options={"tables": tables, "scheme": scheme})
    assert result.stats.target_calls == target.calls  # the model's real forward count
    return result


def _sample(shape, tables, temperature, top_k, scheme="auto", seed=4321):
    key = (shape, tables, temperature, top_k, scheme, seed)
    if key not in _samples_cache:
        prompts = [STAT_PROMPTS[i % len(STAT_PROMPTS)] for i in range(N_SEQUENCES)]
        result = _toy_decode(prompts, shape, tables, temperature, top_k, seed, STAT_NEW, scheme=scheme)
        assert all(len(t) == STAT_NEW for t in result.tokens)
        _samples_cache[key] = result
    return _samples_cache[key]


@pytest.mark.slow
@pytest.mark.parametrize("shape,tables,temperature,top_k,scheme", NGRAM_STAT_CASES,
                         ids=[f"k{s[0]}w{s[1]}-{t}-T{temp}-topk{tk}-{sc}" for s, t, temp, tk, sc in NGRAM_STAT_CASES])
def test_sampled_sequences_follow_target(shape, tables, temperature, top_k, scheme):
    result = _sample(shape, tables, temperature, top_k, scheme)
    assert_follows_target(result.text, temperature, top_k)
    assert 0 < result.stats.accepted < result.stats.drafted  # drafts accepted and rejected
    k, w = shape
    assert max(result.stats.draft_lengths) <= k * w
    if k > 1:  # some trees held more than one row: the path choice and the tree mask were used
        assert max(result.stats.draft_lengths) > w


@pytest.mark.slow
def test_chisquare_can_fail():
    """The check rejects the ngram samples against a target with 1% of mass moved between its two
    likeliest sequences, and against the same target at another temperature."""
    exact = sequence_distribution(TARGET_TABLE, "ab", STAT_NEW)
    samples = _sample((4, 2), "bigram", 1.0, 0).text
    assert _fit(samples, exact)[0] > ALPHA
    shifted = mass_moved(exact)
    assert _fit(samples, shifted)[0] < ALPHA
    assert _fit(samples, sequence_distribution(TARGET_TABLE, "ab", STAT_NEW, 0.9))[0] < ALPHA


@pytest.mark.parametrize("scheme, seen", [("auto", {"positional"}), ("positional", {"positional"}),
                                          ("token", {"tree_verify recursive", "chain_verify token"}),
                                          ("joint", {"tree_verify traversal", "chain_verify block"})])
def test_scheme_names_the_verifier(monkeypatch, scheme, seen):
    """Option "scheme": sampled trees walked through the target's positional tokens ("auto" too), or handed
    to tree_verify with a one-hot q, by recursive rejection sampling ("token") or traversal verification
    ("joint"); a step of one row goes to chain_verify, token by token or by block verification (traversal
    on a chain). Greedy is greedy matching in all of them."""
    from specops.decoding import verify

    calls = []
    real_tree, real_chain, real_walk = verify.ops.tree_verify, verify.ops.chain_verify, verify._match_tree

    def tree_verify(logits, tokens, parents, probs, **kwargs):
        assert probs is None  # deterministic drafts: one-hot q
        calls.append(f"tree_verify {kwargs['scheme']}")
        return real_tree(logits, tokens, parents, probs, **kwargs)

    def chain_verify(logits, drafts, probs=None, **kwargs):
        if drafts.shape[1]:
            assert probs is None
            calls.append(f"chain_verify {kwargs['scheme']}")
        return real_chain(logits, drafts, probs, **kwargs)

    def walk(*args):
        calls.append("positional")
        return real_walk(*args)

    monkeypatch.setattr(verify.ops, "tree_verify", tree_verify)
    monkeypatch.setattr(verify.ops, "chain_verify", chain_verify)
    monkeypatch.setattr(verify, "_match_tree", walk)
    positional = verify.positional

    def spy_positional(logits, *args):
        if logits.shape[1] > 1:  # a chain's drafts matched (a plain step draws its one token this way too)
            calls.append("positional")
        return positional(logits, *args)

    monkeypatch.setattr(verify, "positional", spy_positional)
    prompts = STAT_PROMPTS * 2
    script = iter([(4, 2), (1, 2)] * 50)  # a tree step, then a one-row step
    monkeypatch.setattr(DraftShape, "choose", lambda self, rows, source, lead=None: next(script))
    _toy_decode(prompts, "auto", "bigram", 1.0, 0, 5, 8, scheme=scheme)
    assert set(calls) == seen
    model, tok = TableLM(TARGET_TABLE), letter_tokenizer()
    greedy = _toy_decode(prompts, "auto", "bigram", 0.0, 0, 5, 8, scheme=scheme)
    assert greedy.tokens == specops.decode(prompts, target=model, tokenizer=tok, method="ar", max_new_tokens=8).tokens


def test_sampling_reproducible_and_batch_invariant():
    """A request's tokens depend on its seed and its context, not on the batch it is decoded in."""
    prompts = STAT_PROMPTS * 4

    def run(batch, seed):
        return _toy_decode(batch, (4, 2), "bigram", 1.0, 0, seed, 12).tokens

    assert run(prompts, 7) == run(prompts, 7)
    assert run(prompts, 7) != run(prompts, 8)
    assert run(prompts[:1], 7) == run(prompts, 7)[:1]


def test_greedy_cycle_table():
    """The toy model's greedy text is known (toy_models.greedy_cycle); context n-grams predict it, so
    drafts of 3 are accepted and a step emits up to 4 tokens."""
    prompts = ["ab", "aa", "bcd", "c"]
    result = _toy_decode(prompts, (2, 3), "none", 0.0, 0, 0, 20, table=cycle_table())
    assert result.text == [greedy_cycle(p, 20) for p in prompts]
    assert result.stats.target_calls < 10 and result.stats.accepted > 0


# ---- 3. tree pieces ----

def test_build_tree():
    rows = torch.tensor([
        [[5, 6, 7], [5, 6, 8], [9, -1, -1], [5, 6, 7]],  # shared prefixes, a short row, a repeated row
        [[5, -1, 4], [-1, -1, -1], [5, 7, -1], [2, -1, -1]],  # a row ends at its first -1; an empty row
    ])
    tree = build_tree(torch.tensor([11, 12]), rows)
    assert tree.nodes == 6  # request 1 has 4 nodes and 2 padding nodes
    assert tree.tokens.tolist() == [[11, 5, 6, 7, 8, 9], [12, 5, 7, 2, 0, 0]]
    assert tree.parent.tolist() == [[0, 0, 1, 2, 2, 0], [0, 0, 1, 0, 0, 0]]
    assert tree.depth.tolist() == [[0, 1, 2, 3, 3, 1], [0, 1, 2, 1, 0, 0]]
    assert tree.valid.tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    assert tree.paths.tolist() == [
        [[1, 2, 3], [1, 2, 4], [5, -1, -1], [1, 2, 3]],
        [[1, -1, -1], [-1, -1, -1], [1, 2, -1], [3, -1, -1]],
    ]
    # visible: ancestor-or-self; a padding node sees only itself.
    for b in range(2):
        for i in range(tree.nodes):
            ancestors = {i}
            node = i
            while tree.valid[b, i] and node != 0:
                node = int(tree.parent[b, node])
                ancestors.add(node)
            assert tree.visible[b, i].nonzero().flatten().tolist() == sorted(ancestors), (b, i)
    # Every path's tokens are its row's tokens up to the row's first -1.
    for b in range(2):
        for r in range(rows.shape[1]):
            path = [n for n in tree.paths[b, r].tolist() if n >= 0]
            row = rows[b, r].tolist()
            length = row.index(-1) if -1 in row else len(row)
            assert [int(tree.tokens[b, n]) for n in path] == row[:length]


def test_build_tree_root_only():
    tree = build_tree(torch.tensor([3, 4, 5]), torch.full((3, 2, 2), -1))
    assert tree.nodes == 1 and tree.tokens.tolist() == [[3], [4], [5]]
    assert tree.visible.tolist() == [[[True]]] * 3 and (tree.paths == -1).all()


# KVState.append_tree + commit: after any sequence of tree steps, the cache must hold exactly what a fresh
# run over each row's plain token sequence computes. Tolerance: float32 with batched, masked attention
# against an unbatched one reorders sums; logits here are O(1), so 1e-5 absolute is ~100 ulp.
ATOL, RTOL = 1e-5, 1e-4


def _fresh_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([sequence])).logits[0, -1].float()


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        valid[b, width - len(p):] = True
    return ids, valid


def _check_tree_step(model, state, sequences, roots, rows, chosen, keep):
    """One verification step: feed the tree, compare every node's logits with a fresh run, keep
    row chosen[b]'s first keep[b] drafts. Returns the kept tokens per request (root included)."""
    tree = build_tree(torch.tensor(roots), rows)
    with torch.inference_mode():
        logits = state.append_tree(tree.tokens, tree.valid, tree.depth, tree.visible)
    for b, sequence in enumerate(sequences):
        for node in range(tree.nodes):
            if not tree.valid[b, node]:
                continue
            chain, at = [], node
            while at != 0:
                chain.append(int(tree.tokens[b, at]))
                at = int(tree.parent[b, at])
            expected = _fresh_logits(model, sequence + [roots[b]] + chain[::-1])
            assert torch.allclose(logits[b, node], expected, atol=ATOL, rtol=RTOL), (b, node)
    path = tree.paths[torch.arange(len(roots)), torch.tensor(chosen)]
    slots = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], dim=1)
    with torch.inference_mode():
        state.commit(tree.nodes, slots, torch.tensor(keep) + 1)
    kept = []
    for b in range(len(roots)):
        assert keep[b] <= int((path[b] >= 0).sum())
        kept.append([roots[b]] + [int(tree.tokens[b, n]) for n in path[b, :keep[b]].tolist()])
    return kept


TREE_MODELS = {
    "llama": lambda: tiny_llama(layers=2, seed=5),
    "gemma-sw4": lambda: tiny_gemma3(layers=4, seed=5, sliding_window=4, layer_types=MIXED),
    "gemma-sw4-eager": lambda: tiny_gemma3(layers=2, seed=5, sliding_window=4),
}


@pytest.mark.parametrize("name", list(TREE_MODELS))
def test_append_tree_and_commit_match_fresh_runs(name):
    model = TREE_MODELS[name]()
    if name.endswith("eager"):
        model.set_attn_implementation("eager")  # the engine's masks become additive float masks
    lm = CausalLM(model)
    sequences = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34]]  # ragged: left padding
    state = KVState(lm, len(sequences))
    ids, valid = _left_padded(sequences)
    with torch.inference_mode():
        prefill = state.append(ids, valid, keep=1)[:, -1]
    for b, sequence in enumerate(sequences):
        assert torch.allclose(prefill[b], _fresh_logits(model, sequence), atol=ATOL, rtol=RTOL)

    steps = [  # roots, rows [3, k, w], chosen row, drafts kept: different per request (holes)
        ([40, 41, 42],
         [[[50, 51, 52], [50, 53, 54], [55, -1, -1]],
          [[60, -1, -1], [-1, -1, -1], [-1, -1, -1]],
          [[70, 71, 72], [73, 74, 75], [70, 71, 76]]],
         [1, 0, 2], [2, 0, 3]),
        ([43, 44, 45],
         [[[80, 81, -1], [82, -1, -1], [80, 83, -1]],
          [[90, 91, 92], [90, 91, 93], [94, 95, 96]],
          [[-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]],  # nothing drafted: the root alone
         [2, 1, 0], [1, 3, 0]),
        ([46, 47, 48],
         [[[100, 101, 102], [100, 101, 103], [104, 105, 106]],
          [[110, 111, 112], [113, 114, 115], [116, 117, 118]],
          [[120, 121, 122], [120, 123, 124], [125, 126, 127]]],
         [0, 2, 1], [3, 1, 2]),
    ]
    for roots, rows, chosen, keep in steps:
        kept = _check_tree_step(model, state, sequences, roots, torch.tensor(rows), chosen, keep)
        sequences = [s + k for s, k in zip(sequences, kept)]
        assert state.next_pos.tolist() == [len(s) for s in sequences]
    # A plain forward after the last commit sees each row's plain sequence.
    last = [130, 131, 132]
    with torch.inference_mode():
        logits = state.append(torch.tensor(last)[:, None])[:, -1]
    for b, sequence in enumerate(sequences):
        assert torch.allclose(logits[b], _fresh_logits(model, sequence + [last[b]]), atol=ATOL, rtol=RTOL), b
    assert min(len(s) for s in sequences) > 8  # every row crossed the sliding window of 4


def test_commit_crops_slots_no_row_keeps():
    """Slots past every row's kept path leave the cache: it grows by the longest kept path."""
    model = tiny_llama(layers=1, seed=6)
    state = KVState(CausalLM(model), 2)
    ids, valid = _left_padded([[5, 6, 7], [8, 9]])
    with torch.inference_mode():
        state.append(ids, valid)
        rows = torch.tensor([[[10, 11, 12], [13, 14, 15]], [[16, 17, 18], [19, 20, 21]]])
        tree = build_tree(torch.tensor([1, 2]), rows)
        state.append_tree(tree.tokens, tree.valid, tree.depth, tree.visible)
    assert state.mask.shape[1] == 3 + tree.nodes
    path = tree.paths[:, 1]
    slots = torch.cat([torch.zeros_like(path[:, :1]), path], dim=1)
    with torch.inference_mode():
        state.commit(tree.nodes, slots, torch.tensor([2, 1]))
        state.append(torch.tensor([[22], [23]]))
    # The dropped slots left before that forward: each row's tokens contiguous, ending at the last slot, and
    # the cache grew by the longest kept path (row 1's shorter path became padding at its front).
    assert state.mask.shape[1] == 3 + 2 + 1 and state.cache.get_seq_length() == 3 + 2 + 1
    assert state.mask.long().tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    assert state.next_pos.tolist() == [3 + 2 + 1, 2 + 1 + 1]


def test_cpu_forward_used_and_restored():
    """CPU float32 models run through the engine's skinny_linear forward (cpu_forward.CpuForward; the
    fresh-run comparisons above go through it), and the model's own layers are untouched afterwards."""
    model = tiny_llama(layers=1, seed=7)
    lm = CausalLM(model)
    assert lm.cpu_forward is not None
    state = KVState(lm, 2)
    ids, valid = _left_padded([[5, 6, 7], [8]])
    with torch.inference_mode():
        logits = state.append(ids, valid, keep=1)[:, -1]
    assert logits.dtype == torch.float32
    assert torch.allclose(logits[1], _fresh_logits(model, [8]), atol=ATOL, rtol=RTOL)
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_cpu_forward_follows_dtype_change():
    """CausalLM promises float32 logits. The probe's verdict is cached per model object, so a model that
    passed it in float32 and is then converted in place (model.to(torch.bfloat16)) must not keep the
    float32-only CPU path, or at least must still return float32 logits."""
    model = tiny_llama(layers=1, seed=7)
    assert CausalLM(model).cpu_forward is not None
    model.to(torch.bfloat16)
    lm = CausalLM(model)
    with torch.inference_mode():
        logits = KVState(lm, 1).append(torch.tensor([[5, 6, 7]]))
    assert logits.dtype == torch.float32, f"CausalLM returned {logits.dtype} logits"


# ---- 4. DraftShape ----

class _ModelKey:
    """A fresh weak-referenceable stand-in for a model: DraftShape keeps step costs per model object for
    the life of the process, so every test gets its own."""


def test_tree_nodes_hand_made():
    rows = torch.tensor([[[5, 6, 7], [5, 6, 8], [5, 9, -1], [-1, -1, -1]]])
    nodes = tree_nodes(rows)[0]
    assert nodes.tolist() == [[1, 2, 3], [1, 2, 4], [1, 3, 5], [1, 3, 5]]


def test_tree_nodes_matches_build_tree():
    """tree_nodes(rows)[b, k-1, w-1] == build_tree of the first k rows cut to w tokens, minus the root."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 3, (6, 5, 4), generator=g)  # 3 tokens: many shared prefixes
    rows[torch.rand(rows.shape, generator=g) < 0.15] = -1
    nodes = tree_nodes(rows)
    for b in range(rows.shape[0]):
        for k in range(1, 6):
            for w in range(1, 5):
                tree = build_tree(torch.tensor([0]), rows[b:b + 1, :k, :w])
                assert int(nodes[b, k - 1, w - 1]) == tree.nodes - 1, (b, k, w)


def test_distinct_rows_hand_made():
    """Rows that repeat an earlier row in their first w tokens do not count at width w."""
    rows = torch.tensor([[[5, 6, 7], [5, 6, 8], [5, 9, -1], [5, 6, 7], [-1, -1, -1]]])
    assert distinct_rows(rows)[0].tolist() == [[1, 1, 1], [1, 1, 2], [1, 2, 3], [1, 2, 3], [1, 2, 3]]


def test_draft_shape_values_rows_alike_as_one_row():
    """Learned: one row never catches the next token, the eighth row always does (8 distinct rows). A step
    whose 8 rows are one row 8 times is a one-node tree worth what one row is worth (0.03 tokens): plain
    decoding wins (a draft node costs 5 % of a plain step). Priced by its 8 rows, it would draft (8, 1) at 0.97
    tokens; where the 8 rows differ, they do draft."""
    for method in ("choose", "shapes"):
        shape = DraftShape("auto", _ModelKey(), "cpu")
        learned = _distinct_rows(1, shape.k_max, shape.w_max)[0]
        for _ in range(60):
            shape.score([learned], [1], [learned[7].tolist()])
        expected = shape.expected_accepted()[1, :, 0]
        assert float(expected[0]) < 0.1 and float(expected[7]) > 0.9, expected
        for drafts in (0, 1, 2, 4, 8):
            for _ in range(3):
                shape.observe_cost(1, 1 + drafts, 0.1 + 0.005 * drafts)
        alike = learned[:1].expand(shape.k_max, shape.w_max)[None].clone()
        chosen = getattr(shape, method)(alike, torch.tensor([1]))
        assert (chosen == 0).all() if method == "shapes" else chosen == (0, 0), (method, chosen)
        chosen = getattr(shape, method)(learned[None].clone(), torch.tensor([1]))
        k = int(chosen[0, 0]) if method == "shapes" else chosen[0]
        assert k == shape.k_max, (method, chosen)


def _rows_accepted_whole(per_draft: float) -> tuple[DraftShape, torch.Tensor]:
    """A shape (one row of up to 16 tokens) that learned every row accepted whole, with steps of 2 requests
    measured at 0.1 s plus `per_draft` a draft token; and that row [1, 16]."""
    shape = DraftShape("auto", _ModelKey(), "cpu", k_max=1, w_max=16, sources=2)
    full = torch.arange(1, 17).view(1, 16)
    for _ in range(60):
        shape.score([full], [1], [full[0].tolist()])
    for drafts in (0, 1, 2, 4, 8, 16, 32):
        for _ in range(3):
            shape.observe_cost(2, 2 + drafts, 0.1 + per_draft * drafts)
    return shape, full


def test_draft_shape_values_a_short_row_at_its_own_width():
    """Learned: every row is accepted whole, so a shape w tokens wide is worth about w. A request whose row
    holds 3 tokens is worth 3 at any w >= 3, so it drafts (1, 3), not the widest shape: priced at w, it took
    (1, 10) and the step carried 10 tokens for every request. The other request's full row goes as far as pays."""
    shape, full = _rows_accepted_whole(0.001)
    short = full.clone()
    short[0, 3:] = -1
    for method in ("choose", "shapes"):
        alone = getattr(shape, method)(short[None].clone(), torch.tensor([1]))
        assert (alone.tolist() == [[1, 3]]) if method == "shapes" else alone == (1, 3), (method, alone)
    both = shape.shapes(torch.stack([short, full]), torch.tensor([1, 1]))
    assert both[0].tolist() == [1, 3] and both[1].tolist() == [1, 16], both


def test_draft_shape_shapes_count_requests_far_ahead_a_quarter():
    """Two requests whose 16-token rows are always accepted whole, on steps where a draft token costs 40 % of
    a plain step's share: counted whole, drafting pays (16 tokens each); with the second request more than one
    longest row (w_max) ahead of the first, its drafts count _AHEAD_WORTH and nothing but a probe pays.
    Within w_max of it, they count whole."""
    shape, full = _rows_accepted_whole(0.04)
    rows, source = torch.stack([full, full]), torch.tensor([1, 1])
    for lead in (None, torch.tensor([0, 0]), torch.tensor([0, 16])):
        assert shape.shapes(rows.clone(), source, lead).tolist() == [[1, 16], [1, 16]], lead
    far = shape.shapes(rows.clone(), source, torch.tensor([0, 17]))
    assert (far[:, 1] <= 1).all(), far  # plain, or a probe's one token each


def test_draft_shape_acceptance_fades_per_step_not_per_request():
    """Eight requests' draft lists scored at each of 10 steps: the past fades by _DECAY a step, so the
    estimate holds 8 (1 - _DECAY^10) / (1 - _DECAY) lists' worth, not 1 / (1 - _DECAY) (about 4 steps' worth):
    a batch's estimate is as steady as one request's over as many steps."""
    shape = DraftShape("auto", _ModelKey(), "cpu", sources=3)
    rows = _distinct_rows(1, shape.k_max, shape.w_max)[0]
    for _ in range(10):
        shape.score([rows] * 8, [2] * 8, [rows[0].tolist()] * 8)
    assert shape.weight[2].item() == pytest.approx(8 * (1 - _DECAY ** 10) / (1 - _DECAY))
    assert shape.weight[:2].tolist() == [0.0, 0.0]  # sources never scored do not fade either
    assert shape.accepted[2, 0, -1].item() == pytest.approx(shape.w_max * shape.weight[2].item())


@pytest.mark.parametrize("setting", [0, -1, 2.5, "x", "", None, True, (0, 2), (2, 0), (2,), (1, 2, 3), [2, 2],
                                     (True, 2), (2, 1.5), "8"])
def test_draft_shape_bad_setting(setting):
    with pytest.raises(ValueError, match="num_draft_tokens for method 'ngram'"):
        DraftShape(setting, _ModelKey(), "cpu")


@pytest.mark.parametrize("setting,shape", [(1, (1, 1)), (3, (1, 3)), ((4, 2), (4, 2)), ((12, 1), (12, 1))])
def test_draft_shape_fixed(setting, shape):
    draft_shape = DraftShape(setting, _ModelKey(), "cpu")
    assert (draft_shape.k_max, draft_shape.w_max) == shape
    rows = torch.full((2, *shape), 3)
    for seconds in (0.01, 10.0):  # costs never change a fixed shape
        assert draft_shape.choose(rows, torch.zeros(2, dtype=torch.long)) == shape
        draft_shape.observe_cost(2, 2, seconds)


def _distinct_rows(batch: int, k: int, w: int) -> torch.Tensor:
    """Draft lists [batch, k, w] with no shared prefixes: shape (k, w) has k * w tree nodes."""
    return (torch.arange(k * w).view(1, k, w) + 100 * torch.arange(1, k + 1).view(1, k, 1)).expand(
        batch, k, w).clone()


def _drive(shape: DraftShape, cost, truth_row, steps: int, batch: int = 2):
    """Run `steps` steps of the decoder's DraftShape protocol on synthetic data: choose, pay cost(size),
    record the draft lists, then learn that the tokens that followed were row truth_row(step) of the
    list (or never drafted tokens when it is None). Returns the chosen shapes and their sizes, checking
    that no step explores beyond twice the largest size measured before it."""
    rows = _distinct_rows(batch, shape.k_max, shape.w_max)
    source = torch.zeros(batch, dtype=torch.long)
    nodes = tree_nodes(rows).amax(0)
    generated = [[] for _ in range(batch)]
    chosen = []
    for step in range(steps):
        largest = shape.cost.largest()
        k, w = shape.choose(rows, source)
        size = batch * (1 + (int(nodes[k - 1, w - 1]) if k else 0))
        if largest:
            assert size <= 2 * largest, (step, (k, w), size, largest)
        else:
            assert (k, w) == (0, 0)  # nothing measured yet: plain decoding first
        chosen.append(((k, w), size))
        shape.observe_cost(batch, size, cost(size))
        shape.record(list(range(batch)), [len(g) for g in generated], source, rows)
        row = truth_row(step)
        for g in generated:
            g.extend(rows[0, row].tolist() if row is not None else [7] * shape.w_max)
        shape.resolve(generated, set())
    return chosen


def test_draft_shape_auto_plain_when_drafting_cannot_pay():
    """A CPU-like steep step cost and drafts that never match: after some optimistic exploration it
    settles on plain decoding."""
    shape = DraftShape("auto", _ModelKey(), "cpu")
    chosen = _drive(shape, lambda size: 0.05 * size, lambda step: None, steps=40)
    assert any(k for (k, _), _ in chosen[:10]), chosen[:10]  # it did try drafting
    assert all(s == (0, 0) for s, _ in chosen[-15:]), chosen


def test_draft_shape_probes_batch_sizes_whose_drafts_were_never_measured():
    """Drafts measured with one request only, plain steps of 32: the fit prices 32 drafts for 32 requests by
    extrapolation, so the first plain-winning step there drafts one token per request (both choosers) to
    measure them. Once measured too dear, plain decoding wins, and probes come only at the probe interval
    and only where drafting could pay at all (here it cannot: no step before the interval drafts)."""
    for method in ("choose", "shapes"):
        shape = DraftShape("auto", _ModelKey(), "cpu", sources=3)
        for _ in range(10):
            for drafts in (0, 1, 3, 7):
                shape.observe_cost(1, 1 + drafts, 0.05 + 0.02 * drafts)  # steep: drafts never pay with one
            shape.observe_cost(32, 32, 0.3)
        rows = _distinct_rows(32, shape.k_max, shape.w_max)
        source = torch.zeros(32, dtype=torch.long)
        for _ in range(20):  # the first row is always what followed
            shape.score([rows[0]], [0], [rows[0, 0].tolist()])
        first = getattr(shape, method)(rows, source)
        drafted = (first != 0).any(-1).all() if method == "shapes" else first == (1, 1)
        assert drafted, first  # the probe: one node per request
        if method == "shapes":
            assert first.tolist() == [[1, 1]] * 32
        shape.observe_cost(32, 64, 0.9)  # 2.4 plain steps for 1.5 steps' tokens: never worth it
        for _ in range(5):
            again = getattr(shape, method)(rows, source)
            assert (again == 0).all() if method == "shapes" else again == (0, 0), again
            shape.observe_cost(32, 32, 0.3)


def test_draft_shape_auto_wide_when_drafting_is_free():
    """A GPU-like flat cost and drafts that match fully, but by turns from rows 0, 1 and 2: it grows
    by doubling to three full-width rows (a(3, 8) = 8 tokens, fewer rows accept less)."""
    shape = DraftShape("auto", _ModelKey(), "cpu")
    chosen = _drive(shape, lambda size: 0.05, lambda step: step % 3, steps=40)
    sizes = [size for _, size in chosen]
    assert sizes[0] == 2 and max(sizes[:3]) <= 8  # 2 rows: plain, then at most doubling per step
    assert chosen[-1][0] == (3, 8), chosen
    assert all(s == (3, 8) for s, _ in chosen[-10:])


def _chains(shape: DraftShape, accepted: dict[int, float]) -> None:
    """Teach `shape` (k_max 1) that a source-s draft is accepted for exactly accepted[s] tokens (whole)."""
    for source, count in accepted.items():
        for _ in range(60):
            rows = torch.arange(1, shape.w_max + 1).view(1, shape.w_max)
            truth = rows[0, :int(count)].tolist() + [-5] * (shape.w_max - int(count))
            shape.score([rows], [source], [truth])


def test_draft_shape_widths_spend_tokens_where_they_pay():
    """Per-request chain lengths (vLLM): with a line of 0.1 s + 0.01 s per token, a request whose drafts
    run 6 tokens deep gets 6, one whose drafts never match gets none; hand-computed best split."""
    shape = DraftShape("auto", _ModelKey(), "cpu", k_max=1, w_max=8, sources=3)
    _chains(shape, {0: 0, 2: 6})
    for n in (2, 8, 16):
        shape.observe_cost(2, n, 0.1 + 0.01 * n)
    rows = torch.arange(1, 9).view(1, 1, 8).repeat(2, 1, 1)
    widths = shape.widths(rows, torch.tensor([2, 0]))
    assert widths[1] == 0 and widths[0] == 6, widths
    assert shape.widths(rows, torch.tensor([0, 0])) == [0, 0]  # nothing pays: plain
    short = rows.clone()
    short[0, 0, 3:] = -1  # a request with only 3 draft tokens gets at most 3
    assert shape.widths(short, torch.tensor([2, 2]))[0] == 3


def test_draft_shape_widths_for_requests_submitted_together():
    """Line 0.1 s + 0.02 s per token. Alone, a request on a 6-deep match gets 6 drafts whatever its
    neighbour. In a group (lead >= 0) whose other member's drafts never match, the group cannot finish
    sooner: its tokens count a quarter and no longer pay (hand-computed: 2.25 tokens in 0.16 s against
    2 in 0.14 s). Both on good matches: both draft. A member 2 tokens behind gets the longer chain."""
    shape = DraftShape("auto", _ModelKey(), "cpu", k_max=1, w_max=8, sources=3)
    _chains(shape, {0: 0, 2: 6})
    for n in (2, 8, 16):
        shape.observe_cost(2, n, 0.1 + 0.02 * n)
    rows = torch.arange(1, 9).view(1, 1, 8).repeat(2, 1, 1)
    mixed, good = torch.tensor([2, 0]), torch.tensor([2, 2])
    assert shape.widths(rows, mixed)[0] == 6
    assert shape.widths(rows, mixed, torch.tensor([-1, -1]))[0] == 6  # alone, as without leads
    assert shape.widths(rows, mixed, torch.tensor([0, 0])) == [0, 0]
    assert shape.widths(rows, good, torch.tensor([0, 0])) == [6, 6]
    behind = shape.widths(rows, good, torch.tensor([2, 0]))
    assert behind[1] > behind[0] > 0, behind
    assert shape.widths(rows, mixed, torch.tensor([0, -1]))[0] == 6  # a group of one is alone


def test_draft_shape_widths_for_a_group_that_mostly_accepts():
    """Seven requests submitted together, each accepting 9 of every 10 eight-token drafts (1 in 10 rejects
    the first token): the group keeps the pace of its weakest member, 0.9 a token, not the 0.9 ** 7 = 0.48
    chance that all seven accept in one step. On a line of 0.1 s + 0.025 s per token (hand-computed): eight
    drafts each make 7 + 56 x (0.25 x 0.9 + 0.75 x 0.9) = 57.4 tokens in 1.675 s, 34.3 a second against
    plain's 25.5; the product valued a draft token at 0.25 x 0.9 + 0.75 x 0.48 = 0.58 and stayed plain
    (one draft each: 11.1 tokens in 0.45 s, 24.6 a second)."""
    shape = DraftShape("auto", _ModelKey(), "cpu", k_max=1, w_max=8, sources=2)
    rows = torch.arange(1, 9).view(1, 8)
    for i in range(200):
        shape.score([rows], [1], [rows[0].tolist() if i % 10 else [-5] * 8])
    for n in (7, 14, 28, 56):
        shape.observe_cost(7, n, 0.1 + 0.025 * n)
    chains = rows.view(1, 1, 8).repeat(7, 1, 1)
    assert shape.widths(chains, torch.ones(7, dtype=torch.long), torch.zeros(7, dtype=torch.long)) == [8] * 7


def test_draft_shape_widths_pad_to_a_cheaper_step():
    """Where a step with more tokens in flight was measured cheaper (vLLM's CPU engine, one request: 80 ms
    plain, 98 ms with one draft, 68 with three), the widths grow to it with filler: a request with nothing to
    draft sends 3 tokens, one with a single poor draft token 3; a good 8-token match keeps the best rate (4
    drafts at 69 ms); costs that only grow (a line) are never padded; a difference under 3 % is noise."""
    shape = DraftShape("auto", _ModelKey(), "cpu", k_max=1, w_max=8, sources=3)
    shape.cost = StepCost(per_size=True)
    _chains(shape, {0: 0, 1: 0, 2: 4})
    step = {0: 0.080, 1: 0.098, 2: 0.072, 3: 0.068, 4: 0.069, 5: 0.070, 6: 0.084, 7: 0.090, 8: 0.091}
    for _ in range(3):
        for drafts, seconds in step.items():
            shape.observe_cost(1, 1 + drafts, seconds)
    empty = torch.full((1, 1, 8), -1)
    one = empty.clone()
    one[0, 0, 0] = 7
    full = torch.arange(1, 9).view(1, 1, 8)
    assert shape.widths(empty, torch.tensor([0])) == [3]
    assert shape.widths(one, torch.tensor([1])) == [3]
    assert shape.widths(full, torch.tensor([2])) == [4]
    line = DraftShape("auto", _ModelKey(), "cpu", k_max=1, w_max=8, sources=3)
    line.cost = StepCost(per_size=True)
    _chains(line, {0: 0})
    for _ in range(3):
        for drafts in range(9):
            line.observe_cost(1, 1 + drafts, 0.080 + 0.002 * drafts - 0.008 * (drafts == 3))
    assert line.widths(empty, torch.tensor([0])) == [0]  # 3 drafts 2.5 % cheaper than none: not padded
    assert ngram_shape._pad([0, 2, 1], 3, 4) == [2, 2, 2] and ngram_shape._pad([4, 3], 5, 4) == [4, 4]


def test_draft_shape_widths_explore_and_stop():
    """Nothing measured: plain; one size measured (a flat line): drafts, at most doubling the tokens in
    flight; a line where a token costs half a plain step: plain again; a fixed setting: always that."""
    shape = DraftShape("auto", _ModelKey(), "cpu", k_max=1, w_max=8, sources=2)
    rows = torch.arange(1, 9).view(1, 1, 8).repeat(4, 1, 1)
    source = torch.ones(4, dtype=torch.long)
    assert shape.widths(rows, source) == [0] * 4
    shape.observe_cost(4, 4, 0.1)
    first = shape.widths(rows, source)
    assert 0 < sum(first) <= 4, first  # 4 requests + at most 4 drafts = twice the 4 measured
    _chains(shape, {1: 1})
    shape.observe_cost(4, 8, 0.3)
    shape.observe_cost(4, 4, 0.1)
    assert shape.widths(rows, source) == [0] * 4
    with pytest.raises(ValueError, match="one row per request"):
        shape.widths(rows.repeat(1, 2, 1), source)
    assert DraftShape(3, _ModelKey(), "cpu", k_max=1, w_max=8).widths(rows, source) == [3] * 4


def test_draft_shape_costs_shared_per_model():
    """A later decode call on the same model starts from the costs earlier ones measured."""
    key = _ModelKey()
    first = DraftShape("auto", key, "cpu")
    first.observe_cost(1, 1, 0.05)
    second = DraftShape("auto", key, "cpu")
    assert second.cost(1, 1) == pytest.approx(0.05)
    assert DraftShape("auto", _ModelKey(), "cpu").cost(1, 1) is None


def test_draft_shape_acceptance_carried_to_the_next_call():
    """"auto" starts from what the last call with the same model and memory key learned, worth at most
    _CARRIED steps per source; another key, a fixed shape or no key starts from the prior."""
    from specops.decoding.ngram_shape import _CARRIED

    key = _ModelKey()
    first = DraftShape("auto", key, "cpu", memory="T=1")
    first.accepted[0] += 3.0 * _CARRIED  # 4 * _CARRIED steps of source 0 that accepted 0.75 each
    first.weight[0] += 4.0 * _CARRIED
    first.accepted[1] += 1.0  # 2 steps of source 1 that accepted 0.5 each
    first.weight[1] += 2.0
    second = DraftShape("auto", key, "cpu", memory="T=1")
    assert second.weight[:2].tolist() == [_CARRIED, 2.0]
    assert torch.allclose(second.accepted[0] / second.weight[0], torch.tensor(0.75, dtype=torch.float64))
    assert torch.equal(second.accepted[1], first.accepted[1])
    assert not DraftShape("auto", key, "cpu", memory="T=0").weight.any()
    assert not DraftShape("auto", key, "cpu").weight.any()
    assert not DraftShape((2, 2), key, "cpu", memory="T=1").weight.any()
    assert DraftShape("auto", key, "cpu", memory="T=1").weight[0] == _CARRIED  # (2, 2) kept nothing


def test_draft_shape_probes_count_on_across_calls():
    """Plain steps count toward the next probe across calls with the same model and memory key, as for
    chains and trees: 8 samples of a prompt settled on plain decoding otherwise probed at the 8th and 24th
    plain steps of every call. Another key starts at the shortest interval."""
    from specops.decoding.cost_model import _PROBE_EVERY

    key = _ModelKey()
    first = DraftShape("auto", key, "cpu", memory="T=1")
    dues = [first.probe.due() for _ in range(3 * _PROBE_EVERY + 3)]
    assert dues.count(True) == 2 and first.probe.interval == 4 * _PROBE_EVERY
    second = DraftShape("auto", key, "cpu", memory="T=1")
    assert (second.probe.interval, second.probe.plain_steps) == (4 * _PROBE_EVERY, 3)
    assert not any(second.probe.due() for _ in range(4 * _PROBE_EVERY - 4)) and second.probe.due()
    assert DraftShape("auto", key, "cpu", memory="T=0").probe.interval == _PROBE_EVERY


def test_draft_shape_resolve_scores_counterfactually():
    shape = DraftShape("auto", _ModelKey(), "cpu", k_max=3, w_max=3, sources=3)
    prior = torch.full((3, 3), _PRIOR_ACCEPTED, dtype=torch.float64)
    assert torch.equal(shape.expected_accepted()[1], prior)
    rows = torch.tensor([[[1, 2, 3], [1, 4, 5], [6, 7, 8]]])
    shape.record([0], [2], torch.tensor([1]), rows)  # request 0's drafts for its tokens 2, 3, 4
    generated = [[9, 9, 1, 4]]
    shape.resolve(generated, set())
    assert len(shape.pending) == 1  # only 2 of 3 tokens known: not scored yet
    assert torch.equal(shape.expected_accepted()[1], prior)
    generated[0] += [5, 0]
    shape.resolve(generated, set())
    assert not shape.pending
    # a(k, w) = min(w, longest prefix any of the first k rows shares with 1, 4, 5): row 0 shares 1,
    # row 1 shares 3, row 2 none.
    a = torch.tensor([[1, 1, 1], [1, 2, 3], [1, 2, 3]], dtype=torch.float64)
    expected = (a + _PRIOR_WEIGHT * _PRIOR_ACCEPTED) / (1 + _PRIOR_WEIGHT)
    assert torch.allclose(shape.expected_accepted()[1], expected)
    assert torch.equal(shape.expected_accepted()[0], prior)  # other sources untouched
    # A request that finished early is scored on what it emitted: 6 matches row 2's first token only.
    shape.record([1], [0], torch.tensor([7]), rows)  # sources past the last share the last
    shape.resolve([[], [6]], {1})
    later = shape.expected_accepted()[2]
    assert (later[2] > _PRIOR_ACCEPTED).all() and (later[:2] < _PRIOR_ACCEPTED).all()
    # Expected acceptance moves the right way: full matches raise it, misses lower it.
    before = shape.expected_accepted()[1].clone()
    for _ in range(5):
        shape.record([0], [len(generated[0])], torch.tensor([1]), rows)
        generated[0] += [6, 7, 8]
        shape.resolve(generated, set())
    after = shape.expected_accepted()[1]
    assert after[2, 2] > before[2, 2] and after[0, 2] < before[0, 2]


# ---- 5. model n-grams ----

class _Embeddings(torch.nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.inputs = torch.nn.Embedding.from_pretrained(inputs)
        self.outputs = torch.nn.Linear(outputs.shape[1], outputs.shape[0], bias=False)
        self.outputs.weight.data.copy_(outputs)

    def get_input_embeddings(self):
        return self.inputs

    def get_output_embeddings(self):
        return self.outputs


def test_unigram_order():
    """d(x)^2 = (u_x - mean u)^T C (u_x - mean u), C = V^T V / |V| = diag(4.5, 0.5) here; centered
    outputs (1.25, -0.25), (0.25, 2.75), (0.25, -2.25), (-1.75, -0.25) give d^2 = 7.06, 4.06, 2.81,
    13.81: farthest first is 3, 0, 1, 2 (Euclidean order would be 1, 2, 3, 0; nearest first 2, 1, 0, 3)."""
    inputs = torch.tensor([[3.0, 0.0], [-3.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    outputs = torch.tensor([[1.0, 0.0], [0.0, 3.0], [0.0, -2.0], [-2.0, 0.0]])
    model = _Embeddings(inputs, outputs)
    assert model_ngrams.unigram(model, top=4).tolist() == [3, 0, 1, 2]
    assert model_ngrams.unigram(model, top=2).tolist() == [3, 0]
    assert model_ngrams.unigram(model, top=100).tolist() == [3, 0, 1, 2]  # distinct ids, at most V


def test_unigram_distinct_on_a_model():
    model = tiny_llama(layers=1, seed=2)
    top = model_ngrams.unigram(model, top=32)
    assert top.dtype == torch.int64 and len(set(top.tolist())) == 32
    assert all(0 <= t < BYTE_VOCAB for t in top.tolist())


# The bigram ranks in bfloat16 (model_ngrams docstring), so it is compared with the float32 logits up to
# bfloat16 rounding: its j-th token's logit must be within BF16_TOL of the j-th largest logit. The tiny
# models' logits are below 1 in magnitude; bfloat16 keeps 8 bits, ~0.004 each, summed over a few layers.
BF16_TOL = 0.02


def _next_logits(model, vocab: int, bos: int | None) -> torch.Tensor:
    ids = torch.arange(vocab)[:, None]
    if bos is not None:
        ids = torch.cat([torch.full_like(ids, bos), ids], dim=1)
    with torch.inference_mode():
        return model(input_ids=ids).logits[:, -1].float()


def _bigram_error(table: torch.Tensor, logits: torch.Tensor) -> float:
    top = logits.topk(table.shape[1], dim=-1).values
    return float((logits.gather(1, table.long()) - top).abs().max())


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_bigram_is_the_model_top_k(monkeypatch, tmp_path, bos):
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    vocab = BYTE_VOCAB + bos
    model, tok = tiny_llama(layers=2, seed=3, vocab=vocab), byte_tokenizer(bos=bos)
    table = model_ngrams.bigram(model, tok, top=6, chunk=100, progress=False)
    assert table.shape == (vocab, 6) and table.dtype == torch.int32
    assert all(len(set(row)) == 6 for row in table.tolist())
    # After BOS when the tokenizer adds one, else after nothing; a context with another first token
    # (no BOS, or <eos>) gives another table, and the check tells them apart.
    assert _bigram_error(table, _next_logits(model, vocab, BOS_ID if bos else None)) < BF16_TOL
    assert _bigram_error(table, _next_logits(model, vocab, None if bos else EOS_ID)) > 5 * BF16_TOL


def _count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_auto_tables_build_a_bigram_only_when_cached_or_quick(monkeypatch, tmp_path):
    """tables "auto": a tiny model's bigram is built at once (estimated well under a minute); where the
    estimate is over budget, the context alone drafts until the table is cached (then it is used)."""
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    tok = byte_tokenizer()
    model = tiny_llama(layers=1, seed=4)
    assert model_ngrams.bigram_ready(model, tok, 8)
    monkeypatch.setattr(model_ngrams, "BUILD_BUDGET_S", 0.0)
    assert not model_ngrams.bigram_ready(model, tok, 8)
    built = []
    real = model_ngrams.bigram
    monkeypatch.setattr(model_ngrams, "bigram", lambda *a, **k: built.append(1) or real(*a, **k))
    kwargs = dict(target=model, tokenizer=tok, method="ngram", max_new_tokens=6, num_draft_tokens=(2, 2))
    ar = specops.decode(PROMPTS[:2], target=model, tokenizer=tok, method="ar", max_new_tokens=6)
    assert specops.decode(PROMPTS[:2], **kwargs).tokens == ar.tokens
    assert not built and not list((tmp_path / "ngrams").glob("*.pt"))
    real(model, tok, top=8, progress=False)  # cached now: "auto" takes it
    assert model_ngrams.bigram_ready(model, tok, 8)
    assert specops.decode(PROMPTS[:2], **kwargs).tokens == ar.tokens
    assert built
    # Held in memory: known without hashing the weights again; after an in-place update, asked anew.
    monkeypatch.setattr(model_ngrams, "_fingerprint", lambda *a: pytest.fail("hashed the weights"))
    assert model_ngrams.bigram_ready(model, tok, 8)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)
    with pytest.raises(pytest.fail.Exception, match="hashed"):
        model_ngrams.bigram_ready(model, tok, 8)


def test_table_name_hashed_once_per_model_and_weights(monkeypatch, tmp_path):
    """Where the table is not cached and too slow to build, every ngram call asks again whether it is: the
    weights are hashed for its file name once per model object, again after an in-place update of a weight or
    a change of the configuration, and a table cached meanwhile under that name is found."""
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    monkeypatch.setattr(model_ngrams, "BUILD_BUDGET_S", 0.0)
    tok = byte_tokenizer()
    model = tiny_llama(layers=1, seed=4)
    hashed = []
    real = model_ngrams._fingerprint
    monkeypatch.setattr(model_ngrams, "_fingerprint", lambda *a: hashed.append(1) or real(*a))
    assert not model_ngrams.bigram_ready(model, tok, 8)
    assert not model_ngrams.bigram_ready(model, tok, 8)
    assert len(hashed) == 1
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)
    assert not model_ngrams.bigram_ready(model, tok, 8)
    assert len(hashed) == 2
    model.config.rms_norm_eps *= 2
    assert not model_ngrams.bigram_ready(model, tok, 8)
    assert len(hashed) == 3
    twin = copy.deepcopy(model)  # another object: its own name, the same file
    model_ngrams.bigram(twin, tok, top=8, progress=False)
    assert model_ngrams.bigram_ready(model, tok, 8) and len(hashed) == 4


def test_bigram_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    tok = byte_tokenizer()
    model = tiny_llama(layers=1, seed=4)
    calls = _count_forwards(model)
    first = model_ngrams.bigram(model, tok, top=4, progress=False)
    assert calls[0] > 0
    assert len(list((tmp_path / "ngrams").glob("*.pt"))) == 1
    made = calls[0]
    assert torch.equal(model_ngrams.bigram(model, tok, top=4, progress=False), first)
    assert calls[0] == made  # the same model object: not recomputed
    twin = tiny_llama(layers=1, seed=4)  # the same weights in another object: loaded from disk
    twin_calls = _count_forwards(twin)
    assert torch.equal(model_ngrams.bigram(twin, tok, top=4, progress=False), first)
    assert twin_calls[0] == 0
    model_ngrams.bigram(model, tok, top=5, progress=False)  # other settings: another table
    assert calls[0] > made and len(list((tmp_path / "ngrams").glob("*.pt"))) == 2
    made = calls[0]
    with torch.no_grad():
        model.lm_head.weight.neg_()  # reverses every ranking
    changed = model_ngrams.bigram(model, tok, top=4, progress=False)
    assert calls[0] > made, "new output weights, yet the cached table was used"
    assert not torch.equal(changed, first)
    assert not list((tmp_path / "ngrams").glob("*.partial"))
    assert not list((tmp_path / "ngrams").glob("*.checkpoint"))


def test_bigram_successors_kept_with_the_model(monkeypatch, tmp_path):
    """The extended bigram's successor table is computed once per model and settings: equal to successors() of
    the model's bigram, the same object on the next call, and decode calls after the first build none; its
    first columns serve narrower drafts (DraftTables slices it), so drafts equal those of a table built at
    their own width."""
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    tok = byte_tokenizer()
    model = tiny_llama(layers=1, seed=4)
    table = model_ngrams.bigram(model, tok, top=8, progress=False)
    deep = model_ngrams.bigram_successors(model, tok, 7, top=8)
    assert torch.equal(deep, model_ngrams.successors(table, 7))
    assert model_ngrams.bigram_successors(model, tok, 7, top=8) is deep
    prompts = [list(tok("abcab")["input_ids"]), list(tok("dd")["input_ids"])]
    for w in (1, 3, 8):
        built, sliced = _drafter(prompts, bigram=table), _drafter(prompts, bigram=table)
        sliced.tables.follow = deep
        for a, b in zip(built.propose(4, w), sliced.propose(4, w)):
            assert torch.equal(a, b)
    built = []
    real = model_ngrams.successors
    monkeypatch.setattr(model_ngrams, "successors", lambda *args: built.append(args) or real(*args))
    specops.decode(["abcab", "dd"], target=model, tokenizer=tok, method="ngram", max_new_tokens=6,
                   options={"tables": "bigram"})
    assert not built  # this model's table, kept from above
    fresh = tiny_llama(layers=1, seed=5)
    for _ in range(2):
        specops.decode(["abcab", "dd"], target=fresh, tokenizer=tok, method="ngram", max_new_tokens=6,
                       options={"tables": "bigram"})
    assert len(built) == 1


def _scaled_layer(model):
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(50.0)
    return model


def test_bigram_cache_key_covers_every_weight(monkeypatch, tmp_path):
    """The cache must not serve a table computed for other weights when only non-embedding weights
    differ (a model fine-tuned with frozen embeddings, e.g. LoRA on the attention layers): neither for
    another model object with such weights (the disk key), nor for the same object changed in place
    (the in-memory copy)."""
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    tok = byte_tokenizer()
    original = model_ngrams.bigram(tiny_llama(layers=1, seed=4), tok, top=4, progress=False)
    expected = model_ngrams.bigram(_scaled_layer(tiny_llama(layers=1, seed=4)), tok, top=4, progress=False,
                                   cache=False)
    assert not torch.equal(expected, original)  # the model's bigram did change
    other = _scaled_layer(tiny_llama(layers=1, seed=4))
    other_object = model_ngrams.bigram(other, tok, top=4, progress=False)
    model = tiny_llama(layers=1, seed=4)
    model_ngrams.bigram(model, tok, top=4, progress=False)
    in_place = model_ngrams.bigram(_scaled_layer(model), tok, top=4, progress=False)
    assert torch.equal(other_object, expected), "the disk cache returned the table of other weights"
    assert torch.equal(in_place, expected), "the in-memory cache returned the table of other weights"


def test_bigram_cache_key_ignores_where_the_model_was_loaded(monkeypatch):
    """One table serves the same weights loaded from another folder or under another transformers version
    (a config written out records the version: a key that held it built a 10-minute table per environment),
    and a config entry that changes what the model computes still changes the key."""
    import transformers.configuration_utils as configuration_utils

    first, second = tiny_llama(layers=1, seed=4), tiny_llama(layers=1, seed=4)
    key = model_ngrams._fingerprint(first, None, 8)
    second.config._name_or_path = "/somewhere/else"
    monkeypatch.setattr(configuration_utils, "__version__", "0.0.1")
    assert '"0.0.1"' in second.config.to_json_string()  # the version a config is written out with
    assert model_ngrams._fingerprint(second, None, 8) == key
    second.config.rope_theta = float(getattr(first.config, "rope_theta", 10000.0) or 10000.0) * 2
    second.config.rms_norm_eps = first.config.rms_norm_eps * 2
    assert model_ngrams._fingerprint(first, None, 8) != model_ngrams._fingerprint(second, None, 8)
    assert model_ngrams._fingerprint(first, None, 8) != model_ngrams._fingerprint(first, 1, 8)


@pytest.mark.parametrize("tables", ["bigram", "unigram"])
def test_ngram_tables_for_model_built_in_inference_mode(monkeypatch, tmp_path, tables):
    """A model created under torch.inference_mode (its weights are inference tensors, which have no
    version counter) decodes with "ar"; it must decode with "ngram" too."""
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    tok = byte_tokenizer()
    with torch.inference_mode():
        model = tiny_llama(layers=1, seed=8)
    ar = specops.decode(PROMPTS[:2], target=model, tokenizer=tok, method="ar", max_new_tokens=6)
    result = specops.decode(PROMPTS[:2], target=model, tokenizer=tok, method="ngram", max_new_tokens=6,
                            options={"tables": tables})
    assert result.tokens == ar.tokens


def test_bigram_small_vocabulary(monkeypatch, tmp_path):
    """decode() asks for max(8, k) bigram entries per token; a vocabulary smaller than that must still
    work (at most V distinct next tokens exist), not fail inside torch.topk."""
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    tok = letter_tokenizer()  # 5 tokens
    model = tiny_llama(layers=1, seed=4, vocab=len(tok))
    result = specops.decode(["abcab", "dd"], target=model, tokenizer=tok, method="ngram", max_new_tokens=6)
    ar = specops.decode(["abcab", "dd"], target=model, tokenizer=tok, method="ar", max_new_tokens=6)
    assert result.tokens == ar.tokens


def test_extend():
    table = torch.tensor([[1, 0], [2, 0], [0, 1], [5, 0], [4, 0], [3, 0]], dtype=torch.int32)
    first = torch.tensor([[0, -1], [3, 2]])
    follow = model_ngrams.successors(table, 3)
    assert follow.dtype == torch.int64 and follow.tolist()[:3] == [[1, 2, 0], [2, 0, 1], [0, 1, 2]]
    out = model_ngrams.extend(first, follow)
    assert out.dtype == torch.int64
    assert out.tolist() == [[[0, 1, 2, 0], [-1, -1, -1, -1]], [[3, 5, 3, 5], [2, 0, 1, 2]]]
    assert model_ngrams.extend(first, model_ngrams.successors(table, 0)).tolist() == [[[0], [-1]], [[3], [2]]]


def _drafter(prompts: list[list[int]], bigram=None, unigram=None, max_new_tokens: int = 8) -> NgramDrafter:
    batch = SimpleNamespace(prompt_rows=prompts, rows=len(prompts), max_new_tokens=max_new_tokens)
    return NgramDrafter(batch, bigram, unigram, torch.device("cpu"))


def test_ngram_drafter_rows():
    """Context matches first (a match cut off by the end of the context continues with the bigram's
    top-1), then the extended bigram from its top entry on; -1 where nothing is left."""
    bigram = torch.tensor([[1, 2], [2, 0], [3, 1], [1, 0]], dtype=torch.int32)  # V = 4, top1 = 1, 2, 3, 1
    prompts = [[1, 2, 3, 1, 2], [3, 0, 3]]
    drafter = _drafter(prompts, bigram)
    rows, source, share = drafter.propose(3, 4)
    # Request 0: "1 2" occurred before, followed by 3 1 2 | end -> 3 1 2 then top1(2) = 3; then the
    # bigram after 2 (3, 1), extended: 3 1 2 3 and 1 2 3 1.
    # Request 1: "3" occurred before, followed by 0 3 | end -> 0 3 1 2; then 1 2 3 1 and 0 1 2 3.
    assert rows.tolist() == [[[3, 1, 2, 3], [3, 1, 2, 3], [1, 2, 3, 1]],
                             [[0, 3, 1, 2], [1, 2, 3, 1], [0, 1, 2, 3]]]
    assert source.tolist() == [2, 1]  # the length of the context match
    assert share.tolist() == [1.0, 1.0]  # each match was followed one way only
    # Without model n-grams, only the context rows; with the unigram, one-token rows after them.
    rows, _, _ = _drafter(prompts).propose(3, 4)
    assert rows.tolist() == [[[3, 1, 2, -1]] + [[-1] * 4] * 2, [[0, 3, -1, -1]] + [[-1] * 4] * 2]
    rows, _, _ = _drafter(prompts, unigram=torch.tensor([2, 0])).propose(3, 4)
    assert rows[0].tolist() == [[3, 1, 2, -1], [2, -1, -1, -1], [0, -1, -1, -1]]
    # No context match at all: the bigram rows, source 0.
    rows, source, _ = _drafter([[0, 1, 2, 3]], bigram).propose(2, 2)
    assert rows.tolist() == [[[1, 2], [0, 1]]] and source.tolist() == [0]
    # The contexts grow with what is emitted, ragged across requests (on the CPU through NumPy, elsewhere
    # through tensor operations: both the same).
    on_device = _drafter(prompts, bigram)
    for new in ([[3], [1, 0]], [[], [2]], [[0, 1, 2], [3]]):
        drafter.extend_contexts(new)
        on_device._extend_on_device(new)
    assert drafter.lengths.tolist() == [9, 7]
    assert drafter.contexts[1, :7].tolist() == [3, 0, 3, 1, 0, 2, 3]
    assert drafter.contexts[0, :9].tolist() == [1, 2, 3, 1, 2, 3, 0, 1, 2]
    assert torch.equal(on_device.contexts, drafter.contexts) and torch.equal(on_device.lengths, drafter.lengths)


# ---- 6. bad input ----

@pytest.fixture(scope="module")
def llama(targets):
    return targets["llama"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(drafter="self:2"), "method 'ngram' does not use a drafter"),
    (dict(options={"tables": "trigram"}), "option 'tables' of method ngram must be one of auto, bigram, unigram, none, got 'trigram'"),
    (dict(options={"tables": None}), "option 'tables' of method ngram must be one of"),
    (dict(options={"scheme": "block"}), "option 'scheme' must be one of auto, positional, token, joint, got 'block' "
                                        r"\('block' is the op's name: the option says 'joint'\)"),
    (dict(num_draft_tokens=0), "num_draft_tokens for method 'ngram' must be 'auto', an int w >= 1"),
    (dict(num_draft_tokens=(0, 3)), "num_draft_tokens for method 'ngram'"),
    (dict(num_draft_tokens=(2, 2, 2)), "num_draft_tokens for method 'ngram'"),
    (dict(num_draft_tokens="x"), "num_draft_tokens for method 'ngram'"),
    (dict(num_draft_tokens=1.5), "num_draft_tokens for method 'ngram'"),
])
def test_bad_arguments(llama, kwargs, match):
    model, tok = llama
    with pytest.raises(ValueError, match=match):
        specops.decode("hi", target=model, tokenizer=tok, method="ngram", max_new_tokens=2, **kwargs)


def test_drafter_model_rejected(llama):
    model, tok = llama
    with pytest.raises(ValueError, match="method 'ngram' does not use a drafter"):
        specops.decode("hi", target=model, tokenizer=tok, drafter=model, drafter_tokenizer=tok,
                       method="ngram", max_new_tokens=2)


def test_tuple_shape_only_for_ngram(llama):
    model, tok = llama
    with pytest.raises(ValueError, match="num_draft_tokens must be 'auto' or an int >= 1"):
        specops.decode("hi", target=model, tokenizer=tok, drafter="self:2", max_new_tokens=2,
                       num_draft_tokens=(2, 2))


@pytest.mark.parametrize("scheme", ["recursive", "traversal"])
def test_sampled_tree_accepts_the_longest_emitted_prefix_it_holds(scheme):
    """Why DraftShape scores a sampled step as it scores a greedy one: with deterministic rows (one-hot q),
    tree_verify accepts a child exactly when the token emitted at its parent is that child, so the drafts
    accepted are always the longest prefix of the emitted tokens that is a path of the tree (checked on
    every one of 2,000 sampled verifications, not on average), under both schemes (traversal keeps a node
    only once all its children were removed, and its residual no longer holds their tokens)."""
    gen = torch.Generator().manual_seed(3)
    vocab, nodes, batch = 5, 9, 2000
    # one tree per request: node n's parent is random among earlier nodes, tokens distinct among siblings
    parents = torch.zeros(batch, nodes, dtype=torch.int64)
    tokens = torch.zeros(batch, nodes, dtype=torch.int64)
    for b in range(batch):
        for n in range(1, nodes):
            parent = int(torch.randint(0, n, (), generator=gen))
            taken = {int(tokens[b, m]) for m in range(1, n) if int(parents[b, m]) == parent}
            free = [t for t in range(vocab) if t not in taken]
            if not free:
                parent, free = 0, [t for t in range(vocab)]
            parents[b, n] = parent
            tokens[b, n] = free[int(torch.randint(0, len(free), (), generator=gen))]
    logits = torch.randn(batch, nodes, vocab, generator=gen) * 2
    out, _, accepted = specops.ops.tree_verify(logits, tokens, parents, None, seed=5, scheme=scheme)
    for b in range(batch):
        node, held = 0, 0
        for token in out[b].tolist():
            kids = [n for n in range(1, nodes) if int(parents[b, n]) == node and int(tokens[b, n]) == token]
            if token < 0 or not kids:
                break
            node, held = kids[0], held + 1
        assert held == int(accepted[b])


def test_draft_shape_counts_drafts_of_requests_ahead_for_less():
    """Learned: every first draft token is accepted; a step of 8 requests with one draft each costs 1.75
    plain steps. With every request as far from its end as the others (or no leads given), one draft each
    pays (8 + 7.8 tokens for 1.75 steps' time) and it drafts; with 7 of the 8 ahead of the one with the most
    tokens left, their drafts count _AHEAD_WORTH (the call ends when that one does) and plain decoding wins.
    `shapes` (the memory's per-request shapes) counts them whole."""
    for method in ("choose", "shapes"):
        shape = DraftShape("auto", _ModelKey(), "cpu", k_max=1, w_max=1, sources=2)
        rows = _distinct_rows(8, 1, 1)
        source = torch.ones(8, dtype=torch.long)
        for _ in range(60):
            shape.score([rows[0]], [1], [rows[0, 0].tolist()])
        for _ in range(10):
            shape.observe_cost(8, 8, 0.040)
            shape.observe_cost(8, 16, 0.070)

        def drafts(lead) -> int:  # requests that draft this step
            if method == "shapes":
                return int((shape.shapes(rows, source) != 0).any(-1).sum())
            return 8 * shape.choose(rows, source, lead)[0]

        assert drafts(None) == 8 and drafts(torch.zeros(8, dtype=torch.long)) == 8
        ahead = drafts(torch.tensor([0, 3, 3, 2, 5, 1, 1, 4]))
        assert ahead == (8 if method == "shapes" else 0), method
