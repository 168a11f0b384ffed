"""The same bad input gets the same outcome on every device and every way in: each op's contract
(`specops.ops.CONTRACTS[op]`, the checks of devices whose kernels cannot raise) and its wrapper
(`specops.ops.<op>`, which only shapes arguments) against its C++ CPU kernel. One checker per device path: a
cap or a message that differs in any of the three fails here.

The C++ kernels check their arguments (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE: ValueError /
TypeError); the Triton kernels cannot raise, so the kernel registered for CUDA is the op's
contract `check(*schema_args)` followed by the launcher. The contract is device-generic torch code, so it
runs here on CPU tensors, on exactly the arguments `torch.ops.specops.<op>` takes.

Per op: valid schema-level arguments (tiny) and a table of single-defect mutations, one per check the C++
kernel makes (read from csrc/cpu/<op>.cpp and csrc/cpu/sampling.h), plus inputs both must accept (padding,
leaf rows, validate=False: what the ops' docstrings say is not read or not checked). Each case states the
C++ outcome (exception type and part of its message, or "ok"); the tests check that
  - the C++ kernel does exactly that (a case that tests nothing, or the wrong check, fails here),
  - the contract gives the same outcome: the same exception type and the same message (first line),
  - the guarded CUDA kernel `specops.kernels.<op>.<op>_cuda` raises the same on a few bad cases (before
    any launch: only inputs the contract rejects reach it, so no Triton kernel runs), and where there is a
    GPU so does `torch.ops.specops.<op>` on CUDA tensors,
  - every op with a contract has cases here, and every op with a Triton CUDA kernel has a contract.
An op with cases and no contract fails. Two kinds of case relax the comparison, each with its reason:
`trusting` (validate=False: accelerators may trust values the CPU kernel still checks, so the contract
may accept, but if it raises it must raise what C++ does) and `cpu_only` (a restriction of the CPU kernel
alone, e.g. skinny_linear's float32 input: not compared).
Each bad case has one bad row: the C++ kernels check rows in parallel loops, so where several rows are bad
the row their message names can depend on the threads.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import specops

NAN, INF = float("nan"), float("inf")
I32, I64, F32, F64 = torch.int32, torch.int64, torch.float32, torch.float64


def contracts() -> dict:
    """`specops.ops.CONTRACTS`, read at each use."""
    return specops.ops.CONTRACTS


def schema_names(op: str) -> list[str]:
    return [a.name for a in getattr(torch.ops.specops, op).default._schema.arguments]


def cuda_kernel_ops() -> set[str]:
    """The ops of specops/kernels/*.py registered for CUDA with torch.library.register_kernel (read from the
    source, so that this needs neither triton nor a GPU) that torch.ops.specops has."""
    pattern = re.compile(r"register_kernel\(\s*[\"']specops::(\w+)[\"']\s*,\s*[\"']cuda[\"']")
    found = set()
    for path in (Path(specops.__file__).parent / "kernels").glob("*.py"):
        found.update(pattern.findall(path.read_text()))
    return {op for op in found if hasattr(torch.ops.specops, op)}


# ---- cases ----

@dataclass(frozen=True)
class Case:
    op: str
    name: str
    change: Callable[[dict], None] | None  # mutates the op's valid arguments (None: the valid ones)
    error: type[Exception] | None = None  # what the C++ kernel raises (None: it accepts)
    match: str = ""  # a part of the C++ message (after "<op>: ")
    trusting: str = ""  # why an accelerator may accept it (the contract may return None)
    cpu_only: str = ""  # why the contract need not make this check at all
    guard: bool = False  # also run through specops.kernels.<op>.<op>_cuda


CASES: dict[tuple[str, str], Case] = {}


def bad(op, name, change, match, error=ValueError, **flags):
    assert (op, name) not in CASES, (op, name)
    CASES[op, name] = Case(op, name, change, error, match, **flags)


def good(op, name, change=None):
    assert (op, name) not in CASES, (op, name)
    CASES[op, name] = Case(op, name, change)


def with_(**changes):
    """Replace arguments: each value is the new argument, or a function of the old one."""
    def change(a):
        for name, value in changes.items():
            a[name] = value(a[name]) if callable(value) else value
    return change


def put(name, index, value):
    """Write `value` at `index` of argument `name` (in place: the arguments are built fresh for each call)."""
    def change(a):
        a[name][index] = value
    return change


def seq(*changes):
    def change(a):
        for c in changes:
            c(a)
    return change


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sampling_rows(rows: int) -> dict:
    """Valid per-row sampling arguments: temperature / top_p float32 [rows], top_k / seed int64 [rows]."""
    return dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3])[torch.arange(rows) % 4],
                top_k=torch.tensor([0, 5, 0, 2])[torch.arange(rows) % 4],
                top_p=torch.tensor([1.0, 0.9, 1.0, 0.5])[torch.arange(rows) % 4],
                seed=torch.arange(rows, dtype=I64) + 3)


# 0 / 0: the NaN x86 makes has its sign bit set, and C++ prints it "-nan".
NEG_NAN = torch.zeros(()) / torch.zeros(())
NEG_NAN_TEXT = "-nan" if math.copysign(1.0, NEG_NAN.item()) < 0 else "nan"


def first_row(a):
    """Keep the first row of the logits and of the per-row sampling arguments."""
    for name in ("draft_logits", "temperature", "top_k", "top_p", "seed"):
        a[name] = a[name][:1]


def sampling_cases(op: str, rows_name: str = "B"):
    """The per-row sampling arguments' checks (check_per_row and SamplingRows::check of sampling.h)."""
    bad(op, "top_k_shape", with_(top_k=lambda t: t[:1]), f"top_k and seed must be [{rows_name}] int64")
    bad(op, "top_k_float32", with_(top_k=lambda t: t.float()), f"top_k and seed must be [{rows_name}] int64")
    bad(op, "seed_int32", with_(seed=lambda t: t.int()), f"top_k and seed must be [{rows_name}] int64")
    bad(op, "temperature_float64", with_(temperature=lambda t: t.double()),
        f"temperature and top_p must be [{rows_name}] float32")
    bad(op, "top_p_2d", with_(top_p=lambda t: t[:, None]), f"temperature and top_p must be [{rows_name}] float32")
    bad(op, "offset_negative", with_(offset=-1), "offset must be >= 0")
    bad(op, "temperature_negative", put("temperature", 1, -0.5), "temperature[1] = -0.5 must be finite and >= 0",
        guard=True)
    bad(op, "temperature_nan", put("temperature", 0, NAN), "temperature[0] = nan must be finite and >= 0")
    bad(op, "temperature_negative_nan", put("temperature", 1, NEG_NAN), f"temperature[1] = {NEG_NAN_TEXT} must be finite")
    bad(op, "temperature_inf", put("temperature", 1, INF), "temperature[1] = inf must be finite and >= 0")
    bad(op, "top_k_negative", put("top_k", 0, -1), "top_k[0] = -1 must be >= 0")
    bad(op, "top_p_zero", put("top_p", 1, 0.0), "top_p[1] = 0 must be in (0, 1]")
    bad(op, "top_p_above_one", put("top_p", 0, 1.5), "top_p[0] = 1.5 must be in (0, 1]")
    bad(op, "top_p_nan", put("top_p", 0, NAN), "top_p[0] = nan must be in (0, 1]")
    bad(op, "validate_false_temperature_negative", seq(with_(validate=False), put("temperature", 1, -0.5)),
        "temperature[1] = -0.5 must be finite and >= 0", trusting=TRUST)


TRUST = "validate=False: the CPU kernel still checks this, accelerators may trust the values (no host sync)"

# ---- chain_verify (csrc/cpu/chain_verify.cpp) ----


def chain_verify_args() -> dict:
    batch, k, vocab = 2, 3, 16
    return dict(target_logits=torch.randn(batch, k + 1, vocab, generator=gen(0)),
                draft_tokens=torch.randint(0, vocab, (batch, k), generator=gen(1)),
                draft_probs=torch.softmax(torch.randn(batch, k, vocab, generator=gen(2)), -1),
                num_draft=torch.tensor([3, 3]), **sampling_rows(batch), offset=0, validate=True, scheme="token")


def _chain_cases():
    op = "chain_verify"
    good(op, "valid")
    good(op, "one_hot_q", with_(draft_probs=None))
    good(op, "block_scheme", with_(scheme="block"))
    good(op, "greedy", with_(temperature=torch.zeros(2)))
    good(op, "bfloat16_logits", with_(target_logits=lambda t: t.bfloat16()))
    good(op, "some_neginf_logits", put("target_logits", (0, slice(None), slice(0, 8)), -INF))
    good(op, "no_drafts", with_(num_draft=torch.tensor([0, 0])))
    # draft_tokens: positions past num_draft are ignored (e.g. -1 padding).
    good(op, "padding_drafts_minus_one", seq(put("num_draft", 1, 1), put("draft_tokens", (1, slice(1, None)), -1)))
    good(op, "padding_drafts_outside_vocab", seq(put("num_draft", 0, 2), put("draft_tokens", (0, 2), 99)))
    # validate: every used draft_probs row (i < num_draft) sums to 1; padding rows are not checked.
    good(op, "padding_probs_unnormalized", seq(put("num_draft", 1, 1), put("draft_probs", (1, 2), 0.5)))
    good(op, "validate_false_probs_nan", seq(with_(validate=False), put("draft_probs", (0, 1, 3), NAN)))
    good(op, "validate_false_probs_negative", seq(with_(validate=False), put("draft_probs", (1, 0, 3), -0.25)))
    good(op, "validate_false_probs_unnormalized", seq(with_(validate=False), put("draft_probs", (0, 0), 0.5)))
    # With num_draft = 0 the walk stops at row 0: later rows are never read without validate.
    good(op, "validate_false_logits_nan_unread_row",
         seq(with_(validate=False, num_draft=torch.tensor([0, 0])), put("target_logits", (1, 2, 4), NAN)))

    bad(op, "logits_2d", with_(target_logits=lambda t: t[0]), "target_logits must be [B, K+1, V]", guard=True)
    bad(op, "logits_no_vocabulary", with_(target_logits=lambda t: t[..., :0]), "needs K+1 >= 1 and V >= 1")
    bad(op, "draft_tokens_shape", with_(draft_tokens=lambda t: t[:, :2]),
        "draft_tokens must be [B, K] matching target_logits [B, K+1, V]")
    bad(op, "draft_tokens_int32", with_(draft_tokens=lambda t: t.int()), "draft_tokens must be int64", TypeError,
        guard=True)
    bad(op, "num_draft_shape", with_(num_draft=lambda t: t[:1]), "num_draft, top_k and seed must be [B] int64")
    bad(op, "num_draft_int32", with_(num_draft=lambda t: t.int()), "num_draft, top_k and seed must be [B] int64")
    bad(op, "scheme_unknown", with_(scheme="tree"), "scheme must be 'token' or 'block', got 'tree'")
    bad(op, "validate_false_scheme_unknown", with_(validate=False, scheme="recursive"),
        "scheme must be 'token' or 'block', got 'recursive'")
    bad(op, "logits_float64", with_(target_logits=lambda t: t.double()),
        "target_logits must be float32, bfloat16 or float16", TypeError)
    bad(op, "logits_int64", with_(target_logits=lambda t: t.long()),
        "target_logits must be float32, bfloat16 or float16", TypeError)
    bad(op, "draft_probs_shape", with_(draft_probs=lambda t: t[..., :15]),
        "draft_probs must be [B, K, V] matching target_logits")
    bad(op, "draft_probs_float64", with_(draft_probs=lambda t: t.double()), "draft_probs must be float32", TypeError)
    bad(op, "draft_probs_bfloat16", with_(draft_probs=lambda t: t.bfloat16()), "draft_probs must be float32",
        TypeError)
    sampling_cases(op)
    bad(op, "num_draft_above_k", put("num_draft", 1, 4), "num_draft[1] = 4 is outside [0, 3]")
    bad(op, "num_draft_negative", put("num_draft", 0, -1), "num_draft[0] = -1 is outside [0, 3]")
    bad(op, "draft_id_at_vocabulary", put("draft_tokens", (1, 1), 16),
        "draft_tokens[1, 1] = 16 is outside the vocabulary [0, 16)", guard=True)
    bad(op, "draft_id_negative", put("draft_tokens", (0, 0), -1),
        "draft_tokens[0, 0] = -1 is outside the vocabulary [0, 16)")
    bad(op, "logits_nan", put("target_logits", (1, 2, 5), NAN), "target_logits[1, 2] contains NaN or +inf",
        guard=True)
    bad(op, "logits_posinf", put("target_logits", (0, 1, 0), INF), "target_logits[0, 1] contains NaN or +inf")
    bad(op, "logits_nan_in_bonus_row", put("target_logits", (0, 3, 15), NAN), "target_logits[0, 3] contains NaN")
    bad(op, "logits_nan_past_num_draft", seq(put("num_draft", 1, 1), put("target_logits", (1, 3, 2), NAN)),
        "target_logits[1, 3] contains NaN or +inf")
    bad(op, "logits_row_all_neginf", put("target_logits", (0, 1), -INF), "target_logits[0, 1] has no finite logit")
    bad(op, "draft_probs_nan", put("draft_probs", (1, 0, 3), NAN),
        "draft_probs[1, 0] contains NaN, inf or negative values")
    bad(op, "draft_probs_inf", put("draft_probs", (0, 2, 3), INF),
        "draft_probs[0, 2] contains NaN, inf or negative values")
    bad(op, "draft_probs_negative", put("draft_probs", (0, 1, 7), -0.01),
        "draft_probs[0, 1] contains NaN, inf or negative values")
    bad(op, "draft_probs_unnormalized", with_(draft_probs=lambda p: p * torch.tensor([1.0, 1.1, 1.0])[:, None]),
        "draft_probs[0, 1] sums to 1.1, not 1 (each used row must be a distribution)")
    # A padding row is not summed, but its values are checked like any other (validate scans every row).
    bad(op, "draft_probs_nan_past_num_draft", seq(put("num_draft", 1, 1), put("draft_probs", (1, 2, 0), NAN)),
        "draft_probs[1, 2] contains NaN, inf or negative values")
    # Without validate the C++ kernel still range-checks num_draft and the used draft ids (they index rows)
    # and checks the logit rows it reads (row 0 always).
    bad(op, "validate_false_num_draft_above_k", seq(with_(validate=False), put("num_draft", 0, 4)),
        "num_draft[0] = 4 is outside [0, 3]", trusting=TRUST)
    bad(op, "validate_false_draft_id_outside", seq(with_(validate=False), put("draft_tokens", (1, 0), 16)),
        "draft_tokens[1, 0] = 16 is outside the vocabulary [0, 16)", trusting=TRUST)
    bad(op, "validate_false_logits_nan_first_row", seq(with_(validate=False), put("target_logits", (0, 0, 1), NAN)),
        "target_logits[0, 0] contains NaN or +inf", trusting=TRUST)


# ---- tree_verify (csrc/cpu/tree_verify.cpp) ----

# Request 0: root children 1, 2; node 1 children 3, 4 (leaves 2, 3, 4). Request 1: 1 <- 0, 2 and 3 <- 1,
# 4 <- 2 (leaves 3, 4). Siblings have distinct tokens; node 0's token and parent are not read.
TREE_TOKENS = [[7, 3, 5, 3, 9], [0, 2, 4, 6, 4]]
TREE_PARENTS = [[0, 0, 0, 1, 1], [0, 0, 1, 1, 2]]


def tree_verify_args() -> dict:
    batch, nodes, vocab = 2, 5, 16
    return dict(target_logits=torch.randn(batch, nodes, vocab, generator=gen(3)), tokens=torch.tensor(TREE_TOKENS),
                parents=torch.tensor(TREE_PARENTS),
                draft_probs=torch.softmax(torch.randn(batch, nodes, vocab, generator=gen(4)), -1),
                num_nodes=torch.tensor([5, 5]), replacement=False, **sampling_rows(batch), offset=0, validate=True,
                scheme="recursive")


def _zero_q(a):
    """q = 0 for node 2 of request 0 (token 5) under its parent's row (node 0), the row still summing to 1."""
    row = a["draft_probs"][0, 0]
    row[6] += row[5]
    row[5] = 0.0


def _tree_cases():
    op = "tree_verify"
    good(op, "valid")
    good(op, "one_hot_q", with_(draft_probs=None))
    good(op, "traversal_scheme", with_(scheme="traversal"))
    good(op, "replacement", with_(replacement=True))
    good(op, "greedy", with_(temperature=torch.zeros(2)))
    good(op, "root_only", with_(num_nodes=torch.tensor([1, 1])))
    good(op, "float16_logits", with_(target_logits=lambda t: t.half()))
    # tokens[b, 0] (the root) and parents[b, 0] are not read.
    good(op, "root_token_and_parent_unread", seq(put("tokens", (0, 0), -1), put("parents", (1, 0), 42)))
    # draft_probs rows are checked for the nodes with children only.
    good(op, "leaf_probs_nan", put("draft_probs", (0, 2), NAN))
    good(op, "leaf_probs_unnormalized", put("draft_probs", (0, 4), 0.5))
    good(op, "leaf_probs_negative", put("draft_probs", (1, 3, 0), -1.0))
    # Nodes past num_nodes are ignored: tokens, parents, probabilities, logits.
    padding = put("num_nodes", 1, 3)  # request 1 keeps nodes 0..2 (node 1 keeps child 2)
    good(op, "padding_tokens_garbage", seq(padding, put("tokens", (1, 3), -5), put("tokens", (1, 4), 99)))
    good(op, "padding_parents_garbage", seq(padding, put("parents", (1, 3), 7), put("parents", (1, 4), -3)))
    good(op, "padding_probs_nan", seq(padding, put("draft_probs", (1, 3), NAN)))
    good(op, "padding_probs_unnormalized", seq(padding, put("draft_probs", (1, 4), 3.0)))
    good(op, "padding_logits_nan", seq(padding, put("target_logits", (1, 3, 2), NAN)))
    good(op, "padding_logits_all_neginf", seq(padding, put("target_logits", (1, 4), -INF)))
    # A node that lost its children to num_nodes is a leaf: its row is no longer checked.
    good(op, "padding_makes_a_leaf", seq(put("num_nodes", 0, 3), put("draft_probs", (0, 1), NAN)))
    good(op, "repeated_siblings_with_replacement", seq(with_(replacement=True), put("tokens", (0, 2), 3)))
    # One-hot q (no draft_probs): nothing to check a repeated sibling against.
    good(op, "repeated_siblings_one_hot", seq(with_(draft_probs=None), put("tokens", (0, 2), 3)))
    good(op, "validate_false_probs_nan", seq(with_(validate=False), put("draft_probs", (0, 0), NAN)))
    good(op, "validate_false_probs_unnormalized", seq(with_(validate=False), put("draft_probs", (1, 1), 0.5)))
    good(op, "validate_false_zero_q", seq(with_(validate=False), _zero_q))
    good(op, "validate_false_repeated_siblings", seq(with_(validate=False), put("tokens", (0, 2), 3)))

    bad(op, "scheme_unknown", with_(scheme="token"), "scheme must be 'recursive' or 'traversal', got 'token'",
        guard=True)
    bad(op, "logits_2d", with_(target_logits=lambda t: t[0]), "target_logits must be [B, N, V]")
    bad(op, "logits_no_vocabulary", with_(target_logits=lambda t: t[..., :0]), "needs N >= 1 and V >= 1")
    bad(op, "logits_no_nodes", with_(target_logits=lambda t: t[:, :0]), "needs N >= 1 and V >= 1")
    bad(op, "tokens_shape", with_(tokens=lambda t: t[:, :4]),
        "tokens and parents must be [B, N] matching target_logits")
    bad(op, "parents_1d", with_(parents=lambda t: t[0]), "tokens and parents must be [B, N] matching target_logits")
    bad(op, "tokens_int32", with_(tokens=lambda t: t.int()), "tokens and parents must be int64", TypeError,
        guard=True)
    bad(op, "parents_float32", with_(parents=lambda t: t.float()), "tokens and parents must be int64", TypeError)
    bad(op, "num_nodes_shape", with_(num_nodes=lambda t: t[:1]), "num_nodes, top_k and seed must be [B] int64")
    bad(op, "num_nodes_int32", with_(num_nodes=lambda t: t.int()), "num_nodes, top_k and seed must be [B] int64")
    bad(op, "logits_float64", with_(target_logits=lambda t: t.double()),
        "target_logits must be float32, bfloat16 or float16", TypeError)
    bad(op, "draft_probs_shape", with_(draft_probs=lambda t: t[:, :4]),
        "draft_probs must be [B, N, V] matching target_logits")
    bad(op, "draft_probs_float16", with_(draft_probs=lambda t: t.half()), "draft_probs must be float32", TypeError)
    sampling_cases(op)
    bad(op, "num_nodes_zero", put("num_nodes", 1, 0), "num_nodes[1] = 0 is outside [1, 5]")
    bad(op, "num_nodes_above_n", put("num_nodes", 0, 6), "num_nodes[0] = 6 is outside [1, 5]")
    bad(op, "parent_is_itself", put("parents", (0, 3), 3),
        "parents[0, 3] = 3 must be in [0, 3) (parents come before their children)", guard=True)
    bad(op, "parent_after_child", put("parents", (1, 2), 4), "parents[1, 2] = 4 must be in [0, 2)")
    bad(op, "parent_negative", put("parents", (0, 1), -1), "parents[0, 1] = -1 must be in [0, 1)")
    bad(op, "token_at_vocabulary", put("tokens", (1, 4), 16), "tokens[1, 4] = 16 is outside the vocabulary [0, 16)")
    bad(op, "token_negative", put("tokens", (0, 2), -1), "tokens[0, 2] = -1 is outside the vocabulary [0, 16)")
    bad(op, "logits_nan", put("target_logits", (1, 3, 0), NAN), "target_logits[1, 3] contains NaN or +inf",
        guard=True)
    bad(op, "logits_posinf", put("target_logits", (0, 0, 9), INF), "target_logits[0, 0] contains NaN or +inf")
    bad(op, "logits_nan_in_leaf", put("target_logits", (0, 4, 1), NAN), "target_logits[0, 4] contains NaN or +inf")
    bad(op, "logits_row_all_neginf", put("target_logits", (0, 2), -INF), "target_logits[0, 2] has no finite logit")
    bad(op, "draft_probs_nan", put("draft_probs", (0, 1, 4), NAN),
        "draft_probs[0, 1] contains NaN, inf or negative values")
    bad(op, "draft_probs_inf", put("draft_probs", (1, 2, 4), INF),
        "draft_probs[1, 2] contains NaN, inf or negative values")
    bad(op, "draft_probs_negative", put("draft_probs", (1, 0, 0), -0.01),
        "draft_probs[1, 0] contains NaN, inf or negative values")
    bad(op, "draft_probs_unnormalized", put("draft_probs", (1, 2), 0.1),
        "draft_probs[1, 2] sums to 1.6, not 1 (each row of a node with children must be a distribution)")
    bad(op, "child_with_zero_q", _zero_q,
        "tokens[0, 2] = 5 has q = 0 under draft_probs[0, 0] (it could not have been drawn)")
    bad(op, "repeated_siblings", put("tokens", (0, 2), 3),
        "nodes 1 and 2 of request 0 are siblings with the same token 3 although drawn without replacement")
    bad(op, "repeated_siblings_deeper", put("tokens", (1, 3), 4),
        "nodes 2 and 3 of request 1 are siblings with the same token 4 although drawn without replacement")
    # Without validate the C++ kernel still checks the structure (node counts, parents, ids: they keep the
    # walk in bounds) and the logit rows it reads (the root's always).
    bad(op, "validate_false_num_nodes_zero", seq(with_(validate=False), put("num_nodes", 0, 0)),
        "num_nodes[0] = 0 is outside [1, 5]", trusting=TRUST)
    bad(op, "validate_false_parent_after_child", seq(with_(validate=False), put("parents", (0, 2), 4)),
        "parents[0, 2] = 4 must be in [0, 2)", trusting=TRUST)
    bad(op, "validate_false_token_outside", seq(with_(validate=False), put("tokens", (1, 1), -2)),
        "tokens[1, 1] = -2 is outside the vocabulary [0, 16)", trusting=TRUST)
    bad(op, "validate_false_root_logits_nan", seq(with_(validate=False), put("target_logits", (1, 0, 3), NAN)),
        "target_logits[1, 0] contains NaN or +inf", trusting=TRUST)


# ---- sample_without_replacement (csrc/cpu/sample_without_replacement.cpp, without_replacement.h) ----


def sample_without_replacement_args() -> dict:
    return dict(logits=torch.randn(4, 16, generator=gen(5)), num_samples=3, **sampling_rows(4), offset=0,
                validate=True)


def _sample_cases():
    op = "sample_without_replacement"
    good(op, "valid")
    good(op, "greedy", with_(temperature=torch.zeros(4)))
    good(op, "every_token", with_(num_samples=16))
    good(op, "some_neginf_logits", put("logits", (1, slice(0, 14)), -INF))
    good(op, "bfloat16_logits", with_(logits=lambda t: t.bfloat16()))
    good(op, "no_rows", seq(with_(logits=lambda t: t[:0]), *(with_(**{k: v[:0]}) for k, v in sampling_rows(4).items())))

    bad(op, "logits_3d", with_(logits=lambda t: t[None]), "logits must be [N, V]", guard=True)
    bad(op, "logits_no_columns", with_(logits=lambda t: t[:, :0]), "logits has no columns")
    bad(op, "num_samples_zero", with_(num_samples=0), "num_samples must be in [1, 16], got 0", guard=True)
    bad(op, "num_samples_above_vocabulary", with_(num_samples=17), "num_samples must be in [1, 16], got 17")
    bad(op, "logits_float64", with_(logits=lambda t: t.double()), "logits must be float32, bfloat16 or float16",
        TypeError)
    bad(op, "logits_int32", with_(logits=lambda t: t.int()), "logits must be float32, bfloat16 or float16",
        TypeError)
    sampling_cases(op, "N")
    bad(op, "logits_nan", put("logits", (2, 3), NAN), "logits[2] contains NaN or +inf", guard=True)
    bad(op, "logits_posinf", put("logits", (3, 0), INF), "logits[3] contains NaN or +inf")
    bad(op, "logits_row_all_neginf", put("logits", 1, -INF), "logits[1] has no finite value")
    bad(op, "greedy_row_nan", seq(with_(temperature=torch.zeros(4)), put("logits", (0, 0), NAN)),
        "logits[0] contains NaN or +inf")
    # The C++ kernel reads every row and always checks it; accelerators check only with validate.
    bad(op, "validate_false_logits_nan", seq(with_(validate=False), put("logits", (1, 5), NAN)),
        "logits[1] contains NaN or +inf", trusting=TRUST)


# ---- stochastic_beam_step (csrc/cpu/stochastic_beam_step.cpp) ----


def stochastic_beam_step_args() -> dict:
    # Request 0's beam 2 is not live (phi = G = -inf).
    return dict(logits=torch.randn(2, 3, 16, generator=gen(6)),
                beam_log_probs=torch.tensor([[0.0, -1.2, -INF], [0.0, -0.5, -2.0]]),
                beam_scores=torch.tensor([[0.0, -0.3, -INF], [0.0, -0.1, -1.0]]), beam_width=3,
                **sampling_rows(2), offset=0, validate=True)


def _beam_cases():
    op = "stochastic_beam_step"
    good(op, "valid")
    good(op, "greedy", with_(temperature=torch.zeros(2)))
    good(op, "beam_width_vocabulary", with_(beam_width=16))
    good(op, "float16_logits", with_(logits=lambda t: t.half()))
    # Rows of beams that are not live are not read.
    good(op, "dead_beam_logits_nan", put("logits", (0, 2, 4), NAN))
    good(op, "dead_beam_logits_all_neginf", put("logits", (0, 2), -INF))
    good(op, "dead_by_score_logits_nan", seq(put("beam_scores", (1, 2), -INF), put("logits", (1, 2, 0), NAN)))
    good(op, "dead_by_log_prob_logits_posinf", seq(put("beam_log_probs", (1, 1), -INF), put("logits", (1, 1, 0), INF)))

    bad(op, "logits_2d", with_(logits=lambda t: t[0]), "logits must be [B, W, V]", guard=True)
    bad(op, "logits_no_beams", with_(logits=lambda t: t[:, :0]), "logits needs W >= 1 and V >= 1")
    bad(op, "beam_width_zero", with_(beam_width=0), "beam_width must be in [1, 16], got 0")
    bad(op, "beam_width_above_vocabulary", with_(beam_width=17), "beam_width must be in [1, 16], got 17")
    bad(op, "beam_log_probs_shape", with_(beam_log_probs=lambda t: t[:, :2]),
        "beam_log_probs and beam_scores must be [B, W] float32")
    bad(op, "beam_scores_float64", with_(beam_scores=lambda t: t.double()),
        "beam_log_probs and beam_scores must be [B, W] float32", guard=True)
    bad(op, "logits_float64", with_(logits=lambda t: t.double()), "logits must be float32, bfloat16 or float16",
        TypeError)
    sampling_cases(op)
    bad(op, "beam_log_probs_nan", put("beam_log_probs", (0, 1), NAN),
        "beam_log_probs and beam_scores must not hold NaN or +inf (beam 1 of request 0)")
    bad(op, "beam_scores_posinf", put("beam_scores", (1, 2), INF),
        "beam_log_probs and beam_scores must not hold NaN or +inf (beam 2 of request 1)")
    bad(op, "dead_beam_score_nan", put("beam_scores", (0, 2), NAN),
        "beam_log_probs and beam_scores must not hold NaN or +inf (beam 2 of request 0)")
    # The row sampler names a beam's row by its flat index b * W + w.
    bad(op, "logits_nan", put("logits", (1, 1, 5), NAN), "logits[4] contains NaN or +inf", guard=True)
    bad(op, "logits_posinf", put("logits", (0, 0, 2), INF), "logits[0] contains NaN or +inf")
    bad(op, "logits_row_all_neginf", put("logits", (1, 2), -INF), "logits[5] has no finite value")
    bad(op, "validate_false_logits_nan", seq(with_(validate=False), put("logits", (0, 1, 5), NAN)),
        "logits[1] contains NaN or +inf", trusting=TRUST)


# ---- vocab_project (csrc/cpu/vocab_project.cpp) ----

# Drafter ids 0..11 map into a target vocabulary of 20; ids 12..15 are outside the intersection.
TARGET_IDS = [19, 3, 0, 7, 12, 5, 1, 17, 8, 2, 14, 10, -1, -1, -1, -1]


def vocab_project_args() -> dict:
    return dict(draft_logits=torch.randn(2, 16, generator=gen(7)), target_ids=torch.tensor(TARGET_IDS),
                target_vocab=20, **sampling_rows(2), offset=0, validate=True)


def _vocab_cases():
    op = "vocab_project"
    good(op, "valid")
    good(op, "greedy", with_(temperature=torch.zeros(2)))
    good(op, "union_map", with_(target_ids=torch.arange(16) + 4))
    good(op, "bfloat16_logits", with_(draft_logits=lambda t: t.bfloat16()))
    good(op, "unmapped_neginf", put("draft_logits", (1, slice(12, None)), -INF))
    good(op, "mapped_partly_neginf", put("draft_logits", (0, slice(1, 12)), -INF))
    # validate=False: ids outside [0, target_vocab) are left out, repeats and unmapped values are not checked.
    good(op, "validate_false_logits_nan_unmapped", seq(with_(validate=False), put("draft_logits", (0, 13), NAN)))
    good(op, "validate_false_target_id_outside", seq(with_(validate=False), put("target_ids", 3, 20)))
    good(op, "validate_false_target_id_below_minus_one", seq(with_(validate=False), put("target_ids", 3, -7)))
    good(op, "validate_false_target_ids_repeated", seq(with_(validate=False), put("target_ids", 5, 0)))

    bad(op, "logits_1d", with_(draft_logits=lambda t: t[0]), "draft_logits must be an [N, V_d] tensor", guard=True)
    bad(op, "logits_float64", with_(draft_logits=lambda t: t.double()),
        "draft_logits must be float32, bfloat16 or float16", TypeError)
    bad(op, "logits_no_columns", with_(draft_logits=lambda t: t[:, :0]), "draft_logits has no columns")
    bad(op, "target_ids_shape", with_(target_ids=lambda t: t[:15]),
        "target_ids must be [V_d] = [16] to match draft_logits")
    bad(op, "target_ids_int32", with_(target_ids=lambda t: t.int()), "target_ids must be int64", TypeError,
        guard=True)
    bad(op, "target_vocab_zero", with_(target_vocab=0), "target_vocab must be an int >= 1, got 0")
    bad(op, "target_vocab_2_31", with_(target_vocab=2**31),
        "vocabularies of 2**31 tokens or more are not supported")
    sampling_cases(op, "N")
    bad(op, "target_id_below_minus_one", put("target_ids", 3, -2), "target_ids[3] = -2 must be -1 or in [0, 20)")
    bad(op, "target_id_at_target_vocab", put("target_ids", 14, 20), "target_ids[14] = 20 must be -1 or in [0, 20)")
    bad(op, "target_ids_repeated", put("target_ids", 5, 0),
        "target_ids maps two drafter ids to the same target id (drafter ids 2 and 5 to target id 0)", guard=True)
    bad(op, "logits_nan_mapped", put("draft_logits", (1, 0), NAN), "draft_logits[1] contains NaN or +inf")
    bad(op, "logits_nan_unmapped", put("draft_logits", (0, 13), NAN), "draft_logits[0] contains NaN or +inf")
    bad(op, "logits_posinf_unmapped", put("draft_logits", (1, 15), INF), "draft_logits[1] contains NaN or +inf")
    bad(op, "no_finite_logit_in_intersection", put("draft_logits", (1, slice(0, 12)), -INF),
        "draft_logits[1] has no finite logit inside the intersection (target_ids >= 0)")
    # One row: with several bad rows, which one the C++ kernel names depends on its threads.
    bad(op, "empty_intersection", seq(first_row, with_(target_ids=torch.full((16,), -1))),
        "draft_logits[0] has no finite logit inside the intersection (target_ids >= 0)")
    # Without validate the C++ kernel still checks the mapped logits (its passes need them ordered).
    bad(op, "validate_false_logits_nan_mapped", seq(with_(validate=False), put("draft_logits", (0, 2), NAN)),
        "draft_logits[0] contains NaN or +inf", trusting=TRUST)
    bad(op, "validate_false_no_finite_logit_in_intersection",
        seq(with_(validate=False), put("draft_logits", (0, slice(0, 12)), -INF)),
        "draft_logits[0] has no finite logit inside the intersection", trusting=TRUST)


# ---- ensemble_logits (csrc/cpu/ensemble_logits.cpp) ----


def ensemble_logits_args() -> dict:
    return dict(members=[torch.randn(2, 16, generator=gen(8)), torch.randn(2, 16, generator=gen(9))],
                weights=torch.tensor([0.25, 0.75]), mode=0, mu=0.0, alpha=0.0, validate=True)


CONTRASTIVE = with_(mode=1, mu=0.5, alpha=0.1)


def _put_member(m, index, value):
    def change(a):
        a["members"][m][index] = value
    return change


def _ensemble_cases():
    op = "ensemble_logits"
    good(op, "valid")
    good(op, "contrastive", CONTRASTIVE)
    good(op, "contrastive_no_cut", with_(mode=1, mu=1.0, alpha=0.0))
    # A contrastive ensemble does not use weights: any tensor is accepted.
    good(op, "contrastive_ignores_weights", seq(CONTRASTIVE, with_(weights=torch.ones(5, dtype=F64))))
    good(op, "one_member", with_(members=lambda m: m[:1], weights=torch.tensor([1.0])))
    good(op, "zero_weight", with_(weights=torch.tensor([0.0, 1.0])))
    good(op, "weights_sum_within_tolerance", with_(weights=torch.tensor([0.25, 0.75005])))
    good(op, "bfloat16_members", with_(members=lambda m: [t.bfloat16() for t in m]))
    good(op, "3d_members", with_(members=lambda m: [t[None] for t in m]))
    good(op, "no_rows", with_(members=lambda m: [t[:0] for t in m]))
    good(op, "some_neginf", _put_member(1, (0, slice(0, 8)), -INF))

    bad(op, "mode_unknown", with_(mode=2), "mode must be 0 (weighted) or 1 (contrastive)", guard=True)
    bad(op, "no_members", with_(members=[]), "needs at least one member")
    bad(op, "contrastive_three_members", seq(CONTRASTIVE, with_(members=lambda m: m + m[:1])),
        "a contrastive ensemble has exactly 2 members (expert, amateur), got 3")
    bad(op, "contrastive_one_member", seq(CONTRASTIVE, with_(members=lambda m: m[:1])),
        "a contrastive ensemble has exactly 2 members (expert, amateur), got 1")
    bad(op, "members_0d", with_(members=lambda m: [t[0, 0] for t in m]), "members must be [..., V] with V >= 1")
    bad(op, "members_no_vocabulary", with_(members=lambda m: [t[:, :0] for t in m]),
        "members must be [..., V] with V >= 1")
    bad(op, "member_shape", with_(members=lambda m: [m[0], m[1][:, :15]]),
        "member 1 has shape [2, 15], member 0 has [2, 16]", guard=True)
    bad(op, "member_float64", with_(members=lambda m: [m[0], m[1].double()]),
        "members must be float32, bfloat16 or float16", TypeError, guard=True)
    bad(op, "member_int64", with_(members=lambda m: [m[0].long(), m[1]]),
        "members must be float32, bfloat16 or float16", TypeError)
    bad(op, "weights_shape", with_(weights=torch.tensor([0.25, 0.25, 0.5])), "weights must be [2] (one per member)")
    bad(op, "weights_2d", with_(weights=lambda w: w[None]), "weights must be [2] (one per member)")
    bad(op, "weights_float64", with_(weights=lambda w: w.double()), "weights must be float32", TypeError)
    bad(op, "weights_negative", with_(weights=torch.tensor([-0.5, 1.5])),
        "weights must be finite and >= 0, got -0.5 for member 0")
    bad(op, "weights_nan", with_(weights=torch.tensor([0.5, NAN])), "weights must be finite and >= 0, got nan for "
        "member 1")
    bad(op, "weights_inf", with_(weights=torch.tensor([INF, 0.0])), "weights must be finite and >= 0, got inf for "
        "member 0")
    bad(op, "weights_sum", with_(weights=torch.tensor([0.5, 0.4])), "weights must sum to 1, got 0.9", guard=True)
    bad(op, "mu_negative", seq(CONTRASTIVE, with_(mu=-1.0)), "mu must be finite and >= 0, got -1")
    bad(op, "mu_nan", seq(CONTRASTIVE, with_(mu=NAN)), "mu must be finite and >= 0, got nan")
    bad(op, "mu_inf", seq(CONTRASTIVE, with_(mu=INF)), "mu must be finite and >= 0, got inf")
    bad(op, "alpha_one", seq(CONTRASTIVE, with_(alpha=1.0)), "alpha must be in [0, 1), got 1")
    bad(op, "alpha_negative", seq(CONTRASTIVE, with_(alpha=-0.25)), "alpha must be in [0, 1), got -0.25")
    bad(op, "alpha_nan", seq(CONTRASTIVE, with_(alpha=NAN)), "alpha must be in [0, 1), got nan")
    bad(op, "member_nan", _put_member(1, (0, 3), NAN), "member 1, row 0 contains NaN or +inf")
    bad(op, "member_posinf", _put_member(0, (1, 15), INF), "member 0, row 1 contains NaN or +inf")
    bad(op, "member_row_all_neginf", _put_member(0, 1, -INF), "member 0, row 1 has no finite logit")
    bad(op, "contrastive_member_nan", seq(CONTRASTIVE, _put_member(0, (1, 0), NAN)),
        "member 0, row 1 contains NaN or +inf")
    bad(op, "validate_false_member_nan", seq(with_(validate=False), _put_member(0, (0, 0), NAN)),
        "member 0, row 0 contains NaN or +inf", trusting=TRUST)


# ---- ngram_match (csrc/cpu/ngram_match.cpp) ----


def ngram_match_args() -> dict:
    return dict(tokens=torch.randint(0, 5, (2, 10), generator=gen(10)), lengths=torch.tensor([10, 7]), min_ngram=1,
                max_ngram=3, num_candidates=2, width=3, validate=True)


def _ngram_cases():
    op = "ngram_match"
    good(op, "valid")
    good(op, "int32_tokens", with_(tokens=lambda t: t.int()))
    good(op, "empty_contexts", with_(lengths=torch.tensor([0, 0])))
    good(op, "longest_ngram", with_(max_ngram=63))
    good(op, "wide", with_(width=12, num_candidates=4))
    # Tokens past a row's length are padding: not read.
    good(op, "negative_padding", put("tokens", (1, slice(7, None)), -1))
    good(op, "validate_false_negative_token", seq(with_(validate=False), put("tokens", (0, 4), -3)))

    bad(op, "tokens_1d", with_(tokens=lambda t: t[0]), "tokens must be [B, L], got 1 dimensions", guard=True)
    bad(op, "tokens_float32", with_(tokens=lambda t: t.float()), "tokens must be int32 or int64, got Float",
        TypeError, guard=True)
    # A zero-stride view: L = 2**28 columns without the memory.
    bad(op, "tokens_too_long", with_(tokens=torch.zeros(2, 1, dtype=I64).expand(2, 2**28)),
        "tokens must have L < 2**28 columns, got 268435456")
    bad(op, "lengths_shape", with_(lengths=torch.tensor([10, 7, 1])), "lengths must be [B] = [2], got [3]")
    bad(op, "lengths_int32", with_(lengths=lambda t: t.int()), "lengths must be int64, got Int", TypeError)
    bad(op, "min_ngram_zero", with_(min_ngram=0), "need 1 <= min_ngram <= max_ngram <= 63, got min_ngram = 0, "
        "max_ngram = 3")
    bad(op, "max_ngram_64", with_(max_ngram=64), "need 1 <= min_ngram <= max_ngram <= 63, got min_ngram = 1, "
        "max_ngram = 64")
    bad(op, "min_ngram_above_max", with_(min_ngram=4), "need 1 <= min_ngram <= max_ngram <= 63, got min_ngram = 4, "
        "max_ngram = 3")
    bad(op, "num_candidates_zero", with_(num_candidates=0), "num_candidates must be >= 1 and < 2**28, got 0")
    bad(op, "num_candidates_2_to_the_28", with_(num_candidates=2**28),
        "num_candidates must be >= 1 and < 2**28, got 268435456")
    bad(op, "width_zero", with_(width=0), "width must be >= 1 and < 2**28, got 0")
    bad(op, "width_2_to_the_28", with_(width=2**28), "width must be >= 1 and < 2**28, got 268435456")
    bad(op, "lengths_above_l", put("lengths", 1, 11), "lengths[1] = 11 is outside [0, 10]", guard=True)
    bad(op, "lengths_negative", put("lengths", 0, -1), "lengths[0] = -1 is outside [0, 10]")
    bad(op, "negative_token", put("tokens", (1, 3), -1),
        "tokens[1, 3] = -1 is negative; context tokens must be ids >= 0")
    bad(op, "negative_token_int32", seq(with_(tokens=lambda t: t.int()), put("tokens", (0, 9), -2)),
        "tokens[0, 9] = -2 is negative; context tokens must be ids >= 0")
    # Documented: without validate the CPU kernel still rejects lengths outside [0, L]; GPU kernels clamp them.
    bad(op, "validate_false_lengths_above_l", seq(with_(validate=False), put("lengths", 0, 11)),
        "lengths[0] = 11 is outside [0, 10]", trusting="validate=False: GPU kernels clamp lengths (docstring)")


# ---- ngram_memory_insert / ngram_memory_lookup (csrc/cpu/ngram_memory_*.cpp, ngram_memory.h) ----

# A store of two runs ("1 2 3 1 2" and "2 3"), its first three followed positions indexed as one level.
MEMORY_TOKENS = [1, 2, 3, 1, 2, -1, 2, 3, -1]


def _memory_index(room: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The store and its index's entries buffer (one level of 3, then `room` free entries)."""
    tokens = torch.tensor(MEMORY_TOKENS, dtype=I32)
    entries = torch.full((3 + room,), -1, dtype=I32)
    specops.ops.ngram_memory_insert(tokens, entries, [], torch.tensor([0, 1, 2]), depth=4)
    return tokens, entries


def ngram_memory_insert_args() -> dict:
    tokens, entries = _memory_index(room=2)
    return dict(tokens=tokens, entries=entries, levels=[3], positions=torch.tensor([3, 6]), depth=4, validate=True)


def ngram_memory_lookup_args() -> dict:
    tokens, entries = _memory_index()
    return dict(tokens=tokens, entries=entries, levels=[3], contexts=torch.tensor([[1, 2, 3], [5, 1, 2]]),
                lengths=torch.tensor([3, 2]), depth=4, min_match=1, num_candidates=2, width=3, max_occurrences=8,
                validate=True)


def _memory_index_cases(op: str, room: int):
    bad(op, "tokens_2d", with_(tokens=lambda t: t[None]), "tokens must be [T], got 2 dimensions", guard=True)
    bad(op, "tokens_int64", with_(tokens=lambda t: t.long()), "tokens must be int32, got Long", TypeError, guard=True)
    bad(op, "entries_2d", with_(entries=lambda t: t[None]), "entries must be [capacity], got 2 dimensions")
    bad(op, "entries_int64", with_(entries=lambda t: t.long()), "entries must be int32, got Long", TypeError)
    bad(op, "levels_past_the_buffer", with_(levels=[4 + room]),
        f"levels sum to {4 + room} but entries has room for {3 + room}")
    bad(op, "levels_empty_level", with_(levels=[0, 3]), "levels[0] = 0 must be >= 1")
    bad(op, "depth_zero", with_(depth=0), "depth must be in [1, 64], got 0")
    bad(op, "depth_65", with_(depth=65), "depth must be in [1, 64], got 65")


def _memory_cases():
    op = "ngram_memory_insert"
    good(op, "valid")
    good(op, "nothing_added", with_(positions=torch.empty(0, dtype=I64)))
    good(op, "two_levels", with_(levels=[1, 2]))
    good(op, "validate_false_bad_position", seq(with_(validate=False), put("positions", 1, 5)))
    _memory_index_cases(op, room=2)
    bad(op, "no_room", with_(entries=lambda t: t[:4].clone()),
        "entries has room for 4 entries, and the index would hold 5")
    bad(op, "entries_not_contiguous", with_(entries=lambda t: torch.stack([t, t], 1)[:, 0]),
        "entries must be contiguous (it is written in place)")
    bad(op, "positions_2d", with_(positions=lambda t: t[None]), "positions must be [n], got 2 dimensions")
    bad(op, "positions_int32", with_(positions=lambda t: t.int()), "positions must be int64, got Int", TypeError)
    bad(op, "position_negative", put("positions", 0, -1), "positions[0] = -1 is outside [0, 8)", guard=True)
    bad(op, "position_last", put("positions", 1, 8), "positions[1] = 8 is outside [0, 8)")
    bad(op, "positions_not_increasing", with_(positions=torch.tensor([6, 3])),
        "positions must increase strictly, but positions[1] = 3 follows 6")
    bad(op, "position_repeated", with_(positions=torch.tensor([3, 3])),
        "positions must increase strictly, but positions[1] = 3 follows 3")
    bad(op, "position_not_followed", put("positions", 1, 4),
        "positions[1] = 4 does not hold a token followed by a token (tokens[4:6] = 2, -1)")
    bad(op, "position_on_a_separator", put("positions", 1, 5),
        "positions[1] = 5 does not hold a token followed by a token (tokens[5:7] = -1, 2)")

    op = "ngram_memory_lookup"
    good(op, "valid")
    good(op, "int32_contexts", with_(contexts=lambda t: t.int()))
    good(op, "empty_contexts", with_(lengths=torch.tensor([0, 0])))
    good(op, "empty_memory", with_(entries=torch.empty(0, dtype=I32), levels=[]))
    good(op, "negative_padding", put("contexts", (1, 2), -1))
    good(op, "validate_false_negative_token", seq(with_(validate=False), put("contexts", (0, 0), -3)))
    good(op, "widest", with_(width=256, max_occurrences=256, num_candidates=256))
    good(op, "buffer_with_room", with_(entries=lambda t: torch.cat([t, torch.full((4,), -1, dtype=I32)])))
    _memory_index_cases(op, room=0)
    bad(op, "contexts_1d", with_(contexts=lambda t: t[0]), "contexts must be [B, C], got 1 dimensions", guard=True)
    bad(op, "contexts_float", with_(contexts=lambda t: t.float()), "contexts must be int32 or int64, got Float",
        TypeError)
    bad(op, "lengths_shape", with_(lengths=torch.tensor([3])), "lengths must be [B] = [2], got [1]")
    bad(op, "lengths_int32", with_(lengths=lambda t: t.int()), "lengths must be int64, got Int", TypeError)
    bad(op, "min_match_zero", with_(min_match=0), "min_match must be in [1, depth = 4], got 0")
    bad(op, "min_match_above_depth", with_(min_match=5), "min_match must be in [1, depth = 4], got 5")
    bad(op, "max_occurrences_zero", with_(max_occurrences=0), "max_occurrences must be in [1, 256], got 0")
    bad(op, "max_occurrences_257", with_(max_occurrences=257), "max_occurrences must be in [1, 256], got 257")
    bad(op, "num_candidates_above_occurrences", with_(num_candidates=9),
        "num_candidates must be in [1, max_occurrences = 8], got 9")
    bad(op, "width_zero", with_(width=0), "width must be in [1, 256], got 0")
    bad(op, "width_257", with_(width=257), "width must be in [1, 256], got 257")
    bad(op, "lengths_above_c", put("lengths", 1, 4), "lengths[1] = 4 is outside [0, 3]", guard=True)
    bad(op, "negative_token", put("contexts", (1, 1), -1),
        "contexts[1, 1] = -1 is negative; context tokens must be ids >= 0")
    bad(op, "validate_false_lengths_above_c", seq(with_(validate=False), put("lengths", 0, 9)),
        "lengths[0] = 9 is outside [0, 3]")


# ---- tree_attention (csrc/cpu/tree_attention.cpp) ----

# Node 0 the root, nodes 1 and 2 its children, node 3 node 1's child: each row its ancestors and itself.
TREE_MASK = [[1], [3], [5], [11]]


def tree_attention_args() -> dict:
    kv_mask = torch.ones(2, 2, dtype=torch.bool)
    kv_mask[1, 0] = False
    return dict(query=torch.randn(2, 2, 4, 8, generator=gen(11)), key=torch.randn(2, 1, 6, 8, generator=gen(12)),
                value=torch.randn(2, 1, 6, 8, generator=gen(13)),
                tree_mask=torch.tensor([TREE_MASK, TREE_MASK], dtype=I32), kv_mask=kv_mask, scale=0.35, window=0,
                softcap=0.0, sinks=None, validate=True)


def _own_bits(batch: int, nodes: int) -> torch.Tensor:
    """A mask in which every node sees only itself (padding nodes of a ragged tree)."""
    words = (nodes + 31) // 32
    mask = torch.zeros(batch, nodes, words, dtype=I64)
    for i in range(nodes):
        mask[:, i, i // 32] = 1 << (i % 32)
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(I32)


def _nodes_33(a):
    """N = 33 nodes (two mask words), each seeing only itself."""
    a.update(query=torch.randn(1, 1, 33, 4, generator=gen(14)), key=torch.randn(1, 1, 35, 4, generator=gen(15)),
             value=torch.randn(1, 1, 35, 4, generator=gen(16)), tree_mask=_own_bits(1, 33),
             kv_mask=torch.ones(1, 2, dtype=torch.bool))


def _tree_attention_cases():
    op = "tree_attention"
    good(op, "valid")
    good(op, "sinks", with_(sinks=torch.tensor([0.5, -1.0])))
    good(op, "window_and_softcap", with_(window=2, softcap=5.0))
    good(op, "float16", with_(query=lambda t: t.half(), key=lambda t: t.half(), value=lambda t: t.half()))
    good(op, "no_prefix_visible", with_(kv_mask=torch.zeros(2, 2, dtype=torch.bool)))
    good(op, "padding_nodes_see_themselves", with_(tree_mask=_own_bits(2, 4)))
    good(op, "hidden_slot_nan", seq(put("key", (1, 0, 0), NAN), put("value", (1, 0, 0), NAN)))
    good(op, "no_prefix", with_(key=lambda t: t[:, :, 2:], value=lambda t: t[:, :, 2:],
                                kv_mask=torch.ones(2, 0, dtype=torch.bool)))
    good(op, "grouped_query", with_(query=torch.randn(2, 4, 4, 8, generator=gen(17)),
                                    key=torch.randn(2, 2, 6, 8, generator=gen(18)),
                                    value=torch.randn(2, 2, 6, 8, generator=gen(19))))
    good(op, "empty_batch", with_(query=lambda t: t[:0], key=lambda t: t[:0], value=lambda t: t[:0],
                                  tree_mask=lambda t: t[:0], kv_mask=lambda t: t[:0]))
    good(op, "33_nodes", _nodes_33)
    # The mask's values are checked only with validate.
    good(op, "validate_false_mask_bit_past_n", seq(with_(validate=False), put("tree_mask", (0, 1, 0), 3 | 1 << 4)))
    good(op, "validate_false_node_blind_to_itself", seq(with_(validate=False), put("tree_mask", (1, 3, 0), 3)))

    bad(op, "query_3d", with_(query=lambda t: t[0]), "query, key and value must be 4-D", guard=True)
    bad(op, "key_3d", with_(key=lambda t: t[0]), "query, key and value must be 4-D")
    bad(op, "value_5d", with_(value=lambda t: t[None]), "query, key and value must be 4-D")
    bad(op, "no_nodes", with_(query=lambda t: t[:, :, :0]), "need N >= 1, Hq a multiple of Hkv and S >= N")
    bad(op, "heads_not_a_multiple", with_(query=torch.randn(2, 3, 4, 8), key=torch.randn(2, 2, 6, 8),
                                          value=torch.randn(2, 2, 6, 8)),
        "need N >= 1, Hq a multiple of Hkv and S >= N")
    bad(op, "no_kv_heads", with_(key=lambda t: t[:, :0], value=lambda t: t[:, :0]),
        "need N >= 1, Hq a multiple of Hkv and S >= N")
    bad(op, "fewer_slots_than_nodes", with_(key=lambda t: t[:, :, :3], value=lambda t: t[:, :, :3]),
        "need N >= 1, Hq a multiple of Hkv and S >= N")
    bad(op, "key_head_dim", with_(key=lambda t: t[..., :4]), "key and value must be [B, Hkv, S, D]")
    bad(op, "key_batch", with_(key=lambda t: torch.cat([t, t[:1]])), "key and value must be [B, Hkv, S, D]")
    bad(op, "value_slots", with_(value=lambda t: t[:, :, :5]), "key and value must be [B, Hkv, S, D]")
    # A dtype mismatch is a ValueError here, not a TypeError.
    bad(op, "key_float64", with_(key=lambda t: t.double()), "key and value must have query's dtype", TypeError,
        guard=True)
    bad(op, "value_float16", with_(value=lambda t: t.half()), "key and value must have query's dtype", TypeError)
    bad(op, "query_float64", with_(query=lambda t: t.double(), key=lambda t: t.double(), value=lambda t: t.double()),
        "query must be float32, bfloat16 or float16", TypeError, guard=True)
    bad(op, "tree_mask_int64", with_(tree_mask=lambda t: t.long()),
        "tree_mask must be [B, N, ceil(N/32)] int32", guard=True)
    bad(op, "tree_mask_words", with_(tree_mask=lambda t: torch.cat([t, t], -1)),
        "tree_mask must be [B, N, ceil(N/32)] int32")
    bad(op, "kv_mask_uint8", with_(kv_mask=lambda t: t.to(torch.uint8)), "kv_mask must be [B, S - N] bool")
    bad(op, "kv_mask_shape", with_(kv_mask=lambda t: t[:, :1]), "kv_mask must be [B, S - N] bool")
    bad(op, "sinks_float64", with_(sinks=torch.zeros(2, dtype=F64)), "sinks must be a float32 [Hq] tensor")
    bad(op, "sinks_shape", with_(sinks=torch.zeros(3)), "sinks must be a float32 [Hq] tensor")
    bad(op, "sinks_2d", with_(sinks=torch.zeros(1, 2)), "sinks must be a float32 [Hq] tensor")
    bad(op, "scale_zero", with_(scale=0.0), "scale must be finite and > 0, got 0", guard=True)
    bad(op, "scale_nan", with_(scale=NAN), "scale must be finite and > 0, got nan")
    bad(op, "scale_beyond_float32", with_(scale=1e39), "scale must be finite and > 0, got 1e+39")
    bad(op, "window_negative", with_(window=-1), "window must be >= 0 (0: no window), got -1", guard=True)
    bad(op, "softcap_negative", with_(softcap=-2.0), "softcap must be finite and >= 0 (0: no soft-cap), got -2")
    bad(op, "softcap_inf", with_(softcap=INF), "softcap must be finite and >= 0 (0: no soft-cap), got inf")
    bad(op, "mask_bit_past_n", put("tree_mask", (1, 2, 0), 5 | 1 << 4), "tree_mask has a bit set at or past node N = 4",
        guard=True)
    bad(op, "mask_sign_bit", put("tree_mask", (0, 0, 0), 1 - 2**31), "tree_mask has a bit set at or past node N = 4")
    bad(op, "mask_bit_past_n_second_word", seq(_nodes_33, put("tree_mask", (0, 32, 1), 1 | 1 << 1)),
        "tree_mask has a bit set at or past node N = 33")
    bad(op, "node_blind_to_itself", put("tree_mask", (1, 3, 0), 3),
        "tree_mask has a node that does not see itself (its own bit is clear)")
    bad(op, "node_blind_to_itself_second_word", seq(_nodes_33, put("tree_mask", (0, 32, 1), 0)),
        "tree_mask has a node that does not see itself (its own bit is clear)")


# ---- skinny_linear, quantized_linear, int8_linear (csrc/cpu/skinny_linear.cpp, quantized_linear.cpp,
# int8_linear.cpp) ----

CPU_FLOAT32 = "the CPU kernel takes float32 activations only; accelerators also take bfloat16 / float16"


def skinny_linear_args() -> dict:
    return dict(input=torch.randn(2, 8, generator=gen(20)), weight=torch.randn(4, 8, generator=gen(21)),
                bias=torch.randn(4, generator=gen(22)))


def quantized_linear_args() -> dict:
    return dict(input=torch.randn(2, 64, generator=gen(23)),
                weight=torch.randint(-127, 128, (4, 64), generator=gen(24), dtype=torch.int8),
                scales=torch.rand(4, 2, generator=gen(25)) / 100, mins=None, bias=torch.randn(4, generator=gen(26)))


def int8_linear_args() -> dict:
    return dict(input=torch.randint(-128, 128, (2, 64), generator=gen(30), dtype=torch.int8),
                input_scales=torch.rand(2, generator=gen(31)) / 100,
                weight=torch.randint(-128, 128, (4, 64), generator=gen(32), dtype=torch.int8),
                weight_scales=torch.rand(4, generator=gen(33)) / 100)


_INT8_LONG_K = 2**17  # one past int8_linear's longest K (specops.reference.INT8_LINEAR_MOST_K)


def _int4(a):
    a.update(weight=torch.randint(0, 256, (4, 32), generator=gen(27), dtype=torch.uint8),
             mins=-torch.rand(4, 2, generator=gen(28)))


def _linear_cases():
    op = "skinny_linear"
    good(op, "valid")
    good(op, "no_bias", with_(bias=None))
    good(op, "no_rows", with_(input=lambda t: t[:0]))
    bad(op, "input_1d", with_(input=lambda t: t[0]), "input must be [M, K] and weight [N, K]", ValueError,
        guard=True)
    bad(op, "weight_3d", with_(weight=lambda t: t[None]), "input must be [M, K] and weight [N, K]", ValueError)
    bad(op, "input_float64", with_(input=lambda t: t.double()), "the CPU kernel takes float32 input and weight",
        TypeError, cpu_only=CPU_FLOAT32)
    bad(op, "input_bfloat16", with_(input=lambda t: t.bfloat16()), "the CPU kernel takes float32 input and weight",
        TypeError, cpu_only=CPU_FLOAT32)
    bad(op, "weight_inner_size", with_(weight=lambda t: t[:, :7]), "weight must be [N, K] with K = 8, got [4, 7]",
        ValueError, guard=True)
    bad(op, "bias_shape", with_(bias=lambda t: t[:3]), "bias must be float32 [N] with N = 4", ValueError)
    bad(op, "bias_2d", with_(bias=lambda t: t[None]), "bias must be float32 [N] with N = 4", ValueError)
    bad(op, "bias_float64", with_(bias=lambda t: t.double()), "bias must be float32 [N] with N = 4", ValueError)

    op = "quantized_linear"
    good(op, "valid")
    good(op, "int8_one_group", with_(scales=lambda s: s[:, :1]))
    good(op, "int8_one_group_k_48", with_(input=lambda t: t[:, :48], weight=lambda t: t[:, :48],
                                          scales=lambda s: s[:, :1]))
    good(op, "int4", _int4)
    good(op, "bfloat16_weight", with_(weight=torch.randn(4, 64, generator=gen(29)).bfloat16(), scales=None))
    good(op, "no_bias", with_(bias=None))
    bad(op, "input_1d", with_(input=lambda t: t[0]), "input must be float32 [M, K]", ValueError, guard=True)
    bad(op, "input_float16", with_(input=lambda t: t.half()), "input must be float32 [M, K]", ValueError,
        cpu_only=CPU_FLOAT32)
    bad(op, "weight_1d", with_(weight=lambda t: t[0]), "weight must be 2-D", ValueError)
    bad(op, "weight_float32", with_(weight=lambda t: t.float(), scales=None),
        "weight must be bfloat16, int8 or uint8 (packed int4), got Float", TypeError, guard=True)
    bad(op, "bfloat16_weight_inner_size", with_(weight=torch.zeros(4, 63, dtype=torch.bfloat16), scales=None),
        "a bfloat16 weight must be [N, K] with K = 64", ValueError)
    bad(op, "bfloat16_weight_with_scales", with_(weight=torch.zeros(4, 64, dtype=torch.bfloat16)),
        "a bfloat16 weight takes no scales or mins", ValueError)
    bad(op, "bfloat16_weight_with_mins", with_(weight=torch.zeros(4, 64, dtype=torch.bfloat16), scales=None,
                                               mins=torch.zeros(4, 2)),
        "a bfloat16 weight takes no scales or mins", ValueError)
    bad(op, "int8_inner_size", with_(weight=lambda t: t[:, :32]), "an int8 weight must be [N, K] with K = 64",
        ValueError)
    bad(op, "int8_without_scales", with_(scales=None), "this weight format needs scales", ValueError)
    bad(op, "scales_rows", with_(scales=lambda s: s[:3]), "scales must be float32 [N, G] with N = 4", ValueError)
    bad(op, "scales_no_groups", with_(scales=lambda s: s[:, :0]), "scales must be float32 [N, G] with N = 4",
        ValueError)
    bad(op, "scales_float64", with_(scales=lambda s: s.double()), "scales must be float32 [N, G] with N = 4",
        ValueError)
    bad(op, "scales_uneven_groups", with_(scales=torch.ones(4, 3)),
        "scales [N, G] must split K = 64 into G groups of a multiple of 32 (or G = 1)", ValueError)
    bad(op, "scales_groups_of_16", with_(scales=torch.ones(4, 4)),
        "scales [N, G] must split K = 64 into G groups of a multiple of 32 (or G = 1)", ValueError)
    bad(op, "int8_with_mins", with_(mins=torch.zeros(4, 2)), "int8 weights are symmetric: no mins", ValueError)
    bad(op, "int4_inner_size", seq(_int4, with_(weight=lambda t: torch.cat([t, t], 1))),
        "an int4 (uint8) weight must be [N, K / 2] with K = 64", ValueError)
    bad(op, "int4_k_not_a_multiple_of_32", seq(_int4, with_(input=lambda t: t[:, :48], weight=lambda t: t[:, :24],
                                                            scales=lambda s: s[:, :1], mins=lambda m: m[:, :1])),
        "int4 weights need K a multiple of 32, got 48", ValueError)
    bad(op, "int4_without_mins", seq(_int4, with_(mins=None)), "this weight format needs mins", ValueError)
    bad(op, "int4_mins_rows", seq(_int4, with_(mins=lambda m: m[:3])), "mins must be float32 [N, G] with N = 4",
        ValueError)
    bad(op, "int4_mins_groups", seq(_int4, with_(mins=lambda m: m[:, :1])), "mins must have the shape of scales",
        ValueError)
    bad(op, "bias_shape", with_(bias=lambda t: t[:2]), "bias must be float32 [N] with N = 4", ValueError)
    bad(op, "bias_float16", with_(bias=lambda t: t.half()), "bias must be float32 [N] with N = 4", ValueError)

    op = "int8_linear"
    good(op, "valid")
    good(op, "no_rows", with_(input=lambda t: t[:0], input_scales=lambda s: s[:0]))
    good(op, "no_outputs", with_(weight=lambda t: t[:0], weight_scales=lambda s: s[:0]))
    good(op, "k_zero", with_(input=lambda t: t[:, :0], weight=lambda t: t[:, :0]))
    good(op, "longest_k", with_(input=torch.zeros(2, 2**17 - 1, dtype=torch.int8),
                                weight=torch.zeros(4, 2**17 - 1, dtype=torch.int8)))
    bad(op, "input_1d", with_(input=lambda t: t[0]), "input must be int8 [M, K]", guard=True)
    bad(op, "input_3d", with_(input=lambda t: t[None]), "input must be int8 [M, K]")
    bad(op, "input_float32", with_(input=lambda t: t.float()), "input must be int8 [M, K]", guard=True)
    bad(op, "input_uint8", with_(input=lambda t: t.to(torch.uint8)), "input must be int8 [M, K]")
    bad(op, "weight_1d", with_(weight=lambda t: t[0]), "weight must be int8 [N, K]")
    bad(op, "weight_float32", with_(weight=lambda t: t.float()), "weight must be int8 [N, K]", guard=True)
    bad(op, "weight_inner_size", with_(weight=lambda t: t[:, :32]), "weight must be [N, K] with K = 64, got [4, 32]",
        guard=True)
    bad(op, "k_too_long", with_(input=torch.zeros(2, _INT8_LONG_K, dtype=torch.int8),
                                weight=torch.zeros(4, _INT8_LONG_K, dtype=torch.int8)),
        f"K = {_INT8_LONG_K} is longer than 131071 (the int32 sums would overflow)", guard=True)
    bad(op, "input_scales_shape", with_(input_scales=lambda s: s[:1]), "input_scales must be float32 [M] with M = 2")
    bad(op, "input_scales_2d", with_(input_scales=lambda s: s[:, None]),
        "input_scales must be float32 [M] with M = 2")
    bad(op, "input_scales_float64", with_(input_scales=lambda s: s.double()),
        "input_scales must be float32 [M] with M = 2", guard=True)
    bad(op, "weight_scales_shape", with_(weight_scales=lambda s: s[:3]), "weight_scales must be float32 [N] with N = 4")
    bad(op, "weight_scales_2d", with_(weight_scales=lambda s: s[None]), "weight_scales must be float32 [N] with N = 4")
    bad(op, "weight_scales_float16", with_(weight_scales=lambda s: s.half()),
        "weight_scales must be float32 [N] with N = 4", guard=True)


VALID = {"chain_verify": chain_verify_args, "tree_verify": tree_verify_args,
         "sample_without_replacement": sample_without_replacement_args,
         "stochastic_beam_step": stochastic_beam_step_args, "vocab_project": vocab_project_args,
         "ensemble_logits": ensemble_logits_args, "ngram_match": ngram_match_args,
         "ngram_memory_insert": ngram_memory_insert_args, "ngram_memory_lookup": ngram_memory_lookup_args,
         "tree_attention": tree_attention_args, "skinny_linear": skinny_linear_args,
         "quantized_linear": quantized_linear_args, "int8_linear": int8_linear_args}
for _register in (_chain_cases, _tree_cases, _sample_cases, _beam_cases, _vocab_cases, _ensemble_cases, _ngram_cases,
                  _memory_cases, _tree_attention_cases, _linear_cases):
    _register()


# ---- running a case ----

def arguments(case: Case) -> list:
    """The case's schema-level arguments, positional in the schema's order, built fresh."""
    a = VALID[case.op]()
    if case.change is not None:
        case.change(a)
    return [a[name] for name in schema_names(case.op)]


def outcome(fn, args) -> str | tuple[type, str]:
    """"ok", or the exception's type and its message's first line (a c10 error may carry more lines)."""
    try:
        fn(*args)
    except Exception as error:  # the type is the outcome
        lines = str(error).strip().splitlines()
        return type(error), lines[0].strip() if lines else ""
    return "ok"


@functools.cache
def _cpp(op: str, name: str):
    return outcome(getattr(torch.ops.specops, op), arguments(CASES[op, name]))


def cpp(case: Case):
    """The C++ kernel's outcome (once per case: it is deterministic)."""
    return _cpp(case.op, case.name)


def on_cuda(value):
    if isinstance(value, torch.Tensor):
        return value.cuda()
    return [on_cuda(v) for v in value] if isinstance(value, list) else value


def ids(cases) -> list[str]:
    return [f"{c.op}-{c.name}" for c in cases]


ALL = list(CASES.values())
GUARDED = [c for c in ALL if c.guard]


def contract_of(op: str):
    """The op's contract: every op with cases here has one (a missing one fails, it does not skip)."""
    check = contracts().get(op)
    assert check is not None, f"specops.ops.CONTRACTS has no {op}"
    return check


# ---- tests ----

@pytest.mark.parametrize("op", sorted(VALID))
def test_valid_arguments_follow_the_schema(op):
    assert list(VALID[op]()) == schema_names(op)


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_cpp_outcome(case):
    """The C++ kernel rejects each bad case with the check it is there for, and accepts the others."""
    got = cpp(case)
    if case.error is None:
        assert got == "ok"
        return
    assert got != "ok", "the C++ kernel accepts it: the case tests nothing"
    error, message = got
    assert error is case.error and message.startswith(f"{case.op}: ") and case.match in message, got


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_contract_matches_cpp(case):
    """CONTRACTS[op] gives what the C++ kernel gives: None where it accepts, else the same exception type and
    message."""
    check = contract_of(case.op)
    if case.cpu_only:
        pytest.skip(f"a check of the CPU kernel alone: {case.cpu_only}")
    want, got = cpp(case), outcome(check, arguments(case))
    if case.trusting and got == "ok":
        return  # allowed: see case.trusting
    assert got == want


@pytest.mark.parametrize("op", sorted(VALID))
def test_contract_signature_is_the_schema(op):
    check = contract_of(op)
    params = list(inspect.signature(check).parameters.values())
    schema = getattr(torch.ops.specops, op).default._schema.arguments
    assert [p.name for p in params] == [a.name for a in schema]
    for p, a in zip(params, schema):
        assert p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD), p
        if a.has_default_value():
            assert p.default is not p.empty and p.default == a.default_value, (p, a.default_value)
        else:
            assert p.default is p.empty, p


def test_every_contract_has_cases():
    covered = {op for op, _ in CASES}
    assert set(contracts()) <= covered, sorted(set(contracts()) - covered)


def test_every_cuda_kernel_op_has_cases():
    ops = cuda_kernel_ops()
    assert ops, "no register_kernel(..., 'cuda') found in specops/kernels"
    assert ops <= set(VALID), sorted(ops - set(VALID))


def test_every_cuda_kernel_op_has_a_contract():
    missing = cuda_kernel_ops() - set(contracts())
    assert not missing, f"ops with a Triton CUDA kernel and no contract: {sorted(missing)}"


@pytest.mark.parametrize("case", GUARDED, ids=ids(GUARDED))
def test_guarded_cuda_kernel_raises_as_cpp(case):
    """specops.kernels.<op>.<op>_cuda (the contract, then the launcher) raises what the C++ kernel raises. Only
    inputs the contract rejects are passed, so no Triton kernel runs; its tensors are on the CPU."""
    check = contract_of(case.op)
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: specops.kernels does not load")
    module = importlib.import_module(f"specops.kernels.{case.op}")  # with triton a kernel file must import
    guarded = getattr(module, f"{case.op}_cuda", None)
    assert guarded is not None, f"specops.kernels.{case.op} has no {case.op}_cuda"
    want = cpp(case)
    assert outcome(check, arguments(case)) == want, "the contract itself differs (see test_contract_matches_cpp)"
    assert outcome(guarded, arguments(case)) == want


# Cases where a CUDA kernel's outcome is its own, with what it is: it takes inputs the C++ kernel does not,
# and says so (seen on an H200, 2026-12-04).
CUDA_OWN = {("quantized_linear", "input_1d"):
            (ValueError, "quantized_linear: input must be float32, bfloat16 or float16 [M, K]")}


def test_cuda_own_outcomes_name_guarded_cases():
    assert set(CUDA_OWN) <= {(c.op, c.name) for c in GUARDED}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", GUARDED, ids=ids(GUARDED))
def test_cuda_dispatch_raises_as_cpp(case):
    """torch.ops.specops.<op> on CUDA tensors (the dispatcher's CUDA kernel) raises what it raises on CPU ones."""
    contract_of(case.op)
    want = CUDA_OWN.get((case.op, case.name)) or cpp(case)
    assert outcome(getattr(torch.ops.specops, case.op), [on_cuda(a) for a in arguments(case)]) == want


# A wrapper (`specops.ops.<op>`) only shapes arguments; what it takes in another form than the op is translated
# back here, by argument: ensemble_logits names its mode; tree_attention takes no window or soft-cap as None.
WRAPPER_FORM = {("ensemble_logits", "mode"): {0: "weighted", 1: "contrastive"},
                ("tree_attention", "window"): {0: None}, ("tree_attention", "softcap"): {0.0: None}}
# Cases where the wrapper's outcome is its own, each with why: it accepts what it shapes, or refuses a value of
# its own vocabulary.
WRAPPER_OWN = {("skinny_linear", "input_1d"): "the wrapper takes input [..., K]: a [K] input is one row",
               ("quantized_linear", "input_1d"): "the wrapper takes input [..., K]: a [K] input is one row",
               ("ensemble_logits", "mode_unknown"): "the wrapper takes the mode by name",
               ("ensemble_logits", "weights_2d"): "the wrapper takes weights as numbers: a tensor's values, flat",
               ("ensemble_logits", "weights_float64"): "the wrapper takes weights as numbers: a tensor's values"}


def wrapper_call(case: Case, wrapper=None):
    """A call of the op's wrapper (or `wrapper`) on the case's arguments, by name, in the wrapper's form."""
    a = dict(zip(schema_names(case.op), arguments(case)))
    for (op, name), form in WRAPPER_FORM.items():
        if op == case.op and a[name] in form:
            a[name] = form[a[name]]
    fn = wrapper or getattr(specops.ops, case.op)
    return lambda: fn(**a)


@pytest.mark.parametrize("case", ALL, ids=ids(ALL))
def test_wrapper_matches_cpp(case):
    """specops.ops.<op> checks nothing the op checks: on the op's own arguments it gives what the C++ kernel
    gives, the same exception and message (one checker per device path: the C++ kernel on CPU, the contract
    elsewhere)."""
    got, want = outcome(wrapper_call(case), []), cpp(case)
    own = WRAPPER_OWN.get((case.op, case.name))
    if own:
        assert got != want, f"{case.op}-{case.name} is listed as the wrapper's own ({own}) but matches the kernel"
        return
    assert got == want


def test_a_wrapper_with_its_own_cap_fails_the_comparison():
    """The comparison can fail: a wrapper that caps ngram_match's num_candidates itself, with its own message
    (as one did), differs from the kernel on the cap's case, and one that checks nothing does not."""
    def capping(tokens, lengths, min_ngram, max_ngram, num_candidates, width, validate):
        if num_candidates >= 2**28:
            raise ValueError("ngram_match: num_candidates must be below 2**28")
        return specops.ops.ngram_match(tokens, lengths, min_ngram=min_ngram, max_ngram=max_ngram,
                                       num_candidates=num_candidates, width=width, validate=validate)
    case = CASES["ngram_match", "num_candidates_2_to_the_28"]
    assert outcome(wrapper_call(case, capping), []) != cpp(case)
    assert outcome(wrapper_call(case), []) == cpp(case)


def _nan_rows(name: str, rows: list):
    """A change that puts NaN at column 0 of each of `rows` (index tuples) of argument `name`."""
    def change(a):
        t = a[name].clone()
        for row in rows:
            t[row][0] = NAN
        a[name] = t
    return change


# Several bad rows at once, for the ops whose C++ kernel checks rows in parallel loops: the error names the
# first bad row (csrc/cpu/sampling.h's parallel_rows), whatever the threads, as the contract does.
SEVERAL_BAD_ROWS = {
    "chain_verify": (_nan_rows("target_logits", [(1, 3), (1, 1), (0, 2)]), "target_logits[0, 2] contains NaN"),
    "tree_verify": (_nan_rows("target_logits", [(1, 3), (0, 2)]), "target_logits[0, 2] contains NaN"),
    "sample_without_replacement": (_nan_rows("logits", [(3,), (2,), (1,)]), "logits[1] contains NaN"),
    "stochastic_beam_step": (_nan_rows("logits", [(1, 1), (1, 0), (0, 1)]), "logits[1] contains NaN"),
    "vocab_project": (_nan_rows("draft_logits", [(1,), (0,)]), "draft_logits[0] contains NaN"),
}


@pytest.mark.parametrize("op", list(SEVERAL_BAD_ROWS))
def test_several_bad_rows_name_the_first_whatever_the_threads(op):
    change, match = SEVERAL_BAD_ROWS[op]
    a = VALID[op]()
    change(a)
    args = [a[name] for name in schema_names(op)]
    threads = torch.get_num_threads()
    try:
        seen = set()
        for n in (1, 2, 4, 8):
            torch.set_num_threads(n)
            for _ in range(5):
                seen.add(outcome(getattr(torch.ops.specops, op), args))
    finally:
        torch.set_num_threads(threads)
    assert len(seen) == 1, seen
    (error, message), = seen
    assert error is ValueError and match in message, message
    if op in contracts():
        assert outcome(contracts()[op], args) == (error, message)
