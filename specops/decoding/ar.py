"""Autoregressive decoding (method "ar"): one target forward per token, no drafts. The baseline every
speculative method is measured against, on the same loop and engine."""

from __future__ import annotations

from specops.decoding.protocol import Method, NoDrafts, Proposer, Setup


def _make(setup: Setup) -> Proposer:
    return NoDrafts()


METHODS = [Method("ar", "autoregressive decoding, the baseline", _make, plain=True,
                  auto=lambda given: not given.drafter and not given.ensemble and not given.trees)]
