"""Which request sits in each row of vLLM's input batch, from step to step, and how long each step took.

vLLM hands a `custom_class` proposer its input batch as rows (`token_ids_cpu`, `num_tokens_no_spec`,
`sampled_token_ids`) and no request ids, and it moves rows when requests leave or join. A request is
recognised by its tokens instead: after a step, a row holding n tokens is keyed by the hash of those n
tokens; at the next step the row whose tokens before its newly sampled ones hash to that key is the same
request. Two requests with identical tokens are interchangeable for everything a proposer keeps (its
state depends on the tokens alone), so they may swap keys harmlessly.

vLLM skips the proposer for a whole step when any request of the batch is near `max_model_len`
(`_input_fits_in_drafter` in vLLM's model runner): at the next call a row then holds tokens the last call never
saw. A row that matches no key exactly is matched by the longest shorter prefix a key was taken of; such a
request is `resumed`, and `emitted` holds per row every token it gained since the tracker last saw it, so a
proposer that follows requests token by token (a drafter's cache) reads all of them.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["Requests", "as_arrays"]


def as_arrays(lengths, tokens) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's `num_tokens_no_spec` and `token_ids_cpu` as NumPy arrays: vLLM versions pass NumPy arrays or CPU
    tensors (a tensor's array shares its memory: nothing is copied)."""
    return np.asarray(lengths), np.asarray(tokens)


def _key(tokens: np.ndarray, row: int, length: int) -> tuple[int, int]:
    return length, hash(tokens[row, :length].tobytes())


class Requests:
    """Request ids per row across steps, and the wall time of each step that carried the same requests."""

    def __init__(self):
        self._after: dict[tuple[int, int], list[int]] = {}  # key of a row's tokens after the last step -> ids
        self._next = 0
        self.last: list[int | None] = []  # request id per row at the last step (None: not decoding)
        self.resumed: set[int] = set()  # ids matched across steps this tracker did not see (module docstring)
        self.emitted: list[list[int]] = []  # per row, the tokens it gained since the tracker last saw it ([]: new)
        self._started: float | None = None  # when the last step's proposal began

    def step(self, sampled: list[list[int]], lengths, tokens) -> tuple[list[int | None], set[int], float | None]:
        """(request id per row, None where the row sampled nothing this step (a prefill chunk); the ids of
        last step's requests that are gone; the seconds since the last step's proposal began if this step
        decoded exactly the requests the last one proposed for, else None). `lengths` and `tokens`: NumPy
        arrays or CPU tensors."""
        now = time.perf_counter()
        lengths, tokens = as_arrays(lengths, tokens)
        ids: list[int | None] = [None] * len(sampled)
        emitted: list[list[int]] = [[] for _ in sampled]
        after: dict[tuple[int, int], list[int]] = {}
        unmatched = []
        for row, new in enumerate(sampled):
            if not new:
                continue
            candidates = self._after.get(_key(tokens, row, int(lengths[row]) - len(new)))
            if candidates:
                ids[row] = candidates.pop()
                emitted[row] = list(new)
            else:
                unmatched.append(row)
        self.resumed = set()
        remembered = sorted({key[0] for key, left in self._after.items() if left}, reverse=True) if unmatched else []
        for row in unmatched:
            before = int(lengths[row]) - len(sampled[row])
            for length in remembered:  # steps skipped since the last call: a shorter prefix, the longest first
                candidates = self._after.get(_key(tokens, row, length)) if length < before else None
                if candidates:
                    ids[row] = candidates.pop()
                    self.resumed.add(ids[row])
                    emitted[row] = tokens[row, length:int(lengths[row])].tolist()
                    break
            if ids[row] is None:
                ids[row], self._next = self._next, self._next + 1
        for row, request in enumerate(ids):
            if request is not None:
                after.setdefault(_key(tokens, row, int(lengths[row])), []).append(request)
        previous = {r for r in self.last if r is not None}
        current = {r for r in ids if r is not None}
        seconds = None
        if (self._started is not None and current == previous and None not in ids and len(current) == len(ids)
                and not self.resumed):
            seconds = now - self._started
        self._after, self.last, self._started, self.emitted = after, ids, now, emitted
        return ids, previous - current, seconds
