"""The sweep over transformers' whole causal-LM mapping: for every model type in
`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, a tiny random model (`tiny`), a ragged batch, and each method of
CASES through `specops.decode`; every case must be exact (each row's greedy tokens equal the model's own
`generate()` on that prompt alone) or refused before decoding with a ValueError that names the model's
class and lists only methods that work. Nothing downloads.

Each type runs in a worker process with a time limit (`sweep`): a type that crashes the interpreter or
hangs is recorded as such and the sweep goes on in a fresh worker.

    python python_tests/causal_lm_sweep.py [--types a,b] [--workers 2] [--markdown docs/...md]

runs it and prints (or writes) the table; test_causal_lm_sweep.py runs it in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import select
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["abcab", "the cat; the cat; ", "Hello hello, Hello"]
MAX_NEW = 10
# id -> decode keyword arguments; "sampled" runs twice with one seed and must repeat itself.
CASES = {
    "ar": dict(method="ar"),
    "sd": dict(method="sd", drafter="self:1", num_draft_tokens=3),
    "ngram": dict(method="ngram", options={"tables": "none"}, num_draft_tokens=(2, 3)),
    "rsd-c": dict(method="rsd-c", drafter="self:1", num_draft_tokens=(2, 2)),
    "sampled": dict(method="sd", drafter="self:1", num_draft_tokens=3, temperature=1.0, seed=0),
}
TIME_LIMIT = 120  # seconds per model type, all cases together

# Query heads (4; key/value heads follow them: _KV_HEADS) and expert counts (4, top-k at most 2: _TOP_K).
_HEADS = ("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "num_heads")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num")
# Config fields set on every model type (and on each sub-config) where the default config has them: each is
# lowered to its size here (never raised); a per-layer list of such a field is lowered element-wise.
_SHRINK = {
    64: ("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "dim", "model_dim", "hidden_dim",
         "word_embed_proj_dim", "embedding_size", "text_hidden_size", "projection_dim", "emb_dim",
         "shape_embed_dim", "pronunciation_embed_dim",
         # widths that must equal a hidden size: this config's or another one's (also made 64)
         "adapter_in_dim", "adapter_input_size", "adapter_out_dim", "hidden_size_global", "out_hidden_size"),
    4: _HEADS + _EXPERTS + (
        "encoder_attention_heads", "index_n_heads", "swa_num_attention_heads", "linear_num_heads",
        "linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads", "mamba_num_heads",
        "n_mamba_heads"),
    128: ("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "ffn_hidden_size", "d_ff", "dff",
          "dim_ff", "d_inner", "intermediate_size_mlp", "dense_intermediate_size", "mlp_dim",
          "encoder_ffn_dim", "feed_forward_size", "moe_intermediate_size", "expert_intermediate_size",
          "expert_ffn_hidden_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
          "moe_shared_expert_intermediate_size", "shared_intermediate_size",
          "prefix_dense_intermediate_size"),
    16: ("head_dim", "d_kv", "kv_channels", "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim",
         "attention_head_size", "dim_head", "global_head_dim", "index_head_dim", "swa_head_dim",
         "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim", "hidden_size_per_layer_input"),
    # low-rank projections (MLA's latent key/value and query ranks) and state-space sizes
    32: ("kv_lora_rank", "q_lora_rank", "o_lora_rank", "hc_lowrank", "mamba_d_state", "ssm_state_size",
         "state_size", "mamba_chunk_size", "chunk_size"),
    # partial rotary dimensions, within the shrunk head size (16)
    8: ("rotary_dim",),
}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
                 "num_decoder_layers")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv",
             "swa_num_key_value_heads", "num_query_groups")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_top_k", "moe_topk", "top_k_experts")
# Expert-group routing (DeepSeek-V3 style): at most 2 groups of the 4 experts, 1 group chosen per token;
# state-space models' groups, at most 2, dividing their 4 heads.
_GROUPS = {"n_group": 2, "num_expert_group": 2, "topk_group": 1, "n_groups": 2}
# State-space heads: (heads, head size, expansion); the heads' total stays expansion * hidden size.
_SSM_HEADS = (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand"),
              ("mamba_num_heads", "mamba_head_dim", "expand"),
              ("n_mamba_heads", "mamba_headdim", "mamba_expand"))
# Sizes of extra embedding tables (per-layer inputs, hashed byte n-grams, RoCBert's glyph shapes and
# pronunciations): the byte vocabulary's at most.
_VOCABS = ("vocab_size_per_layer_input", "encoder_hash_byte_group_vocab", "shape_vocab_size",
           "pronunciation_vocab_size")
# Layer-count dependent integers: the first k layers (dense ones, ...), the last k (sharing the KV cache
# of earlier ones), an inclusive last index. Kept true of the same layers when layers are dropped.
_FIRST_K = ("first_k_dense_replace", "max_window_layers", "num_dense_layers", "moe_layer_start_index")
_LAST_K = ("num_kv_shared_layers",)
_LAST_INDEX = ("moe_layer_end_index",)
_SIZES = {name: size for size, names in _SHRINK.items() for name in names}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrunk(values: dict, fixed: dict | None = None) -> dict:
    """`values` (a config dict) with the sizes of _SHRINK (or `fixed` ones) and the consistency they need:
    key/value heads (2, or all heads where the default has as many as query heads: MHA and latent
    attention), top-k experts, expert groups, a head_dim left to None (derived) made explicit, ..."""
    from toy_models import BYTE_VOCAB

    out = dict(values)
    for name, size in _SIZES.items():
        value = out.get(name)
        if _is_int(value) and value > size:
            out[name] = size
        elif isinstance(value, list) and value and all(_is_int(v) for v in value):
            out[name] = [min(v, size) for v in value]
    fixed = fixed or {}
    out.update(fixed)
    heads = next((name for name in _HEADS if _is_int(values.get(name))), None)
    for name in _KV_HEADS:
        if name in fixed:
            continue
        if _is_int(values.get(name)):
            full = heads is not None and values[name] == values[heads]
            out[name] = out[heads] if full else min(values[name], 2)
        elif name in values and values[name] is None and heads:  # unset: as many as query heads
            out[name] = out[heads]
    experts = any(_is_int(out.get(name)) for name in _EXPERTS)
    for name in _TOP_K:
        if _is_int(out.get(name)):
            out[name] = min(out[name], 2)
        elif name in out and out[name] is None and experts:  # DeepSeek-V2's default leaves it unset
            out[name] = 2
    for name, size in _GROUPS.items():
        if _is_int(out.get(name)) and out[name] > size:
            out[name] = size
    if "head_dim" in out and out["head_dim"] is None and heads and _is_int(out.get("hidden_size")):
        out["head_dim"] = out["hidden_size"] // out[heads]
    # A head size that was the sum of latent attention's two query parts (no position / rotary) stays so.
    parts = [values.get("qk_nope_head_dim"), values.get("qk_rope_head_dim")]
    for name in ("head_dim", "qk_head_dim"):
        if all(map(_is_int, parts)) and _is_int(values.get(name)) and values[name] == sum(parts):
            out[name] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    hidden = next((out[n] for n in _SHRINK[64] if _is_int(out.get(n))), None)
    for heads_name, size_name, expand_name in _SSM_HEADS:
        old = [values.get(n) for n in (heads_name, size_name, expand_name)]
        if all(map(_is_int, old)) and hidden and old[0] * old[1] == old[2] * values.get("hidden_size", -1):
            out[size_name] = out[expand_name] * hidden // out[heads_name]
    ssm = [values.get(n) for n in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head")]
    if all(map(_is_int, ssm)) and ssm[0] == ssm[1] * ssm[2]:  # Falcon-H1's heads' total
        out["mamba_d_ssm"] = out["mamba_n_heads"] * out["mamba_d_head"]
    for name in _VOCABS:
        if _is_int(out.get(name)) and out[name] > BYTE_VOCAB:
            out[name] = BYTE_VOCAB
    return out


def _index_list(name: str, value, layers: int) -> bool:
    """Whether `value` is a list of layer indices (the MoE layers, the cross-attention layers, ...)."""
    return (isinstance(value, list) and any(word in name for word in ("layer", "idx", "ids", "indices"))
            and all(_is_int(v) and 0 <= v < layers for v in value) and value == sorted(set(value)))


def _kept_layers(values: dict, layers: int) -> list[int]:
    """Which of the default config's `layers` layers the tiny model keeps: the first layer of each kind
    (its entries in the per-layer lists with few distinct values, whether an index list names it, which
    fields `per_layer_config` overrides for it, and whether it is among the first / last k of _FIRST_K /
    _LAST_K), at least two. So a model of sliding and full attention keeps one of each, a model whose first
    layers are dense and the rest MoE keeps one of each, and so on."""
    kinds: list[list] = [[] for _ in range(layers)]
    overrides = {int(k): v for k, v in (values.get("per_layer_config") or {}).items()}
    for name, value in values.items():
        if _index_list(name, value, layers):
            for i in range(layers):
                kinds[i].append(i in value)
        elif isinstance(value, list) and len(value) == layers and len(set(map(repr, value))) <= 4:
            for i in range(layers):
                kinds[i].append(repr(value[i]))
        elif name in _FIRST_K + _LAST_K + _LAST_INDEX and _is_int(value):
            for i in range(layers):
                kinds[i].append(i < value if name in _FIRST_K else i >= layers - value if name in _LAST_K
                                else i <= value)
    for i in range(layers):
        kinds[i].append(tuple(sorted(overrides.get(i, {}))))
    first = {}
    for i, kind in enumerate(kinds):
        first.setdefault(repr(kind), i)
    kept = sorted(first.values())
    for i in range(layers):
        if len(kept) >= 2:
            break
        if i not in kept:
            kept = sorted(kept + [i])
    return kept


def _fewer_layers(values: dict) -> dict:
    """The fields that cut the config dict `values` to the layers _kept_layers chooses: the layer count,
    every per-layer list and index list, per_layer_config (sized by _shrunk, its overrides kept different
    from the global values), and the layer-count dependent integers."""
    name = next((n for n in _LAYER_COUNTS if _is_int(values.get(n))), None)
    if name is None or values[name] <= 2:
        return {}
    layers = values[name]
    kept = _kept_layers(values, layers)
    small = _shrunk(values)
    out = {n: len(kept) for n in _LAYER_COUNTS if _is_int(values.get(n)) and values[n] == layers}
    for key, value in values.items():
        if _index_list(key, value, layers):
            out[key] = [j for j, i in enumerate(kept) if i in value]
        elif isinstance(value, list) and len(value) == layers:
            out[key] = [small[key][i] for i in kept]
        elif key in _FIRST_K and _is_int(value):
            out[key] = sum(1 for i in kept if i < value)
        elif key in _LAST_K and _is_int(value):
            out[key] = sum(1 for i in kept if i >= layers - value)
        elif key in _LAST_INDEX and _is_int(value):
            out[key] = sum(1 for i in kept if i <= value) - 1
    if values.get("per_layer_config"):
        overrides = {int(k): v for k, v in values["per_layer_config"].items()}
        out["per_layer_config"] = {}
        for j, i in enumerate(kept):
            if i not in overrides:
                continue
            merged = {**values, **overrides[i]}
            # An override that the global value's size would swallow stays apart from it: double or half.
            fixed = {key: small[key] * 2 if value > values[key] else max(1, small[key] // 2)
                     for key, value in overrides[i].items()
                     if _is_int(value) and _is_int(values.get(key)) and value != values[key]
                     and _shrunk(merged)[key] == small[key]}
            layer = _shrunk(merged, fixed)
            out["per_layer_config"][j] = {key: v for key, v in layer.items()
                                          if key in overrides[i] or (_is_int(v) and v != small.get(key))}
    return out


def _field(cfg, key: str):
    """`cfg`'s attribute `key`, also where a heterogeneous config refuses to give a per-layer one."""
    get = getattr(cfg, "_getattr_without_heterogeneous_validation", None)
    return get(key, None) if get is not None else getattr(cfg, key, None)


def _may_be_none(cfg, key: str) -> bool:
    """Whether `cfg`'s class accepts None for the field `key` (a strict config may type it a plain int)."""
    fields = {f.name: f for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else {}
    return key not in fields or "None" in str(fields[key].type) or "Optional" in str(fields[key].type)


def _config_kwargs(cfg, model_type: str) -> dict:
    """Keyword arguments that rebuild `cfg`'s class small: _shrunk's sizes, _fewer_layers' layers, the byte
    vocabulary and special ids (no bos where the class allows none), larger initial weights, an untied head;
    sub-configs likewise, as dicts."""
    import transformers
    from toy_models import BYTE_VOCAB, EOS_ID, PAD_ID

    values = cfg.to_dict()
    small = {**_shrunk(values), **_fewer_layers(values)}
    kwargs = {k: v for k, v in small.items() if k not in values or v != values[k]}
    for key in values:
        sub = _field(cfg, key)
        if isinstance(sub, transformers.PretrainedConfig):
            kwargs[key] = {**sub.to_dict(), **_config_kwargs(sub, model_type)}
    for name in ("vocab_size", "unpadded_vocab_size"):  # the latter: the head's, where the table is padded
        if name in values:
            kwargs[name] = BYTE_VOCAB
    bos = None if _may_be_none(cfg, "bos_token_id") else PAD_ID
    for name, value in (("pad_token_id", PAD_ID), ("eos_token_id", EOS_ID), ("bos_token_id", bos),
                        ("decoder_start_token_id", PAD_ID)):
        if name in values:
            kwargs[name] = value
    # No generation rules from the real vocabulary: forced first / last ids, suppressed ids.
    for name in ("forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
        if values.get(name) is not None and _may_be_none(cfg, name):
            kwargs[name] = None
    if "is_decoder" in values:  # causal self-attention: BERT-like encoders' LM heads need it set
        kwargs["is_decoder"] = True
    if "initializer_range" in values:
        kwargs["initializer_range"] = 0.1
    if "tie_word_embeddings" in values:
        kwargs["tie_word_embeddings"] = False
    return kwargs


# Qwen4-Exp's token indexer for its indexed-attention layers: 4 heads of 16, over blocks of 4 tokens, 8
# tokens at most.
_QSA = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
        "indexer_compress_ratio": 4}


def tiny_config(model_type: str):
    """The default config of `model_type` rebuilt small (_config_kwargs) over the byte tokenizer's vocabulary,
    with FIXES[model_type] on top: through the config class's own constructor, so fields it derives from
    the sizes (layer types, per-layer settings) follow them."""
    import transformers

    if model_type in NOT_BUILDABLE:
        raise NotImplementedError(f"{model_type} is not built as a causal LM: {NOT_BUILDABLE[model_type]}")
    cls = transformers.CONFIG_MAPPING[model_type]
    kwargs = _config_kwargs(cls(), model_type)
    for key, value in FIXES.get(model_type, {}).items():  # a dict for a sub-config updates it
        kwargs[key] = {**kwargs[key], **value} if isinstance(kwargs.get(key), dict) else value
    return cls(**kwargs)


# Per-type config fixes on top of the generic shrinking: type -> fields (a sub-config's: a dict of them).
FIXES: dict[str, dict] = {
    # Hybrids whose layer pattern does not follow from per-layer lists: one state-space (recurrent) layer
    # and one attention layer (the defaults give Bamba and Granite-MoE-Hybrid none, the other two none in
    # their first 2 layers).
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Cohere Compass keys its RoPE settings by layer type, and the default config has none at all.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                   "rope_theta": 1e4}}},
    # The attention reads attn_config.rope_theta, a field DbrxAttentionConfig does not define, and clamps
    # q/k/v to clip_qkv, which must then be set (DBRX's own value is 8).
    "dbrx": {"attn_config": {"rope_theta": 1e4, "clip_qkv": 8.0}},
    # Input, looped and output blocks of one layer each (the counts must add up to the layers).
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # The default config leaves the MoE unset (no experts, no top-k).
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # The looped span must be whole attention-residual blocks (6 layers by default) inside the 2 layers.
    "inkling2_loop_text": {"n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1,
                           "loop_layer_index_end": 2},
    # The default config has no layer types; attention everywhere, like LFM2's default.
    "lfm2_moe": {"layer_types": ["full_attention", "full_attention"]},
    # The causal LM is the decoder (MusicgenForCausalLM takes config.decoder); one codebook, so that a
    # row of token ids is one sequence; generate() pads its codebook delay pattern with the start id.
    "musicgen": {"decoder": {"num_codebooks": 1, "decoder_start_token_id": 0}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1, "decoder_start_token_id": 0}},
    # The indexed-attention layers' token indexer (QSA) has no default sizes.
    "qwen4_exp_text": _QSA,
    "qwen4_exp": {"text_config": _QSA},
    # The axial position embeddings' two parts must add up to the hidden size.
    "reformer": {"axial_pos_embds_dim": [32, 32]},
    # X-MOD routes through per-language adapters and needs a language for plain token ids.
    "xmod": {"default_language": "en_XX"},
}

# The causal LM of these types takes a sub-config of the type's config: type -> its field.
_CAUSAL_LM_SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}

# Types that cannot run as a causal LM on text alone, without outside files: type -> why.
NOT_BUILDABLE: dict[str, str] = {
    "gemma3n": "Gemma3nForConditionalGeneration builds its vision tower through timm (TimmWrapperModel), "
               "which is not installed; gemma3n_text covers the text model",
    "gemma4_assistant": "a drafter head for a Gemma 4 target: its forward needs the target's input "
                        "embeddings and shared KV states (inputs_embeds, shared_kv_states), not token ids",
    "gemma4_unified_assistant": "the same drafter head for Gemma 4 Unified: its forward needs the target's "
                                "inputs_embeds and shared_kv_states, not token ids",
}


def tiny(model_type: str, seed: int = 0):
    """A float32 eval-mode model of `model_type` from AutoModelForCausalLM with weights from `seed`."""
    import torch
    import transformers
    from toy_models import EOS_ID, PAD_ID
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if model_type in _CAUSAL_LM_SUB_CONFIG:
            model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
            model = model_cls(getattr(config, _CAUSAL_LM_SUB_CONFIG[model_type]))
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(torch.float32).eval()
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = PAD_ID, EOS_ID, None
    return model


def _cut_at_eos(tokens: list[int]) -> list[int]:
    from toy_models import EOS_ID
    return tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def _generate_alone(model, tok, prompt: str) -> list[int]:
    import torch
    from toy_models import EOS_ID, PAD_ID

    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_NEW, pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    return _cut_at_eos(out[0, ids.shape[1]:].tolist())


def _greedy_no_cache(model, tok, prompt: str) -> list[int]:
    """Greedy decoding by a full forward over the whole sequence per token, no cache: the definition."""
    import torch
    from toy_models import EOS_ID

    ids = tok(prompt)["input_ids"]
    new: list[int] = []
    with torch.inference_mode():
        for _ in range(MAX_NEW):
            x = torch.tensor([ids + new])
            token = int(model(input_ids=x, use_cache=False).logits[0, -1].argmax())
            new.append(token)
            if token == EOS_ID:
                break
    return new


_WORKS = re.compile(r"[Mm]ethods that work (?:with|on) (?:it|the target \([A-Za-z0-9_]+\)): ([a-z0-9, -]+)")

# Types whose generate() is not a text generator, so the reference is greedy decoding by full forwards.
REFERENCE_IS_FORWARD = {
    "musicgen": "MusicGen's generate() interleaves audio codebooks with a delay pattern",
    "musicgen_melody": "MusicGen's generate() interleaves audio codebooks with a delay pattern",
}


def check_type(model_type: str) -> dict:
    """Every case of CASES on a tiny `model_type`: {"type", "class", "build", "reference", case: status}.
    A case's status is "exact", "refused: <message>", "differs: <detail>" or "error: <exception>"."""
    import torch
    import specops
    from toy_models import EOS_ID, byte_tokenizer

    torch.set_num_threads(1)
    result: dict = {"type": model_type}
    try:
        model = tiny(model_type)
    except Exception as exc:  # noqa: BLE001 - a type that cannot be built is recorded, not fatal
        result["build"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return result
    result["class"] = type(model).__name__
    result["build"] = "ok"
    tok = byte_tokenizer()
    try:
        from specops.decoding.engine import CausalLM
        from specops.decoding.probe import chain_support
        result["rows apart"] = chain_support(CausalLM(model), list(range(2, 40))).ragged is not None
    except Exception:  # noqa: BLE001 - decode refuses such a model itself; the cases say how
        result["rows apart"] = None
    reference = None
    if model_type in REFERENCE_IS_FORWARD:
        result["reference"] = f"full forwards: {REFERENCE_IS_FORWARD[model_type]}"
    else:
        try:
            reference = [_generate_alone(model, tok, p) for p in PROMPTS]
            result["reference"] = "generate"
        except Exception as exc:  # noqa: BLE001
            result["reference"] = f"generate fails: {type(exc).__name__}: {str(exc)[:160]}"
    try:
        definition = [_greedy_no_cache(model, tok, p) for p in PROMPTS]
    except Exception as exc:  # noqa: BLE001
        result["build"] = f"the model's own forward fails: {type(exc).__name__}: {str(exc)[:160]}"
        return result
    if reference is None:
        reference = definition
    elif reference != definition:
        # generate()'s cached decoding disagrees with the model's own forward (RoBERTa-style decoders get
        # 0-based position ids from generate() but count from padding_idx + 1 in their forward): the
        # forward defines the model.
        result["reference"] = "full forwards (generate() differs from them)"
        reference = definition
    for case, kwargs in CASES.items():
        streamed: list = []
        try:
            out = specops.decode(PROMPTS, target=model, tokenizer=tok, max_new_tokens=MAX_NEW,
                                 stream=lambda i, text: streamed.append(i), **kwargs)
            if case == "sampled":
                again = specops.decode(PROMPTS, target=model, tokenizer=tok, max_new_tokens=MAX_NEW, **kwargs)
                with torch.inference_mode():
                    vocab = model(input_ids=torch.tensor([[2, 3]]), use_cache=False).logits.shape[-1]
                bad = [t for row in out.tokens for t in row if not 0 <= t < vocab]
                if bad:
                    result[case] = f"differs: ids outside the vocabulary {bad[:3]}"
                elif again.tokens != out.tokens:
                    result[case] = "differs: the same seed gave other tokens"
                elif any(EOS_ID in row[:-1] or (len(row) != MAX_NEW and row[-1:] != [EOS_ID]) for row in out.tokens):
                    result[case] = f"differs: rows not ended at EOS or {MAX_NEW} tokens: {out.tokens}"
                else:
                    result[case] = "exact"
                continue
            rows = [r for r, (got, want) in enumerate(zip(out.tokens, reference)) if got != want]
            if not rows:
                result[case] = "exact"
            else:
                r = rows[0]
                alone = "the row alone is exact" if out.tokens[r] == definition[r] else ""
                result[case] = (f"differs: row {r} {out.tokens[r]} vs {reference[r]}"
                                + (f" ({alone})" if alone else ""))
        except ValueError as exc:
            message = str(exc)
            if streamed:
                result[case] = f"error: ValueError after decoding began: {message[:300]}"
            elif result["class"] not in message:
                result[case] = f"error: refusal does not name {result['class']}: {message[:300]}"
            else:
                result[case] = f"refused: {message}"
        except Exception as exc:  # noqa: BLE001
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
            result[case] = f"error: {type(exc).__name__} at {where}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return result


def verdict(result: dict) -> list[str]:
    """What is wrong with one type's result: crashes, errors, silent differences, and refusals whose list
    of working methods names a method that did not work. Empty when the type passes."""
    problems = []
    if "crash" in result:
        return [f"{result['type']}: {result['crash']}"]
    if result.get("build") != "ok":
        return []
    exact = {case for case in CASES if result.get(case) == "exact"}
    for case in CASES:
        status = result.get(case, "missing")
        if status.startswith(("error", "differs", "missing")):
            problems.append(f"{result['type']} {case}: {status}")
        elif status.startswith("refused"):
            listed = _WORKS.search(status)
            if listed is None:
                problems.append(f"{result['type']} {case}: refusal lists no working methods: {status[:200]}")
                continue
            for method in (m.strip() for m in listed.group(1).split(",")):
                ran = [c for c, kw in CASES.items() if kw["method"] == method and c != "sampled"]
                if ran and not set(ran) <= exact:
                    problems.append(f"{result['type']} {case}: refusal lists {method!r}, which did not work")
    return problems


# ---- the worker protocol: one JSON line in (a type), one JSON line out (its result) ----

def _worker() -> None:
    sys.path.insert(0, HERE)
    import warnings
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    protocol = sys.stdout
    for line in sys.stdin:
        model_type = json.loads(line)
        start = time.perf_counter()
        # What a model prints (Reformer prints warnings) goes nowhere: stdout carries only the results.
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            result = check_type(model_type)
        result["seconds"] = round(time.perf_counter() - start, 1)
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()


class _Worker:
    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.job: str | None = None
        self.since = 0.0

    def give(self, model_type: str) -> None:
        self.job, self.since = model_type, time.monotonic()
        self.proc.stdin.write(json.dumps(model_type) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> str:
        self.proc.kill()
        _, err = self.proc.communicate()
        return err


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(types: list[str], workers: int = 2, limit: float = TIME_LIMIT, progress=None) -> dict[str, dict]:
    """check_type for every type, in `workers` worker processes; a worker that dies or passes `limit`
    seconds on one type is replaced, and the type recorded with "crash"."""
    queue = list(types)
    results: dict[str, dict] = {}
    pool: list[_Worker] = []
    while queue or any(w.job for w in pool):
        while queue and sum(1 for w in pool if w.job is None) == 0 and len(pool) < workers:
            pool.append(_Worker())
        for w in pool:
            if w.job is None and queue:
                w.give(queue.pop(0))
        busy = [w for w in pool if w.job]
        ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], 1.0)
        for w in list(busy):
            if w.proc.stdout in ready:
                line = w.proc.stdout.readline()
                if line:
                    result = json.loads(line)
                else:
                    err = w.stop().strip().splitlines()
                    result = {"type": w.job, "crash": f"the worker died (exit {w.proc.returncode}): "
                              + (err[-1][:200] if err else "")}
                    pool.remove(w)
            elif time.monotonic() - w.since > limit:
                w.stop()
                result = {"type": w.job, "crash": f"no result within {limit:.0f} s"}
                pool.remove(w)
            else:
                continue
            results[result["type"]] = result
            w.job = None
            if progress:
                progress(result)
    for w in pool:
        w.proc.stdin.close()
        w.proc.wait()
    return results


_WHY = (("cannot be decoded with a KV cache", "no usable KV cache"),
        ("cannot be rolled back", "recurrent state"),
        ("scores draft trees", "draft trees"),
        ("cannot draft for the target", "self:N"))


def _cell(status: str | None) -> str:
    if status is None:
        return ""
    if status.startswith("refused"):
        why = next((short for phrase, short in _WHY if phrase in status), "")
        return f"refused ({why})" if why else "refused"
    return status.split(":")[0]


def markdown(results: dict[str, dict]) -> str:
    """The sweep as a markdown table: one row per type, one column per case, and whether its rows were
    decoded apart (probe.chain_support: left padding shifts its positions)."""
    header = ("| model type | class | rows | " + " | ".join(f"`{c}`" for c in CASES) + " |\n"
              + "|---|---|---|" + "---|" * len(CASES) + "\n")
    rows = []
    for name in sorted(results):
        r = results[name]
        if "crash" in r:
            rows.append(f"| {name} | | | crash: {r['crash']} |" + " |" * (len(CASES) - 1))
        elif r.get("build") != "ok":
            rows.append(f"| {name} | not built here: {r['build'][:120]} | |" + " |" * len(CASES))
        else:
            apart = "apart" if r.get("rows apart") else "batched"
            rows.append(f"| {name} | {r['class']} | {apart} | " + " | ".join(_cell(r.get(c)) for c in CASES) + " |")
    return header + "\n".join(rows) + "\n"


def counts(results: dict[str, dict]) -> dict[str, int]:
    built = [r for r in results.values() if r.get("build") == "ok"]
    return {
        "types": len(results),
        "could not build": sum(1 for r in results.values() if "crash" not in r and r.get("build") != "ok"),
        "every case exact": sum(1 for r in built if all(r.get(c) == "exact" for c in CASES)),
        "some cases refused, the rest exact": sum(
            1 for r in built if all(r.get(c, "").startswith(("exact", "refused")) for c in CASES)
            and any(r.get(c, "").startswith("refused") for c in CASES) and not verdict(r)),
        "failing": sum(1 for r in results.values() if verdict(r)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--types", help="comma-separated model types (default: the whole mapping)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--markdown", help="write the table (markdown) here")
    args = parser.parse_args()
    if args.worker:
        _worker()
        return
    sys.path.insert(0, HERE)
    types = args.types.split(",") if args.types else all_types()
    start = time.perf_counter()

    def progress(result):
        problems = verdict(result)
        print(f"{result['type']:28s} {result.get('seconds', '-'):>6} s  "
              + ("; ".join(problems) if problems else "ok" if result.get("build") == "ok"
                 else f"not built: {result.get('build')}"), flush=True)

    results = sweep(types, args.workers, progress=progress)
    print(f"{len(types)} types in {time.perf_counter() - start:.0f} s: {counts(results)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results))


if __name__ == "__main__":
    main()
