"""specops inside transformers' `generate()`: the decoding loop of `model.generate(...,
custom_generate=specops.hf.generate)`.

    out = model.generate(**tokenizer(prompts, return_tensors="pt", padding=True),
                         custom_generate=specops.hf.generate, draft_model=drafter,
                         draft_tokenizer=drafter_tokenizer, target_tokenizer=tokenizer,
                         max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.95)

transformers prepares the generation config, the logits processors and the stopping criteria, then hands
them to `generate` below in place of its own sampling loop; specops decodes with any of its methods and
returns what `generate()` returns: the left-padded prompts followed by the new tokens, finished rows padded
with `pad_token_id`, or a `GenerateDecoderOnlyOutput` with `sequences` when `return_dict_in_generate=True`.
Greedy output is the model's own `generate(do_sample=False)` token for token; sampled output follows the
same distribution (temperature, top-k, top-p as transformers' warpers define them).

What transformers forwards to a custom_generate function: the keywords in its signature that its own
sampling loop does not take. It does not forward `tokenizer=`, `assistant_tokenizer=`, `assistant_model=`
or `streamer=` (`_extract_generation_mode_kwargs` replaces them with those extra keywords), so:
- the drafter is `draft_model=` (a model, an embedded name such as "smollm2-135m", or "self:N"), with
  `draft_tokenizer=` when its vocabulary differs from the target's (without one a drafter model object
  shares the target's vocabulary, as transformers' assistant models do);
- the target's tokenizer, needed only for a drafter or ensemble member with another vocabulary, is
  `target_tokenizer=`, else the streamer's tokenizer, else the one saved beside the model's weights
  (`model.name_or_path`, read without any download);
- a `streamer=` given to generate() is found in generate's own frame (it has already received the prompt).
  Streaming needs a batch of one prompt, as transformers' streamers do;
- `assistant_model=` raises: pass the drafter as `draft_model=`.
Stop strings need transformers' tokenizer, which it drops: pass
`stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, stops)])` instead of `stop_strings=`.

Whatever would change the target's distribution or the output's form and specops cannot honour raises a
ValueError naming it before any forward: beam search, contrastive search, DoLa, prompt lookup (use
method="ngram"), logits processors other than temperature / top-k / top-p (repetition penalty, min length,
bad words, ...), output scores, logits, attentions or hidden states, model inputs other than token ids,
a prefilled cache, encoder-decoder models.
"""

from __future__ import annotations

import os
import sys

import torch

from specops._seeds import draw_seed
from specops.decoding import _decode
from specops.decoding.hf_compat import CACHE_ARGUMENTS
from specops.decoding.stats import Stats

__all__ = ["generate"]

# Logits processors transformers builds from generation-config options, for naming the option in errors.
_PROCESSOR_OPTIONS = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinLengthLogitsProcessor": "min_length or min_new_tokens",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens or min_length",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "MinPLogitsWarper": "min_p",
    "TopHLogitsWarper": "top_h",
    "TypicalLogitsWarper": "typical_p",
    "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff",
    "WatermarkLogitsProcessor": "watermarking_config",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}
# Model inputs generate() prepares for every decoder-only model; specops computes its own positions and cache.
_MODEL_INPUTS = {"attention_mask", "position_ids", "logits_to_keep", "use_cache", "cache_position",
                 *CACHE_ARGUMENTS}
_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _refuse(option: str, why: str) -> None:
    raise ValueError(f"specops.hf.generate: {option} is not supported: {why}")


def _from_generate(name: str):
    """A local of the transformers generate() call this function runs under (None elsewhere)."""
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_code.co_name == "generate"
                                     and "custom_generate" in frame.f_locals):
        frame = frame.f_back
    return None if frame is None else frame.f_locals.get(name)


def _check_config(model, config, model_kwargs: dict, synced_gpus: bool) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        _refuse("an encoder-decoder model", "specops decodes decoder-only causal LMs")
    if (config.num_beams or 1) > 1:
        _refuse(f"num_beams={config.num_beams}", "specops samples or decodes greedily; beam search keeps "
                "several hypotheses per prompt")
    for option, off in (("penalty_alpha", None), ("dola_layers", None), ("prompt_lookup_num_tokens", None),
                        ("assistant_early_exit", None), ("num_beam_groups", 1)):
        value = getattr(config, option, off)
        if value not in (off, 0) or (option == "penalty_alpha" and value not in (None, 0, 0.0)):
            lookup = option == "prompt_lookup_num_tokens"
            hint = " (specops' n-gram drafting is method='ngram')" if lookup else ""
            _refuse(f"{option}={value!r}", f"it selects another decoding mode than sampling or greedy{hint}")
    if config.return_dict_in_generate:
        for option in _OUTPUTS:
            if getattr(config, option, False):
                _refuse(f"{option}=True", "speculative decoding scores several tokens per forward and "
                        "keeps no per-token scores, logits, attentions or hidden states; only sequences are "
                        "returned")
    if synced_gpus or _from_generate("synced_gpus"):  # transformers keeps it from a custom loop: look
        _refuse("synced_gpus=True", "specops runs one process per model")
    if _from_generate("assistant_model") is not None:
        _refuse("assistant_model=", "transformers does not pass it to a custom_generate function; give the "
                "drafter as draft_model= (and its tokenizer as draft_tokenizer=)")
    unknown = sorted(set(model_kwargs) - _MODEL_INPUTS)
    if unknown:
        _refuse(f"the model input {unknown[0]!r}", "specops decodes causal LMs from input_ids (and their "
                "attention_mask) alone")
    for name in CACHE_ARGUMENTS:  # generate() holds the cache under its version's name
        cache = model_kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            _refuse(f"a prefilled KV cache ({name}=)", "specops builds its own cache from the prompt")


def _sampling(config, processors) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of the warpers transformers built; 0 temperature when not sampling.
    Any other logits processor changes the target's distribution, which verification must not."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    temperature, top_k, top_p = 1.0, 0, 1.0
    for processor in processors or []:
        if isinstance(processor, TemperatureLogitsWarper):
            temperature = float(processor.temperature)
        elif isinstance(processor, TopKLogitsWarper):
            top_k = int(processor.top_k)
        elif isinstance(processor, TopPLogitsWarper):
            if processor.min_tokens_to_keep != 1:
                _refuse(f"top_p with min_tokens_to_keep={processor.min_tokens_to_keep}",
                        "specops' top-p keeps the smallest set of tokens holding top_p of the mass")
            top_p = float(processor.top_p)
        else:
            name = type(processor).__name__
            option = _PROCESSOR_OPTIONS.get(name)
            what = f"{option} (transformers' {name})" if option else f"the logits processor {name}"
            _refuse(what, "it changes the model's distribution, and speculative verification keeps exactly "
                    "the model's (temperature, top_k and top_p are supported)")
    return (temperature, top_k, top_p) if config.do_sample else (0.0, 0, 1.0)


def _prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"specops.hf.generate: input_ids must be [batch, length] with length > 0, got "
                         f"{tuple(input_ids.shape)} (inputs_embeds are not supported)")
    ids = input_ids.tolist()
    if attention_mask is None:
        return ids
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"specops.hf.generate: attention_mask {tuple(attention_mask.shape)} does not match "
                         f"input_ids {tuple(input_ids.shape)}")
    rows = []
    for b, mask in enumerate(attention_mask.tolist()):
        start = mask.index(1) if 1 in mask else len(mask)
        if any(m != 1 for m in mask[start:]) or any(m != 0 for m in mask[:start]) or start == len(mask):
            raise ValueError(f"specops.hf.generate: prompt {b} is not left-padded (attention_mask {mask}); "
                             "pad on the left (tokenizer.padding_side = 'left'), as batched generation needs")
        rows.append(ids[b][start:])
    return rows


class _Stopping:
    """transformers' stopping criteria, per request: the token budget (MaxLengthCriteria) and EOS ids
    (EosTokenCriteria) go to the decoder's own rules; any other criterion (stop strings, time, the caller's)
    is asked after every token with that request's sequence ([1, length]) and scores=None (speculative
    decoding keeps no per-token scores), as generate() asks after every step."""

    def __init__(self, criteria, config, input_ids: torch.Tensor):
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        self.padded = input_ids.tolist()
        self.device = input_ids.device
        length = input_ids.shape[1]
        max_length = config.max_length
        eos = set()
        if config._eos_token_tensor is not None:
            eos.update(int(t) for t in config._eos_token_tensor.flatten().tolist())
        self.other = []
        for criterion in criteria or []:
            if isinstance(criterion, MaxLengthCriteria):
                max_length = min(max_length, criterion.max_length) if max_length else criterion.max_length
            elif isinstance(criterion, EosTokenCriteria):
                eos.update(int(t) for t in criterion.eos_token_id.flatten().tolist())
            else:
                self.other.append(criterion)
        self.eos = eos
        self.max_new_tokens = max(0, max_length - length) if max_length is not None else 0

    def __call__(self, request: int, tokens: list[int]) -> bool:
        ids = torch.tensor([self.padded[request] + tokens], dtype=torch.long, device=self.device)
        return any(bool(torch.as_tensor(criterion(ids, None)).any()) for criterion in self.other)


def _target_tokenizer(model, given, streamer):
    if given is not None:
        return given
    if getattr(streamer, "tokenizer", None) is not None:
        return streamer.tokenizer
    path = getattr(model, "name_or_path", None)
    if path and os.path.isdir(path):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):
            return None
    return None


def _needs_text(draft_model, draft_tokenizer, ensemble_models, method: str) -> bool:
    """Whether the method may need the target's tokenizer (a vocabulary to compare or text to re-encode)."""
    from specops.decoding import registry

    embedded = isinstance(draft_model, str) and not draft_model.startswith("self:")
    crossing = method in registry.METHODS and registry.METHODS[method].tokenizers is not None
    return embedded or draft_tokenizer is not None or bool(ensemble_models) or crossing


@torch.no_grad()
def generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
             synced_gpus=False, streamer=None, *, draft_model=None, draft_tokenizer=None,
             target_tokenizer=None, method: str = "auto", num_draft_tokens="auto", seed: int | None = None,
             options: dict | None = None, ensemble=None, ensemble_models=None, ensemble_tokenizers=None,
             stats: Stats | None = None, memory=None, **model_kwargs):
    """The decoding loop of `model.generate(..., custom_generate=specops.hf.generate)` (module docstring).

    draft_model: a drafter model, an embedded name ("smollm2-135m", with its default low-precision weights,
    or "smollm2-135m:float32"), or "self:N" (the target's first N layers); draft_tokenizer: its tokenizer
    when its vocabulary differs; target_tokenizer: the target's, where transformers drops `tokenizer=`.
    method: any `specops.decode` method; "auto" as in `specops.decode` (without a drafter: ngram, or ar for a
    model that cannot score draft trees).
    num_draft_tokens, options: as in `specops.decode`. seed: the sampling seed (default: drawn from torch's
    generator, so torch.manual_seed makes a call reproducible). Ensembles: ensemble_models=[m2, ...] (and
    ensemble_tokenizers=[t2, ...]) decode from the ensemble of the model and those, ensemble=
    specops.WeightedEnsemble(...) or specops.ContrastiveEnsemble(...) (method "se" or "ensemble").
    stats: a `specops.Stats()` to fill with what the call did. memory: a `specops.NgramMemory` that n-gram
    drafting reads and writes (as in `specops.decode`). num_return_sequences=n (sampling) reads each prompt
    once and decodes its n samples from one forked cache, drafting from each other through a memory.
    """
    if generation_config is None:
        raise TypeError("specops.hf.generate is the decoding loop of transformers' generate(): call "
                        "model.generate(..., custom_generate=specops.hf.generate)")
    streamer = streamer if streamer is not None else _from_generate("streamer")
    try:
        return _generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         synced_gpus, streamer, draft_model, draft_tokenizer, target_tokenizer, method,
                         num_draft_tokens, seed, options, ensemble, ensemble_models, ensemble_tokenizers,
                         stats, memory, model_kwargs)
    finally:
        if streamer is not None:
            streamer.end()  # also on an error: a TextIteratorStreamer's reader would wait forever


def _samples(rows: list[list[int]], config) -> tuple[list[list[int]], int | None]:
    """generate() repeats each prompt num_return_sequences times before the decoding loop: the prompts once and
    that count, so each is read once and forked (rows as they are where they do not come in such groups)."""
    n = int(getattr(config, "num_return_sequences", 1) or 1)
    if n < 2 or len(rows) % n or any(rows[i + j] != rows[i] for i in range(0, len(rows), n) for j in range(n)):
        return rows, None
    return rows[::n], n


def _generate(model, input_ids, processors, criteria, config, synced_gpus, streamer, draft_model,
              draft_tokenizer, target_tokenizer, method, num_draft_tokens, seed, options, ensemble,
              ensemble_models, ensemble_tokenizers, stats, memory, model_kwargs):
    _check_config(model, config, model_kwargs, synced_gpus)
    temperature, top_k, top_p = _sampling(config, processors)
    rows = _prompt_rows(input_ids, model_kwargs.get("attention_mask"))
    distinct, samples = _samples(rows, config)
    stopping = _Stopping(criteria, config, input_ids)
    if streamer is not None and len(rows) > 1:
        raise ValueError(f"specops.hf.generate: a streamer streams one prompt, and this batch has "
                         f"{len(rows)} (transformers' streamers take a batch of one too)")
    if stats is not None and not isinstance(stats, Stats):
        raise TypeError(f"specops.hf.generate: stats must be a specops.Stats(), got {type(stats).__name__}")
    if ensemble_tokenizers is not None and not ensemble_models:
        raise ValueError("specops.hf.generate: ensemble_tokenizers= needs ensemble_models=")
    tokenizer = (_target_tokenizer(model, target_tokenizer, streamer)
                 if _needs_text(draft_model, draft_tokenizer, ensemble_models, method) else target_tokenizer)
    target, tokenizers = model, tokenizer
    if ensemble_models:
        members = list(ensemble_models)
        extra = list(ensemble_tokenizers) if ensemble_tokenizers is not None else [None] * len(members)
        if len(extra) != len(members):
            raise ValueError(f"specops.hf.generate: {len(members)} ensemble_models but {len(extra)} "
                             "ensemble_tokenizers")
        if tokenizer is None:
            raise ValueError("specops.hf.generate: an ensemble needs the target's tokenizer: pass "
                             "target_tokenizer=")
        # A member without a tokenizer shares the target's vocabulary, as a drafter model object does.
        extra = [t if t is not None else tokenizer for t in extra]
        target, tokenizers = [model, *members], [tokenizer, *extra]
    if draft_model is not None and not isinstance(draft_model, str) and draft_tokenizer is None:
        draft_tokenizer = tokenizer  # a drafter model without a tokenizer shares the target's vocabulary
    if (isinstance(draft_model, str) and not draft_model.startswith("self:") or draft_tokenizer is not None) \
            and tokenizer is None:
        raise ValueError("specops.hf.generate: a drafter with its own tokenizer needs the target's to "
                         "compare vocabularies; transformers does not pass tokenizer= on, so give "
                         "target_tokenizer=")

    sequences = input_ids
    if stopping.max_new_tokens > 0:
        def on_tokens(request: int, tokens: list[int]) -> None:
            streamer.put(torch.tensor(tokens, dtype=torch.long))

        batch, result = _decode(
            distinct, target=target, drafter=draft_model, method=method, tokenizer=tokenizers,
            drafter_tokenizer=draft_tokenizer, max_new_tokens=stopping.max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, num_draft_tokens=num_draft_tokens,
            seed=draw_seed() if seed is None else seed, stop=None, stream=None, options=options,
            ensemble=ensemble,
            eos_ids=stopping.eos, stop_when=stopping if stopping.other else None,
            on_tokens=on_tokens if streamer is not None else None, memory=memory, num_samples=samples)
        if stats is not None:
            stats.__dict__.update(result.__dict__)
        sequences = _pad(input_ids, batch.generated, config)
    if config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _pad(input_ids: torch.Tensor, generated: list[list[int]], config) -> torch.Tensor:
    """The prompts followed by each request's tokens, shorter ones padded as generate() pads finished rows."""
    width = max(len(tokens) for tokens in generated)
    pad = config._pad_token_tensor
    if pad is None and config._eos_token_tensor is not None:
        pad = config._eos_token_tensor.flatten()[0]
    fill = int(pad) if pad is not None else 0
    new = torch.full((len(generated), width), fill, dtype=input_ids.dtype)
    for row, tokens in enumerate(generated):
        new[row, :len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)
