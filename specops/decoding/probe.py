"""Probes that decide, once per model and before any prompt is decoded, what specops can decode exactly on
it: `chain_support` (chains through specops' KV cache, alone and in a ragged batch) and `tree_support`
(draft trees through the tree mask and attention of tree_forward.py). Each decodes a few tokens through
engine.KVState and compares every logit with the model's own forward over the same tokens. Above both the
engine and the attention path, which do not import it; decode() and the tests ask it.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from specops._kept import per_object
from specops.decoding.tree_forward import is_transformers_model, weakly_keyed
from specops.decoding.engine import OWN_POSITIONS, CausalLM, KVState

__all__ = ["ChainSupport", "chain_support", "close_logits", "tree_support"]


class ChainSupport(NamedTuple):
    """What `chain_support` found: cache, why `lm` cannot be decoded with a KV cache; ragged, why rows of
    a batch change each other's logits (None where nothing is wrong); runs, whether its cached forwards at
    least run (a drafter need not be exact, only run); positions, whether the model is given position
    ids: a model whose positions follow another rule than the token count (RoBERTa-style decoders count
    from padding_idx + 1) is exact only when left to compute its own, so it gets none."""

    cache: str | None
    ragged: str | None
    runs: bool
    positions: bool = True  # whether to pass position ids (False: the model's own rule reproduces its forward)


_CHAINS: weakref.WeakKeyDictionary[object, ChainSupport] = per_object(
    "chain probe", "whether the model decodes draft chains exactly, and how (probed once)")


def chain_support(lm: CausalLM, tokens: list[int]) -> ChainSupport:
    """How exactly `lm` decodes chains with specops' KV cache; probed once per model with ids from `tokens`.

    The probe decodes short chains through KVState, as the loop does (a prefill, an appended token, a
    rejected token rolled back and another appended), one row alone and then two ragged rows, and
    compares every logit with the model's own forward over the whole sequence without a cache. A model
    whose forward takes no KV cache, or ignores the one it is given, fails alone; one that takes its
    positions from the cache length instead of the position ids (learned absolute positions in the
    decoder halves of encoder-decoder families, some older models) fails only ragged: left padding
    shifts its positions, so its rows must be decoded apart."""
    if not is_transformers_model(lm.model):
        return ChainSupport(None, None, True)  # the position-id and 2-D mask contract (module docstring)
    weak = weakly_keyed(lm.model)
    known = _CHAINS.get(lm.model) if weak else None
    if known is None:
        pool = sorted(set(tokens))
        probe = CausalLM(lm.model, lm.name)  # its own call counters
        alone, runs = _chain_probe(probe, pool, ragged=False)
        positions = True
        if alone is not None and runs and "position_ids" in probe.takes:
            probe.takes.discard("position_ids")  # its own position rule, if that reproduces its forward
            if _chain_probe(probe, pool, ragged=False)[0] is None:
                alone, positions = None, False
            else:
                probe.takes.add("position_ids")
        known = ChainSupport(alone, None if alone else _chain_probe(probe, pool, ragged=True)[0], runs, positions)
        if weak:
            _CHAINS[lm.model] = known
            if not positions:
                OWN_POSITIONS.add(lm.model)
    return known


def _chain_probe(lm: CausalLM, pool: list[int], ragged: bool) -> tuple[str | None, bool]:
    """(what is wrong, whether the forwards ran)."""
    token = lambda i: pool[(7 * i) % len(pool)]  # noqa: E731
    rows = [[token(i) for i in range(5)], [token(i + 11) for i in range(2)]][:2 if ragged else 1]
    b = len(rows)
    tolerance = 1e-3 if lm.dtype == torch.float32 else 3e-2

    def whole(row: list[int]) -> torch.Tensor:
        ids = torch.tensor([row], device=lm.device)
        # Only the last position's logits are compared: its output layer alone (a vocabulary of 262,144 on
        # every position made these forwards most of a first call's probing).
        keep = {"logits_to_keep": 1} if "logits_to_keep" in lm.takes else {}
        return lm.model(input_ids=ids, use_cache=False, **keep).logits[0, -1].float()

    def differs(logits: torch.Tensor) -> bool:
        return not all(close_logits(whole(row), logits[i], tolerance) for i, row in enumerate(rows))

    try:
        with torch.inference_mode():
            state = KVState(lm, b)
            if differs(state.prefill(rows)):
                return "its logits after a prompt differ from its forward over the same tokens without a cache", True
            rejected = [token(20 + i) for i in range(b)]
            state.append(torch.tensor([rejected], device=lm.device).T)
            # Row 0 rejects its token, the others keep theirs: ragged rows after the rollback.
            state.drop_last(torch.tensor([1] + [0] * (b - 1)))
            rows = [row + ([rejected[i]] if i else []) for i, row in enumerate(rows)]
            nxt = [token(30 + i) for i in range(b)]
            logits = state.append(torch.tensor([nxt], device=lm.device).T)[:, -1]
            rows = [row + [nxt[i]] for i, row in enumerate(rows)]
            if differs(logits):
                return ("its logits with a KV cache differ from its forward over the whole sequence without one"
                        if not ragged else "left padding changes its logits (it does not take its positions "
                        "from the position ids and mask specops passes)"), True
    except Exception as error:  # noqa: BLE001 - any failure is the answer
        first = str(error).splitlines()[0][:200] if str(error) else ""
        return f"its forward with a KV cache fails ({type(error).__name__}: {first})", False
    return None, True


_SUPPORT: weakref.WeakKeyDictionary[object, tuple[str | None, bool]] = per_object(
    "tree probe", "whether the model decodes draft trees exactly, and through which path (probed once)")


def tree_support(lm, tokens: list[int]) -> str | None:
    """None if draft trees are exact on `lm` (a CausalLM), else the reason they are not; probed once per
    model, with ids from `tokens` (ones its tokenizer produces): a ragged batch of two prompts, a branching
    tree per row, every node's logits compared with the same root-to-node path decoded as a plain chain
    from scratch. Sets lm.tree_kernel: whether its layers attend through specops.ops.tree_attention (every
    layer's mask is causal with at most a window, and the probe passes that way) or through the model's
    own attention with a dense mask."""
    lm.tree_kernel = False
    if not is_transformers_model(lm.model):
        return None  # the 4-D mask contract (module docstring)
    if any(type(module).__name__.endswith("Indexer") for module in lm.model.modules()):
        # DeepSeek sparse attention (DeepSeek V3.2, GLM-MoE-DSA): an indexer picks each query's top keys
        # with the causal mask only, so a tree node could pick keys of other branches once the context is
        # longer than its top-k (a short probe cannot see that).
        return ("its sparse-attention indexer picks each query's keys without the tree's mask, so a node could "
                "attend to other branches")
    known = _SUPPORT.get(lm.model) if weakly_keyed(lm.model) else None
    if known is None:
        pool = sorted(set(tokens))
        known = (None, True) if _tree_probe(lm, pool, kernel=True) is None else (_tree_probe(lm, pool, kernel=False), False)
        if weakly_keyed(lm.model):
            _SUPPORT[lm.model] = known
    reason, lm.tree_kernel = known
    return reason


def _tree_probe(model_lm, pool: list[int], kernel: bool) -> str | None:
    """The tree probe through the general path (transformers' layers under the tree attention of
    tree_forward.py: every layer must reach it), then, where the model has the few-call path that takes trees
    of few rows (llama_forward.py), the same tree through that path too; both against the chains."""
    lm = CausalLM(model_lm.model, model_lm.name)  # its own call counters
    lm.tree_kernel = kernel
    fused = CausalLM(model_lm.model, model_lm.name) if lm.llama_forward is not None else None
    lm._llama_forward = None  # the general path, which trees beyond the few-call path's rows take
    token = lambda i: pool[(7 * i) % len(pool)]
    prompts = [[token(i) for i in range(5)], [token(i + 11) for i in range(3)]]
    # Per row: root, two children of the root, a grandchild under the first child; row 1 has no
    # grandchild (a padding node).
    parents = [[-1, 0, 0, 1], [-1, 0, 0, -1]]
    nodes = [[token(20), token(21), token(22), token(23)], [token(30), token(31), token(32), token(0)]]
    depth = torch.tensor([[0, 1, 1, 2], [0, 1, 1, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    visible = torch.zeros(2, 4, 4, dtype=torch.bool)
    for b in range(2):
        for i in range(4):
            j = i
            while j >= 0 and valid[b, i]:
                visible[b, i, j] = True
                j = parents[b][j]
        visible[b, 3, 3] = True
    device = lm.device
    try:
        with torch.inference_mode():
            state = KVState(lm, 2)
            state.prefill(prompts)
            tree = state.append_tree(torch.tensor(nodes, device=device), valid.to(device), depth.to(device),
                                     visible.to(device))
            checks = state.last_tree
            if checks.mask_calls == 0 or checks.attention_calls != lm.attention_layers:
                return (f"its attention does not go through transformers' attention registry in every layer "
                        f"({checks.attention_calls} of {lm.attention_layers} layers did)")
            if kernel and checks.kernel_calls != lm.attention_layers:
                return f"tree_attention cannot reproduce its masks ({checks.kernel_calls} of its layers' can)"
            # Every node's root-to-node path as a chain from scratch, all in one left-padded batch.
            cases, chains = [], []
            for b in range(2):
                for i in range(4):
                    if valid[b, i]:
                        path, j = [], i
                        while j >= 0:
                            path.append(nodes[b][j])
                            j = parents[b][j]
                        cases.append((b, i))
                        chains.append(prompts[b] + path[::-1])
            want = KVState(lm, len(chains)).prefill(chains)
            tolerance = 1e-3 if lm.dtype == torch.float32 else 3e-2
            if not all(close_logits(want[n], tree[b, i], tolerance) for n, (b, i) in enumerate(cases)):
                return ("its logits for a draft tree differ from the same paths decoded as chains (its attention "
                        "or positions do not follow the mask and position ids specops passes)")
            if fused is not None:
                state = KVState(fused, 2)
                state.prefill(prompts)
                tree = state.append_tree(torch.tensor(nodes, device=device), valid.to(device), depth.to(device),
                                         visible.to(device))
                if not all(close_logits(want[n], tree[b, i], tolerance) for n, (b, i) in enumerate(cases)):
                    return "its logits for a draft tree through specops' few-call CPU path differ from the chains'"
    except Exception as error:  # a model that cannot take the tree at all
        return f"a tree forward fails ({type(error).__name__}: {error})"
    return None


def close_logits(want: torch.Tensor, got: torch.Tensor, tolerance: float) -> bool:
    """Equal up to `tolerance` of the largest finite logit (summation order differs between a tree and a
    chain forward: about 1e-6 of the scale in float32; a wrong mask or position moves logits by a large
    fraction of it); -inf (impossible tokens) must match exactly."""
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not bool(finite.any()):
        return bool(torch.equal(want, got))
    # Masked in place rather than gathered (want[finite] copies): 1.3-1.5 ms against 6.6-7.7 for one
    # 262,144-word row, and the tree probe compares 14 of them (2-vCPU AMD EPYC, 2026-12-06).
    zero = want.new_zeros(())
    scale = torch.where(finite, want, zero).abs().amax().clamp(min=1e-6)
    return bool(torch.where(finite, want - got, zero).abs().amax() <= tolerance * scale)
