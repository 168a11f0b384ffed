"""Compile every Triton kernel specops launches for a GPU, on a machine without one.

    python -m specops.tools.compile_check [--targets 90,80] [--quick] [--json PATH]

Each launcher (`<op>_triton` in specops/kernels) is called with meta tensors (shapes and dtypes, no data)
at the shapes, dtypes and options the ops meet in decoding: the vocabularies of Gemma-3 (262,144) and
Llama (32,000) and a small one, every input dtype the op takes on CUDA, with and without draft
distributions, and so on (CASES). The kernel launches are recorded instead of run: each kernel, its
argument types, its constexpr values and its compile options, exactly as the launcher chose them for
those inputs (tile sizes, num_warps, branches; meta tensors are on no CPU, so configurations that exist
only for Triton's interpreter are not taken). Every distinct launch is compiled ahead of time with
`triton.compile` for each target (sm_90, sm_80 by default), and the cubin's resource use is read with
the `cuobjdump` Triton bundles: registers per thread, stack bytes (spills), shared memory.

Printed: one row per kernel, configuration and target, and whether it fits the target (255 registers
per thread, no spills, shared memory within the target's per-block limit). `kernels_launched()` and
`kernels_defined()` let a test check that no kernel defined in specops/kernels goes uncompiled.

Compiling needs no GPU and no CUDA torch, only Triton with its NVIDIA backend. Triton's interpreter
(TRITON_INTERPRET=1) must be off: it decides at import which kernels are compilable.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch

_SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}  # bytes per block (opt-in maximum) on sm_90 / sm_80
_REGISTER_LIMIT = 255

# The kernels that spill at a configuration their launcher takes, each with the most bytes a thread spilled
# (any configuration, sm_90 or sm_80, Triton 3.9 or 3.6: docs/gpu.md) and the reason. test_compile_check
# fails on a spill that is not listed here, or larger than listed.
_TILE_LOOP = ("16 warps at BLOCK_V 8,192 cap a thread at 128 registers (65,536 / 512 threads), and its tile loop "
              "(a tile of float32 values, float64 sums, Philox state) needs more; at 8 warps it spills nothing but "
              "has half the threads per tile: which is faster is for a GPU to time")
EXPLAINED_SPILLS = {
    "tree_verify._walk_kernel": (32, _TILE_LOOP),
    "sample_without_replacement._draw_kernel": (40, _TILE_LOOP),
    "vocab_project._sample_kernel": (24, _TILE_LOOP),
    "chain_verify._sample_kernel": (8, _TILE_LOOP),
    "chain_verify._block_sample_kernel": (16, _TILE_LOOP),
    "chain_verify._block_chain_kernel": (8, _TILE_LOOP + " (sm_80 only)"),
    "vocab_project._mask_stats_kernel": (8, "sm_80 only, at BLOCK_V 8,192: " + _TILE_LOOP),
    "tree_verify._traversal_kernel": (56, "8 warps already (at 4 or 16 it spills more); float32 logits at BLOCK_V "
                                          "8,192 on sm_90, as _walk_kernel"),
    "tree_attention._tree_attention_kernel": (40, "float32 at D = 256 (16 x 16 tiles), and bfloat16 at D = 256 with "
                                                  "Triton 3.6 (24 bytes); smaller tiles would re-read the keys more"),
}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}
_META = "meta"


@dataclass
class Launch:
    """One kernel launch as a launcher made it: enough to compile it."""

    kernel: object  # triton JITFunction
    signature: dict[str, str]
    constexprs: dict[str, object]
    options: dict[str, object]
    cases: list[str] = field(default_factory=list)  # the inputs that led to it
    attrs: dict = field(default_factory=dict)  # what the JIT would infer from the values (_specialization)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def key(self) -> tuple:
        return (self.kernel.fn.__module__, self.name, tuple(sorted(self.signature.items())),
                tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
                tuple(sorted((k, repr(v)) for k, v in self.options.items())), tuple(sorted(self.attrs)))

    def config(self) -> str:
        """The constexprs and options, shortly (what tells one configuration of a kernel from another)."""
        parts = [f"{k}={v}" for k, v in self.constexprs.items()]
        parts += [f"{k}={v}" for k, v in self.options.items()]
        dtypes = sorted({t for t in self.signature.values() if t.startswith("*")} - {"*i32", "*i64"})
        return " ".join(parts + ([",".join(dtypes)] if dtypes else []))


def _arg_type(value) -> str:
    """Triton's signature type for a launch argument (as its JIT would specialize it)."""
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    raise TypeError(f"compile_check: no Triton type for a launch argument of type {type(value).__name__}")


def _specialization(value, param) -> int | None:
    """What Triton's JIT infers from a launch argument's value and compiles into the kernel, as it does at a
    real launch: 1 for an int equal to 1 (a constant), 16 for an int divisible by 16 or a tensor whose data
    starts 16-byte aligned (`tt.divisibility`: vectorized loads, cheaper index math), else None. Parameters
    marked do_not_specialize (on alignment) get none. Meta tensors have no address: their storage offset
    stands for it, as torch's allocations are aligned."""
    if isinstance(value, bool) or isinstance(value, float):
        return None
    if isinstance(value, torch.Tensor):
        aligned = value.storage_offset() * value.element_size() % 16 == 0
        return 16 if aligned and not getattr(param, "do_not_specialize_on_alignment", False) else None
    if isinstance(value, int) and not getattr(param, "do_not_specialize", False):
        if value == 1:
            return 1
        if value % 16 == 0 and not getattr(param, "do_not_specialize_on_alignment", False):
            return 16
    return None


@contextlib.contextmanager
def _recording(launches: list, case: str):
    """Within: every `kernel[grid](...)` is recorded into `launches` instead of run."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        names = [p.name for p in self.params]
        bound = dict(zip(names, args))
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        bound.update(kwargs)
        signature, constexprs, attrs = {}, {}, {}
        for p in self.params:
            value = bound.get(p.name, p.default)
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constexprs[p.name] = value
                continue
            signature[p.name] = _arg_type(value)
            if value is None:
                constexprs[p.name] = None
                continue
            hint = _specialization(value, p)
            if hint == 1:  # the JIT makes an int argument equal to 1 a constant
                signature[p.name] = "constexpr"
                constexprs[p.name] = 1
            elif hint == 16:
                attrs[(p.num,)] = [["tt.divisibility", 16]]
        launches.append(Launch(self, signature, constexprs, options, [case], attrs))

    JITFunction.run = record
    try:
        yield
    finally:
        JITFunction.run = original


def _t(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device=_META)


def _rows(batch: int):
    """temperature, top_k, top_p, seed as the ops normalize them: one per row."""
    return (_t(batch), _t(batch, dtype=torch.int64), _t(batch), _t(batch, dtype=torch.int64))


_VOCABS = (1000, 32000, 262144)
_LOGITS = (torch.float32, torch.bfloat16, torch.float16)


def _chain_verify(run):
    from specops.kernels.chain_verify import chain_verify_triton

    for vocab in _VOCABS:
        for dtype in _LOGITS:
            for probs in (False, True):
                for scheme in ("token", "block"):
                    b, k = 64, 4
                    q = _t(b, k, vocab) if probs else None
                    run(f"B={b} K={k} V={vocab} {dtype} q={probs} {scheme}", chain_verify_triton,
                        _t(b, k + 1, vocab, dtype=dtype), _t(b, k, dtype=torch.int64), q,
                        _t(b, dtype=torch.int64), *_rows(b), 0, scheme=scheme)


def _tree_verify(run):
    from specops.kernels.tree_verify import tree_verify_triton

    for vocab in _VOCABS:
        for dtype in _LOGITS:
            for probs, replacement in ((False, False), (True, False), (True, True)):
                for scheme in ("recursive", "traversal"):
                    b, n = 8, 16
                    q = _t(b, n, vocab) if probs else None
                    run(f"B={b} N={n} V={vocab} {dtype} q={probs} replacement={replacement} {scheme}",
                        tree_verify_triton, _t(b, n, vocab, dtype=dtype), _t(b, n, dtype=torch.int64),
                        _t(b, n, dtype=torch.int64), q, _t(b, dtype=torch.int64), replacement, *_rows(b), 0,
                        scheme=scheme)


def _sample_without_replacement(run):
    from specops.kernels.sample_without_replacement import sample_without_replacement_triton

    for vocab in _VOCABS:
        for dtype in _LOGITS:
            run(f"R=8 V={vocab} {dtype} k=4", sample_without_replacement_triton, _t(8, vocab, dtype=dtype), 4,
                *_rows(8), 0)


def _stochastic_beam_step(run):
    from specops.kernels.stochastic_beam_step import stochastic_beam_step_triton

    for vocab in _VOCABS:
        for dtype in _LOGITS:
            b, w = 4, 4
            run(f"B={b} W={w} V={vocab} {dtype}", stochastic_beam_step_triton, _t(b, w, vocab, dtype=dtype),
                _t(b, w), _t(b, w), w, *_rows(b), 0)


def _vocab_project(run):
    from specops.kernels.vocab_project import vocab_project_triton

    for vocab, target in ((1000, 1200), (49152, 262144), (262144, 32000)):
        for dtype in _LOGITS:
            run(f"R=8 V_d={vocab} V={target} {dtype}", vocab_project_triton, _t(8, vocab, dtype=dtype),
                _t(vocab, dtype=torch.int64), target, *_rows(8), 0)


def _ensemble_logits(run):
    from specops.kernels.ensemble_logits import ensemble_logits_triton

    for vocab in _VOCABS:
        for dtype in _LOGITS:
            for mode in (0, 1):
                run(f"R=5 V={vocab} {dtype} mode={mode}", ensemble_logits_triton,
                    [_t(5, vocab, dtype=dtype), _t(5, vocab, dtype=dtype)], _t(2), mode, 0.1, 0.0)


def _ngram_match(run):
    from specops.kernels.ngram_match import ngram_match_triton

    for length in (64, 4096, 32768):
        for dtype in (torch.int64, torch.int32):
            run(f"B=16 L={length} {dtype}", ngram_match_triton, _t(16, length, dtype=dtype),
                _t(16, dtype=torch.int64), 1, 4, 8, 8)


def _ngram_memory(run):
    from specops.kernels.ngram_memory_insert import ngram_memory_insert_triton
    from specops.kernels.ngram_memory_lookup import ngram_memory_lookup_triton

    store, levels = 1 << 24, [1 << 20, 1 << 16]
    tokens, entries = _t(store, dtype=torch.int32), _t(store, dtype=torch.int32)
    for added in (512, 1 << 16):  # a decoding step's new positions; a corpus merging into the older level
        run(f"T=2**24 levels={levels} n={added} depth=64", ngram_memory_insert_triton, tokens, entries, levels,
            _t(added, dtype=torch.int64), 64)
    for occurrences, width in ((64, 16), (256, 256)):  # what ngram drafting asks; the op's largest
        run(f"B=64 T=2**24 levels={levels} S={occurrences} W={width} depth=64", ngram_memory_lookup_triton, tokens,
            entries, levels, _t(64, 512, dtype=torch.int64), _t(64, dtype=torch.int64), 64, 1, 8, width, occurrences)


def _tree_attention(run):
    from specops.kernels.tree_attention import tree_attention_triton

    # Gemma-3 (4 query heads on 1 KV head of 256) and Llama-3 8B (32 on 8 of 128); sinks and softcap on one.
    cases = [(dtype, shape, False, 0.0) for dtype in _LOGITS for shape in ((4, 1, 256), (32, 8, 128))]
    cases += [(torch.bfloat16, (4, 1, 256), True, 0.0), (torch.bfloat16, (4, 1, 256), False, 50.0)]
    for dtype, (heads, kv_heads, dim), sinks, softcap in cases:
        b, n, prefix = 4, 64, 4096
        kv = (b, kv_heads, prefix + n, dim)
        run(f"B={b} H={heads}/{kv_heads} D={dim} N={n} prefix={prefix} {dtype} sinks={sinks} "
            f"softcap={softcap}", tree_attention_triton, _t(b, heads, n, dim, dtype=dtype),
            _t(*kv, dtype=dtype), _t(*kv, dtype=dtype), _t(b, n, (n + 31) // 32, dtype=torch.int32),
            _t(b, prefix, dtype=torch.bool), dim ** -0.5, 0, softcap, _t(heads) if sinks else None)


def _skinny_linear(run):
    from specops.kernels.skinny_linear import skinny_linear_triton

    for dtype in _LOGITS:
        for rows in (1, 16):
            for bias in (False, True):
                run(f"M={rows} N=2048 K=640 {dtype} bias={bias}", skinny_linear_triton,
                    _t(rows, 640, dtype=dtype), _t(2048, 640, dtype=dtype),
                    _t(2048, dtype=dtype) if bias else None)


def _quantized_linear(run):
    from specops.kernels.quantized_linear import quantized_linear_triton

    n, k = 2048, 640
    formats = {"bf16": (_t(n, k, dtype=torch.bfloat16), None, None),
               "int8": (_t(n, k, dtype=torch.int8), _t(n, 1), None),
               "int4": (_t(n, k // 2, dtype=torch.uint8), _t(n, k // 32), _t(n, k // 32))}
    for dtype in _LOGITS:
        for name, (weight, scales, mins) in formats.items():
            for bias in (False, True):
                run(f"M=4 N={n} K={k} {name} {dtype} bias={bias}", quantized_linear_triton,
                    _t(4, k, dtype=dtype), weight, scales, mins, _t(n, dtype=dtype) if bias else None)


def _int8_linear(run):
    from specops.kernels.int8_linear import int8_linear_triton

    # The int8 screen of a greedy step's head: Gemma-3-270M's (262,144 x 640), two int8 rows per input row.
    for rows in (2, 32):
        for n, k in ((2048, 640), (262144, 640)):
            run(f"M={rows} N={n} K={k}", int8_linear_triton, _t(rows, k, dtype=torch.int8), _t(rows),
                _t(n, k, dtype=torch.int8), _t(n))
            run(f"M={rows} N={n} K={k} packed", int8_linear_triton, _t(rows, k, dtype=torch.int8), _t(rows),
                _t(n // 16, k // 4, 64, dtype=torch.uint8), _t(n))


CASES = [_chain_verify, _tree_verify, _sample_without_replacement, _stochastic_beam_step, _vocab_project,
         _ensemble_logits, _ngram_match, _ngram_memory, _tree_attention, _skinny_linear, _quantized_linear,
         _int8_linear]


def kernels_launched() -> list[Launch]:
    """Every distinct launch the CASES make (the launchers run on meta tensors; nothing executes)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check: Triton's interpreter is on (TRITON_INTERPRET=1); kernels "
                           "decorated under it cannot be compiled. Run it in a process without it.")
    launches: list[Launch] = []

    def run(case: str, launcher, *args, **kwargs):
        with _recording(launches, f"{launcher.__name__}: {case}"):
            launcher(*args, **kwargs)

    for cases in CASES:
        cases(run)
    distinct: dict[tuple, Launch] = {}
    for launch in launches:
        if launch.key() in distinct:
            distinct[launch.key()].cases += launch.cases
        else:
            distinct[launch.key()] = launch
    return list(distinct.values())


def kernels_defined() -> dict[str, set[str]]:
    """Module -> names of the Triton kernels it launches itself (`name[grid](...)` in its source)."""
    import specops.kernels as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"specops.kernels.{info.name}")
        with open(module.__file__, encoding="utf-8") as file:
            source = file.read()
        names = set(re.findall(r"\b(_\w+_kernel)\[", source))
        if names:
            found[module.__name__] = names
    return found


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_launch(launch: Launch, capability: int) -> dict:
    """Compile one launch for sm_<capability>; its resource use (or the error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = {"module": launch.kernel.fn.__module__.rsplit(".", 1)[-1], "kernel": launch.name,
           "config": launch.config(), "target": f"sm_{capability}", "cases": len(launch.cases)}
    try:
        source = ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs)
        target = GPUTarget("cuda", capability, 32)
        compiled = triton.compile(source, target=target, options=dict(launch.options))
    except Exception as error:  # noqa: BLE001  (a kernel that does not compile is the finding, not a crash)
        row.update(ok=False, error=f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}")
        return row
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    registers, stack, static_shared, local = (int(v) for v in found.groups())
    shared = static_shared + int(compiled.metadata.shared)
    row.update(registers=registers, spill_bytes=stack + local, shared_bytes=shared,
               num_warps=compiled.metadata.num_warps)
    row["ok"] = registers <= _REGISTER_LIMIT and shared <= _SHARED_LIMIT[capability]
    row["fits"] = row["ok"] and row["spill_bytes"] == 0
    return row


def check(targets=(90, 80), quick: bool = False) -> list[dict]:
    """Every distinct launch compiled for every target: one row each. quick: one launch per kernel (its
    last case, the largest vocabulary or model), as the test suite runs it."""
    launches = kernels_launched()
    if quick:
        launches = list({launch.name + launch.kernel.fn.__module__: launch for launch in launches}.values())
    return [compile_launch(launch, capability) for launch in launches for capability in targets]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="90,80", help="compute capabilities (default 90,80)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="one configuration per kernel")
    args = parser.parse_args(argv)
    import triton

    rows = check(tuple(int(t) for t in args.targets.split(",")), quick=args.quick)
    print(f"Triton {triton.__version__}; {len(rows)} compilations")
    print("| kernel | configuration | target | registers | spill bytes | shared bytes | fits |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if "error" in row:
            print(f"| {row['module']}.{row['kernel']} | {row['config']} | {row['target']} | "
                  f"does not compile: {row['error']} | | | no |")
            continue
        print(f"| {row['module']}.{row['kernel']} | {row['config']} | {row['target']} | {row['registers']} | "
              f"{row['spill_bytes']} | {row['shared_bytes']} | {'yes' if row['fits'] else 'no'} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=1)
    failed = [r for r in rows if not r.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
