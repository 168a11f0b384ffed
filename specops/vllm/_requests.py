"""Which request sits in each row of vLLM's input batch, from step to step, and how long each step took.

vLLM hands a `custom_class` proposer its input batch as rows (`token_ids_cpu`, `num_tokens_no_spec`,
`sampled_token_ids`) and no request ids, and it moves rows when requests leave or join. A request is
recognised by its tokens instead: after a step, a row holding n tokens is keyed by the hash of those n
tokens; at the next step the row whose tokens before its newly sampled ones hash to that key is the same
request. Two requests with identical tokens are interchangeable for everything a proposer keeps (its
state depends on the tokens alone), so they may swap keys harmlessly.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["Requests"]


def _key(tokens: np.ndarray, row: int, length: int) -> int:
    return hash(tokens[row, :length].tobytes())


class Requests:
    """Request ids per row across steps, and the wall time of each step that carried the same requests."""

    def __init__(self):
        self._after: dict[int, list[int]] = {}  # key of a row's tokens after the last step -> request ids
        self._next = 0
        self.last: list[int | None] = []  # request id per row at the last step (None: not decoding)
        self._started: float | None = None  # when the last step's proposal began

    def step(self, sampled: list[list[int]], lengths: np.ndarray, tokens: np.ndarray
             ) -> tuple[list[int | None], set[int], float | None]:
        """(request id per row, None where the row sampled nothing this step (a prefill chunk); the ids of
        last step's requests that are gone; the seconds since the last step's proposal began if this step
        decoded exactly the requests the last one proposed for, else None)."""
        now = time.perf_counter()
        ids: list[int | None] = []
        after: dict[int, list[int]] = {}
        for row, new in enumerate(sampled):
            length = int(lengths[row])
            if not new:
                ids.append(None)
                continue
            candidates = self._after.get(_key(tokens, row, length - len(new)))
            if candidates:
                request = candidates.pop()
            else:
                request, self._next = self._next, self._next + 1
            ids.append(request)
            after.setdefault(_key(tokens, row, length), []).append(request)
        previous = {r for r in self.last if r is not None}
        current = {r for r in ids if r is not None}
        seconds = None
        if self._started is not None and current == previous and None not in ids and len(current) == len(ids):
            seconds = now - self._started
        self._after, self.last, self._started = after, ids, now
        return ids, previous - current, seconds
