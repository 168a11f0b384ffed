"""String-level exact match (method "slem", paper 000 Alg 2): a drafter with any vocabulary drafts
text, the text is re-encoded in the target's tokens, and the target keeps the drafts it would have
produced itself.

Each step, per request:
1. The drafter (its own KV cache, its own encoding of the prompt) proposes k tokens.
2. Their bytes are re-encoded by the target's tokenizer behind a look-behind of the last target tokens:
   tokenizers merge across boundaries (" fo" + "o" is " foo"), so the window's tokens must come back
   unchanged for the drafts after them to be the target's tokens; the widest window that does wins.
3. One target forward scores them; `chain_verify` with one-hot drafts accepts while they match the
   target's greedy token, or, when sampling, keeps each draft with probability p(draft) and otherwise
   samples from p without it: the target's own sample, so the output follows the target exactly.
4. Re-alignment: the drafter keeps the longest run of its drafts whose text the target emitted, and
   reads the rest of the emitted text in its own tokens. Both caches persist across steps.
"""

from __future__ import annotations

import time

import torch

from specops import ops
from specops.decoding.ar import prefill
from specops.decoding.draft_length import DraftLength
from specops.decoding.engine import Batch, CausalLM, KVState, SamplingParams, Stats, sample_tokens
from specops.decoding.sd import DraftVocab, close_step, drop_finished, prompt_rows, run_drafter
from specops.vocab import VocabMap

LOOK_BEHIND = 4  # target tokens re-encoded with each draft
_HISTORY = 16


def _valid_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters, as text."""
    for cut in range(min(4, len(data)) + 1):
        try:
            return data[:len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace")


def matched(tokens: list[int], emitted: bytes, token_bytes: list) -> tuple[int, int]:
    """(how many of `tokens` spell a prefix of `emitted`, the bytes they cover): the drafter keeps
    those and reads the rest of the emitted text in its own tokens."""
    count, covered = 0, 0
    for token in tokens:
        piece = token_bytes[token] or b""
        if not piece or emitted[covered:covered + len(piece)] != piece:
            break
        count, covered = count + 1, covered + len(piece)
    return count, covered


class _Text:
    """Moves text between the two tokenizers."""

    def __init__(self, vmap: VocabMap, target_tokenizer, drafter_tokenizer):
        self.vmap = vmap
        self.target_tokenizer = target_tokenizer
        self.drafter_tokenizer = drafter_tokenizer
        self.single = [vmap.draft.canonical.get(bytes([b])) for b in range(256)]
        self.stand_in = next((i for i in (getattr(drafter_tokenizer, "unk_token_id", None),
                                          getattr(drafter_tokenizer, "eos_token_id", None)) if i is not None), 0)

    def to_target(self, history: list[int], draft: bytes) -> list[int]:
        """Target tokens for drafted bytes that follow `history` (target ids), via the look-behind."""
        text = _valid_prefix(draft)
        if not text:
            return []
        encode = self.target_tokenizer
        for behind in range(min(LOOK_BEHIND, len(history)), 0, -1):
            window = history[-behind:]
            try:
                context = self.vmap.target.text_bytes(window).decode("utf-8")
            except UnicodeDecodeError:  # the window starts inside a character
                continue
            ids = encode(context + text, add_special_tokens=False)["input_ids"]
            if ids[:behind] == window:
                return ids[behind:]
        return encode(text, add_special_tokens=False)["input_ids"]

    def to_drafter(self, data: bytes) -> list[int]:
        """Drafter tokens for emitted bytes: its own encoding of whole characters, single-byte tokens for a
        trailing partial character."""
        text = _valid_prefix(data)
        ids = self.drafter_tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        for b in data[len(text.encode("utf-8")):]:
            if self.single[b] is not None:
                ids.append(self.single[b])
        return ids


def decode_slem(target: CausalLM, drafter: CausalLM, batch: Batch, params: SamplingParams, seeds: torch.Tensor,
                stats: Stats, draft_length: DraftLength, vmap: VocabMap, drafter_tokenizer) -> None:
    device = target.device
    text = _Text(vmap, batch.tokenizer, drafter_tokenizer)
    drafting = DraftVocab.same(drafter.vocab_size, device)  # the drafter samples from its own distribution
    target_state, logits = prefill(target, batch, stats)
    stats.target_calls += 1
    drafter_state = KVState(drafter, batch.rows)
    last = sample_tokens(logits, params, seeds, 0)  # emitted, not yet seen by the target
    history = [prompt[-_HISTORY:] + [t] for prompt, t in zip(prompt_rows(batch), last.tolist())]
    pending = [prompt + text.to_drafter(vmap.target.text_bytes([t]))  # not yet seen by the drafter
               for prompt, t in zip(prompt_rows(batch, drafter_tokenizer), last.tolist())]
    finished, _ = batch.emit([[t] for t in last.tolist()])
    step = 1
    while True:
        seeds, last, (pending, history) = drop_finished(batch, finished, (target_state, drafter_state), seeds, last,
                                                        pending, history)
        if not batch.rows:
            return
        step_start = time.perf_counter()
        forwards_before = target.seconds + drafter.seconds
        k = draft_length.choose()
        drafter_seconds = None
        drafted: list[list[int]] = [[] for _ in range(batch.rows)]
        if k:
            columns = []

            def draw(draft_logits, i):
                _, token, _ = drafting.draft(draft_logits, params, seeds, step, i)
                columns.append(token)
                return token

            drafter_seconds = run_drafter(drafter, drafter_state, pending, k, draw, stats)
            drafted = torch.stack(columns, dim=1).tolist()
        # Re-encode for the target; a request may take at most remaining - 1 drafts.
        start = time.perf_counter()
        remaining = batch.remaining().tolist()
        target_drafts = [text.to_target(h, vmap.draft.text_bytes(d))[:max(0, r - 1)]
                         for h, d, r in zip(history, drafted, remaining)]
        m = max((len(d) for d in target_drafts), default=0)
        drafts = torch.tensor([d + [0] * (m - len(d)) for d in target_drafts], dtype=torch.long).view(batch.rows, m)
        drafts = drafts.to(device)
        num_draft = torch.tensor([len(d) for d in target_drafts], dtype=torch.long, device=device)
        stats.draft_seconds += time.perf_counter() - start
        # Verify: one target forward over the last emitted token and the re-encoded drafts.
        start = time.perf_counter()
        target_before = target.seconds
        verify_logits = target_state.append(torch.cat([last.unsqueeze(1), drafts], dim=1), keep=m + 1)
        target_seconds = target.seconds - target_before
        out, accepted = ops.chain_verify(verify_logits, drafts, None, num_draft=num_draft,
                                         temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                         seed=seeds, offset=step, validate=False)
        stats.verify_seconds += time.perf_counter() - start
        stats.target_calls += 1
        target_state.rollback(m + 1, accepted + 1)
        accepted_list, out_list = accepted.tolist(), out.tolist()
        new_tokens = [out_list[row][: n + 1] for row, n in enumerate(accepted_list)]
        last = out[torch.arange(batch.rows, device=device), accepted]
        # Re-align the drafter with what was emitted.
        previous, keep, pending = pending, [], []
        for row, tokens in enumerate(new_tokens):
            emitted = vmap.target.text_bytes(tokens)
            history[row] = (history[row] + tokens)[-_HISTORY:]
            d = drafted[row]
            j, covered = matched(d, emitted, vmap.draft.token_bytes)
            rest = emitted[covered:]
            if k and not rest and j:  # the drafter's next input must be a real token: re-read d_j
                keep.append(j - 1)
                pending.append([d[j - 1]])
            else:
                keep.append(min(j, k - 1) if k else 0)
                carried = [d[k - 1]] if k and j == k else []
                pending.append((carried if k else previous[row]) + text.to_drafter(rest))
            if not pending[-1]:  # the emitted token stands for no text (a special token)
                pending[-1] = [text.stand_in]
        if k > 1:
            drafter_state.rollback(k - 1, torch.tensor(keep, device=device))
        finished = close_step(batch, stats, draft_length, k, new_tokens, accepted_list, num_draft.tolist(),
                              target_seconds, drafter_seconds,
                              time.perf_counter() - step_start - (target.seconds + drafter.seconds - forwards_before))
        step += 1
