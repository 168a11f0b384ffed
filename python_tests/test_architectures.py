"""The architecture matrix: `specops.decode` on every decoder-only architecture of arch_zoo.py, for every
method, against the model's own `generate()`; nothing downloads.

For each architecture x method:

1. Greedy exactness: greedy `decode` of a ragged batch (PROMPTS: 5, 18 and 31 bytes, with repeated
   substrings so that context n-grams propose drafts) equals, row for row and token for token,
   `model.generate(do_sample=False)` on that prompt ALONE (no padding), cut to its new tokens and ended
   at the first EOS, inclusive (decode stops a row at EOS and keeps it; generate pads after it only in
   a batch).
2. A sampled run (temperature 1, seed 0) runs, gives every row MAX_NEW tokens or ends it at EOS, emits
   only ids of the target's vocabulary, and gives the same tokens again with the same seed.
3. EXPECTED_REFUSALS: combinations decode must refuse. There decode raises ValueError naming the model's
   class (type(model).__name__) before anything is decoded: the `stream` callback is never called.

Methods: "ar"; "sd" with drafter "self:1" (the target's first layer) and num_draft_tokens 3 or "auto",
and with the target itself as its drafter ("sd-same": every draft accepted, the bonus-token path);
"ngram" with options={"tables": "none"} and num_draft_tokens (2, 3) (two rows of three tokens: a small draft
tree, whose forwards must attend through specops.ops.tree_attention, but on DENSE_TREES); "rsd-c",
"rsd-s" and "specinfer" with drafter "self:1" and branching (2, 2) (drafter and target both score
trees); "tli" and "slem" on PAIRS of
architectures with different tokenizers (a byte-level target and a drafter with multi-byte tokens of
another architecture, and the reverse). Random models of different
architectures almost never agree, so those pairs test the rejection path only (at most 1 of 80 to 420
drafts accepted); "twin" pairs add a drafter of the target's own architecture and weights over the other
vocabulary (`twin`). It still reads the prompts in its own tokens, so it agrees with the target only now
and then (0 to 18% of drafts accepted, mostly about 5%), enough for accepted drafts followed by rejections
in one step.

A further check, about the models rather than specops: `generate` on the left-padded batch equals
`generate` on each prompt alone (where it does not, batched-versus-alone differences are the model's
own numerics); architectures known to differ are in PADDED_GENERATE_DIFFERS.

Every test has a time limit (TIME_LIMIT seconds, SIGALRM): an engine that loops fails instead of hanging.
The module runs torch on one thread (see `_one_thread`).
"""

from __future__ import annotations

import signal

import pytest
import torch

import specops
from arch_zoo import ARCHITECTURES
from specops.decoding.probe import tree_support
from specops.decoding.engine import CausalLM
from toy_models import EOS_ID, PAD_ID, TRANSFORMERS, byte_tokenizer, merged_byte_tokenizer

# (architecture or pair id, method) -> why decode must refuse it. Pair ids are "target+drafter" (see
# PAIRS); the method is a decode method ("sd": every sd case) or one of the METHODS ids ("sd-k3": that case
# only). Chains work on every architecture (the cache is compacted, so each forward is what generate()
# does with a left-padded batch); draft trees (ngram) need attention that goes through transformers'
# attention registry in every layer (specops/decoding/tree_forward.py), which these architectures bypass.
_OWN_ATTENTION = {
    "gpt_neo": "local attention from its own slot-indexed buffer",
    "bloom": "ALiBi built from the 2-D mask's running count",
    "falcon_alibi": "ALiBi built from the 2-D mask's running count",
    "mpt": "ALiBi built from slot indices",
    "falcon": "its own attention module",
    "xglm": "its own attention module",
}
if TRANSFORMERS < (5, 24):  # transformers 5.24 moved GPT-J and CodeGen onto its attention registry
    _OWN_ATTENTION.update({"gptj": "its own attention module", "codegen": "its own attention module"})
EXPECTED_REFUSALS: dict[tuple[str, str], str] = {
    (arch, method): f"draft trees: {why}, outside transformers' attention registry"
    for arch, why in _OWN_ATTENTION.items() for method in ("ngram", "rsd-c", "rsd-s", "specinfer")}

# Architectures whose tree forwards take the model's own attention with a dense mask instead of
# specops.ops.tree_attention (the probe finds the kernel's logits differ), and why.
DENSE_TREES: dict[str, str] = {}
if TRANSFORMERS < (5, 21):  # 5.21 made Gemma-2 refuse SDPA
    DENSE_TREES["gemma2"] = ("its default SDPA attention drops the attention soft-cap the config sets, "
                             "which tree_attention applies")

# Architectures whose own generate() gives other greedy tokens for a prompt in a left-padded batch than
# for the prompt alone (see test_generate_padded_equals_alone).
PADDED_GENERATE_DIFFERS: dict[str, str] = {}

# Ragged: 5, 18 and 31 bytes; repeated substrings, so context n-grams match from the first step.
PROMPTS = ["abcab", "the cat; the cat; ", "Hello hello, Hello hello, Hello"]
MAX_NEW = 20
TIME_LIMIT = 60  # seconds per test

# Multi-byte tokens of the drafter (or target) with another vocabulary, in the byte-level alphabet
# ("Ġ" is a space); every prefix of 2 bytes or more becomes a token.
MERGED_WORDS = ["Ġthe", "Ġcat", "Ġhello", "Hello", "abc", "ab", "ca", "ll", "lo", "he", "Ġt"]

# Same-vocabulary methods: id -> decode keyword arguments.
METHODS = {
    "ar": dict(method="ar"),
    "sd-k3": dict(method="sd", drafter="self:1", num_draft_tokens=3),
    "sd-auto": dict(method="sd", drafter="self:1", num_draft_tokens="auto"),
    "sd-same": dict(method="sd", drafter="same", num_draft_tokens=3),  # the target object drafts for itself
    "ngram": dict(method="ngram", options={"tables": "none"}, num_draft_tokens=(2, 3)),
    "rsd-c": dict(method="rsd-c", drafter="self:1", num_draft_tokens=(2, 2)),
    "rsd-s": dict(method="rsd-s", drafter="self:1", num_draft_tokens=(2, 2)),
    "specinfer": dict(method="specinfer", drafter="self:1", num_draft_tokens=(2, 2)),
}
# Sampled runs need a fixed draft length: with "auto" the draft lengths follow measured timings, and
# with them which random numbers each token uses.
SAMPLED_METHODS = ["ar", "sd-k3", "sd-same", "ngram", "rsd-c", "rsd-s", "specinfer"]
# Methods that draft on every step (a fixed draft length): a run must have drafted something.
ALWAYS_DRAFTS = ("sd-k3", "sd-same", "ngram", "rsd-c", "rsd-s", "specinfer")

# Drafter-with-another-vocabulary pairs: id -> (target architecture, target tokenizer, drafter
# architecture, drafter tokenizer); "byte" is byte_tokenizer(), "merged" merged_byte_tokenizer();
# drafter architecture "twin": the target's architecture and weights over the drafter tokenizer's
# vocabulary (see `twin`).
PAIRS = {
    "mistral+llama": ("mistral", "byte", "llama", "merged"),
    "gemma2+gpt_neox": ("gemma2", "byte", "gpt_neox", "merged"),
    "gpt2+qwen3": ("gpt2", "byte", "qwen3", "merged"),
    "bloom+gemma3": ("bloom", "byte", "gemma3", "merged"),
    "gpt_neo+phi": ("gpt_neo", "byte", "phi", "merged"),
    "gpt_oss+falcon": ("gpt_oss", "byte", "falcon", "merged"),
    # the reverse: a target with multi-byte tokens, a byte-level drafter
    "llama+mistral": ("llama", "merged", "mistral", "byte"),
    "qwen2_sliding+opt": ("qwen2_sliding", "merged", "opt", "byte"),
    # twins: some drafts accepted, on targets whose caches are hardest to keep exact
    "mistral+twin": ("mistral", "byte", "twin", "merged"),
    "gpt_neo+twin": ("gpt_neo", "byte", "twin", "merged"),
    "mpt+twin": ("mpt", "byte", "twin", "merged"),
    "gemma2+twin": ("gemma2", "byte", "twin", "merged"),
    "gpt_oss+twin": ("gpt_oss", "merged", "twin", "byte"),
}
# Pair methods and their num_draft_tokens: "rsd-s" draws trees across the vocabularies (the intersection),
# so both models of the pair must take trees.
PAIR_METHODS = {"tli": 3, "slem": 3, "rsd-s": (2, 2)}
EXPECTED_REFUSALS.update({
    (pair_id, "rsd-s"): f"draft trees: {_OWN_ATTENTION[arch]}, outside transformers' attention registry"
    for pair_id, (target, _, drafter, _) in PAIRS.items()
    for arch in (target, target if drafter == "twin" else drafter) if arch in _OWN_ATTENTION})


# ---- one thread, and a time limit per test ----

@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two threads per
    process oversubscribe it: the file took 625 s with torch's default 2 threads next to other test runs,
    78 s with 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _time_limit():
    def expired(signum, frame):
        raise TimeoutError(f"too slow: over {TIME_LIMIT} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TIME_LIMIT)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# ---- models, tokenizers and generate() references, built once per module ----

@pytest.fixture(scope="module")
def tokenizers():
    return {"byte": byte_tokenizer(), "merged": merged_byte_tokenizer(MERGED_WORDS)}


def _favour_merged(model, byte_vocab: int):
    """Double the LM-head rows of the multi-byte tokens, so a model over the merged vocabulary emits them
    often and the vocabulary crossings are exercised (random weights alone rarely pick them)."""
    with torch.no_grad():
        model.get_output_embeddings().weight[byte_vocab:] *= 2
    return model


def twin(model, name: str, vocab: int, seed: int = 1):
    """A model of architecture `name` over `vocab` tokens with `model`'s weights: every tensor copied, those
    with a vocabulary dimension (embeddings, LM head and its bias) up to the smaller vocabulary; rows of
    tokens `model` lacks keep their random initialisation. Tokens shared by the two tokenizers have the
    same ids (the byte tokens 0..BYTE_VOCAB-1), so the twin proposes what the target would, except where
    its extra tokens win or the target's extra tokens are missing."""
    other = ARCHITECTURES[name](vocab=vocab, seed=seed)
    old_vocab = model.get_output_embeddings().weight.shape[0]
    source = model.state_dict()
    with torch.no_grad():
        for key, tensor in other.state_dict().items():
            weight = source[key]
            if weight.shape == tensor.shape:
                tensor.copy_(weight)
            elif weight.shape[1:] == tensor.shape[1:] and {weight.shape[0], tensor.shape[0]} == {old_vocab, vocab}:
                rows = min(old_vocab, vocab)
                tensor[:rows] = weight[:rows]
            else:
                raise AssertionError(f"twin of {name}: cannot map {key} {tuple(weight.shape)} -> {tuple(tensor.shape)}")
    return other


class Zoo:
    """Models by (architecture, tokenizer kind), built on first use, and their generate() references."""

    def __init__(self, tokenizers):
        self.tokenizers = tokenizers
        self.models = {}
        self.references = {}

    def model(self, name: str, kind: str = "byte", seed: int = 0):
        key = (name, kind, seed)
        if key not in self.models:
            vocab = len(self.tokenizers[kind])
            model = ARCHITECTURES[name](vocab=vocab, seed=seed)
            if kind == "merged":
                model = _favour_merged(model, len(self.tokenizers["byte"]))
            self.models[key] = model
        return self.models[key]

    def twin(self, name: str, kind: str, twin_kind: str):
        """The twin (see `twin`) of model (name, kind) over the vocabulary of tokenizer `twin_kind`."""
        key = (name, kind, "twin", twin_kind)
        if key not in self.models:
            self.models[key] = twin(self.model(name, kind), name, len(self.tokenizers[twin_kind]))
        return self.models[key]

    def reference(self, name: str, kind: str = "byte", seed: int = 0) -> list[list[int]]:
        """Greedy new tokens of every prompt, each generated alone, ended at the first EOS (inclusive)."""
        key = (name, kind, seed)
        if key not in self.references:
            model, tok = self.model(name, kind, seed), self.tokenizers[kind]
            self.references[key] = [_generate_alone(model, tok, prompt) for prompt in PROMPTS]
        return self.references[key]


def _cut_at_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def _generate(model, input_ids, attention_mask) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                              max_new_tokens=MAX_NEW, pad_token_id=PAD_ID, eos_token_id=EOS_ID)


def _generate_alone(model, tok, prompt: str) -> list[int]:
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = _generate(model, ids, torch.ones_like(ids))
    return _cut_at_eos(out[0, ids.shape[1]:].tolist())


@pytest.fixture(scope="module")
def zoo(tokenizers):
    return Zoo(tokenizers)


# ---- helpers ----

def _compare(result_tokens: list[list[int]], reference: list[list[int]]) -> str | None:
    """None when equal, else a description of the first row that differs."""
    assert len(result_tokens) == len(reference)
    for row, (got, want) in enumerate(zip(result_tokens, reference)):
        if got != want:
            at = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            return (f"row {row} ({len(PROMPTS[row])}-byte prompt {PROMPTS[row]!r}) differs from generate() "
                    f"from new token {at}: decode {got} vs generate {want}")
    return None


def _decode_kwargs(method_id: str, model, tok) -> dict:
    kwargs = dict(METHODS[method_id])
    if kwargs.get("drafter") == "same":
        kwargs.update(drafter=model, drafter_tokenizer=tok)
    return kwargs


def _refusal(name: str, method_id: str):
    """The EXPECTED_REFUSALS key that covers (name, method_id), or None."""
    for key in ((name, method_id), (name, method_id.split("-")[0])):
        if key in EXPECTED_REFUSALS:
            return key
    return None


def _assert_refused(call, refusal_key, class_names: list[str]):
    """decode(...) must raise ValueError naming one of `class_names`, before streaming anything."""
    streamed = []
    with pytest.raises(ValueError) as info:
        call(stream=lambda index, text: streamed.append((index, text)))
    message = str(info.value)
    assert any(name in message for name in class_names), (
        f"{refusal_key}: the ValueError does not name {' or '.join(class_names)}: {message!r}")
    assert not streamed, f"{refusal_key}: text was streamed before the refusal: {streamed}"


def _check_sampled(first, second, vocab: int):
    for row, tokens in enumerate(first.tokens):
        assert all(0 <= t < vocab for t in tokens), f"row {row}: ids outside the vocabulary: {tokens}"
        assert len(tokens) == MAX_NEW or (0 < len(tokens) <= MAX_NEW and tokens[-1] == EOS_ID), (
            f"row {row}: {len(tokens)} tokens, not {MAX_NEW} and not ended at EOS: {tokens}")
        assert EOS_ID not in tokens[:-1], f"row {row}: tokens after EOS: {tokens}"
    assert first.tokens == second.tokens, "the same seed gave different tokens"


# ---- 1. greedy exactness, same-vocabulary methods ----

ARCH_NAMES = list(ARCHITECTURES)


@pytest.mark.slow
@pytest.mark.parametrize("method_id", list(METHODS))
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_greedy_equals_generate(zoo, tokenizers, arch, method_id):
    model, tok = zoo.model(arch), tokenizers["byte"]

    def call(**extra):
        return specops.decode(PROMPTS, target=model, tokenizer=tok, max_new_tokens=MAX_NEW, temperature=0.0,
                              **_decode_kwargs(method_id, model, tok), **extra)

    key = _refusal(arch, method_id)
    if key is not None:
        _assert_refused(call, key, [type(model).__name__])
        return
    result = call()
    mismatch = _compare(result.tokens, zoo.reference(arch))
    assert mismatch is None, f"{arch} ({type(model).__name__}), {method_id}: {mismatch}"
    if method_id in ALWAYS_DRAFTS:
        assert result.stats.drafted > 0, f"{arch}, {method_id}: nothing was drafted"
    if method_id in ("ngram", "rsd-c"):  # its tree forwards attended through specops.ops.tree_attention
        lm = CausalLM(model)
        assert tree_support(lm, list(range(3, 40))) is None, arch
        assert lm.tree_kernel == (arch not in DENSE_TREES), arch


# ---- 2. sampled runs, same-vocabulary methods ----

@pytest.mark.slow
@pytest.mark.parametrize("method_id", SAMPLED_METHODS)
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_sampled_runs(zoo, tokenizers, arch, method_id):
    model, tok = zoo.model(arch), tokenizers["byte"]

    def call(**extra):
        return specops.decode(PROMPTS, target=model, tokenizer=tok, max_new_tokens=MAX_NEW, temperature=1.0,
                              seed=0, **_decode_kwargs(method_id, model, tok), **extra)

    key = _refusal(arch, method_id)
    if key is not None:
        _assert_refused(call, key, [type(model).__name__])
        return
    first = call()
    _check_sampled(first, call(), len(tok))
    # With a seed, every method here verifies by matching the target's positional tokens (scheme "auto"):
    # its text is sampled ar's on every architecture it accepts.
    if method_id != "ar":
        if arch not in _sampled_ar:
            _sampled_ar[arch] = specops.decode(PROMPTS, target=model, tokenizer=tok, max_new_tokens=MAX_NEW,
                                               temperature=1.0, seed=0, method="ar").tokens
        assert first.tokens == _sampled_ar[arch], "sampled text differs from sampled ar's with the same seed"


_sampled_ar: dict[str, list[list[int]]] = {}


# ---- 3. drafters with another vocabulary: tli and slem on pairs of architectures ----

def _pair(zoo, pair_id: str):
    target_arch, target_kind, drafter_arch, drafter_kind = PAIRS[pair_id]
    target = zoo.model(target_arch, target_kind)
    if drafter_arch == "twin":
        drafter = zoo.twin(target_arch, target_kind, drafter_kind)
    else:
        drafter = zoo.model(drafter_arch, drafter_kind, seed=1)
    return target, zoo.tokenizers[target_kind], drafter, zoo.tokenizers[drafter_kind]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(PAIR_METHODS))
@pytest.mark.parametrize("pair_id", list(PAIRS))
def test_greedy_pair_equals_generate(zoo, pair_id, method):
    target, target_tok, drafter, drafter_tok = _pair(zoo, pair_id)

    def call(**extra):
        return specops.decode(PROMPTS, target=target, tokenizer=target_tok, drafter=drafter,
                              drafter_tokenizer=drafter_tok, method=method, max_new_tokens=MAX_NEW,
                              temperature=0.0, num_draft_tokens=PAIR_METHODS[method], **extra)

    key = _refusal(pair_id, method)
    if key is not None:
        _assert_refused(call, key, [type(target).__name__, type(drafter).__name__])
        return
    result = call()
    target_arch, target_kind = PAIRS[pair_id][:2]
    mismatch = _compare(result.tokens, zoo.reference(target_arch, target_kind))
    assert mismatch is None, (f"{pair_id} ({type(target).__name__} + {type(drafter).__name__}), {method}: "
                              f"{mismatch}")
    assert result.stats.drafted > 0, f"{pair_id}, {method}: nothing was drafted"


@pytest.mark.slow
@pytest.mark.parametrize("method", list(PAIR_METHODS))
@pytest.mark.parametrize("pair_id", list(PAIRS))
def test_sampled_pair_runs(zoo, pair_id, method):
    target, target_tok, drafter, drafter_tok = _pair(zoo, pair_id)

    def call(**extra):
        return specops.decode(PROMPTS, target=target, tokenizer=target_tok, drafter=drafter,
                              drafter_tokenizer=drafter_tok, method=method, max_new_tokens=MAX_NEW,
                              temperature=1.0, seed=0, num_draft_tokens=PAIR_METHODS[method], **extra)

    key = _refusal(pair_id, method)
    if key is not None:
        _assert_refused(call, key, [type(target).__name__, type(drafter).__name__])
        return
    _check_sampled(call(), call(), len(target_tok))


# ---- 4. the models themselves ----

@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_zoo_model(zoo, tokenizers, arch):
    """The zoo's promises: float32, eval mode, the byte vocabulary, pad 0 / eos 1, a window (where there is
    one) that the prompts plus generation cross, and generate() on one prompt alone works."""
    model = zoo.model(arch)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.get_output_embeddings().weight.shape[0] == len(tokenizers["byte"])
    assert (model.config.pad_token_id, model.config.eos_token_id) == (PAD_ID, EOS_ID)
    window = getattr(model.config, "sliding_window", None) or getattr(model.config, "window_size", None)
    if window:
        assert window < len(PROMPTS[1]) + MAX_NEW
    reference = zoo.reference(arch)
    assert all(len(tokens) > 0 for tokens in reference)



@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_generate_padded_equals_alone(zoo, tokenizers, arch):
    """Not a specops test: whether the model's own generate() is batch-invariant under left padding. Where
    it is not (PADDED_GENERATE_DIFFERS), a batched-versus-alone difference is the model's numerics."""
    if arch in PADDED_GENERATE_DIFFERS:
        pytest.xfail(PADDED_GENERATE_DIFFERS[arch])
    model, tok = zoo.model(arch), tokenizers["byte"]
    encoded = tok(PROMPTS, padding=True, return_tensors="pt")  # byte_tokenizer pads on the left
    out = _generate(model, encoded["input_ids"], encoded["attention_mask"])
    width = encoded["input_ids"].shape[1]
    batched = [_cut_at_eos(row[width:].tolist()) for row in out]
    mismatch = _compare(batched, zoo.reference(arch))
    assert mismatch is None, f"{arch} ({type(model).__name__}): left-padded generate(): {mismatch}"
