"""How many drafts traversal verification keeps against recursive rejection sampling, on the draft trees of
real decoding, and how far both are from the best any verifier can do at the root.

    python bench/tree_acceptance.py [--methods rsd-c,rsd-s,specinfer] [--shape 2,2] [--first 0] [--prompts 8]
                                    [--new-tokens 64] [--temperatures 1.0,0.7] [--resample 0]
                                    [--csv docs/tree_acceptance.csv]

Target Gemma-3-270M, drafter SmolLM2-135M across the vocabularies (the trees are drawn from its distribution
restricted to the shared tokens), HumanEval prompts, scheme "token" (recursive rejection sampling). Every tree
the decoder hands to `tree_verify` is also scored exactly, in float64, given the tree (only the verifier's own
randomness is averaged over):

- recursive: E[accepted] = sum over nodes of P(the walk reaches it), from the acceptance probabilities
  min(1, p_i(x) / q_i(x)) of each node's children in order, with the residual updates of `tree_verify`;
- traversal: the candidates the walk meets when it rejects everything, with their weights w_1, w_2, ...
  (`specops.reference._traversal_verify_request`'s rule): P(the i-th is kept) = w_i prod_{j<i} (1 - w_j);
- for i.i.d. children (specinfer), recursive rejection sampling's P(accepted >= 1) in expectation over the
  root's draws as well (`recursive_root_iid`): the same quantity the bound bounds, without the noise of the
  trees drawn;
- the root's bound: whatever the verifier, the first token is accepted only if it is one of the root's
  children S while it follows p, so P(accepted >= 1) <= alpha* = 1 - max_A [p(A) - P(S meets A)] (the
  optimal transport bound of Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025,
  arXiv 2502.18779). For i.i.d. children P(S meets A) = 1 - (1 - q(A))^n depends on q(A) alone and is
  concave in it, so the maximum is on a prefix of the tokens sorted by p/q: exact. For two children without
  replacement the same prefixes give an upper bound on alpha* (the maximum over fewer sets is smaller).
  Other widths without replacement: not computed.

The decoding itself samples with its own random numbers; the trees are those of the recursive scheme's run,
so both verifiers are scored on the same trees. With --resample N (rsd-c and specinfer), the leaves of every
tree are also drawn again N times, from the q of their parents and as the decoder draws them (without or with
replacement), and both expectations are averaged over the N + 1 leaf sets: a leaf's own rows do not enter
either expectation, so this needs no forward, keeps each tree's expectation, and removes the part of the
trees' spread that the last level's draws make. Printed: per method and temperature, the trees scored, mean
E[accepted] for both (accepted drafts per target call), their ratio with the standard error of the paired
difference (trees as observations), and the mean P(accepted >= 1) of both against the mean bound.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _children(parents: list[int], count: int) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(count)]
    for c in range(1, count):
        kids[parents[c]].append(c)
    return kids


def recursive_expected(p_rows, q_rows, tokens, kids, replacement) -> tuple[float, float]:
    """(E[accepted], P(accepted >= 1)) of recursive rejection sampling on one tree (float64 rows)."""
    expected, first = 0.0, 0.0
    stack = [(0, 1.0)]
    while stack:
        b, reach = stack.pop()
        if not kids[b]:
            continue
        p, q, left, none = p_rows[b], q_rows[b], 1.0, 1.0
        for c in kids[b]:
            x = tokens[c]
            # Drawn without replacement, the mass left can round to 0 before the last sibling (q is float32):
            # such a sibling has no chance under q, and none is given to it here.
            left = max(left, 1e-300)
            q_x = float(q[x]) / left
            accept = min(1.0, float(p[x]) / q_x) if q_x > 0 else 1.0
            expected += reach * none * accept
            stack.append((c, reach * none * accept))
            none *= 1.0 - accept
            update = torch.clamp(p - q / left, min=0.0)
            mass = float(update.sum())
            if mass > 0:
                p = update / mass
            if not replacement:
                left -= float(q[x])
        if b == 0:
            first = 1.0 - none
    return expected, first


def traversal_expected(p_rows, q_rows, tokens, kids, replacement) -> tuple[float, float]:
    """(E[accepted], P(accepted >= 1)) of traversal verification on one tree (float64 rows): the rule of
    `specops.reference._traversal_verify_request` with normalized residuals."""
    count = len(kids)
    parent, depth = [0] * count, [0] * count
    for b, cs in enumerate(kids):
        for c in cs:
            parent[c], depth[c] = b, depth[b] + 1
    alive = [list(cs) for cs in kids]
    r = dict(enumerate(p_rows))
    left = [1.0] * count
    weight = [1.0] * count
    fraction: dict[int, float] = {}

    def w_of(b: int) -> float:
        return 1.0 if b == 0 else fraction.get(b, weight[b])

    def reweigh() -> None:
        for c in range(1, count):
            b = parent[c]
            if c in fraction or c not in alive[b]:
                continue
            x = tokens[c]
            pw = w_of(b) * float(r[b][x])
            q_x = float(q_rows[b][x]) / max(left[b], 1e-300)
            weight[c] = 1.0 if pw >= q_x else pw / q_x

    reweigh()
    expected, none = 0.0, 1.0
    while True:
        a = 0
        while alive[a]:
            a = alive[a][0]
            if w_of(a) == 0.0:
                break
        if a == 0:
            break
        w = w_of(a)
        expected += none * w * depth[a]
        none *= 1.0 - w
        b, x = parent[a], tokens[a]
        alive[b].remove(a)
        w_b = w_of(b)
        update = torch.clamp(w_b * r[b] - q_rows[b] / max(left[b], 1e-300), min=0.0)
        mass = float(update.sum())
        if mass > 0:
            r[b] = update / mass
        if not replacement:
            left[b] -= float(q_rows[b][x])
        if b != 0:
            den = mass + 1.0 - w_b
            fraction[b] = mass / den if den > 0 else 0.0
        reweigh()
    return expected, 1.0 - none


def root_bound(p: torch.Tensor, q: torch.Tensor, n: int, replacement: bool) -> float | None:
    """alpha* for the root's n children (module docstring): exact i.i.d., an upper bound for n = 2 without
    replacement, None otherwise."""
    if not replacement and n > 2:
        return None
    ratio = torch.where(q > 0, p / q.clamp(min=1e-300), torch.inf)
    order = torch.argsort(ratio, descending=True)
    p_s, q_s = p[order], q[order]
    taken_p = torch.cat([p.new_zeros(1), torch.cumsum(p_s, 0)])
    taken_q = torch.cat([q.new_zeros(1), torch.cumsum(q_s, 0)]).clamp(max=1.0)
    if replacement or n == 1:
        miss = (1.0 - taken_q) ** n
    else:  # two draws without replacement, both outside the prefix A
        share = q_s / (1.0 - q_s).clamp(min=1e-300)
        tail_share = torch.flip(torch.cumsum(torch.flip(share, [0]), 0), [0])
        tail_sq = torch.flip(torch.cumsum(torch.flip(q_s * share, [0]), 0), [0])
        rest = 1.0 - taken_q[:-1]
        miss = torch.cat([rest * tail_share - tail_sq, q.new_zeros(1)]).clamp(min=0.0)
    gap = taken_p - (1.0 - miss)
    return float(1.0 - gap.max().clamp(min=0.0))


def recursive_root_iid(p: torch.Tensor, q: torch.Tensor, n: int) -> float:
    """P(accepted >= 1) of recursive rejection sampling over n i.i.d. children of q, in expectation over the
    draws: each rejection leaves the residual norm(max(0, p_i - q)) whatever was drawn, so child i is kept
    with probability beta_i = sum min(p_i, q) given the earlier ones were not."""
    none = 1.0
    for _ in range(n):
        beta = float(torch.minimum(p, q).sum())
        none *= 1.0 - beta
        update = torch.clamp(p - q, min=0.0)
        if float(update.sum()) > 0:
            p = update / update.sum()
    return 1.0 - none


def redraw_leaves(q_rows, tokens, kids, replacement, gen) -> list[int]:
    """`tokens` with the children of every node whose children are all leaves drawn again from that node's q
    (float64 rows), in draw order: Gumbel-top-k without replacement, i.i.d. with it."""
    tokens = list(tokens)
    for b, cs in enumerate(kids):
        if not cs or any(kids[c] for c in cs):
            continue
        q = q_rows[b]
        if replacement:
            picks = torch.multinomial(q, len(cs), replacement=True, generator=gen)
        else:
            gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=gen, dtype=q.dtype).clamp(min=1e-300)))
            picks = torch.topk(torch.log(q) + gumbel, len(cs)).indices
        for c, x in zip(cs, picks.tolist()):
            tokens[c] = x
    return tokens


class Recorder:
    """Wraps `tree_verify` in the decoder: scores every sampled tree (and `resample` more leaf sets of it),
    then verifies it as the decoder asked."""

    def __init__(self, op, resample: int = 0, seed: int = 0):
        self.op, self.rows = op, []
        self.resample, self.gen = resample, torch.Generator().manual_seed(seed)

    def __call__(self, logits, tokens, parents, probs=None, *, num_nodes=None, replacement=False, temperature=1.0,
                 top_k=0, top_p=1.0, **kwargs):
        from specops import reference

        if probs is not None:
            batch, nodes, vocab = logits.shape
            per_row = [torch.as_tensor(v).expand(batch) for v in (temperature, top_k, top_p)]
            for b in range(batch):
                count = int(num_nodes[b]) if num_nodes is not None else nodes
                if count < 2 or float(per_row[0][b]) == 0.0:
                    continue
                rows = reference.filter_logits(logits[b, :count].float(), per_row[0][b].expand(count).float(),
                                               per_row[1][b].expand(count).long(), per_row[2][b].expand(count).float())
                p_rows = list(torch.softmax(rows.double(), -1))
                q_rows = list(probs[b, :count].double())
                toks = tokens[b, :count].tolist()
                kids = _children(parents[b, :count].tolist(), count)
                scored = [toks] + [redraw_leaves(q_rows, toks, kids, replacement, self.gen)
                                   for _ in range(self.resample)]
                each = [recursive_expected(p_rows, q_rows, t, kids, replacement)
                        + traversal_expected(p_rows, q_rows, t, kids, replacement) for t in scored]
                rec, rec_first, trav, trav_first = (sum(v) / len(each) for v in zip(*each))
                bound = root_bound(p_rows[0], q_rows[0], len(kids[0]), replacement)
                exact_first = recursive_root_iid(p_rows[0], q_rows[0], len(kids[0])) if replacement else None
                self.rows.append((rec, trav, rec_first, trav_first, bound, exact_first, each[0][2] - each[0][0]))
        return self.op(logits, tokens, parents, probs, num_nodes=num_nodes, replacement=replacement,
                       temperature=temperature, top_k=top_k, top_p=top_p, **kwargs)


def check(trials: int = 3, draws: int = 20000) -> None:
    """The float64 expectations against the C++ kernels' sample means on small random trees."""
    import specops

    gen = torch.Generator().manual_seed(0)
    for trial in range(trials):
        vocab, parents = 6, [0, 0, 0, 1, 1, 2, 2]
        logits = 1.5 * torch.randn(7, vocab, generator=gen)
        q = torch.softmax(logits + torch.randn(7, vocab, generator=gen), -1)
        replacement = trial % 2 == 1
        tokens = [0] * 7
        for b in range(3):
            picks = torch.multinomial(q[b], 2, replacement=replacement, generator=gen).tolist()
            tokens[2 * b + 1], tokens[2 * b + 2] = picks
        p_rows = list(torch.softmax(logits.double(), -1))
        kids = _children(parents, 7)
        want = {"recursive": recursive_expected(p_rows, list(q.double()), tokens, kids, replacement)[0],
                "traversal": traversal_expected(p_rows, list(q.double()), tokens, kids, replacement)[0]}
        for scheme, expected in want.items():
            _, _, accepted = specops.ops.tree_verify(
                logits.expand(draws, 7, vocab), torch.tensor(tokens).expand(draws, 7),
                torch.tensor(parents).expand(draws, 7), q.expand(draws, 7, vocab), replacement=replacement,
                seed=torch.arange(draws), scheme=scheme)
            mean, se = float(accepted.double().mean()), float(accepted.double().std()) / math.sqrt(draws)
            print(f"check {trial} {scheme}: exact {expected:.4f}, kernel {mean:.4f} +- {se:.4f}", file=sys.stderr)
            assert abs(mean - expected) < 4 * se + 1e-9, (trial, scheme, expected, mean)


def check_redraw(draws: int = 3000) -> None:
    """redraw_leaves' mean expectation against the expectation over every leaf set, enumerated with its
    probability, on a small (2, 2) tree drawn without and with replacement."""
    import itertools

    gen = torch.Generator().manual_seed(5)
    vocab, parents = 5, [0, 0, 0, 1, 1, 2, 2]
    kids = _children(parents, 7)
    p_rows = list(torch.softmax(1.5 * torch.randn(7, vocab, generator=gen, dtype=torch.float64), -1))
    q_rows = list(torch.softmax(1.5 * torch.randn(7, vocab, generator=gen, dtype=torch.float64), -1))
    for replacement in (False, True):
        def law(q):  # ordered pairs and their probabilities
            for x, y in itertools.product(range(vocab), repeat=2):
                if replacement:
                    yield (x, y), float(q[x] * q[y])
                elif x != y:
                    yield (x, y), float(q[x] * q[y] / (1 - q[x]))

        tokens = [0, 1, 2, 0, 0, 0, 0]
        for score in (recursive_expected, traversal_expected):
            exact = 0.0
            for (a, pa), (b, pb) in itertools.product(law(q_rows[1]), law(q_rows[2])):
                exact += pa * pb * score(p_rows, q_rows, tokens[:3] + [*a, *b], kids, replacement)[0]
            got = torch.tensor([score(p_rows, q_rows, redraw_leaves(q_rows, tokens, kids, replacement, gen), kids,
                                      replacement)[0] for _ in range(draws)], dtype=torch.float64)
            mean, se = float(got.mean()), float(got.std()) / math.sqrt(draws)
            print(f"check redraw {score.__name__} replacement={replacement}: exact {exact:.4f}, "
                  f"redrawn {mean:.4f} +- {se:.4f}", file=sys.stderr)
            assert abs(mean - exact) < 4 * se + 1e-9, (score.__name__, replacement, exact, mean)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="rsd-c,rsd-s,specinfer")
    parser.add_argument("--shape", default="2,2", help="num_draft_tokens: branching per level (rsd-s: W,L)")
    parser.add_argument("--first", type=int, default=0, help="the first HumanEval problem")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="1.0,0.7")
    parser.add_argument("--resample", type=int, default=0,
                        help="also score N more leaf sets of every tree (module docstring; rsd-c, specinfer)")
    parser.add_argument("--csv", default="bench/results/tree_acceptance.csv")
    args = parser.parse_args()
    if args.resample and "rsd-s" in args.methods.split(","):
        parser.error("--resample: rsd-s's beams are drawn jointly across a level, not per parent")
    import specops
    from specops.decoding import verify
    from _timing import load_prompts

    check()
    if args.resample:
        check_redraw()
    target = specops.models.load("gemma-3-270m")
    drafter = specops.models.load("smollm2-135m")
    prompts = load_prompts(args.first, args.prompts)
    shape = tuple(int(v) for v in args.shape.split(","))
    out = []
    print("| method | T | trees | recursive | traversal | ratio | SE of difference | P(>=1) recursive | "
          "P(>=1) traversal | P(>=1) recursive, over draws | root bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for method in [m for m in args.methods.split(",") if m]:
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            recorder = Recorder(specops.ops.tree_verify, args.resample)
            verify.ops.tree_verify = recorder
            try:
                specops.decode(prompts, target=target[0], tokenizer=target[1], drafter=drafter[0],
                               drafter_tokenizer=drafter[1], method=method, num_draft_tokens=shape,
                               temperature=temperature, max_new_tokens=args.new_tokens,
                               options={"scheme": "token"})
            finally:
                verify.ops.tree_verify = recorder.op
            rows = torch.tensor([r[:4] for r in recorder.rows], dtype=torch.float64)
            bounds = [r[4] for r in recorder.rows if r[4] is not None]
            exact_first = [r[5] for r in recorder.rows if r[5] is not None]
            diff = rows[:, 1] - rows[:, 0]
            row = {"method": method, "shape": args.shape, "temperature": temperature, "trees": len(rows),
                   "first": args.first, "prompts": args.prompts, "resample": args.resample,
                   "recursive": float(rows[:, 0].mean()), "traversal": float(rows[:, 1].mean()),
                   "diff_se": float(diff.std() / math.sqrt(len(rows))),
                   "diff_se_drawn_leaves": float(torch.tensor([r[6] for r in recorder.rows], dtype=torch.float64).std()
                                                 / math.sqrt(len(rows))),
                   "first_recursive": float(rows[:, 2].mean()), "first_traversal": float(rows[:, 3].mean()),
                   "first_se": float(rows[:, 3].std() / math.sqrt(len(rows))),
                   "first_recursive_exact": sum(exact_first) / len(exact_first) if exact_first else float("nan"),
                   "root_bound": sum(bounds) / len(bounds) if bounds else float("nan")}
            out.append(row)
            print(f"| {method} {args.shape} | {temperature} | {row['trees']} | {row['recursive']:.4f} | "
                  f"{row['traversal']:.4f} | {row['traversal'] / row['recursive']:.4f} | {row['diff_se']:.4f} | "
                  f"{row['first_recursive']:.4f} | {row['first_traversal']:.4f} +- {row['first_se']:.4f} | "
                  f"{row['first_recursive_exact']:.4f} | "
                  f"{row['root_bound']:.4f}{'' if method == 'specinfer' else ' (upper)'} |", flush=True)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)


if __name__ == "__main__":
    main()
