"""The requests of one decode call: their tokens so far, stopping (EOS, token budget, stop strings),
streaming, and which requests are still running."""

from __future__ import annotations

import torch

__all__ = ["Batch"]


class Batch:
    """Requests decoded together: their tokens so far, stopping, streaming and row bookkeeping.

    Rows are the requests still running; `index[row]` is the request they belong to. Finished requests
    leave the batch (their caches shrink with them)."""

    def __init__(self, tokenizer, prompts: list[str], max_new_tokens: int, stop: list[str] | None, stream,
                 eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop = stop or []
        self.stream = stream
        self.eos_ids = eos_ids
        self.prompts = prompts
        self.index = list(range(len(prompts)))
        self.prompt_rows = self.encode(tokenizer)  # the running requests' prompts in target ids
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.text_sent = [0] * len(prompts)
        self.stop_text: list[str | None] = [None] * len(prompts)

    def encode(self, tokenizer) -> list[list[int]]:
        """The running requests' prompts as token ids of `tokenizer` (a drafter with another vocabulary
        encodes the prompts itself)."""
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
                if done:
                    break
            if self.stream is not None:
                self._stream(request, done)
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
