"""Speculative Ensemble (method "se"; paper 004, Alg. 1 for two members, Alg. 2 for n): the members of an
ensemble take turns proposing tokens to each other, and every token is verified against the ensemble's
distribution, so the output follows the ensemble exactly while most tokens cost one member's forward
instead of all of them.

A step, for every request at once (members in turn: step s's proposer is member s mod n):

- the proposer P offers its drafts: the token it sampled from its own distribution at the end of the
  previous step (its bonus, when that step accepted everything), then gamma_P - 1 more drawn from its own
  distribution (at least one for a request without a bonus), each with the distribution q it was drawn
  from;
- every other member reads the last emitted token and the drafts in one forward, which gives its
  distribution at every draft position and one past the last;
- `specops.ops.ensemble_logits` combines the members' logits at every draft position and `chain_verify`
  accepts a prefix with min(1, r/q) against the ensemble r; a rejected draft is replaced by a token from
  the residual norm(max(0, r - q)) and the step ends (option "scheme": "token" is that; "joint", what
  "auto" picks, decides the prefix jointly by block verification, which keeps at least as many drafts in
  expectation and is the same with one draft per step);
- when every draft is accepted no ensemble token is drawn: the next member (the next step's proposer)
  samples its bonus from its own distribution one past the last draft, which the others verify next
  step. That is what makes a step cheap: the bonus needs no forward of its own.

Every member keeps in its KV cache what was emitted except the last token, which it reads with the next
step's drafts; a member that did not read in a step (a proposer with gamma 1 and a bonus for every
request) reads what it missed then. Temperature, top-k and top-p apply to each member's own proposals
and to the ensemble's logits alike, so at temperature 0 every draft is its member's argmax and the
output is the ensemble's greedy decoding, token for token. num_draft_tokens: gamma for every member (an
int), one per member (a tuple), or "auto": 1 for each, the setting the paper shows is never slower than
the ensemble (Cor. 3.7) and the fastest on a CPU, where a forward over two tokens costs about one.

Mixture draws (option draws="mixture"; what "auto" picks where it is exact): a weighted ensemble sampled
at temperature 1 with no top-k or top-p is the mixture sum_i w_i p_i, and a token from it is a member i
drawn with probability w_i and then a token from p_i (beyond the paper, which verifies every token). So
at every step each request draws its member from a Philox stream of its own (stream 5 at the step's
offset) and samples from that member's distribution alone: no verification, no rejection, one forward of
one member per token. The member chosen reads, in that forward, every token emitted since it last read;
the others wait. At batch 1 a token costs sum_i w_i of the members' forwards instead of all of them; a
batch runs every member some request chose, so large batches approach the standard ensemble's cost,
never more. At any other temperature, with top-k or top-p, or for a contrastive ensemble, the ensemble's
distribution is not a mixture and se proposes and verifies as above.
"""

from __future__ import annotations

import torch

from specops import ops
from specops.decoding.draft_vocab import DraftVocab
from specops.decoding.ensemble_target import WeightedEnsemble
from specops.decoding.protocol import Method, Proposal, Proposer, Setup
from specops.decoding.verify import Verified, resolve_scheme, sample, scheme_option
from specops.reference import uniform

__all__ = ["AlternateProposer", "MixtureDraws"]

_BONUS = 2**31  # random-number index of a step's bonus draw (drafts use 0, 1, ...)
_MEMBER_STREAM = 5  # Philox stream of mixture draws' member choices (chain_verify and samplers use 0-4)
DRAWS = ("auto", "alternate", "mixture")
_SCHEME = scheme_option(("auto", "token", "joint"))  # the alternate proposals' chains carry q: no "positional"


def _check_setting(setting) -> None:
    if setting == "auto":
        return
    values = setting if isinstance(setting, tuple) else (setting,)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise ValueError("num_draft_tokens for method 'se' must be 'auto', an int gamma >= 1 (every member) or a "
                         f"tuple of one gamma >= 1 per member, got {setting!r}")


class AlternateProposer(Proposer):
    """The alternate proposal framework over the members of an `EnsembleState` (module docstring).
    Its verifier is its own `verify`: the proposer's drafts and the others' scores meet there."""

    def __init__(self, setup: Setup):
        self.params, self.seeds = setup.params, setup.seeds
        members = len(setup.target.members)
        setting = setup.num_draft_tokens
        if isinstance(setting, tuple) and len(setting) != members:
            raise ValueError(f"decode: num_draft_tokens for 'se' has {len(setting)} values for {members} members")
        self.gammas = [1] * members if setting == "auto" else list(setting) if isinstance(setting, tuple) else \
            [setting] * members
        self.sampler = DraftVocab.same(setup.target.vocab_size, setup.target.device)
        self.scheme = resolve_scheme(setup.options, seeded=setup.seeded, carries_q=True,
                                     choices=_SCHEME["option_choices"]["scheme"])
        self.verifier = self.verify
        self.turn = 0
        self.started = False
        self.bonus: torch.Tensor | None = None  # [B] bool: the request holds a bonus draft
        self.bonus_token = self.bonus_logits = self.bonus_q = None

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        return Proposal(num_draft=budget)  # drafts are made in verify, where the members are

    def select(self, rows: torch.Tensor) -> None:
        if self.bonus is not None:
            rows = rows.to(self.bonus.device)
            self.bonus, self.bonus_token = self.bonus[rows], self.bonus_token[rows]
            self.bonus_logits = self.bonus_logits[rows]
            self.bonus_q = None if self.bonus_q is None else self.bonus_q[rows]
        self.seeds = self.seeds[rows.to(self.seeds.device)]

    def _draw(self, logits: torch.Tensor, step: int, index: int):
        tokens, _, q = self.sampler.draft(logits, self.params, self.seeds, step, index)
        return tokens, q

    def verify(self, state, last: torch.Tensor, proposal: Proposal, params, seeds, step: int) -> Verified:
        members = state.members
        count, rows, device = len(members), state.rows, last.device
        if not self.started:
            self._start(members, last, state.lm.vocab_size)
        p = self.turn % count
        nxt = (p + 1) % count
        every = bool(self.bonus.all())
        new = self.gammas[p] - 1 if every else max(self.gammas[p] - 1, 1)
        num_draft = torch.minimum(self.bonus.long() + new, proposal.num_draft.to(device) + 1)
        k = int(num_draft.max())
        drafts, own, q, proposer_read = self._propose(members[p], new, k, step)

        # The others score the last token and the drafts in one forward each.
        scored = drafts.clamp(min=0).tolist()
        logits_of = {m: member.read([u + d for u, d in zip(member.unread, scored)], keep=k + 1)
                     for m, member in enumerate(members) if m != p}
        after = logits_of[nxt]
        position = torch.arange(k + 1, device=device)[None, :]
        logits_of[p] = torch.where((position < num_draft[:, None])[:, :, None], own, after)  # padding: any valid row
        ensemble = state.combine([logits_of[m] for m in range(count)])
        out, accepted = ops.chain_verify(ensemble, drafts, q, num_draft=num_draft, temperature=params.temperature,
                                         top_k=params.top_k, top_p=params.top_p, seed=seeds, offset=step,
                                         validate=False, scheme=self.scheme.op("chain"))
        whole, out = self._carry_bonus(after, drafts, num_draft, accepted, out, step)
        emitted_count = torch.where(whole, num_draft, accepted + 1).tolist()
        emitted = [row[:n] for row, n in zip(out.tolist(), emitted_count)]
        reads = [proposer_read if m == p else [k] * rows for m in range(count)]
        self._settle(members, p, new, reads, emitted, emitted_count)
        self.turn += 1
        return Verified(out, torch.where(whole, num_draft - 1, accepted), num_draft, k,
                        accepted_drafts=torch.where(whole, num_draft, accepted))

    def _start(self, members, last: torch.Tensor, vocab: int) -> None:
        """The first step: every member has read the prompt, and the first token is unread by all."""
        rows, device = last.shape[0], last.device
        for member in members:
            member.unread = [[t] for t in last.tolist()]
        self.bonus = torch.zeros(rows, dtype=torch.bool, device=device)
        self.bonus_token = torch.zeros(rows, dtype=torch.long, device=device)
        self.bonus_logits = torch.zeros(rows, vocab, device=device)
        self.bonus_q = None if self.params.greedy else torch.zeros(rows, vocab, device=device)
        self.started = True

    def _propose(self, proposer, new: int, k: int, step: int):
        """The proposing member's drafts [B, k] (-1 past a request's count): its bonus first where it holds
        one, then `new` drafts from its own distribution; its logits [B, k + 1, V] at each draft position, q
        [B, k, V] (None when greedy), and per request how many drafts it read."""
        has, rows, device = self.bonus, self.bonus.shape[0], self.bonus.device
        vocab = self.bonus_logits.shape[1]
        offset, arange = has.long(), torch.arange(rows, device=device)
        drafts = torch.full((rows, k), -1, dtype=torch.long, device=device)
        own = torch.zeros(rows, k + 1, vocab, device=device)
        q = None if self.params.greedy else torch.zeros(rows, k, vocab, device=device)
        if bool(has.any()):
            drafts[has, 0] = self.bonus_token[has]
            own[has, 0] = self.bonus_logits[has]
            if q is not None:
                q[has, 0] = self.bonus_q[has]
        bonus_list, has_list = self.bonus_token.tolist(), has.tolist()
        read = [0] * rows
        if not new:
            return drafts, own, q, read
        logits = proposer.read([u + ([bonus_list[b]] if has_list[b] else []) for b, u in enumerate(proposer.unread)],
                               keep=1)[:, 0]
        proposer.unread = [[] for _ in range(rows)]
        read = [int(h) for h in has_list]
        for i in range(new):
            tokens, q_i = self._draw(logits, step, i)
            col = offset + i
            inside = col < k
            where = arange[inside], col[inside]
            drafts[where], own[where] = tokens[inside], logits[inside]
            if q is not None:
                q[where] = q_i[inside]
            if i + 1 < new:
                logits = proposer.read([[t] for t in tokens.tolist()], keep=1)[:, 0]
                read = [n + 1 for n in read]
        return drafts, own, q, read

    def _carry_bonus(self, after: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor,
                     accepted: torch.Tensor, out: torch.Tensor, step: int):
        """Requests whose drafts were all accepted get no ensemble token: the next member's own draw past the
        drafts becomes its bonus, and the step emits the drafts alone. Returns (those requests [B], out)."""
        whole = (accepted == num_draft) & (num_draft > 0)
        if bool(whole.any()):
            rows = drafts.shape[0]
            past = after[torch.arange(rows, device=drafts.device), num_draft]
            token, q_b = self._draw(past, step, _BONUS)
            self.bonus_token = torch.where(whole, token, self.bonus_token)
            self.bonus_logits = torch.where(whole[:, None], past, self.bonus_logits)
            if q_b is not None:
                self.bonus_q = torch.where(whole[:, None], q_b, self.bonus_q)
            padded = torch.cat([drafts, drafts.new_full((rows, 1), -1)], dim=1)
            position = torch.arange(drafts.shape[1] + 1, device=drafts.device)[None, :]
            out = torch.where(whole[:, None], torch.where(position < num_draft[:, None], padded, -1), out)
        self.bonus = whole
        return whole, out

    @staticmethod
    def _settle(members, p: int, new: int, reads: list[list[int]], emitted: list[list[int]],
                emitted_count: list[int]) -> None:
        """Each member keeps what was emitted except the last token (read with the next step's drafts): it
        forgets what it read past that, and the rest is unread. reads[m][b]: tokens member m read this step."""
        for m, member in enumerate(members):
            if m == p and not new:
                member.unread = [u + e for u, e in zip(member.unread, emitted)]
                continue
            kept = [min(r, n - 1) for r, n in zip(reads[m], emitted_count)]
            member.forget([r - c for r, c in zip(reads[m], kept)])
            member.unread = [e[c:] for e, c in zip(emitted, kept)]


class MixtureDraws(Proposer):
    """Mixture draws for a weighted ensemble at temperature 1 without top-k or top-p (module docstring):
    each step every request picks a member with probability its weight and takes one token from that
    member's distribution. Its verifier is its own `verify`, where the members are."""

    def __init__(self, setup: Setup):
        weights = torch.tensor(setup.target.rule.weights, dtype=torch.float64, device=setup.target.device)
        self.bounds = torch.cumsum(weights, 0)[:-1]  # member i: uniform in [bounds[i-1], bounds[i])
        self.verifier = self.verify

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        return Proposal.empty(budget.shape[0], budget.device)

    def verify(self, state, last: torch.Tensor, proposal: Proposal, params, seeds, step: int) -> Verified:
        members, rows, device = state.members, state.rows, last.device
        emitted = last.tolist()
        for member in members:  # the last emitted token is unread by every member
            member.unread = [u + [t] for u, t in zip(member.unread, emitted)]
        chosen = torch.searchsorted(self.bounds, uniform(seeds, step, 0, _MEMBER_STREAM), right=True)
        logits = None
        for m in chosen.unique().tolist():
            member = members[m]
            read = member.read(member.unread, keep=1)[:, 0]  # every row catches up in the same forward
            member.unread = [[] for _ in range(rows)]
            logits = read if logits is None else torch.where((chosen == m)[:, None], read, logits)
        token = sample(logits, params, seeds, step)
        none = torch.zeros(rows, dtype=torch.long, device=device)
        return Verified(token[:, None], none, none, 0)


def _exact_mixture(setup: Setup) -> bool:
    params = setup.params
    return isinstance(setup.target.rule, WeightedEnsemble) and params.temperature == 1.0 and \
        params.top_k == 0 and params.top_p >= 1.0


def _check_options(options: dict) -> None:
    if options["draws"] not in DRAWS:
        raise ValueError(f"decode: se's draws must be one of {', '.join(DRAWS)}, got {options['draws']!r}")
    _SCHEME["check"](options)


def _make(setup: Setup) -> Proposer:
    """draws="auto": mixture draws where they are exact, unless num_draft_tokens sets the alternate
    proposals' gammas."""
    draws = setup.options["draws"]
    if draws == "mixture":
        if not _exact_mixture(setup):
            raise ValueError("decode: se's draws='mixture' samples a weighted ensemble at temperature 1 "
                             "without top-k or top-p (only there is the ensemble a mixture of its members); "
                             "use 'auto'")
        if setup.num_draft_tokens != "auto":
            raise ValueError("decode: se's draws='mixture' drafts nothing: num_draft_tokens must be 'auto', "
                             f"got {setup.num_draft_tokens!r}")
    if draws == "mixture" or (draws == "auto" and setup.num_draft_tokens == "auto"
                              and _exact_mixture(setup)):
        return MixtureDraws(setup)
    return AlternateProposer(setup)


METHODS = [Method("se", "speculative ensemble: the members propose to each other, verified against the "
                  "ensemble (a weighted ensemble at T=1: each token from one member chosen by its weight)",
                  _make, ensemble="only", options={"draws": "auto", "scheme": "auto"}, check=_check_options,
                  option_help={"draws": "mixture draws the member of each token by its weight, then the token from "
                                        "it (exact for a weighted ensemble at temperature 1 without top-k / top-p, "
                                        "where auto uses it); alternate: the members propose to each other and the "
                                        "ensemble verifies",
                               "scheme": "how the ensemble verifies a member's drafts: token by token, or joint "
                                         "(block verification: never fewer drafts kept; the same as token with one "
                                         "draft per step, auto's gamma); auto is joint"},
                  option_choices={"draws": DRAWS, **_SCHEME["option_choices"]},
                  auto=lambda given: not given.drafter and given.ensemble,
                  draft_setting=_check_setting)]
