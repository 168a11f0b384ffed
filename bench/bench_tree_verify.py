"""Benchmark of `specops.ops.tree_verify` (recursive rejection sampling over a draft tree, RSD; and traversal
verification).

    python bench/bench_tree_verify.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N]
        [--batches 1,8,64] [--nodes 8,16,32,64] [--vocabs 32000,262144]

Providers, per case (B requests, trees of N nodes, vocabulary V) and draft setting:
- `specops`: the op through the public wrapper, validate=False (the C++ kernel on CPU, Triton on CUDA);
  `specops traversal`: the same with scheme="traversal" (traversal verification: it computes the softmax
  normalizer of every node with children before its walk, and a residual at each node that loses a child);
  `specops validated`: the same with validate=True (on CUDA the wrapper's checks cost one host sync);
  `specops graph` (CUDA only): the validate=False call captured as a CUDA graph (tree 0 at offset 0).
- `reference`: specops.reference.tree_verify, the pure-torch spec (it filters all B*N rows and walks in
  Python); run only where B*N*V <= REFERENCE_MAX_ELEMENTS (2^25), skipped above.
- `torch loop`: what a user writes without specops, as Sequoia verifies a tree: per request, a Python walk
  from the root; at each node p = softmax(logits / T) of that row and, for each child x in node order,
  accept iff u * q[x] < p[x] (one host sync per child), else p = relu(p - q) / sum and, without
  replacement, q = q without x, renormalized; where no child is accepted (or at a leaf) the token is drawn
  with torch.multinomial(p). One-hot drafts: accept iff u < p[x], else p[x] = 0 and p renormalized. All
  torch ops on the device; its uniforms are drawn before timing (its own, so its tokens differ from the
  op's, with the same distribution; its `accepted` is its own mean).

Workload: temperature 1, top-k / top-p off (the op's defaults; the loop has no filtering code). Target
logits are N(0, 3^2) (float32 on CPU, bfloat16 on CUDA) with one peak token per row, whose logit is set so
that it holds probability m ~ U(0.05, 0.95) (language-model rows range from flat to confident; without it
a flat row would accept one-hot drafts almost never); q = softmax(target logits + N(0, 0.6^2) noise) in
float32, as bench_chain_verify. Trees: per request a random tree of N nodes (node 0 the root): node n's
parent is uniform among the earlier nodes less than L = max(1, floor(log2 N)) levels deep, so a tree has at
most L draft levels (the depth of a complete binary RSD-C (2,2,...) tree of N nodes; almost every tree
reaches it) and is bushiest near the root (on average 2.7, 3.3, 4.2 and 4.8 children of the root, at most
6, 8, 9 and 10 children of a node, at N = 8, 16, 32 and 64). Settings (`draft` column):
- `sampled`: draft_probs = q, replacement=False (RSD): each node's children are drawn without replacement
  from its own q row (torch.multinomial, in node order).
- `one-hot`: draft_probs=None (deterministic drafts): each node's children are the top tokens of its q row
  in order (a top-k tree); a child is then accepted with probability p(x), about m for the first.
The timed calls cycle through 16 trees per case (each request's shape redrawn, and Philox offset i for
tree i), so they see varied acceptance as decoding steps do: specops reads only the rows the walk reaches,
and its cost grows with acceptance. `accepted` is the mean number of accepted drafts per request (the
reference row repeats specops', which it equals by construction; `agree` compares them on tree 0).

GB/s is for every provider the bytes the op must read, averaged over the 16 trees from the op's own walks:
sum over requests of (num_accepted + 1) * V * sizeof(logits) (the rows the walk reaches) plus, in the
sampled setting, V * 4 for each reached node where a child was rejected (its q row: the residual update
reads it); one-hot rejections read nothing more. Inputs and random numbers are all made before the timed
region; times are medians after warm-up.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass

import torch
from _timing import (
    add_speedup,
    bench_parser,
    cuda_graph_of,
    cuda_median_time,
    find_row,
    import_specops,
    int_list,
    machine_info,
    mismatch_lines,
    parse_bench_args,
    report,
    run_cases,
    time_provider,
)

TARGET_SCALE = 3.0
DRAFT_NOISE = 0.6
PEAK_MASS = (0.05, 0.95)  # range of the target's top-token probability per row
NUM_TREES = 16  # tree shapes (and Philox offsets) the timed calls cycle through
SEED = 1234
REFERENCE_MAX_ELEMENTS = 2**25  # reference only where B*N*V is at most this (it is Python over every row)
GOAL = (1, 16, 262144)  # the must-reach point: specops >= 10x the torch loop (sampled setting)
SETTINGS = ("sampled", "one-hot")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# others: cores kept busy by other processes while the case ran (a shared machine inflates CPU times).
COLUMNS = ["device", "B", "N", "V", "dtype", "draft", "provider", "median_us", "GB/s", "accepted", "vs_loop",
           "x_floor", "agree", "runs", "others", "note"]
KEYS = ("B", "N", "V", "dtype", "draft")


@dataclass
class Case:
    batch: int
    nodes: int
    vocab: int


def grid(device: str, quick: bool, batches, nodes, vocabs) -> list[Case]:
    if device == "cpu":
        default = ([1], [8], [32000]) if quick else ([1, 8], [8, 16, 64], [32000, 262144])
    else:
        default = ([1, 64], [16], [32000]) if quick else ([1, 8, 64], [8, 16, 32, 64], [32000, 262144])
    batches, nodes, vocabs = batches or default[0], nodes or default[1], vocabs or default[2]
    cases = [Case(b, n, v) for v in vocabs for n in nodes for b in batches]
    return cases + [c for c in [Case(*GOAL)] if c not in cases]


def random_parents(nodes: int, gen: torch.Generator) -> list[int]:
    """parents of a random tree of `nodes` nodes: node n's parent uniform among the earlier nodes less
    than floor(log2 nodes) levels deep (parents[0] = 0, not read)."""
    levels = max(1, int(math.log2(nodes)))
    parents, depth = [0], [0]
    for n in range(1, nodes):
        open_nodes = [m for m in range(n) if depth[m] < levels]
        parent = open_nodes[int(torch.randint(len(open_nodes), (), generator=gen))]
        parents.append(parent)
        depth.append(depth[parent] + 1)
    return parents


def children_of(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for c in range(1, len(parents)):
        children[parents[c]].append(c)
    return children


def make_inputs(case: Case, dtype: torch.dtype, device: str) -> dict:
    """Target logits, q, and NUM_TREES trees per request with both settings' tokens, on `device`. Child j
    of node n gets the j-th of n's candidates: drawn from q[b, n] without replacement (sampled) or the
    j-th largest of q[b, n] (one-hot)."""
    batch, nodes, vocab = case.batch, case.nodes, case.vocab
    gen = torch.Generator(device=device).manual_seed(SEED)
    host_gen = torch.Generator().manual_seed(SEED)
    target32 = torch.randn(batch, nodes, vocab, generator=gen, device=device) * TARGET_SCALE
    # One peak token per row holding probability m ~ U(PEAK_MASS): its logit is the row's logsumexp
    # plus log(m / (1 - m)).
    peak = torch.randint(vocab, (batch, nodes, 1), generator=gen, device=device)
    low, high = PEAK_MASS
    mass = low + (high - low) * torch.rand(batch, nodes, 1, generator=gen, device=device)
    peak_logit = torch.logsumexp(target32, dim=-1, keepdim=True) + torch.log(mass / (1 - mass))
    target32.scatter_(-1, peak, peak_logit)
    draft_probs = torch.softmax(target32 + DRAFT_NOISE * torch.randn(batch, nodes, vocab, generator=gen,
                                                                     device=device), dim=-1)
    target = target32.to(dtype)
    del target32
    shapes = [[random_parents(nodes, host_gen) for _ in range(batch)] for _ in range(NUM_TREES)]
    children = [[children_of(p) for p in per_request] for per_request in shapes]
    fanout = max(1, max(len(kids) for per_request in children for tree in per_request for kids in tree))
    rows = draft_probs.view(batch * nodes, vocab)
    candidates = {
        "sampled": torch.multinomial(rows, fanout, replacement=False, generator=gen),
        "one-hot": torch.topk(rows, fanout, dim=-1).indices,
    }
    host_candidates = {k: v.view(batch, nodes, fanout).tolist() for k, v in candidates.items()}
    trees = []
    for i in range(NUM_TREES):
        tree = {"parents": torch.tensor(shapes[i], dtype=torch.int64, device=device), "children": children[i],
                "u": torch.rand(batch, nodes, generator=gen, device=device)}  # the torch loop's uniforms
        for setting, cand in host_candidates.items():
            tokens = [[0] * nodes for _ in range(batch)]
            for b in range(batch):
                for n, kids in enumerate(children[i][b]):
                    for j, c in enumerate(kids):
                        tokens[b][c] = cand[b][n][j]
            tree[setting] = {"host": tokens, "tokens": torch.tensor(tokens, dtype=torch.int64, device=device)}
        trees.append(tree)
    return {"target": target, "draft_probs": draft_probs, "trees": trees,
            "seed": torch.arange(batch, dtype=torch.int64, device=device) + SEED}


def torch_loop_request(logits: torch.Tensor, children: list[list[int]], tokens: list[int],
                       q_rows: torch.Tensor | None, u: torch.Tensor, gen: torch.Generator,
                       temperature: float = 1.0) -> tuple[list, int]:
    """One request's tree walk in plain torch (Sequoia's verification loop, without replacement): the
    accepted draft tokens then the emitted token (a tensor), and the number accepted."""
    node, path = 0, []
    while True:
        p = torch.softmax(logits[node].float() / temperature, dim=-1)
        q = None if q_rows is None else q_rows[node]
        follow = None
        for c in children[node]:
            x = tokens[c]
            if q is None:  # one-hot q: accept with probability p(x); relu(p - onehot(x)) is p without x
                if bool(u[c] < p[x]):
                    follow = c
                    break
                p[x] = 0.0
                p = p / p.sum()
            else:
                if bool(u[c] * q[x] < p[x]):
                    follow = c
                    break
                p = (p - q).relu_()
                p = p / p.sum()
                q = q / (1.0 - q[x])  # q without x, renormalized (a new tensor: q_rows stays intact)
                q[x] = 0.0
        if follow is None:
            return path + [torch.multinomial(p, 1, generator=gen)], len(path)
        path.append(tokens[follow])
        node = follow


class Providers:
    """The providers' calls for one case and setting. Call i verifies tree i (of NUM_TREES) at Philox
    offset i; each `*_fn` cycles i."""

    def __init__(self, specops, x: dict, setting: str):
        self.specops_module, self.x, self.setting = specops, x, setting
        self.draft_probs = x["draft_probs"] if setting == "sampled" else None

    def specops(self, i: int, validate: bool = True, scheme: str = "recursive"):
        x, tree = self.x, self.x["trees"][i]
        return self.specops_module.ops.tree_verify(x["target"], tree[self.setting]["tokens"], tree["parents"],
                                                   self.draft_probs, replacement=False, seed=x["seed"],
                                                   offset=i, validate=validate, scheme=scheme)

    def specops_fn(self, validate: bool = True, scheme: str = "recursive"):
        trees = itertools.cycle(range(NUM_TREES))
        return lambda: self.specops(next(trees), validate, scheme)

    def traversal_accepted(self) -> float:
        """Mean accepted drafts per request of scheme "traversal" over all trees (also its warm-up)."""
        counts = [self.specops(i, scheme="traversal")[2] for i in range(NUM_TREES)]
        return float(torch.cat(counts).double().mean())

    def reference(self, i: int):
        x, tree = self.x, self.x["trees"][i]
        target = x["target"]
        batch, nodes, _ = target.shape
        per_row = {"device": target.device}
        return self.specops_module.reference.tree_verify(
            target, tree[self.setting]["tokens"], tree["parents"], self.draft_probs,
            torch.full((batch,), nodes, dtype=torch.int64, **per_row), False,
            torch.ones(batch, dtype=torch.float32, **per_row),
            torch.zeros(batch, dtype=torch.int64, **per_row),
            torch.ones(batch, dtype=torch.float32, **per_row), x["seed"], i)

    def reference_fn(self):
        trees = itertools.cycle(range(NUM_TREES))
        return lambda: self.reference(next(trees))

    def torch_loop_fn(self):
        """Returns a callable giving a list of (tokens, num_accepted), one per request."""
        x, trees = self.x, itertools.cycle(range(NUM_TREES))
        target, q = x["target"], self.draft_probs
        gen = torch.Generator(device=target.device).manual_seed(SEED)

        def run():
            tree = x["trees"][next(trees)]
            tokens = tree[self.setting]["host"]
            return [torch_loop_request(target[b], tree["children"][b], tokens[b], None if q is None else q[b],
                                       tree["u"][b], gen) for b in range(target.shape[0])]
        return run

    def walk_stats(self) -> tuple[float, float, list]:
        """The op's mean accepted drafts per request and mean must-read bytes per call over all trees,
        and tree 0's outputs (also the kernel's warm-up, with validate=True)."""
        target = self.x["target"]
        vocab = target.shape[-1]
        accepted, total_bytes, first = 0, 0, None
        for i in range(NUM_TREES):
            out = self.specops(i)
            first = first or [t.cpu() for t in out]
            out_nodes, num_accepted = out[1].tolist(), out[2].tolist()
            children = self.x["trees"][i]["children"]
            for b, count in enumerate(num_accepted):
                path = [0] + out_nodes[b][:count]
                rejected_rows = sum(bool(children[b][n]) and (k == count or children[b][n][0] != path[k + 1])
                                    for k, n in enumerate(path))
                accepted += count
                total_bytes += (count + 1) * vocab * target.dtype.itemsize
                if self.draft_probs is not None:
                    total_bytes += rejected_rows * vocab * 4
        return accepted / (NUM_TREES * target.shape[0]), total_bytes / NUM_TREES, first


def loop_accepted(run) -> float:
    """Mean accepted drafts per request over NUM_TREES calls (also the provider's warm-up)."""
    counts = [n for _ in range(NUM_TREES) for _, n in run()]
    return sum(counts) / len(counts)


def run_case(specops, case: Case, device: str, quick: bool, bandwidth: float | None) -> list[dict]:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = make_inputs(case, dtype, device)
    rows = [r for setting in SETTINGS
            for r in run_setting(Providers(specops, x, setting), case, device, quick, bandwidth)]
    del x
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_setting(p: Providers, case: Case, device: str, quick: bool, bandwidth: float | None) -> list[dict]:
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    fast = (dict(warmup=2, min_runs=5, min_seconds=0.05) if quick
            else dict(warmup=3, min_runs=20, min_seconds=0.3))
    # Host-bound walks (a sync per child; the reference also filters every row): fewer runs, no warm-up
    # (both ran before timing). The torch loop's runs cover every tree once at least.
    slow = dict(warmup=0, min_runs=3, min_seconds=0.0 if quick else 0.5, max_runs=20, sync=sync)
    walks = dict(slow, min_runs=NUM_TREES, max_runs=4 * NUM_TREES)
    try:
        accepted, must_read, first = p.walk_stats()  # also the kernel's warm-up
    except Exception as error:  # noqa: BLE001 - e.g. no kernel for this device yet: the other providers run
        print(f"  specops failed ({type(error).__name__}: {error}); no accepted or GB/s", file=sys.stderr)
        accepted, must_read, first = None, None, None
    rows: list[dict] = []

    def add(provider, fn, note="", acc=accepted, events=cuda, params=fast, agree=None):
        row = {"device": device, "B": case.batch, "N": case.nodes, "V": case.vocab,
               "dtype": DTYPE_NAMES[p.x["target"].dtype], "draft": p.setting, "provider": provider,
               "median_us": None, "GB/s": None, "accepted": acc, "vs_loop": None, "x_floor": None,
               "agree": agree, "runs": None, "note": note}
        time_provider(row, fn, events=events, params=params, quick=quick, must_move=must_read)
        if row["median_us"] and must_read and bandwidth:
            row["x_floor"] = row["median_us"] / (must_read / bandwidth * 1e6)
        rows.append(row)

    add("specops", p.specops_fn(validate=False), "validate=False")
    add("specops validated", p.specops_fn(validate=True),
        "validate=True (one host sync)" if cuda else "validate=True")
    add("specops traversal", p.specops_fn(validate=False, scheme="traversal"),
        "scheme traversal, validate=False", acc=p.traversal_accepted())
    if cuda:
        try:
            # Capture freezes the arguments, so the graph replays tree 0 at offset 0.
            graph = cuda_graph_of(lambda: p.specops(0, validate=False))
        except Exception as error:  # noqa: BLE001 - capture is optional; say why it did not happen
            add("specops graph", None, f"capture failed: {type(error).__name__}: {error}"[:100])
        else:
            add("specops graph", graph, "CUDA graph, validate=False, tree 0")
    if case.batch * case.nodes * case.vocab <= REFERENCE_MAX_ELEMENTS:
        ref = [t.cpu() for t in p.reference(0)]  # also the reference's warm-up
        agree = None if first is None else ("yes" if all(map(torch.equal, ref, first)) else "NO")
        add("reference", p.reference_fn(), "wall clock" if cuda else "", events=False, params=slow,
            agree=agree)
    else:
        add("reference", None, f"skipped: B*N*V > 2^{REFERENCE_MAX_ELEMENTS.bit_length() - 1}")
    loop = p.torch_loop_fn()
    add("torch loop", loop, f"{case.batch} walks, wall clock" if cuda else f"{case.batch} walks",
        acc=loop_accepted(loop), events=False, params=walks)
    return rows


def read_bandwidth_cuda() -> float:
    """Achievable read bandwidth in bytes/s: torch.sum over a 1 GiB float32 tensor."""
    big_sum = torch.ones(2**28, dtype=torch.float32, device="cuda").sum
    seconds = cuda_median_time(big_sum, warmup_ms=50, rep_ms=300)
    del big_sum
    torch.cuda.empty_cache()
    return 2**30 / seconds


def goal_lines(rows: list[dict], device: str) -> list[str]:
    batch, nodes, vocab = GOAL
    found = {(s, prov): find_row(rows, prov, B=batch, N=nodes, V=vocab, draft=s)
             for s in SETTINGS for prov in ("specops", "torch loop")}
    spec, loop = found["sampled", "specops"], found["sampled", "torch loop"]
    if not (spec and loop):
        return []
    ratio = loop["median_us"] / spec["median_us"]
    line = (f"goal (B={batch}, N={nodes}, V={vocab}, sampled, {device}): specops {spec['median_us']:.0f} us, "
            f"torch loop {loop['median_us']:.0f} us, {ratio:.1f}x "
            f"(goal >= 10x: {'met' if ratio >= 10 else 'NOT met'})")
    spec, loop = found["one-hot", "specops"], found["one-hot", "torch loop"]
    if spec and loop:
        line += f"; one-hot: {loop['median_us'] / spec['median_us']:.1f}x"
    return [line]


def main() -> int:
    parser = bench_parser(__doc__, "tree_verify", "B 1, N 8, V 32000 plus the goal case, and fewer runs")
    parser.add_argument("--batches", type=int_list, default=None,
                        help="B values (CPU default 1,8; CUDA 1,8,64)")
    parser.add_argument("--nodes", type=int_list, default=None,
                        help="N values, tree nodes with the root (CPU default 8,16,64; CUDA 8,16,32,64)")
    parser.add_argument("--vocabs", type=int_list, default=None, help="V values (default 32000,262144)")
    args, csv_path = parse_bench_args(parser, "tree_verify")
    if any(n < 1 for n in args.nodes or []):
        parser.error("--nodes: trees need at least 1 node")
    specops = import_specops()
    info = machine_info(args.device)
    bandwidth = read_bandwidth_cuda() if args.device == "cuda" else None
    if bandwidth:
        info["read_GBps"] = f"{bandwidth / 1e9:.0f}"
    cases = grid(args.device, args.quick, args.batches, args.nodes, args.vocabs)
    rows, elapsed, other_load = run_cases(
        cases, lambda c: f"B={c.batch} N={c.nodes} V={c.vocab}",
        lambda c: run_case(specops, c, args.device, args.quick, bandwidth), info)
    add_speedup(rows, "vs_loop", "torch loop", KEYS)
    notes = [("GB/s: must-read bytes over the median time, for every provider: per call, the mean over "
              "the 16 trees of sum_b (num_accepted_b + 1) * V * sizeof(logits) + (sampled only) V * 4 per "
              "reached node with a rejected child, from the op's walks. vs_loop: torch loop time / this "
              "time. accepted: mean accepted drafts per request (the torch loop's own)."),
             (f"reference: run where B*N*V <= 2^{REFERENCE_MAX_ELEMENTS.bit_length() - 1}, skipped above "
              "(Python over every row); agree: its tokens, nodes and counts equal specops' on tree 0.")]
    if args.device == "cuda":
        notes.append("x_floor: time / (must-read bytes / measured read bandwidth). specops: CUDA events with "
                     "L2 flushed (triton.testing.do_bench); reference and torch loop: wall clock with sync.")
    notes += mismatch_lines(rows, KEYS, "reference != specops")
    report(rows, COLUMNS, info, csv_path, other_load, args.device, notes + goal_lines(rows, args.device),
           elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
