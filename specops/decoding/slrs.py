"""String-level rejection sampling (method "slrs", paper 000 Alg 3): rejection sampling on the strings
a drafter with another vocabulary writes, so drafts need not be tokens the target shares.

Per target position the drafter samples tokens until its string s determines the next target token:
until s is no longer a proper prefix of any target token (the paper's lookahead stopping rule). That
token t is the longest target token that is a prefix of s; its remainder starts the next position's
string. The proposal probability of t,

    psi(t) = P(the drafter's tokens, sampled until the rule stops, determine t),

is computed exactly by enumerating every drafter token sequence that can occur before the rule stops,
which takes a drafter distribution at each of its internal nodes. A string no target token begins
(a drafter special token, a byte the target cannot start with) proposes nothing, which is always
rejected. `chain_verify` then accepts t with min(1, p(t) / psi(t)) and samples rejections from
norm(max(0, p - psi)): exact, because psi is exactly the distribution t was drawn from (Theorem 3.2).
Each position's psi is taken given the drafter's path so far, so a chain of positions is exact too.

The enumeration grows exponentially with the length of target tokens in drafter tokens (Lemma 3.1):
it suits drafters with short tokens. Above `max_drafter_nodes` drafter positions in one step the
method raises instead of approximating. Each enumeration level is one drafter forward over the whole
enumeration tree of every request (tree attention over the drafter's KV cache).
"""

from __future__ import annotations

import torch

from specops import ops
from specops import vocab as vocab_maps
from specops.decoding.retokenize import Retokenizer, matched
from specops.decoding.drafter import DrafterProposer
from specops.decoding.engine import KVState
from specops.decoding.protocol import (Drafter, Method, Proposal, Proposer, SamplingParams, Setup, StepResult,
                                   draft_offset)
from specops.vocab import VocabMap


class _Strings:
    """The target vocabulary as strings: which strings are still undetermined, and which token a
    determined string proposes."""

    def __init__(self, vmap: VocabMap, eos_ids: set[int]):
        self.canonical = vmap.target.canonical
        self.longest = max((len(b) for b in self.canonical), default=0)
        self.open = {b""}  # proper prefixes of target tokens: strings that do not determine a token yet
        for data in self.canonical:
            for i in range(1, len(data)):
                self.open.add(data[:i])
        self.draft_bytes = vmap.draft.token_bytes
        self.target_bytes = vmap.target.token_bytes
        self.null = vmap.target.size  # "no token": a column with target probability 0
        eos = sorted(i for i in eos_ids if i < vmap.target.size)
        self.eos = eos[0] if eos else self.null

    def split(self, s: bytes) -> tuple[int, bytes]:
        """(the token a determined string proposes, the rest of the string after it)."""
        t = self.outcome(s)
        return t, (b"" if t == self.null else s[len(self.target_bytes[t]):])

    def outcome(self, s: bytes) -> int:
        """The token a determined string proposes: the longest target token that is a prefix of s."""
        for cut in range(min(len(s), self.longest), 0, -1):
            t = self.canonical.get(s[:cut])
            if t is not None:
                return t
        return self.null


class _Node:
    __slots__ = ("children", "depth", "parent", "q", "sample", "token")

    def __init__(self, token: int, parent: _Node | None, depth: int):
        self.token, self.parent, self.depth = token, parent, depth
        self.q: torch.Tensor | None = None  # the drafter's distribution after this node
        self.sample: int | None = None  # the drafter token drawn there (used if the walk reaches it)
        self.children: dict[int, _Node] = {}

    def path(self) -> list[int]:
        node, out = self, []
        while node.parent is not None:
            out.append(node.token)
            node = node.parent
        return out[::-1]


class _Enumerator:
    """The drafter trees of one step, one per request, scored level by level."""

    def __init__(self, state: KVState, strings: _Strings, params: SamplingParams, seeds: torch.Tensor, step: int,
                 max_nodes: int):
        self.state, self.strings = state, strings
        self.params, self.seeds, self.step = params, seeds, step
        self.max_nodes = max_nodes
        self.roots: list[_Node] = []
        self.nodes: list[list[_Node]] = []  # per request, in creation order (parents first)
        self.expanded = [0] * seeds.shape[0]

    def start(self, root_logits: torch.Tensor) -> None:
        self.roots = [_Node(-1, None, -1) for _ in range(root_logits.shape[0])]
        self.nodes = [[] for _ in self.roots]
        self._distributions([(row, root) for row, root in enumerate(self.roots)], root_logits)

    def _distributions(self, items: list[tuple[int, _Node]], logits: torch.Tensor) -> None:
        """Set q and the sample of each (request, node) from its drafter logits [n, V_d]; one draw per
        request and depth, so the walk (one node per depth) uses independent numbers."""
        by_depth: dict[int, list[int]] = {}
        for i, (_, node) in enumerate(items):
            by_depth.setdefault(node.depth, []).append(i)
        ids = torch.arange(logits.shape[1], device=logits.device)
        for depth, index in by_depth.items():
            rows = torch.tensor([items[i][0] for i in index], device=logits.device)
            q, _, tokens = ops.vocab_project(
                logits[index], ids, logits.shape[1], temperature=self.params.temperature,
                top_k=self.params.top_k, top_p=self.params.top_p, seed=self.seeds[rows],
                offset=draft_offset(self.step, depth + 1), validate=False)
            for i, qi, t in zip(index, q.cpu(), tokens.tolist()):
                items[i][1].q, items[i][1].sample = qi, t

    def _score(self, wanted: list[tuple[int, _Node]]) -> None:
        """One drafter forward over every request's tree; q for the wanted nodes."""
        width = max(len(n) for n in self.nodes)
        rows = len(self.nodes)
        device = self.state.lm.device
        tokens = torch.zeros(rows, width, dtype=torch.long)
        valid = torch.zeros(rows, width, dtype=torch.bool)
        depth = torch.zeros(rows, width, dtype=torch.long)
        tree = torch.zeros(rows, width, width, dtype=torch.bool)
        slot: dict[int, int] = {}
        for row, nodes in enumerate(self.nodes):
            for i, node in enumerate(nodes):
                slot[id(node)] = i
                tokens[row, i], valid[row, i], depth[row, i] = node.token, True, node.depth
                tree[row, i, i] = True
                if node.parent is not None and node.parent.parent is not None:
                    tree[row, i] |= tree[row, slot[id(node.parent)]]
        logits = self.state.append_tree(tokens.to(device), valid.to(device), depth.to(device), tree.to(device))
        self.state.discard(width)
        picked = torch.stack([logits[row, slot[id(node)]] for row, node in wanted])
        self._distributions(wanted, picked)

    def _child(self, row: int, node: _Node, token: int) -> _Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node(token, node, node.depth + 1)
            self.nodes[row].append(child)
        return child

    def proposals(self, starts: dict[int, tuple[_Node, bytes]]) -> dict[int, torch.Tensor]:
        """psi per request: the distribution of the token proposed from `node` with remainder `s`."""
        null = self.strings.null
        psi = {row: torch.zeros(null + 1, dtype=torch.float64) for row in starts}
        frontier = []
        for row, (node, s) in starts.items():
            if s not in self.strings.open:  # the remainder alone determines the token
                psi[row][self.strings.outcome(s)] = 1.0
            else:
                frontier.append((row, node, s, 1.0))
        while frontier:
            for row, *_ in frontier:  # refuse before scoring nodes that would pass the bound
                self.expanded[row] += 1
                if self.expanded[row] > self.max_nodes:
                    raise ValueError(
                        f"decode: slrs needs more than max_nodes = {self.max_nodes} drafter positions in "
                        "one step to compute the proposal probabilities exactly; the drafter's tokens are too "
                        "long or too many relative to the target's (paper 000, Lemma 3.1). Use 'tli' or 'slem', "
                        "a drafter with shorter tokens, a smaller top_k, or raise options={'max_nodes': ...}")
            unscored = [(row, node) for row, node, _, _ in frontier if node.q is None]
            if unscored:
                self._score(unscored)
            grown = []
            for row, node, s, mass in frontier:
                for token in torch.nonzero(node.q > 0).flatten().tolist():
                    weight = mass * float(node.q[token])
                    piece = self.strings.draft_bytes[token]
                    if piece is None:  # a special token ends the string
                        psi[row][self.strings.eos if not s else self.strings.outcome(s)] += weight
                        continue
                    grown_s = s + piece
                    if grown_s in self.strings.open:
                        grown.append((row, self._child(row, node, token), grown_s, weight))
                    else:
                        psi[row][self.strings.outcome(grown_s)] += weight
            frontier = grown
        return psi

    def walk(self, row: int, node: _Node, s: bytes) -> tuple[_Node, bytes, int, bool]:
        """Follow the drawn tokens from `node` until the string is determined: (node reached, its
        remainder after the proposed token, the proposed token, whether the chain must stop)."""
        if s not in self.strings.open:
            t, rest = self.strings.split(s)
            return node, rest, t, t == self.strings.null
        while True:
            token = node.sample
            piece = self.strings.draft_bytes[token]
            if piece is None:
                t = self.strings.eos if not s else self.strings.outcome(s)
                return node, b"", t, True
            node = self._child(row, node, token)
            s = s + piece
            if s not in self.strings.open:
                t, rest = self.strings.split(s)
                return node, rest, t, t == self.strings.null


class StringSampler(DrafterProposer):
    """Per step: the drafter reads what it has not seen, then each request's enumeration tree gives psi
    for up to k target positions along the drafter's own sampled path."""

    def __init__(self, setup: Setup, max_nodes: int):
        self.vmap = vocab_maps.vocab_map(setup.tokenizer, setup.drafter_tokenizer)
        self.text = Retokenizer(self.vmap, setup.tokenizer, setup.drafter_tokenizer)
        prompts = setup.batch.encode(setup.drafter_tokenizer)
        setup.drafter.check_prompts(prompts, setup.batch.max_new_tokens, "drafter")
        super().__init__(setup, prompts)
        self.strings = _Strings(self.vmap, setup.batch.eos_ids)
        self.max_nodes = max_nodes
        # Verification ids: the target's ids (LM head or tokenizer, whichever is wider; the target gives
        # ids past its LM head probability 0), then "no token", which it never emits either.
        self.width = max(setup.target.vocab_size, self.strings.null) + 1
        self.walked: list[_Node | None] = []

    def start(self, first: list[int]) -> None:
        self.pending = [p + (self.text.to_drafter(self.vmap.target.text_bytes([t])) or [self.text.stand_in])
                        for p, t in zip(self.pending, first)]

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        rows, device = budget.shape[0], budget.device
        limit = budget.tolist()
        self.k = k = self.chain_length(budget)
        drafts: list[list[int]] = [[] for _ in range(rows)]
        psis: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        self.walked = [None] * rows
        if k:
            enumerator = _Enumerator(self.state, self.strings, self.params, self.seeds, step, self.max_nodes)
            enumerator.start(self.read())  # the drafter's distribution after what it has read: every tree's root
            cursor = {row: (enumerator.roots[row], b"") for row in range(rows) if limit[row]}
            self.walked = list(enumerator.roots)
            for _ in range(k):
                if not cursor:
                    break
                psi = enumerator.proposals(cursor)
                advanced = {}
                for row, (node, s) in cursor.items():
                    node, rest, t, stop = enumerator.walk(row, node, s)
                    drafts[row].append(self.width - 1 if t == self.strings.null else t)
                    psis[row].append(psi[row])
                    self.walked[row] = node
                    if not stop and len(drafts[row]) < limit[row]:
                        advanced[row] = (node, rest)
                cursor = advanced
        width = max(len(d) for d in drafts)
        q = torch.zeros(rows, width, self.width, dtype=torch.float32)
        null = self.strings.null  # psi's last column is "no token"
        for row, row_psi in enumerate(psis):
            for j, p in enumerate(row_psi):
                q[row, j, :null] = p[:null].float()
                q[row, j, -1] = float(p[null])
        tensor = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long).view(rows, width)
        num_draft = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        return Proposal(tensor.to(device), num_draft.to(device), q.to(device), width=self.width, size=k,
                        scheme="token")

    def advance(self, result: StepResult) -> None:
        """The drafter keeps the drawn tokens whose text was emitted, and reads the rest in its tokens
        (after a step without drafts it has read nothing since its last draft)."""
        previous, self.pending = self.pending, []
        for row, tokens in enumerate(result.emitted):
            emitted = self.vmap.target.text_bytes(tokens)
            if self.walked[row] is None:
                self.pending.append(previous[row] + (self.text.to_drafter(emitted) or [self.text.stand_in]))
                continue
            path = self.walked[row].path()
            count, covered = matched(path, emitted, self.vmap.draft.token_bytes)
            self.pending.append((path[:count] + self.text.to_drafter(emitted[covered:])) or [self.text.stand_in])


def _check(options: dict) -> None:
    value = options["max_nodes"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"decode: option 'max_nodes' of method slrs must be an int >= 1, got {value!r}")


def _make(setup: Setup) -> Proposer:
    return StringSampler(setup, setup.options["max_nodes"])


METHODS = [Method("slrs", "string-level rejection sampling for drafters with short tokens (exact)", _make,
                  drafter=Drafter.ANY_VOCABULARY, tokenizers=vocab_maps.vocab_map, trees=("drafter",), options={"max_nodes": 256},
                  check=_check,
                  option_help={"max_nodes": "most drafter positions one step may score before it refuses"})]
