"""What the tree_verify tests share (test_tree_verify.py, test_traversal_verify.py): the op's normalized
arguments, each implementation's call, exact comparison, random ragged trees, and the statistical set-up
(a star of children over a fixed 8-token target and draft, chi-square and z thresholds)."""

from __future__ import annotations

import torch
from _triton import TRITON_DEVICE, triton_launcher
from scipy import stats

import specops
from specops import reference

tree_verify_triton = triton_launcher("tree_verify")


NEG_INF = float("-inf")


LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def per_row(value, batch: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    return torch.full((batch,), value, dtype=dtype)


def normalized_args(logits, tokens, parents, probs=None, *, num_nodes=None, replacement=False, temperature=1.0,
                    top_k=0, top_p=1.0, seed=0) -> tuple:
    """The op's normalized arguments except `offset` (CPU tensors); an int seed gives row b seed + b."""
    batch, nodes, _ = logits.shape
    if isinstance(seed, int):
        seed = seed + torch.arange(batch, dtype=torch.int64)
    return (logits, tokens, parents, probs, per_row(nodes if num_nodes is None else num_nodes, batch, torch.int64),
            replacement, per_row(temperature, batch, torch.float32), per_row(top_k, batch, torch.int64),
            per_row(top_p, batch, torch.float32), per_row(seed, batch, torch.int64))


def run_impl(impl: str, args: tuple, offset: int = 0, block_v: int | None = None, scheme: str = "recursive"):
    """(out_tokens, out_nodes, num_accepted) on CPU from one implementation, with tree_verify's `scheme`."""
    if impl == "reference":
        return reference.tree_verify(*args, offset, scheme=scheme)
    if impl == "cpp":
        return torch.ops.specops.tree_verify(*args, offset, True, scheme)
    if impl == "triton":
        moved = [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        return tuple(t.cpu() for t in tree_verify_triton(*moved, offset, scheme=scheme, block_v=block_v))
    raise AssertionError(impl)


def assert_same(result, expected, what: str = "") -> None:
    """Exact equality: implementations share their random numbers, so any difference is a bug."""
    for name, got, want in zip(("out_tokens", "out_nodes", "num_accepted"), result, expected):
        assert torch.equal(got, want), f"{what}{name}\n{got}\n!= reference\n{want}"


def tree(parents: list[int]) -> torch.Tensor:
    """[N] int64 parents (node 0's entry is not read)."""
    return torch.tensor(parents, dtype=torch.int64)


def draw_children(gen: torch.Generator, parents: torch.Tensor, q: torch.Tensor, count: int,
                  replacement: bool) -> torch.Tensor:
    """[N] tokens: node 0 a root id, each node's children drawn from q[parent] in node order, without
    replacement (RSD) or i.i.d. (SpecInfer)."""
    tokens = torch.zeros(parents.shape[0], dtype=torch.int64)
    for parent in range(count):
        kids = [c for c in range(1, count) if int(parents[c]) == parent]
        if kids:
            tokens[kids] = torch.multinomial(q[parent], len(kids), replacement=replacement, generator=gen)
    return tokens


def random_parents(gen: torch.Generator, nodes: int) -> torch.Tensor:
    parents = torch.zeros(nodes, dtype=torch.int64)
    for n in range(1, nodes):
        parents[n] = int(torch.randint(0, n, (1,), generator=gen))
    return parents


def random_case(gen: torch.Generator, batch: int, nodes: int, vocab: int, dtype: torch.dtype, with_probs: bool,
                replacement: bool = False) -> tuple:
    """Ragged random trees, mixed sampling settings per row (greedy, top-k, top-p, plain, T != 1)."""
    logits = (2.0 * torch.randn(batch, nodes, vocab, generator=gen)).to(dtype)
    q = torch.softmax(logits.float() + torch.randn(batch, nodes, vocab, generator=gen), -1)
    counts = torch.randint(1, nodes + 1, (batch,), generator=gen)
    counts[0] = nodes
    parents = torch.stack([random_parents(gen, nodes) for _ in range(batch)])
    tokens = torch.stack([draw_children(gen, parents[b], q[b], int(counts[b]), replacement) for b in range(batch)])
    # Past a request's count: garbage the kernels must not read.
    past = torch.arange(nodes) >= counts[:, None]
    tokens[past], parents[past] = 10**9, -7
    settings = [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.0, 0, 1.0), (1.3, 0, 0.8), (0.9, 4, 0.9), (1.0, 0, 1.0)]
    temperature = torch.tensor([settings[b % 6][0] for b in range(batch)])
    top_k = torch.tensor([settings[b % 6][1] for b in range(batch)])
    top_p = torch.tensor([settings[b % 6][2] for b in range(batch)])
    return normalized_args(logits, tokens, parents, q if with_probs else None, num_nodes=counts,
                           replacement=replacement, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=int(torch.randint(0, 2**40, (1,), generator=gen)))


def point_mass_logits(hot: torch.Tensor, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Logits with one finite entry per row, at `hot`: p is one-hot for any T, top-k, top-p."""
    values = torch.randn(*hot.shape, 1, generator=generator)
    return torch.full((*hot.shape, vocab), NEG_INF).scatter(-1, hot.unsqueeze(-1), values)


def chain_case(gen: torch.Generator, batch: int, k: int, vocab: int, with_probs: bool):
    logits = 2.0 * torch.randn(batch, k + 1, vocab, generator=gen)
    q = torch.softmax(logits + torch.randn(batch, k + 1, vocab, generator=gen), -1)
    drafts = torch.multinomial(q[:, :k].reshape(-1, vocab), 1, generator=gen).view(batch, k)
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), drafts], 1)
    parents = (torch.arange(k + 1) - 1).clamp(min=0).expand(batch, k + 1).contiguous()
    return logits, q if with_probs else None, drafts, tokens, parents


OFFSETS = [0, 7, 2**32 + 3]


# ==== 3. Statistics ====
#
# As test_chain_verify: N = 200,000 requests per test, chi-square at level 1e-3 over at most 36 cells; a
# 1% error moved between two tokens gives a noncentrality >= 80, detected with probability > 0.9999.
# Seeds are fixed, so every run computes the same p-values.
N_DRAWS = 200_000


P_VALUE_MIN = 1e-3


Z_MAX = 3.29


VOCAB = 8


TARGET_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, NEG_INF, 1.5])


# q puts mass on token 6, where p = 0, and is far from p elsewhere: many rejections.
DRAFT_PROBS = torch.softmax(torch.tensor([0.0, 1.5, 0.5, 1.0, -1.0, 0.0, 0.5, -2.0]), -1)


def target_probs(logits_row: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    filtered = reference.filter_logits(logits_row.reshape(1, -1), torch.tensor([temperature]), torch.tensor([top_k]),
                                       torch.tensor([top_p]))
    return torch.softmax(filtered.double(), dim=-1)[0]


def chisquare_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts[support].sum()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def star(device: str, k: int, *, mode: str, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
         draft_seed: int = 0, order=None, claim_replacement=None):
    """N_DRAWS requests, each a root with k children over TARGET_LOGITS / DRAFT_PROBS. mode "rsd": drawn
    without replacement from q; "specinfer": i.i.d. from q; "rows": the k most likely tokens of q as
    deterministic drafts. `order` permutes the children after drawing (to break the verifier);
    `claim_replacement` overrides what the op is told."""
    gen = torch.Generator().manual_seed(draft_seed)
    q = DRAFT_PROBS.expand(N_DRAWS, VOCAB)
    if mode == "rows":
        kids = DRAFT_PROBS.argsort(descending=True)[:k].expand(N_DRAWS, k)
    else:
        kids = torch.multinomial(q, k, replacement=mode == "specinfer", generator=gen)
    if order is not None:
        kids = order(kids)
    tokens = torch.cat([torch.zeros(N_DRAWS, 1, dtype=torch.int64), kids], 1)
    parents = torch.zeros(N_DRAWS, k + 1, dtype=torch.int64)
    logits = TARGET_LOGITS.expand(N_DRAWS, k + 1, VOCAB)
    probs = None if mode == "rows" else DRAFT_PROBS.expand(N_DRAWS, k + 1, VOCAB)
    replacement = (mode == "specinfer") if claim_replacement is None else claim_replacement
    out, nodes, accepted = specops.ops.tree_verify(
        logits.to(device), tokens.to(device), parents.to(device), None if probs is None else probs.to(device),
        replacement=replacement, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=torch.arange(N_DRAWS, dtype=torch.int64).to(device), offset=draft_seed)
    return out.cpu(), nodes.cpu(), accepted.cpu(), kids


STAR_CASES = {  # name: (mode, k, temperature, top_k, top_p)
    "rsd_k2": ("rsd", 2, 1.0, 0, 1.0),
    "rsd_k3_t0.7_top_k_5": ("rsd", 3, 0.7, 5, 1.0),
    "specinfer_k3": ("specinfer", 3, 1.0, 0, 1.0),
    "rows_k3_top_p_0.8": ("rows", 3, 1.0, 0, 0.8),
}


def small_case(device: str = "cpu", with_probs: bool = True) -> tuple:
    gen = torch.Generator().manual_seed(80)
    args = random_case(gen, 4, 5, 12, torch.float32, with_probs)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
