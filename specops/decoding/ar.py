"""Autoregressive decoding (method "ar"): one target forward per token. The baseline every
speculative method is measured against, on the same engine."""

from __future__ import annotations

import time

import torch

from specops.decoding.engine import Batch, CausalLM, KVState, SamplingParams, Stats, sample_tokens


def prefill(lm: CausalLM, batch: Batch, stats: Stats, tokenizer=None) -> tuple[KVState, torch.Tensor]:
    """Run the prompts through a model (encoded by `tokenizer` when it is not the target's); returns its
    state and the logits [B, V] at the last position."""
    start = time.perf_counter()
    state = KVState(lm, batch.rows)
    ids, mask = (batch.prompt_ids, batch.prompt_mask) if tokenizer is None else batch.encode(tokenizer)
    logits = state.append(ids, mask.bool(), keep=1)
    stats.prefill_seconds += time.perf_counter() - start
    return state, logits[:, -1]


def decode_ar(target: CausalLM, batch: Batch, params: SamplingParams, seeds: torch.Tensor, stats: Stats) -> None:
    state, logits = prefill(target, batch, stats)
    stats.target_calls += 1
    step = 0
    while batch.rows:
        start = time.perf_counter()
        tokens = sample_tokens(logits, params, seeds, step)
        stats.verify_seconds += time.perf_counter() - start
        finished, _ = batch.emit([[t] for t in tokens.tolist()])
        survivors = batch.drop(finished)
        if survivors is not None:
            if not batch.rows:
                break
            state.select(survivors)
            seeds, tokens = seeds[survivors], tokens[survivors]
        start = time.perf_counter()
        logits = state.append(tokens.unsqueeze(1))[:, -1]
        stats.verify_seconds += time.perf_counter() - start
        stats.target_calls += 1
        stats.steps += 1
        step += 1
