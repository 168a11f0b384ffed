"""Autoregressive decoding (method "ar"): one target forward per token, no drafts. The baseline every
speculative method is measured against, on the same loop and engine."""

from __future__ import annotations

import torch

from specops.decoding.step import Method, Proposal, Proposer, Setup


class Autoregressive(Proposer):
    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        return Proposal.empty(budget.shape[0], budget.device)


def _make(setup: Setup) -> Proposer:
    return Autoregressive()


METHODS = [Method("ar", "autoregressive decoding, the baseline", _make)]
