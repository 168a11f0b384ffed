"""The requests of one decode call: their tokens so far, stopping (EOS, token budget, stop strings),
streaming, and which requests are still running."""

from __future__ import annotations

import torch

__all__ = ["Batch"]


class Batch:
    """Requests decoded together: their tokens so far, stopping, streaming and row bookkeeping.

    Rows are the requests still running; `index[row]` is the request they belong to. Finished requests
    leave the batch (their caches shrink with them)."""

    def __init__(self, tokenizer, prompts: list[str] | list[list[int]], max_new_tokens: int,
                 stop: list[str] | None, stream, eos_ids: set[int], *, stop_when=None, on_tokens=None,
                 samples: int = 1):
        """prompts: strings (encoded with `tokenizer`) or the prompts' target token ids themselves (then
        `tokenizer` may be None unless something needs text: another vocabulary, stop strings, `texts`).
        stop_when(request, tokens) -> bool: an extra stopping rule, asked after every appended token;
        on_tokens(request, tokens): each request's newly emitted tokens, after every step. samples: requests
        come in groups of this many samples of one prompt (prompts holds each prompt that many times, one
        after another), which the loop reads once and forks."""
        if samples < 1 or len(prompts) % samples:
            raise ValueError(f"Batch: {len(prompts)} prompts do not form groups of {samples} samples")
        self.samples = samples
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop = stop or []
        self.stream = stream
        self.eos_ids = eos_ids
        self.stop_when = stop_when
        self.on_tokens = on_tokens
        self.index = list(range(len(prompts)))
        if all(isinstance(p, str) for p in prompts):
            self._texts: list[str] | None = list(prompts)
            self.prompt_rows = self.encode(tokenizer)  # the running requests' prompts in target ids
        else:
            self._texts = None
            self.prompt_rows = [list(row) for row in prompts]
            if any(not row for row in self.prompt_rows):
                raise ValueError("decode: a prompt has no tokens")
        self._all_rows = list(self.prompt_rows)
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.text_sent = [0] * len(prompts)
        self.stop_text: list[str | None] = [None] * len(prompts)

    @property
    def prompts(self) -> list[str]:
        """Every request's prompt as text (decoded from its ids when it was given as ids)."""
        if self._texts is None:
            if self.tokenizer is None:
                raise ValueError("decode: the prompts were given as token ids without the target's "
                                 "tokenizer, and this method needs them as text (a drafter or ensemble "
                                 "member with another vocabulary encodes the prompts itself): pass the "
                                 "target's tokenizer")
            self._texts = [self.tokenizer.decode(row, skip_special_tokens=True) for row in self._all_rows]
        return self._texts

    def encode(self, tokenizer) -> list[list[int]]:
        """The running requests' prompts as token ids of `tokenizer` (a drafter with another vocabulary
        encodes the prompts itself)."""
        if self._texts is None and tokenizer is self.tokenizer:
            return [list(self._all_rows[i]) for i in self.index]
        encoded = [list(tokenizer(self.prompts[i])["input_ids"]) for i in self.index]
        if any(not ids for ids in encoded):
            raise ValueError("decode: a prompt encodes to no tokens")
        return encoded

    @property
    def rows(self) -> int:
        return len(self.index)

    def remaining(self) -> torch.Tensor:
        """[rows] tokens each running request may still emit."""
        return torch.tensor([self.max_new_tokens - len(self.generated[i]) for i in self.index])

    def emit(self, row_tokens: list[list[int]]) -> tuple[list[int], list[int]]:
        """Append each row's new tokens one at a time, stopping at EOS, at the token that completes a
        stop string, or at the token budget (so every method stops at the same token); stream the new
        text. Returns the rows that finished and how many of each row's tokens were used."""
        finished, used = [], []
        for row, tokens in enumerate(row_tokens):
            request = self.index[row]
            out = self.generated[request]
            done = False
            count = 0
            for token in tokens:
                out.append(token)
                count += 1
                stopped = self._stopped(request)  # also on the last allowed token: it may complete a stop
                done = stopped or token in self.eos_ids or len(out) >= self.max_new_tokens
                if not done and self.stop_when is not None:
                    done = bool(self.stop_when(request, out))
                if done:
                    break
            if self.stream is not None:
                self._stream(request, done)
            if self.on_tokens is not None and count:
                self.on_tokens(request, out[-count:])
            used.append(count)
            if done:
                finished.append(row)
        return finished, used

    def _stopped(self, request: int) -> bool:
        """Whether the request's text now contains a stop string; if so its text ends before the first."""
        if not self.stop:
            return False
        text = self.tokenizer.decode(self.generated[request], skip_special_tokens=True)
        hits = [at for at in (text.find(stop) for stop in self.stop) if at >= 0]
        if hits:
            self.stop_text[request] = text[: min(hits)]
        return bool(hits)

    def _stream(self, request: int, done: bool) -> None:
        text = self.stop_text[request]
        if text is None:
            text = self.tokenizer.decode(self.generated[request], skip_special_tokens=True)
        ready = len(text)
        if not done:
            # Hold back what the next tokens may still change: a trailing replacement character (an
            # incomplete UTF-8 sequence) and a suffix that could begin a stop string.
            ready = len(text.rstrip("\ufffd"))
            ready -= max((size for stop in self.stop for size in range(1, min(len(stop), ready + 1))
                          if text[ready - size:ready] == stop[:size]), default=0)
        if ready > self.text_sent[request]:
            self.stream(request, text[self.text_sent[request]:ready])
            self.text_sent[request] = ready

    def drop(self, finished: list[int]) -> torch.Tensor | None:
        """Remove finished rows; returns the surviving row indices (None if nothing changed)."""
        if not finished:
            return None
        gone = set(finished)
        survivors = [row for row in range(self.rows) if row not in gone]
        self.index = [self.index[row] for row in survivors]
        self.prompt_rows = [self.prompt_rows[row] for row in survivors]
        return torch.tensor(survivors, dtype=torch.long)

    def texts(self) -> list[str]:
        out = []
        for request, tokens in enumerate(self.generated):
            if self.stop_text[request] is not None:
                out.append(self.stop_text[request])
            else:
                out.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return out
