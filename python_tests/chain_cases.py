"""What the chain_verify tests share (test_chain_verify.py, test_block_verify.py): the op's normalized
arguments, exact comparison of two results, random ragged cases with everything mixed, and Markov tables for
exact enumerations (also test_traversal_verify.py)."""

from __future__ import annotations

import itertools

import torch

NEG_INF = float("-inf")


def per_row(value, batch: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    return torch.full((batch,), value, dtype=dtype)


def normalized_args(target_logits, draft_tokens, draft_probs=None, *, num_draft=None, temperature=1.0,
                    top_k=0, top_p=1.0, seed=0) -> tuple:
    """The op's normalized arguments except `offset` ([B] tensors, CPU). An int seed gives row b the
    seed `seed + b`, a readable choice for tests (the public wrapper spreads int seeds differently)."""
    batch, k1, _ = target_logits.shape
    if num_draft is None:
        num_draft = k1 - 1
    if isinstance(seed, int):
        seed = seed + torch.arange(batch, dtype=torch.int64)
    return (target_logits, draft_tokens, draft_probs, per_row(num_draft, batch, torch.int64),
            per_row(temperature, batch, torch.float32), per_row(top_k, batch, torch.int64),
            per_row(top_p, batch, torch.float32), per_row(seed, batch, torch.int64))


def assert_same(result, expected, what: str = "") -> None:
    """Exact equality: implementations share their random numbers, so any difference is a bug."""
    out, accepted = result
    exp_out, exp_accepted = expected
    assert torch.equal(accepted, exp_accepted), (
        f"{what}num_accepted {accepted.tolist()} != reference {exp_accepted.tolist()}")
    assert torch.equal(out, exp_out), f"{what}out_tokens\n{out}\n!= reference\n{exp_out}"


def random_case(gen: torch.Generator, batch: int, k: int, vocab: int, dtype: torch.dtype, with_probs: bool,
                neg_inf_fraction: float = 0.3) -> tuple:
    """A ragged batch with everything mixed: greedy and sampled rows, top-k/top-p on and off, -inf
    logits, drafts sampled from q (so chains get accepted), random 64-bit seeds."""
    logits = 3 * torch.randn(batch, k + 1, vocab, generator=gen)
    masked = torch.rand(batch, k + 1, vocab, generator=gen) < neg_inf_fraction
    masked[..., torch.randint(0, vocab, (), generator=gen)] = False  # every row keeps a finite logit
    logits = logits.masked_fill(masked, NEG_INF).to(dtype)
    # q close to p, so drafts are often accepted and chains run past position 0.
    q = torch.softmax(logits[:, :k].float() + torch.randn(batch, k, vocab, generator=gen), -1)
    if k:
        drafts = torch.multinomial(q.reshape(-1, vocab) + 1e-6, 1, generator=gen).reshape(batch, k)
    else:
        drafts = torch.empty(batch, 0, dtype=torch.int64)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    num_draft[0], num_draft[-1] = 0, k

    def pick(options):  # a random option per row
        return torch.tensor(options)[torch.randint(0, len(options), (batch,), generator=gen)]

    return normalized_args(
        logits, drafts, q if with_probs else None, num_draft=num_draft,
        temperature=pick([0.0, 1.0, 0.6, 1.7]), top_k=pick([0, 1, 3, vocab + 5]),
        top_p=pick([1.0, 0.9, 0.5, 0.05]), seed=torch.randint(-2**63, 2**63 - 1, (batch,), generator=gen))


OFFSETS = [0, 7, 2**32 + 3, 2**63 - 1]  # high offset word included


def markov_tables(vocab: int, depth: int, seed: int, zeros: bool) -> dict:
    """A distribution for every prefix of up to `depth` tokens, some entries exactly 0."""
    gen = torch.Generator().manual_seed(seed)
    tables = {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            x = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
            if zeros:
                x[torch.rand(vocab, generator=gen) < 0.3] = 0.0
            if x.sum() == 0:
                x[0] = 1.0
            tables[prefix] = x / x.sum()
    return tables
