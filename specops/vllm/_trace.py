"""What a vLLM process's specops proposer computed, for seeing what each rank of a parallel engine does.

With SPECOPS_VLLM_TRACE=DIR, every process that builds a specops proposer writes DIR/<Proposer>-<pid>.json
after each proposer call and when it exits: its rank in vLLM's process group (torch.distributed's, where it is initialized), and the
proposer calls, the request rows they were given, the draft tokens they returned and the seconds they took.
The rank is read while the proposer runs: vLLM destroys its process group before the process exits. The file
is rewritten after every call because exit handlers do not always run: vLLM's shutdown can end a worker before
them (at tensor_parallel_size=2 one CI run found no file from either rank of SlemProposer's engine).
Unset (the default), nothing is counted or written.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path

__all__ = ["Trace"]


class Trace:
    def __init__(self, proposer: str):
        folder = os.environ.get("SPECOPS_VLLM_TRACE")
        self.path = Path(folder) / f"{proposer}-{os.getpid()}.json" if folder else None
        self.calls = self.rows = self.drafts = 0
        self.seconds = 0.0
        self.rank: int | None = None
        if self.path is not None:
            atexit.register(self.write)

    def call(self, propose, sampled, *args, **kwargs):
        """propose(sampled, *args, **kwargs), counted."""
        if self.path is None:
            return propose(sampled, *args, **kwargs)
        if self.rank is None:
            self.rank = _rank()
        start = time.perf_counter()
        drafts = propose(sampled, *args, **kwargs)
        self.calls += 1
        self.rows += sum(1 for tokens in sampled if tokens)
        self.drafts += sum(len(d) for d in drafts)
        self.seconds += time.perf_counter() - start
        self.write()
        return drafts

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"pid": os.getpid(), "rank": self.rank, "calls": self.calls,
                                         "rows": self.rows, "drafts": self.drafts, "seconds": self.seconds}))


def _rank() -> int | None:
    """This process's rank in torch.distributed's default group (else vLLM's tensor-parallel rank), None where
    there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no vLLM, or its groups are not set up in this process
        return None
