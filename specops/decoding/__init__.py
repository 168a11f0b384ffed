"""`specops.decode`: the front door to every decoding method, on one shared engine (engine.py).

Methods: "ar" (autoregressive, the baseline), "sd" (standard speculative decoding with a
same-vocabulary drafter), "tli", "union", "slem" and "slrs" (a drafter with another vocabulary,
paper 000) and "ngram" (learning-free drafts from the context and the model's own n-grams, no
drafter). "auto" picks "sd" for a drafter with the target's vocabulary, "tli" (sampling) or "slem"
(greedy) for one with another vocabulary, else "ar".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specops import vocab as vocab_maps
from specops.decoding import model_ngrams, tli
from specops.decoding.ar import decode_ar
from specops.decoding.draft_length import DraftLength
from specops.decoding.draft_shape import DraftShape
from specops.decoding.engine import Batch, CausalLM, SamplingParams, Stats
from specops.decoding.ngram import NgramDrafter, decode_ngram
from specops.decoding.sd import decode_sd
from specops.decoding.self_draft import truncated
from specops.decoding.slem import decode_slem
from specops.decoding.slrs import decode_slrs

__all__ = ["decode", "DecodeResult", "METHODS"]

METHODS = ("auto", "ar", "sd", "tli", "union", "slem", "slrs", "ngram")
_DRAFTER_METHODS = ("sd", "tli", "union", "slem", "slrs")
NGRAM_TABLES = ("bigram", "unigram", "none")


@dataclass
class DecodeResult:
    """text: the generated text (a str for a str prompt, else a list); tokens: generated token ids per
    prompt (same shape rule); stats: `Stats` (counts, tokens per second, time split)."""

    text: str | list[str]
    tokens: list[int] | list[list[int]]
    stats: Stats


def _resolve_model(model, tokenizer, role: str):
    if isinstance(model, str):
        from specops import models

        loaded, loaded_tokenizer = models.load(model)
        return loaded, tokenizer or loaded_tokenizer
    if tokenizer is None:
        raise ValueError(f"decode: {role} is a model object, so its tokenizer must be given "
                         f"({'tokenizer' if role == 'target' else 'drafter_tokenizer'}=...)")
    return model, tokenizer


def _same_vocabulary(tokenizer, other) -> bool:
    # get_vocab() of a 262,144-token vocabulary takes a fifth of a second: compare sizes first.
    return tokenizer is other or (len(tokenizer) == len(other) and tokenizer.get_vocab() == other.get_vocab())


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple, set)) else [value])
    return {int(i) for i in ids}


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"decode: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"decode: temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"decode: top_k must be an int >= 0, got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"decode: top_p must be in (0, 1], got {top_p!r}")


def decode(prompt, *, target, drafter=None, method: str = "auto", tokenizer=None, drafter_tokenizer=None,
           max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           num_draft_tokens="auto", seed: int | None = None, stop=None, stream=None,
           ngram_tables: str = "bigram", slrs_max_nodes: int = 256) -> DecodeResult:
    """Generate continuations of `prompt` (a string, or a list of strings decoded as one batch).

    target / drafter: a transformers causal LM, or an embedded model name ("gemma-3-270m",
    "smollm2-135m"); the drafter may also be "self:N", the target's first N layers. method: "auto"
    (with a drafter: sd for the same vocabulary, else tli when sampling and slem when greedy; without:
    ar), "ar", "sd", "tli" (drafts from the vocabulary intersection), "union" (TLI's baseline), "slem"
    (drafted text re-encoded for the target, exact-match verification), "slrs" (string-level rejection
    sampling; exact and exponential in token length, so it raises when a step would need more than
    slrs_max_nodes drafter positions) or "ngram". Greedy at temperature 0. num_draft_tokens: an
    int, or "auto" to choose it each step from measured costs and acceptance; for "ngram" an int w is one
    row of w tokens and a tuple (k, w) is k rows of w tokens. ngram_tables: the model-derived n-grams
    "ngram" fills rows with when the context has too few matches: "bigram" (computed once per model,
    with a progress bar, and cached on disk), "unigram" (from the embeddings, instant) or "none". seed: makes sampling
    reproducible for a fixed num_draft_tokens (with "auto", draft lengths follow measured timings, and
    the steps they make decide which random numbers each token uses; the distribution is the target's
    either way). stop: strings that end a request (excluded from its text). stream: called as
    stream(request_index, text) with each new piece of text as tokens are accepted.
    """
    single = isinstance(prompt, str)
    prompts = [prompt] if single else list(prompt) if isinstance(prompt, (list, tuple)) else None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("decode: prompt must be a non-empty string or a non-empty list of strings")
    if any(not p for p in prompts):
        raise ValueError("decode: empty prompt")
    if method not in METHODS:
        raise ValueError(f"decode: unknown method {method!r}; available: {', '.join(METHODS)}")
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError("decode: stop must be a non-empty string or a list of them")
    if stream is not None and not callable(stream):
        raise TypeError("decode: stream must be callable as stream(request_index, text)")
    if method != "ngram":
        draft_length = DraftLength(num_draft_tokens)
    if isinstance(slrs_max_nodes, bool) or not isinstance(slrs_max_nodes, int) or slrs_max_nodes < 1:
        raise ValueError(f"decode: slrs_max_nodes must be an int >= 1, got {slrs_max_nodes!r}")
    if ngram_tables not in NGRAM_TABLES:
        raise ValueError(f"decode: ngram_tables must be one of {', '.join(NGRAM_TABLES)}, got {ngram_tables!r}")

    target_model, tokenizer = _resolve_model(target, tokenizer, "target")
    drafter_model = None
    if drafter is not None:
        if method not in ("auto", *_DRAFTER_METHODS):
            raise ValueError(f"decode: method {method!r} does not use a drafter")
        if isinstance(drafter, str) and drafter.startswith("self:"):
            layers = drafter[len("self:"):]
            if not layers.isdigit():
                raise ValueError(f"decode: drafter {drafter!r} must be 'self:N' with N a number of layers")
            drafter_model, drafter_tokenizer = truncated(target_model, int(layers)), tokenizer
        else:
            drafter_model, drafter_tokenizer = _resolve_model(drafter, drafter_tokenizer, "drafter")
    elif method in _DRAFTER_METHODS:
        raise ValueError(f"decode: method {method!r} needs a drafter (a model, an embedded model name or 'self:N')")
    same = drafter_model is not None and _same_vocabulary(tokenizer, drafter_tokenizer)
    if method == "auto":
        method = "ar" if drafter_model is None else "sd" if same else "tli" if temperature > 0 else "slem"
    if method == "sd" and not same:
        raise ValueError("decode: the drafter's vocabulary differs from the target's, and method 'sd' needs "
                         "the same vocabulary; use method 'tli' (sampling), 'slem' (greedy), 'slrs' or 'union' "
                         "for a drafter with another vocabulary (or 'auto')")

    target_lm = CausalLM(target_model, "target")
    drafter_lm = CausalLM(drafter_model, "drafter") if drafter_model is not None else None
    if drafter_lm is not None and drafter_lm.device != target_lm.device:
        raise ValueError(f"decode: target is on {target_lm.device} but drafter is on {drafter_lm.device}")
    if method == "sd" and drafter_lm.vocab_size != target_lm.vocab_size:
        raise ValueError(f"decode: the drafter's LM head has {drafter_lm.vocab_size} outputs but the target's "
                         f"has {target_lm.vocab_size}; method 'sd' needs the same vocabulary")
    if drafter_model is not None:  # start from what earlier calls with this pair measured
        draft_length = DraftLength.remembered(num_draft_tokens, target_model,
                                              drafter if isinstance(drafter, str) else drafter_model, method)
    vmap = crossing = None
    if method in ("tli", "union", "slem", "slrs"):
        vmap = vocab_maps.vocab_map(tokenizer, drafter_tokenizer)
    if method in ("tli", "union"):
        crossing = (tli.intersection if method == "tli" else tli.union)(
            vmap, drafter_tokenizer, drafter_lm.vocab_size, target_lm.vocab_size, target_lm.device)

    if method == "ngram":
        shape = DraftShape(num_draft_tokens, target_model, target_lm.device, greedy=temperature == 0)
        bigram = unigram = None  # built (once per model) before the clock starts
        if ngram_tables == "bigram":
            bigram = model_ngrams.bigram(target_model, tokenizer, top=max(8, shape.k_max))
        elif ngram_tables == "unigram":
            unigram = model_ngrams.unigram(target_model, top=shape.k_max)
    params = SamplingParams(float(temperature), int(top_k), float(top_p))
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    seeds = (torch.arange(len(prompts), dtype=torch.long) * 0x9E3779B1 + seed).to(target_lm.device)
    batch = Batch(tokenizer, prompts, max_new_tokens, stops, stream, _eos_ids(target_model, tokenizer),
                  target_lm.device)
    stats = Stats()
    start = time.perf_counter()
    with torch.inference_mode():
        if max_new_tokens > 0:
            if method == "ar":
                decode_ar(target_lm, batch, params, seeds, stats)
            elif method == "ngram":
                decode_ngram(target_lm, batch, params, seeds, stats, NgramDrafter(batch, bigram, unigram), shape)
            elif method == "sd":
                decode_sd(target_lm, drafter_lm, batch, params, seeds, stats, draft_length)
            elif method in ("tli", "union"):
                decode_sd(target_lm, drafter_lm, batch, params, seeds, stats, draft_length, crossing,
                          drafter_tokenizer)
            elif method == "slem":
                decode_slem(target_lm, drafter_lm, batch, params, seeds, stats, draft_length, vmap,
                            drafter_tokenizer)
            else:
                decode_slrs(target_lm, drafter_lm, batch, params, seeds, stats, draft_length, vmap,
                            drafter_tokenizer, max_drafter_nodes=slrs_max_nodes)
    stats.seconds = time.perf_counter() - start
    stats.new_tokens = sum(len(t) for t in batch.generated)
    stats.forward_seconds = target_lm.seconds + (drafter_lm.seconds if drafter_lm else 0.0)
    texts = batch.texts()
    tokens = batch.generated
    return DecodeResult(texts[0] if single else texts, tokens[0] if single else tokens, stats)
