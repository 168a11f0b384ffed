"""`specops.decode`: the front door to every decoding method (registry.py), all run by one loop
(loop.py) on one engine (engine.py).

Methods: "ar" (autoregressive, the baseline), "sd" (standard speculative decoding with a
same-vocabulary drafter), "tli", "union", "slem" and "slrs" (a drafter with another vocabulary,
paper 000) and "ngram" (learning-free drafts from the context and the model's own n-grams, no
drafter). "auto" picks "sd" for a drafter with the target's vocabulary, "tli" (sampling) or "slem"
(greedy) for one with another vocabulary, else "ngram" ("ar" for a model that cannot score draft trees).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specops._kept import process_wide
from specops._threads import check_threads, decoding_threads
from specops._seeds import draw_seed, row_seeds
from specops.decoding import registry
from specops.decoding.batch import Batch
from specops.decoding.engine import CausalLM
from specops.decoding.ensemble_target import ENSEMBLES, EnsembleLM, WeightedEnsemble, member_vocab
from specops.decoding.loop import run
from specops.decoding.probe import chain_support, tree_support
from specops.decoding.self_draft import SelfDraftError, truncated
from specops.decoding.stats import Stats
from specops.decoding.protocol import Drafter, SamplingParams, Setup

__all__ = ["METHODS", "DecodeResult", "check_arguments", "decode"]

METHODS = registry.NAMES


@dataclass
class DecodeResult:
    """text: the generated text (a str for a str prompt, else a list); tokens: generated token ids per
    prompt (same shape rule); stats: `Stats` (counts, tokens per second, time split)."""

    text: str | list[str]
    tokens: list[int] | list[list[int]]
    stats: Stats


@functools.lru_cache(maxsize=4)
def _load_embedded(name: str, drafter: bool):
    """An embedded model named by string, loaded once per process (decoding never changes a model): repeated
    calls, such as model.generate(custom_generate=specops.hf.generate, draft_model="smollm2-135m") in a loop,
    do not reload it."""
    from specops import models

    # An embedded drafter named without ":weights" gets its default low-precision weights; targets and
    # ensemble members stay float32 unless their name asks otherwise.
    return models.load_drafter(name) if drafter else models.load(name)


process_wide("embedded models", "the embedded models decode() loaded by name (target='gemma-3-270m')",
             _load_embedded.cache_clear)


def _resolve_model(model, tokenizer, role: str, need_tokenizer: bool = True):
    if isinstance(model, str):
        loaded, loaded_tokenizer = _load_embedded(model, role == "drafter")
        return loaded, tokenizer or loaded_tokenizer
    if tokenizer is None and need_tokenizer:
        keyword = ("tokenizer=..." if role == "target" else "drafter_tokenizer=..." if role == "drafter"
                   else "tokenizer=[...], one per member")
        raise ValueError(f"decode: {role} is a model object, so its tokenizer must be given ({keyword})")
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


def _check_self_drafter(drafter) -> None:
    if isinstance(drafter, str) and drafter.startswith("self:") and not drafter[len("self:"):].isdigit():
        raise ValueError(f"decode: drafter {drafter!r} must be 'self:N' with N a number of layers")


def _drafter_model(drafter, drafter_tokenizer, target_model, tokenizer, ids: list[int],
                   need_tokenizer: bool = True):
    """(drafter model, its tokenizer, why a self:N drafter cannot run or None). ids: prompt tokens for the
    probe (probe.chain_support)."""
    if not (isinstance(drafter, str) and drafter.startswith("self:")):
        return (*_resolve_model(drafter, drafter_tokenizer, "drafter", need_tokenizer), None)
    layers = int(drafter[len("self:"):])
    try:
        model = truncated(target_model, layers)
    except SelfDraftError as error:
        return None, tokenizer, str(error)
    except Exception as error:  # noqa: BLE001 - a model whose first layers cannot run alone
        return None, tokenizer, f"its first {layers} layers cannot run alone ({type(error).__name__}: {error})"
    # The first layers of a model built otherwise (layers looped, or read by position in the stack) may run
    # and still compute something else than the stack's own first layers: their cached decoding must at
    # least agree with their own forward over the whole sequence.
    found = chain_support(CausalLM(model, "drafter"), ids)
    if found.cache is not None:
        return None, tokenizer, f"its first {layers} layers cannot run alone: {found.cache}"
    return model, tokenizer, None


def _prompt_rows(prompts, tokenizer) -> list[list[int]]:
    """The prompts' target token ids (checked against the model's vocabulary and context before anything
    runs; the probes of probe.chain_support and probe.tree_support feed the model these ids)."""
    if not isinstance(prompts[0], str):
        return [list(row) for row in prompts]
    return [list(tokenizer(p)["input_ids"]) for p in prompts]


def _working(lm, ids: list[int], self_draft: bool | None = None) -> str:
    """The methods that decode the target `lm` exactly, as a refusal lists them: every single-target
    method, less those that score draft trees with a target that cannot take them; where self:1 cannot
    run on it (self_draft False; None: try it) the drafter methods are named apart, as needing another
    drafter."""
    trees = not isinstance(lm, CausalLM) or tree_support(lm, ids) is None
    if self_draft is None:
        self_draft = (not isinstance(lm, CausalLM)
                      or _drafter_model("self:1", None, lm.model, None, ids)[2] is None)
    fit = [m for m in registry.METHODS.values() if m.ensemble != "only" and (trees or "target" not in m.trees)]
    alone = [m.name for m in fit if m.drafter == Drafter.NONE]
    drafted = [m.name for m in fit if m.drafter != Drafter.NONE]
    if self_draft:
        return ", ".join(alone + drafted)
    return f"{', '.join(alone)}; with a drafter other than self:N also {', '.join(drafted)}"


def _refuse_cache(lm, ids: list[int], target=None) -> bool:
    """Raise for a model that specops cannot decode with a KV cache (probe.chain_support; every member of an
    ensemble; a drafter, `target` given, need only run); else whether rows of a batch change each other's
    logits, so that they must be decoded apart."""
    apart = False
    for member in getattr(lm, "members", [lm]):
        found = chain_support(member, ids if member is lm else list(range(min(member.vocab_size, 64))))
        if target is None and found.cache is not None:
            raise ValueError(f"decode: the {member.name} ({member.arch}) cannot be decoded with a KV cache: "
                             f"{found.cache}. Methods that work with it: none (decode it with its own "
                             "generate())")
        if target is not None and not found.runs:
            raise ValueError(f"decode: the drafter ({member.arch}) cannot be decoded with a KV cache: "
                             f"{found.cache}; draft with another model. Methods that work with the target "
                             f"({target.arch}): {_working(target, ids)}")
        if not found.positions:
            member.takes.discard("position_ids")
        apart = apart or found.ragged is not None
    return apart


def _ensemble_members(target, tokenizer, ensemble):
    """(members [(model, tokenizer)], rule) for target=[...], or (None, None) for a single target; raises for
    a malformed ensemble before any model is loaded."""
    if not isinstance(target, (list, tuple)):
        if ensemble is not None:
            raise ValueError("decode: ensemble= needs an ensemble of targets: target=[model, model, ...]")
        if isinstance(tokenizer, (list, tuple)):
            raise ValueError("decode: a list of tokenizers needs a list of targets (an ensemble)")
        return None, None
    if len(target) < 2:
        raise ValueError(f"decode: an ensemble needs at least 2 members in target=[...], got {len(target)}; "
                         "pass a single model as target=model")
    if tokenizer is None:
        tokenizer = [None] * len(target)
    if not isinstance(tokenizer, (list, tuple)) or len(tokenizer) != len(target):
        raise ValueError(f"decode: with target=[...] of {len(target)} members, tokenizer must be a list of "
                         f"{len(target)} (one per member; None for an embedded model name)")
    rule = WeightedEnsemble([1.0 / len(target)] * len(target)) if ensemble is None else ensemble
    if not isinstance(rule, ENSEMBLES):
        raise TypeError("decode: ensemble must be specops.WeightedEnsemble(weights) or "
                        f"specops.ContrastiveEnsemble(mu, alpha), got {type(ensemble).__name__}")
    rule.check(len(target))
    return list(zip(target, tokenizer)), rule


def _ensemble_lm(members, rule, prompts: list[str] | list[list[int]]) -> tuple[EnsembleLM, object]:
    """The ensemble as the loop's target, and its output tokenizer (the first member's). Prompts given as
    token ids are the first member's; a member with another vocabulary encodes their text."""
    loaded = [_resolve_model(model, tok, f"target[{i}]") for i, (model, tok) in enumerate(members)]
    lms = [CausalLM(model, f"target[{i}]") for i, (model, _) in enumerate(loaded)]
    if len({str(lm.device) for lm in lms}) > 1:
        raise ValueError(f"decode: ensemble members are on different devices: {[str(lm.device) for lm in lms]}")
    first_tokenizer = loaded[0][1]
    as_ids = not isinstance(prompts[0], str)
    texts = [first_tokenizer.decode(p, skip_special_tokens=True) for p in prompts] if as_ids else prompts
    vocabs, encoded = [], []
    for lm, (_, tok) in zip(lms, loaded):
        same = _same_vocabulary(first_tokenizer, tok)
        vocabs.append(member_vocab(lm, tok, lms[0], first_tokenizer, same))
        rows = [list(p) for p in prompts] if as_ids and same else [list(tok(p)["input_ids"]) for p in texts]
        if any(not r for r in rows):
            raise ValueError("decode: a prompt encodes to no tokens")
        encoded.append(rows)
    return EnsembleLM(lms, vocabs, encoded, rule), first_tokenizer


def _resolved(method, same, temperature, members, drafter_lm, trees: bool):
    return registry.resolve(method, drafter=drafter_lm is not None, same_vocabulary=same, greedy=temperature == 0,
                            ensemble=members is not None, trees=trees)


def _chosen(method, same, temperature, members, target_lm, drafter_lm, tokenizer, drafter_tokenizer,
            trees: bool = True):
    """The method `method` stands for with these models, after every check that needs no prompt."""
    chosen = _resolved(method, same, temperature, members, drafter_lm, trees)
    if chosen.drafter == Drafter.SAME_VOCABULARY and not same:
        takes = ", ".join(repr(m.name) for m in registry.METHODS.values() if m.drafter == Drafter.ANY_VOCABULARY)
        raise ValueError(f"decode: the drafter's vocabulary differs from the target's, and method {chosen.name!r} "
                         f"needs the same vocabulary; methods for a drafter with another vocabulary: {takes} "
                         "(or 'auto')")
    if drafter_lm is not None and drafter_lm.device != target_lm.device:
        raise ValueError(f"decode: target is on {target_lm.device} but drafter is on {drafter_lm.device}")
    if chosen.drafter == Drafter.SAME_VOCABULARY and drafter_lm.vocab_size != target_lm.vocab_size:
        raise ValueError(f"decode: the drafter's LM head has {drafter_lm.vocab_size} outputs but the target's "
                         f"has {target_lm.vocab_size}; method {chosen.name!r} needs the same vocabulary")
    if chosen.tokenizers is not None:
        if tokenizer is None or drafter_tokenizer is None:
            raise ValueError(f"decode: method {chosen.name!r} maps between the target's and the drafter's "
                             "tokenizers, and the target's was not given (specops.hf.generate: pass "
                             "target_tokenizer=)")
        chosen.tokenizers(tokenizer, drafter_tokenizer)
    return chosen


def _check_memory(memory, chosen, method: str, target_lm, tokenizer) -> None:
    """A memory goes to a method that drafts from it, and holds the target's vocabulary (binding a new one)."""
    if memory is None:
        return
    if not chosen.memory:
        readers = ", ".join(m.name for m in registry.METHODS.values() if m.memory)
        why = f"method 'auto' picked {chosen.name!r} here" if method == "auto" else f"method {method!r} was asked for"
        raise ValueError(f"decode: a memory was given, but {why}, which does not draft from one; methods that do: "
                         f"{readers} (no drafter, and a target that scores draft trees)")
    from specops.memory import vocabulary_fingerprint

    memory.bind(target_lm.vocab_size, vocabulary_fingerprint(tokenizer))


def _refuse_trees(method, role: str, lm: CausalLM, rows: list[list[int]]) -> None:
    """Methods that score draft trees need a model that takes them exactly (probe.tree_support)."""
    reason = tree_support(lm, [t for row in rows for t in row]) if role in method.trees else None
    if reason is not None:
        working = _working(lm, [t for row in rows for t in row]) if role == "target" else ", ".join(
            m.name for m in registry.METHODS.values() if role not in m.trees and m.ensemble != "only")
        raise ValueError(f"decode: method {method.name!r} scores draft trees with the {role}, and {lm.arch} cannot "
                         f"take them exactly: {reason}. Methods that work with it: {working}")


def decode(prompt, *, target, drafter=None, method: str = "auto", tokenizer=None, drafter_tokenizer=None,
           max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           num_draft_tokens="auto", seed: int | None = None, stop=None, stream=None, options: dict | None = None,
           ensemble=None, memory=None, num_samples: int | None = None, threads=None) -> DecodeResult:
    """Generate continuations of `prompt` (a string, or a list of strings decoded as one batch).

    Returns a DecodeResult:
      - .text: the new text (a str; a list of str for a list of prompts), a stop string excluded; with
        num_samples, each prompt's entry is a list of num_samples texts;
      - .tokens: the new token ids in the target's vocabulary (a list of int; a list of lists; with
        num_samples, a list of num_samples lists per prompt);
      - .stats: a specops.Stats: the method `auto` chose, tokens/s, target and drafter calls, acceptance and
        where the time went (.summary() gives one line).

    target / drafter: a transformers causal LM, or an embedded model name ("gemma-3-270m",
    "smollm2-135m"); the drafter may also be "self:N", the target's first N layers. An embedded drafter
    gets its default low-precision weights (`specops.models.drafter_weights`: int8 for SmolLM2-135M);
    a suffix chooses them: "smollm2-135m:float32", ":bf16", ":int8", ":int4". tokenizer /
    drafter_tokenizer: for model objects (an embedded name brings its own).

    method: "auto" (the default: with a drafter, sd for the target's vocabulary, else tli when sampling
    and slem when greedy; without one, ngram, or ar for a model that cannot score draft trees; se for an
    ensemble), or one of:
{methods}
    Greedy at temperature 0; top_k 0 and top_p 1 keep every token.

    num_draft_tokens: "auto" (the default) chooses it each step from measured costs and acceptance; an int
    for chains; for "ngram" a tuple (k, w) is k rows of w tokens; for "rsd-c" / "specinfer" (b1, ..., bL)
    children per node at each level; for "rsd-s" (W, L) beams and levels; for "se" one int per member.
    options: the method's own settings, one flat dict for the method that runs (method="ngram",
    options={"tables": "none"}); a key the method does not take is refused. Every method's options, their
    values and defaults are in docs/methods.md ("Options"):
      - "ngram": "tables" ("auto" | "bigram" | "unigram" | "none": the model-derived n-grams that fill rows the
        context does not; "bigram" is computed once per model, with a progress bar, and cached on disk:
        seconds on a GPU, 7 to 25 minutes for Gemma-3-270M on two CPU cores; "unigram" comes from the
        embeddings, instantly; "auto", the default, takes the bigram when it is cached or estimated to build
        within a minute, else the context alone) and "scheme" (below);
      - "slrs": "max_nodes" (an int: raise rather than score more drafter positions than this in a step);
      - "se": "draws" ("auto" | "alternate" | "mixture") and "scheme" ("auto" | "token" | "joint");
      - "slem", "sd", "tli", "union", "rsd-c", "rsd-s", "specinfer": "scheme".
    "scheme" is how sampled drafts are verified, one vocabulary for chains and trees (docs/methods.md,
    "Verification schemes"): "positional" keeps a draft when it is the target's own token drawn with that
    position's random numbers (the same text as sampled "ar" for the same seed); "token" verifies token by
    token against q (speculative sampling; recursive rejection sampling on trees); "joint" verifies the
    draft as a whole (block verification; traversal verification on trees: never fewer drafts kept);
    "auto" (the default) is "positional" when a seed is given or the drafts carry no q (ngram, slem), else
    "joint". The scheme that ran, and why, is in the result's stats (`Stats.scheme`, `scheme_reason`).
    With "auto", options are checked against the method it picks. seed: the same seed gives the same
    text. Given a seed, "ar", "ngram", "slem", "sd", "tli", "union", "rsd-c", "rsd-s" and "specinfer"
    draw each token with random numbers keyed by the seed, the request and the token's position alone and
    accept a draft when it equals that token ("sd", "tli", "union", "rsd-c" and "specinfer" draw their
    drafts, or each tree node's first child, from the drafter with the same numbers, so they are often
    equal), so they give token for token the text sampled "ar" gives, whatever num_draft_tokens is
    ("auto" included) and however requests are batched. The option "scheme" can ask for verification
    against q instead; that, and "slrs", key their random numbers by step: reproducible for a fixed
    num_draft_tokens, while "auto" lengths follow timings. "se" and the ensembles draw from streams keyed
    by step and decide nothing from timings: the same seed gives the same text, which is not "ar"'s.
    stop: strings that end a request (excluded from its text). stream: called as stream(request_index,
    text) with each new piece of text as tokens are accepted (with num_samples, request i * num_samples + j
    is sample j of prompt i).

    memory: a specops.NgramMemory that "ngram" drafts from and writes to: every request's prompt and output go
    into it as they are decoded, so the requests of this call draft from each other and later calls from
    this one ("auto" picks "ngram" when a memory is given without a drafter; other methods refuse one).
    num_samples: decode each prompt this many times (pass@k, best-of-n): each prompt is read once and its
    cache forked, and every sample draws with its own seed (request i * num_samples + j), so the texts are
    those of the prompt list with each prompt repeated num_samples times.
    threads: torch's CPU threads for this call: None (the default) leaves torch's count as it is; an int
    sets it; "auto" takes the cores other processes leave free (measured over 0.1 s, kept 30 s: on a busy
    2-core machine two OpenMP threads ran 10-20x slower than one). torch's count is process-wide, so other
    threads of the process see it while the call runs; it is restored when the call returns.

    Ensembles: target=[m1, m2, ...] with tokenizer=[t1, t2, ...] (None for embedded names) decodes from the
    ensemble `ensemble` defines: specops.WeightedEnsemble(weights) (the default: equal weights) or
    specops.ContrastiveEnsemble(mu, alpha=None). The first member's tokenizer gives the output tokens;
    members with another vocabulary contribute through the shared tokens (specops.decoding.ensemble_target).

    Raises ValueError before decoding for a combination it cannot decode exactly (for example a method
    that scores draft trees with a model whose attention cannot take them), naming what works instead.
    """
    single = isinstance(prompt, str)
    prompts = [prompt] if single else list(prompt) if isinstance(prompt, (list, tuple)) else None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("decode: prompt must be a non-empty string or a non-empty list of strings")
    if any(not p for p in prompts):
        raise ValueError("decode: empty prompt")
    batch, stats = _decode(prompts, target=target, drafter=drafter, method=method, tokenizer=tokenizer,
                           drafter_tokenizer=drafter_tokenizer, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p,
                           num_draft_tokens=num_draft_tokens, seed=seed, stop=stop, stream=stream,
                           options=options, ensemble=ensemble, memory=memory, num_samples=num_samples,
                           threads=threads)
    texts = batch.texts()
    tokens = batch.generated
    if num_samples is not None:  # each prompt's samples as one list
        texts = [texts[i:i + num_samples] for i in range(0, len(texts), num_samples)]
        tokens = [tokens[i:i + num_samples] for i in range(0, len(tokens), num_samples)]
    return DecodeResult(texts[0] if single else texts, tokens[0] if single else tokens, stats)


decode.__doc__ = decode.__doc__.replace("{methods}", "\n".join(  # the registry's methods, one line each
    f"      - {m.name!r}: {m.summary}" for m in registry.METHODS.values()))


def _decode_apart(call: dict, target, tokenizer, drafter, drafter_tokenizer, seeds: torch.Tensor):
    """`_decode` of call["prompts"] one request at a time (models that cannot take a ragged batch), the
    models resolved already; returns one (Batch, Stats) as if they had been decoded together."""
    prompts = call["prompts"]
    n = call["num_samples"] or 1
    merged, stats = None, Stats()
    for i, prompt in enumerate(prompts):
        def shifted(callback, first=i * n):
            return None if callback is None else lambda request, *rest: callback(first + request, *rest)

        given = {k: v for k, v in call.items() if k != "prompts"}
        batch, part = _decode([prompt], **{
            **given, "target": target, "tokenizer": tokenizer, "drafter": drafter,
            "drafter_tokenizer": drafter_tokenizer, "seed": seeds[i * n:(i + 1) * n],
            "stream": shifted(call["stream"]), "stop_when": shifted(call["stop_when"]),
            "on_tokens": shifted(call["on_tokens"])})
        if merged is None:
            merged = Batch(batch.tokenizer, [p for p in prompts for _ in range(n)], call["max_new_tokens"],
                           batch.stop, None, batch.eos_ids, samples=n)
        for j in range(n):
            merged.generated[i * n + j], merged.stop_text[i * n + j] = batch.generated[j], batch.stop_text[j]
        for name, value in vars(part).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(stats, name, getattr(stats, name) + value)
        stats.draft_lengths += part.draft_lengths
        if part.member_calls is not None:  # an ensemble's forwards per member, summed over the requests
            stats.member_calls = [a + b for a, b in zip(stats.member_calls or [0] * len(part.member_calls),
                                                        part.member_calls)]
        stats.method, stats.scheme, stats.scheme_reason = part.method, part.scheme, part.scheme_reason
    return merged, stats


def check_arguments(*, target, drafter=None, method: str = "auto", tokenizer=None, max_new_tokens: int = 128,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, num_draft_tokens="auto",
                    stop=None, stream=None, options: dict | None = None, ensemble=None, memory=None,
                    num_samples=None):
    """Every check of `decode`'s arguments that needs no model: raises ValueError / TypeError before
    anything is loaded (the command line calls it first). Returns (stop strings, ensemble members and
    rule, or None, None)."""
    if method not in METHODS:
        raise ValueError(f"decode: unknown method {method!r}; available: {', '.join(METHODS)}")
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                    or num_samples < 1):
        raise ValueError(f"decode: num_samples must be an int >= 1 or None, got {num_samples!r}")
    if memory is not None:
        from specops.memory import NgramMemory

        if not isinstance(memory, NgramMemory):
            raise TypeError(f"decode: memory must be a specops.NgramMemory, got {type(memory).__name__}")
        if method != "auto" and not registry.METHODS[method].memory:
            readers = ", ".join(m.name for m in registry.METHODS.values() if m.memory)
            raise ValueError(f"decode: method {method!r} does not draft from a memory; methods that do: {readers}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError("decode: stop must be a non-empty string or a list of them")
    if stream is not None and not callable(stream):
        raise TypeError("decode: stream must be callable as stream(request_index, text)")
    registry.check_draft_setting(method, num_draft_tokens)
    _check_self_drafter(drafter)
    members, rule = _ensemble_members(target, tokenizer, ensemble)
    if method == "auto" and isinstance(options, dict) and options:
        # Options are a method's: some method auto can pick here must take them (checked again once it has).
        picks = {m.name: m for m in (registry.resolve(
            "auto", drafter=drafter is not None, same_vocabulary=same, greedy=temperature == 0,
            ensemble=members is not None, trees=trees) for same in (True, False) for trees in (True, False))}
        if not any(set(options) <= set(m.options) for m in picks.values()):
            owners = [m.name for m in registry.METHODS.values() if set(options) & set(m.options)]
            raise ValueError(f"decode: options {sorted(options)} belong to {', '.join(owners) or 'no method'}, and "
                             f"method 'auto' picks {', '.join(sorted(picks))} here")
    if method != "auto":
        chosen = registry.METHODS[method]
        if members is None and chosen.ensemble == "only":
            raise ValueError(f"decode: method {method!r} decodes an ensemble: pass target=[model, model, ...]")
        if members is not None and chosen.ensemble == "no":
            takes = ", ".join(m.name for m in registry.METHODS.values() if m.ensemble != "no")
            raise ValueError(f"decode: method {method!r} does not take an ensemble of targets; methods that do: {takes}")
        if drafter is not None and chosen.drafter == Drafter.NONE:
            raise ValueError(f"decode: method {method!r} does not use a drafter")
        if drafter is None and chosen.drafter != Drafter.NONE:
            raise ValueError(f"decode: method {method!r} needs a drafter (a model, an embedded model name or "
                             "'self:N')")
        registry.check_options(chosen, options)
    return stops, members, rule


def _decode(prompts, *, target, drafter, method, tokenizer, drafter_tokenizer, max_new_tokens, temperature,
            top_k, top_p, num_draft_tokens, seed, stop, stream, options, ensemble=None, eos_ids=None,
            stop_when=None, on_tokens=None, memory=None, num_samples=None, threads=None):
    """`decode` for prompts given as strings or as the target's token ids (then the tokenizers may be None
    where nothing needs text: a drafter model object without one shares the target's vocabulary). eos_ids
    replaces the model's and tokenizer's EOS ids; stop_when / on_tokens: see `Batch` (with num_samples,
    request i * num_samples + j is sample j of prompt i). Returns the finished (Batch, Stats), one request
    per sample."""
    call = dict(locals())
    check_threads(threads)
    as_ids = not isinstance(prompts[0], str)
    stops, members, rule = check_arguments(
        target=target, drafter=drafter, method=method, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, num_draft_tokens=num_draft_tokens, stop=stop,
        stream=stream, options=options, ensemble=ensemble, memory=memory, num_samples=num_samples)
    samples = num_samples or 1
    if members is not None:
        target_lm, tokenizer = _ensemble_lm(members, rule, [p for p in prompts for _ in range(samples)])
        target_model = target_lm.members[0].model
    else:
        target_model, tokenizer = _resolve_model(target, tokenizer, "target", need_tokenizer=not as_ids)
    if (stops or stream is not None) and tokenizer is None:
        raise ValueError("decode: stop strings and text streaming need the target's tokenizer")
    rows = _prompt_rows(prompts, tokenizer)
    ids = [t for row in rows for t in row] or [0]
    if members is None:
        target_lm = CausalLM(target_model, "target")
    target_lm.check_prompts(rows, max_new_tokens, "target")
    apart = _refuse_cache(target_lm, ids)
    drafter_model = None
    if drafter is not None:
        drafter_model, drafter_tokenizer, unfit = _drafter_model(drafter, drafter_tokenizer, target_model,
                                                                 tokenizer, ids, need_tokenizer=not as_ids)
        if unfit is not None:
            raise ValueError(f"decode: drafter {drafter!r} cannot draft for the target ({target_lm.arch}): "
                             f"{unfit}. Methods that work with it: {_working(target_lm, ids, self_draft=False)}")
        if tokenizer is None and drafter_tokenizer is not None:
            raise ValueError("decode: the drafter comes with its own tokenizer, and comparing vocabularies "
                             "needs the target's too: pass the target's tokenizer")
    same = drafter_model is not None and _same_vocabulary(tokenizer, drafter_tokenizer)
    drafter_lm = CausalLM(drafter_model, "drafter") if drafter_model is not None else None
    # What "auto" picks may depend on whether the target scores draft trees exactly, which is probed once the
    # prompts are encoded; every other choice is known now, and checked before any prompt is.
    trees_decide = _resolved(method, same, temperature, members, drafter_lm, True) is not _resolved(
        method, same, temperature, members, drafter_lm, False)
    chosen = None if trees_decide else _chosen(method, same, temperature, members, target_lm, drafter_lm,
                                               tokenizer, drafter_tokenizer)
    if drafter_lm is not None and not isinstance(drafter, str):
        _refuse_cache(drafter_lm, ids if same else list(range(min(drafter_lm.vocab_size, 64))), target_lm)
    if apart and len(prompts) > 1:
        # Left padding would shift this model's positions: each prompt decodes alone, exactly as it would
        # in a batch of one (its own row seeds, so sampled text does not depend on the split either); its
        # samples are rows of equal length, which need no padding.
        return _decode_apart(call, target_model if members is None else target,
                             tokenizer if members is None else call["tokenizer"],
                             drafter_model if not isinstance(drafter, str) else drafter, drafter_tokenizer,
                             row_seeds(draw_seed() if seed is None else seed, len(prompts) * samples,
                                       target_lm.device))
    batch = Batch(tokenizer, [p for p in prompts for _ in range(samples)], max_new_tokens, stops, stream,
                  _eos_ids(target_model, tokenizer) if eos_ids is None else set(eos_ids),
                  stop_when=stop_when, on_tokens=on_tokens, samples=samples)
    if trees_decide:
        trees = tree_support(target_lm, [t for row in batch.prompt_rows for t in row]) is None
        chosen = _chosen(method, same, temperature, members, target_lm, drafter_lm, tokenizer, drafter_tokenizer,
                         trees)
    settings = registry.check_options(chosen, options)
    _check_memory(memory, chosen, method, target_lm, tokenizer)
    _refuse_trees(chosen, "target", target_lm, batch.prompt_rows)
    if "drafter" in chosen.trees:
        _refuse_trees(chosen, "drafter", drafter_lm, batch.encode(drafter_tokenizer))
    params = SamplingParams(float(temperature), int(top_k), float(top_p))
    seeds = row_seeds(draw_seed() if seed is None else seed, batch.rows, target_lm.device)
    setup = Setup(chosen.name, target_lm, tokenizer, batch, params, seeds, num_draft_tokens, settings,
                  drafter_lm, drafter_tokenizer, drafter if isinstance(drafter, str) else drafter_model, same,
                  seeded=seed is not None, memory=memory)
    stats = Stats()
    proposer = chosen.make(setup)  # vocabulary maps, n-gram tables: before the clock starts
    # A greedy target's logits are read by an argmax only (verify.py): its head may be screened.
    target_lm.argmax_only = params.greedy and members is None
    with torch.inference_mode(), decoding_threads(target_lm.device, threads):  # "auto": before the clock
        if target_lm.argmax_only and max_new_tokens > 0:
            target_lm.prepare_greedy(batch.rows if chosen.plain else None)
        run(target_lm, batch, params, seeds, stats, proposer, chosen.name)
    return batch, stats
