"""The standard ensemble (method "ensemble", paper 004's baseline): every member of an ensemble of targets
(`ensemble_target.EnsembleLM`) scores every token, one step per token. "se" (se.py) is the speculative way to
decode from the same ensemble.
"""

from __future__ import annotations

from specops.decoding.protocol import Method, NoDrafts, Proposer, Setup


def _make(setup: Setup) -> Proposer:
    return NoDrafts()


METHODS = [Method("ensemble", "the standard ensemble: every member scores every token (the baseline of se)", _make,
                  ensemble="only", plain=True)]
