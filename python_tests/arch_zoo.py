"""A zoo of tiny random-weight decoder-only transformers models, one builder per architecture, for the
architecture-matrix tests (test_architectures.py); nothing touches the model hub.

Every builder returns a float32 causal LM in eval mode whose weights depend only on `seed` (built under
torch.random.fork_rng, so the global RNG is untouched), with a hidden size of 32 to 64, 2 to 4 layers,
pad_token_id = 0, eos_token_id = 1, no BOS, at least 256 positions, and `vocab` outputs (default
BYTE_VOCAB, for toy_models.byte_tokenizer(); pass len(merged_byte_tokenizer(words)) for a model over
that tokenizer).

Windows (sliding_window, window_size) are WINDOW = 6 tokens, much smaller than the 25 to 60 tokens of
prompt plus generation the tests use, so every windowed layer really drops keys.

`ARCHITECTURES` maps a name to its builder; each builder's docstring says what the entry covers.
Architectures left out, and why, are listed at the end of the file.
"""

from __future__ import annotations

import torch
import transformers

from toy_models import BYTE_VOCAB, EOS_ID, PAD_ID

WINDOW = 6  # sliding / local attention window, in tokens
POSITIONS = 512  # max_position_embeddings (and the like) of every model
HIDDEN = 64
HEADS = 4
# Weight init std: 5x the usual 0.02, and untied LM heads, so random models do not just repeat their last
# input token (a tied head scores the input embedding highest) and their greedy choices are not near-ties.
INIT = 0.1

COMMON = dict(pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=None)


def _build(model_class, config, seed: int):
    """model_class(config) with weights drawn from `seed`, float32, eval mode."""
    config.pad_token_id, config.eos_token_id, config.bos_token_id = PAD_ID, EOS_ID, None
    config.tie_word_embeddings = False
    config.initializer_range = INIT
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    model = model.to(torch.float32).eval()
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = PAD_ID, EOS_ID, None
    return model


def _alternating(layers: int, first: str = "sliding_attention", second: str = "full_attention") -> list[str]:
    return [first if i % 2 == 0 else second for i in range(layers)]


# ---- dense and grouped-query attention ----

def llama(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """Llama: dense multi-head attention (as many KV heads as query heads), RoPE, RMSNorm, SwiGLU."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=layers, num_attention_heads=HEADS,
                                      num_key_value_heads=HEADS, max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.LlamaForCausalLM, config, seed)


def llama_gqa(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """Llama with grouped-query attention: 4 query heads share 1 KV head (multi-query)."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=1,
                                      max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.LlamaForCausalLM, config, seed)


def qwen3(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """Qwen3: grouped-query attention (4 query heads, 2 KV heads) with per-head q/k RMSNorm and an explicit
    head_dim; no sliding window."""
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                      head_dim=16, max_position_embeddings=POSITIONS, use_sliding_window=False,
                                      **COMMON)
    return _build(transformers.Qwen3ForCausalLM, config, seed)


# ---- sliding window through layer_types ----

def gemma3(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 4):
    """Gemma-3 (text): sliding and full layers alternating through `layer_types` (window WINDOW), separate
    local / global RoPE bases, q/k norm, scaled embeddings, multi-query attention."""
    config = transformers.Gemma3TextConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                           num_hidden_layers=layers, num_attention_heads=HEADS,
                                           num_key_value_heads=1, head_dim=16, max_position_embeddings=POSITIONS,
                                           sliding_window=WINDOW, layer_types=_alternating(layers), **COMMON)
    return _build(transformers.Gemma3ForCausalLM, config, seed)


def gemma2(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 4):
    """Gemma-2: sliding / full layers via `layer_types` (window WINDOW) plus soft-capping of the attention
    logits (attn_logit_softcapping) and of the final logits (final_logit_softcapping); GQA."""
    config = transformers.Gemma2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                       num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                       head_dim=16, max_position_embeddings=POSITIONS, sliding_window=WINDOW,
                                       layer_types=_alternating(layers), attn_logit_softcapping=5.0,
                                       final_logit_softcapping=3.0, query_pre_attn_scalar=16, **COMMON)
    return _build(transformers.Gemma2ForCausalLM, config, seed)


def qwen2_sliding(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 4):
    """Qwen2 with use_sliding_window and explicit `layer_types` (full, sliding, full, sliding: the sliding
    layers are not a prefix), window WINDOW; GQA with q/k/v biases."""
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                      max_position_embeddings=POSITIONS, use_sliding_window=True,
                                      sliding_window=WINDOW,
                                      layer_types=_alternating(layers, "full_attention", "sliding_attention"),
                                      **COMMON)
    return _build(transformers.Qwen2ForCausalLM, config, seed)


# ---- sliding window through `sliding_window` alone (no layer_types) ----

def mistral(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """Mistral: every layer sliding, set by `sliding_window` = WINDOW alone (no layer_types); GQA."""
    config = transformers.MistralConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=POSITIONS, sliding_window=WINDOW, **COMMON)
    return _build(transformers.MistralForCausalLM, config, seed)


def phi3(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """Phi-3: every layer sliding through `sliding_window` = WINDOW alone; fused qkv / gate-up
    projections."""
    config = transformers.Phi3Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                     num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                     max_position_embeddings=POSITIONS, original_max_position_embeddings=POSITIONS,
                                     sliding_window=WINDOW, **COMMON)
    return _build(transformers.Phi3ForCausalLM, config, seed)


def starcoder2(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """StarCoder2: every layer sliding through `sliding_window` = WINDOW alone; LayerNorm, biases, GQA."""
    config = transformers.Starcoder2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                           num_hidden_layers=layers, num_attention_heads=HEADS,
                                           num_key_value_heads=2, max_position_embeddings=POSITIONS,
                                           sliding_window=WINDOW, **COMMON)
    return _build(transformers.Starcoder2ForCausalLM, config, seed)


# ---- local attention ----

def gpt_neo(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """GPT-Neo: global and local attention layers alternating (attention_types [[["global", "local"], n]])
    with local window_size = WINDOW; learned absolute positions; no 1/sqrt(d) scaling of scores."""
    config = transformers.GPTNeoConfig(vocab_size=vocab, hidden_size=HIDDEN, num_layers=layers,
                                       attention_types=[[["global", "local"], layers // 2]], num_heads=HEADS,
                                       intermediate_size=2 * HIDDEN, window_size=WINDOW,
                                       max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.GPTNeoForCausalLM, config, seed)


# ---- ALiBi ----

def bloom(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """BLOOM: ALiBi position biases (no position embeddings), embedding LayerNorm, fused qkv."""
    config = transformers.BloomConfig(vocab_size=vocab, hidden_size=HIDDEN, n_layer=layers, n_head=HEADS,
                                      **COMMON)
    return _build(transformers.BloomForCausalLM, config, seed)


def falcon_alibi(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """Falcon with alibi=True (ALiBi instead of RoPE), sequential (non-parallel) attention, multi-query."""
    config = transformers.FalconConfig(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=layers,
                                       num_attention_heads=HEADS, alibi=True, parallel_attn=False, multi_query=True,
                                       bias=True, max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.FalconForCausalLM, config, seed)


def mpt(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """MPT: ALiBi (attn_config alibi=True), no learned positions, no biases; layers in transformer.blocks."""
    config = transformers.MptConfig(vocab_size=vocab, d_model=HIDDEN, n_heads=HEADS, n_layers=layers,
                                    expansion_ratio=2, max_seq_len=POSITIONS,
                                    attn_config={"alibi": True, "alibi_bias_max": 8}, **COMMON)
    return _build(transformers.MptForCausalLM, config, seed)


# ---- parallel residual ----

def gpt_neox(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """GPT-NeoX: parallel residual (use_parallel_residual=True: attention and MLP both read the layer
    input), partial rotary (rotary_pct 0.25); layers in gpt_neox.layers."""
    config = transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=layers,
                                        num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                                        use_parallel_residual=True, rotary_pct=0.25,
                                        max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.GPTNeoXForCausalLM, config, seed)


def gptj(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """GPT-J: parallel attention + MLP with one LayerNorm, interleaved partial rotary (rotary_dim 8),
    biased LM head."""
    config = transformers.GPTJConfig(vocab_size=vocab, n_embd=HIDDEN, n_layer=layers, n_head=HEADS, rotary_dim=8,
                                     n_inner=2 * HIDDEN, n_positions=POSITIONS, **COMMON)
    return _build(transformers.GPTJForCausalLM, config, seed)


def falcon(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """Falcon (7B style): parallel attention (parallel_attn=True), RoPE, multi-query attention, no
    biases."""
    config = transformers.FalconConfig(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=layers,
                                       num_attention_heads=HEADS, alibi=False, parallel_attn=True, multi_query=True,
                                       bias=False, max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.FalconForCausalLM, config, seed)


def cohere(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """Cohere (Command-R): parallel attention + MLP from one LayerNorm, interleaved RoPE, logit_scale,
    tied embeddings, GQA."""
    config = transformers.CohereConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                       num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                       max_position_embeddings=POSITIONS, logit_scale=0.5, **COMMON)
    return _build(transformers.CohereForCausalLM, config, seed)


# ---- others ----

def gpt2(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """GPT-2: learned absolute position embeddings, Conv1D projections, tied LM head."""
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                                     n_positions=POSITIONS, **COMMON)
    return _build(transformers.GPT2LMHeadModel, config, seed)


def opt(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """OPT: learned positions with an offset of 2, layers in model.decoder.layers, ReLU MLP."""
    config = transformers.OPTConfig(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=layers,
                                    ffn_dim=2 * HIDDEN, num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN,
                                    max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.OPTForCausalLM, config, seed)


def phi(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """Phi-1/2: parallel attention + MLP, partial rotary (partial_rotary_factor 0.5), biased LM head."""
    config = transformers.PhiConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                    num_hidden_layers=layers, num_attention_heads=HEADS,
                                    max_position_embeddings=POSITIONS, partial_rotary_factor=0.5, **COMMON)
    return _build(transformers.PhiForCausalLM, config, seed)


def olmo2(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """OLMo-2: post-norm placement (norm after attention / MLP) and whole-projection q/k RMSNorm."""
    config = transformers.Olmo2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.Olmo2ForCausalLM, config, seed)


def stablelm(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """StableLM: partial rotary (0.25), LayerNorm, per-head qk LayerNorm and parallel residual enabled."""
    config = transformers.StableLmConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                         num_hidden_layers=layers, num_attention_heads=HEADS,
                                         num_key_value_heads=2, max_position_embeddings=POSITIONS,
                                         partial_rotary_factor=0.25, qk_layernorm=True,
                                         use_parallel_residual=True, **COMMON)
    return _build(transformers.StableLmForCausalLM, config, seed)


def granite(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 3):
    """Granite: Llama with embedding / residual / attention / logits multipliers (logits_scaling divides
    the logits)."""
    config = transformers.GraniteConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=POSITIONS, embedding_multiplier=4.0,
                                        residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=0.5,
                                        **COMMON)
    return _build(transformers.GraniteForCausalLM, config, seed)


def codegen(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """CodeGen: GPT-J-like parallel block with a fused, model-parallel-ordered qkv projection and partial
    rotary (rotary_dim 8)."""
    config = transformers.CodeGenConfig(vocab_size=vocab, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                                        rotary_dim=8, n_inner=2 * HIDDEN, n_positions=POSITIONS, n_ctx=POSITIONS,
                                        **COMMON)
    return _build(transformers.CodeGenForCausalLM, config, seed)


def gpt_bigcode(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """GPT-BigCode (SantaCoder / StarCoder 1): multi-query attention with a fused c_attn, learned positions."""
    config = transformers.GPTBigCodeConfig(vocab_size=vocab, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                                           n_positions=POSITIONS, multi_query=True, **COMMON)
    return _build(transformers.GPTBigCodeForCausalLM, config, seed)


def xglm(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """XGLM: sinusoidal positions (offset 2), scaled embeddings, layers in model.layers."""
    config = transformers.XGLMConfig(vocab_size=vocab, d_model=HIDDEN, num_layers=layers, attention_heads=HEADS,
                                     ffn_dim=2 * HIDDEN, max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.XGLMForCausalLM, config, seed)


def persimmon(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """Persimmon: fused qkv, qk LayerNorm, partial rotary (0.5), squared-ReLU MLP."""
    config = transformers.PersimmonConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                          num_hidden_layers=layers, num_attention_heads=HEADS,
                                          max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.PersimmonForCausalLM, config, seed)


def gpt_oss(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """GPT-OSS: learned attention sinks (a per-head extra logit in every softmax), sliding / full layers via
    `layer_types` (window WINDOW), a mixture of experts (4 experts, top 2), GQA with biases."""
    config = transformers.GptOssConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=HIDDEN,
                                       num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                       head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=WINDOW, layer_types=_alternating(layers),
                                       max_position_embeddings=POSITIONS,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)
    return _build(transformers.GptOssForCausalLM, config, seed)


def smollm3(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 4):
    """SmolLM3: NoPE layers (every 2nd layer has no rotary embedding: no_rope_layer_interval=2), GQA."""
    config = transformers.SmolLM3Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=POSITIONS, no_rope_layer_interval=2,
                                        use_sliding_window=False, **COMMON)
    return _build(transformers.SmolLM3ForCausalLM, config, seed)


def exaone4(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 4):
    """EXAONE-4: hybrid attention (sliding layers with RoPE, full layers without: NoPE) via `layer_types`,
    window WINDOW, post-norm (norm after attention / MLP) and q/k norm."""
    config = transformers.Exaone4Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=POSITIONS, sliding_window=WINDOW,
                                        layer_types=_alternating(layers), **COMMON)
    return _build(transformers.Exaone4ForCausalLM, config, seed)


def cohere2(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 4):
    """Cohere-2 (Command-R7B): sliding layers with RoPE and full layers without (NoPE) via `layer_types`,
    window WINDOW, parallel attention + MLP, logit_scale."""
    config = transformers.Cohere2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=POSITIONS, sliding_window=WINDOW,
                                        layer_types=_alternating(layers), logit_scale=0.5, **COMMON)
    return _build(transformers.Cohere2ForCausalLM, config, seed)


def mixtral(vocab: int = BYTE_VOCAB, seed: int = 0, layers: int = 2):
    """Mixtral: a sparse mixture of experts (4 experts, top 2) with every layer sliding through
    `sliding_window` = WINDOW alone."""
    config = transformers.MixtralConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=HIDDEN,
                                        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                        num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                        max_position_embeddings=POSITIONS, **COMMON)
    return _build(transformers.MixtralForCausalLM, config, seed)


ARCHITECTURES = {
    # dense / grouped-query attention
    "llama": llama,
    "llama_gqa": llama_gqa,
    "qwen3": qwen3,
    # sliding window via layer_types
    "gemma3": gemma3,
    "gemma2": gemma2,
    "qwen2_sliding": qwen2_sliding,
    # sliding window via sliding_window alone
    "mistral": mistral,
    "phi3": phi3,
    "starcoder2": starcoder2,
    "mixtral": mixtral,
    # local attention
    "gpt_neo": gpt_neo,
    # ALiBi
    "bloom": bloom,
    "falcon_alibi": falcon_alibi,
    "mpt": mpt,
    # parallel residual
    "gpt_neox": gpt_neox,
    "gptj": gptj,
    "falcon": falcon,
    "cohere": cohere,
    # others
    "gpt2": gpt2,
    "opt": opt,
    "phi": phi,
    "olmo2": olmo2,
    "stablelm": stablelm,
    "granite": granite,
    "codegen": codegen,
    "gpt_bigcode": gpt_bigcode,
    "xglm": xglm,
    "persimmon": persimmon,
    "gpt_oss": gpt_oss,
    "smollm3": smollm3,
    "exaone4": exaone4,
    "cohere2": cohere2,
}

# Left out: none so far (every architecture above builds and runs generate() in transformers 5.23).
