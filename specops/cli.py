"""The `specops` command line.

    specops generate "def fibonacci(n):"                       # target gemma-3-270m, method auto
    specops generate "def f(x):" --drafter self:6 --compare    # speculative, against autoregressive
    specops generate "def f(x):" --drafter smollm2-135m        # a drafter with another vocabulary (slem)
    specops generate "def f(x):" --target gemma-3-270m,smollm2-135m --ensemble weighted:0.7,0.3 --compare
    echo "def f(x):" | specops generate -                      # prompt from stdin
    specops generate "def f(x):" --memory mem.bin              # draft from (and add to) earlier outputs
    specops memory add mem.bin corpus/*.py                     # seed a memory with a corpus

The generated text streams to stdout as tokens are accepted; statistics go to stderr, so stdout holds
only the text. Bad settings exit with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import sys

_MODELS = "gemma-3-270m, smollm2-135m"  # specops.models.names(), without importing transformers for --help


def _draft_tokens(value: str):
    if value == "auto":
        return value
    try:
        parts = [int(v) for v in value.split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        return parts[0]
    if len(parts) >= 2:
        return tuple(parts)
    raise argparse.ArgumentTypeError(f"must be 'auto', an integer N, K,W or B1,B2,..., got {value!r}")


def _threads(value: str):
    if value == "auto":
        return value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {value!r}")


def _set_threads(threads) -> None:
    import os

    import torch

    if threads == "auto":
        if os.environ.get("OMP_NUM_THREADS"):
            return  # the user's setting; torch already follows it
        from specops._threads import auto_threads

        threads = auto_threads()
    torch.set_num_threads(threads)


def _ensemble_rule(value: str):
    kind, _, numbers = value.partition(":")
    try:
        values = [float(v) for v in numbers.split(",")] if numbers else []
    except ValueError:
        values = None
    if kind == "weighted" and values:
        return ("weighted", values)
    if kind == "contrastive" and values and len(values) <= 2:
        return ("contrastive", values)
    raise argparse.ArgumentTypeError(f"must be weighted:W1,W2,... or contrastive:MU[,ALPHA], got {value!r}")


def _bytes(value: str) -> int:
    """A byte count: an integer, optionally with a K, M or G suffix (powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(value[-1:].upper(), 1)
    digits = value[:-1] if scale > 1 else value
    if digits.isdigit() and int(digits) > 0:
        return int(digits) * scale
    raise argparse.ArgumentTypeError(f"must be a byte count > 0 (an integer, or with K, M or G), got {value!r}")


def _positive(value: str) -> int:
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")


def _flag(method: str, option: str) -> str:
    return f"--{method}-{option}".replace("_", "-")


def _generate_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from specops.decoding import registry

    parser.add_argument("prompt", nargs="?",
                        help="the prompt; '-' or none reads it from stdin")
    parser.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this file")
    parser.add_argument("--method", choices=registry.NAMES, default="auto", metavar="{" + ",".join(registry.NAMES) + "}",
                        help="decoding method: auto (picks one from what it is given: a drafter and its "
                             "vocabulary, greedy or sampling, one target or several); "
                             + "; ".join(f"{m.name}: {m.summary}" for m in registry.METHODS.values()))
    parser.add_argument("--target", default="gemma-3-270m",
                        help=f"target model, an embedded name ({_MODELS}; NAME:int8 is the fast CPU path, a quantized "
                             "model decoded exactly); several, comma-separated, decode from their ensemble (--ensemble)")
    parser.add_argument("--ensemble", type=_ensemble_rule, default=None, metavar="{weighted:W1,W2,...,contrastive:MU[,ALPHA]}",
                        help="with several targets: the weighted mixture of their probabilities (default: equal "
                             "weights), or contrastive decoding (expert first) with mu and the plausibility alpha")
    parser.add_argument("--drafter", default=None,
                        help="drafter: an embedded model name (its vocabulary may differ from the target's; it runs "
                             "with its default low-precision weights, or name them: smollm2-135m:int8, :int4, :bf16, "
                             ":float32), or 'self:N' (the target's first N layers); none means autoregressive decoding")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 keeps all")
    parser.add_argument("--seed", type=int, default=None, help="random seed (sampling); none draws one")
    parser.add_argument("--num-draft-tokens", type=_draft_tokens, default="auto", metavar="{auto,N,K,W}",
                        help="drafts per step: auto (chosen from measured costs), an integer, for ngram K,W "
                             "(K rows of W tokens), for rsd-c / specinfer B1,B2,... (children per node per level), "
                             "for rsd-s W,L (beams, levels)")
    for method in registry.METHODS.values():  # each method's options, from the registry: --METHOD-OPTION
        for option, default in method.options.items():
            parser.add_argument(_flag(method.name, option), type=type(default), default=argparse.SUPPRESS,
                                dest=f"option:{method.name}:{option}", choices=method.option_choices.get(option),
                                metavar=None if option in method.option_choices else option.upper(),
                                help=f"{method.name}: {method.option_help.get(option, option)} (default: {default})")
    parser.add_argument("--memory", metavar="FILE", default=None,
                        help="an n-gram memory file (specops.NgramMemory): ngram drafts from what it holds, and the "
                             "prompt and output are added to it; loaded if it exists, created if not, saved back")
    parser.add_argument("--memory-budget", type=_bytes, default=None, metavar="BYTES",
                        help="the most a new --memory holds (K, M, G suffixes; default 256M), or a new budget for "
                             "one loaded (least recently used runs leave)")
    parser.add_argument("--num-samples", type=_positive, default=None, metavar="N",
                        help="decode the prompt N times (each sample with its own random numbers), reading it "
                             "once; the samples print one after another, each under a header line")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="stop when this text appears (repeatable); it is not printed")
    parser.add_argument("--threads", type=_threads, default="auto", metavar="{auto,N}",
                        help="CPU threads for the forwards: auto takes the cores other processes leave "
                             "free, measured at start (at least 1; all of them on an idle machine); "
                             "OMP_NUM_THREADS, when set, is the default instead. Threads that compete with "
                             "other busy processes slow decoding down many times over")
    parser.add_argument("--echo", action="store_true", help="print the prompt before the generated text")
    parser.add_argument("--compare", action="store_true",
                        help="also decode without speculation (ar, or ensemble for several targets) and the same "
                             "settings; print the speedup (tok/s ratio) and, when greedy, whether the outputs are "
                             "identical")
    return parser


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("specops")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    generate = _generate_parser(argparse.ArgumentParser(prog="specops generate", formatter_class=formatter))
    parser = argparse.ArgumentParser(
        prog="specops", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Speculative decoding for PyTorch: generate text with the embedded models.",
        epilog=generate.format_help())
    parser.add_argument("--version", action="version", version=f"specops {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,models,memory}")
    _generate_parser(commands.add_parser("generate", formatter_class=formatter,
                                         help="generate a continuation of a prompt",
                                         description="Generate a continuation of a prompt; the text streams to "
                                                     "stdout, one statistics line goes to stderr."))
    models = commands.add_parser("models", help="the embedded models: list them, print a model's folder, build "
                                                "its bigram table",
                                 description="The embedded models. `specops models path NAME` prints the folder "
                                             "of NAME's float32 transformers checkpoint (converted from its GGUF "
                                             "package on first use), which vLLM and transformers load: "
                                             "vllm serve \"$(specops models path gemma-3-270m)\". "
                                             "`specops models bigram NAME|FOLDER` builds (or finds) the model's "
                                             "bigram table, which the ngram method and specops.vllm.NgramProposer "
                                             "read from the cache (about 7 minutes for Gemma-3-270M on 2 CPU "
                                             "cores with AMX, seconds on a GPU).")
    models.add_argument("action", choices=["list", "path", "bigram"])
    models.add_argument("name", nargs="?", help=f"a model: {_MODELS}; for bigram also a transformers model folder")
    memory = commands.add_parser("memory", help="an n-gram memory file: show what it holds, or add a corpus to it",
                                 description="An n-gram memory file (specops.NgramMemory), which `specops generate "
                                             "--memory FILE`, specops.decode(memory=) and specops.vllm.NgramProposer "
                                             "(SPECOPS_NGRAM_MEMORY) draft from. `specops memory show FILE` prints "
                                             "what it holds; `specops memory add FILE TEXT...` encodes each text "
                                             "file with the target's tokenizer and adds it as one run (creating "
                                             "FILE if needed), as a static cache of likely continuations.")
    memory.add_argument("action", choices=["show", "add"])
    memory.add_argument("file", help="the memory file")
    memory.add_argument("texts", nargs="*", metavar="TEXT", help="add: text files, each one run")
    memory.add_argument("--target", default="gemma-3-270m", help=f"add: the model whose tokenizer encodes the texts "
                                                                 f"({_MODELS})")
    memory.add_argument("--budget", type=_bytes, default=None, metavar="BYTES",
                        help="add: the budget of a new file (default 256M), or a new one for an existing file")
    return parser


def _read_prompt(args) -> str:
    if args.prompt_file is not None:
        if args.prompt not in (None, "-"):
            raise ValueError("give the prompt either as an argument or with --prompt-file, not both")
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    if args.prompt is None or args.prompt == "-":
        if args.prompt is None and sys.stdin.isatty():
            raise ValueError("no prompt: give one as an argument, with --prompt-file, or on stdin")
        return sys.stdin.read()
    return args.prompt


def _stream(request: int, text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _check(args, names: list[str]) -> None:
    """Every setting that can be checked without a model, before the seconds a model takes to load."""
    from specops import models
    from specops.decoding import check_arguments

    for name in names + ([args.drafter] if args.drafter and not args.drafter.startswith("self:") else []):
        models.check_name(name)
    if args.ensemble is not None and len(names) < 2:
        raise ValueError("--ensemble needs several targets: --target NAME1,NAME2")
    if args.memory_budget is not None and args.memory is None:
        raise ValueError("--memory-budget needs --memory FILE")
    check_arguments(target=names if len(names) > 1 else names[0], drafter=args.drafter, method=args.method,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, num_draft_tokens=args.num_draft_tokens, stop=args.stop,
                    ensemble=_ensemble(args), options=_options(args), num_samples=args.num_samples)
    if args.memory is not None:
        from specops.decoding import registry

        readers = [m.name for m in registry.METHODS.values() if m.memory]
        if args.drafter is not None or len(names) > 1 or args.method not in ("auto", *readers):
            raise ValueError(f"--memory is read by method {', '.join(readers)} alone: no --drafter, one --target, "
                             f"--method auto or {' or '.join(readers)}")


def _options(args) -> dict | None:
    """The method options the --METHOD-OPTION flags set (None when none is): for --method auto, whatever
    method auto picks must take them (decode checks)."""
    options = {}
    for key, value in vars(args).items():
        if key.startswith("option:"):
            _, method, option = key.split(":")
            if args.method not in ("auto", method):
                raise ValueError(f"{_flag(method, option)} is an option of method {method}, not {args.method}")
            options[option] = value
    return options or None


def _ensemble(args):
    import specops

    if args.ensemble is None:
        return None
    kind, values = args.ensemble
    return (specops.WeightedEnsemble(values) if kind == "weighted"
            else specops.ContrastiveEnsemble(values[0], values[1] if len(values) > 1 else None))


def _open_memory(path: str, budget: int | None):
    """The memory in `path` (with a new budget if one is given), or a new one when there is no such file."""
    from pathlib import Path

    import specops

    if Path(path).exists():
        return specops.NgramMemory.load(path, budget_bytes=budget)
    return specops.NgramMemory(budget_bytes=budget or 256 << 20)


def _generate(args) -> int:
    import specops
    from specops._seeds import draw_seed

    prompt = _read_prompt(args)
    names = args.target.split(",")
    _check(args, names)
    memory = _open_memory(args.memory, args.memory_budget) if args.memory is not None else None
    if args.max_new_tokens == 0:  # nothing to generate: no model needs to load
        print("specops: --max-new-tokens 0: nothing generated", file=sys.stderr)
        return 0
    _set_threads(args.threads)
    if len(names) > 1:
        loaded = [specops.models.load(name) for name in names]
        target, tokenizer = [m for m, _ in loaded], [t for _, t in loaded]
    else:
        target, tokenizer = specops.models.load(args.target)
    ensemble = _ensemble(args)
    drafter, drafter_tokenizer = args.drafter, None
    if drafter is not None and not drafter.startswith("self:"):
        drafter, drafter_tokenizer = specops.models.load_drafter(drafter)
    # --compare needs both runs on the same random numbers, so a missing seed is drawn here, once.
    seed = args.seed if args.seed is not None else draw_seed()
    settings = dict(target=target, tokenizer=tokenizer, ensemble=ensemble, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed, stop=args.stop)
    method = dict(drafter=drafter, drafter_tokenizer=drafter_tokenizer, method=args.method,
                  num_draft_tokens=args.num_draft_tokens, options=_options(args))
    if args.compare:  # the first forwards of a process are slow: keep them out of both timings
        specops.decode(prompt, **method, **{**settings, "max_new_tokens": min(4, args.max_new_tokens)})
    if args.echo:
        _stream(0, prompt)
    samples = args.num_samples
    result = specops.decode(prompt, **method, stream=_stream if samples is None else None, memory=memory,
                            num_samples=samples, **settings)
    if samples is not None:
        for j, text in enumerate(result.text):
            print(f"--- sample {j + 1} of {samples} ---", file=sys.stderr, flush=True)
            _stream(0, text if text.endswith("\n") else text + "\n")
    elif not result.text.endswith("\n"):
        _stream(0, "\n")
    chosen = f"auto chose {result.stats.method}; " if args.method == "auto" else ""
    print(chosen + result.stats.summary(), file=sys.stderr, flush=True)
    if memory is not None:
        memory.save(args.memory)
        print(f"memory {args.memory}: {memory!r}", file=sys.stderr, flush=True)
    if args.compare:
        from specops.decoding import registry

        plain = registry.plain(ensemble=len(names) > 1).name
        baseline = specops.decode(prompt, method=plain, num_samples=samples, **settings)
        print(baseline.stats.summary(), file=sys.stderr)  # it starts with the method's name
        ratio = (result.stats.tokens_per_second / baseline.stats.tokens_per_second
                 if baseline.stats.tokens_per_second else float("nan"))
        line = (f"compare: {result.stats.tokens_per_second:.1f} tok/s vs {plain} {baseline.stats.tokens_per_second:.1f} "
                f"tok/s, speedup {ratio:.2f}x")
        if args.temperature == 0:
            line += f"; greedy outputs identical: {'yes' if result.tokens == baseline.tokens else 'no'}"
        print(line, file=sys.stderr, flush=True)
    return 0


def _models(args) -> int:
    from specops import models

    if args.action == "list":
        if args.name is not None:
            raise ValueError("specops models list takes no model name")
        print("\n".join(models.names()))
        return 0
    if args.name is None:
        raise ValueError(f"specops models {args.action} needs a model name: {_MODELS}")
    if args.action == "bigram":
        from pathlib import Path

        from specops.decoding import model_ngrams

        folder = Path(args.name).expanduser()
        if not folder.is_dir():
            models.check_name(args.name)
            folder = models.path(args.name)
        table = model_ngrams.folder_bigram(folder, tables="bigram")
        print(f"{folder}: bigram table of {table.shape[0]} tokens x {table.shape[1]} ready in "
              f"{model_ngrams.cache_dir()}")
        return 0
    models.check_name(args.name)
    print(models.path(args.name))
    return 0


def _memory(args) -> int:
    from pathlib import Path

    import specops

    if args.action == "show":
        if args.texts:
            raise ValueError("specops memory show takes only the file")
        memory = specops.NgramMemory.load(args.file)
        for key, value in memory.stats().items():
            print(f"{key}: {value}")
        return 0
    if not args.texts:
        raise ValueError("specops memory add needs text files to add")
    specops.models.check_name(args.target)
    texts = [Path(t).read_text(encoding="utf-8") for t in args.texts]  # all readable before anything loads
    memory = _open_memory(args.file, args.budget)
    _, tokenizer = specops.models.load(args.target)
    memory.add_texts(texts, tokenizer)
    memory.save(args.file)
    print(f"memory {args.file}: {memory!r}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"models": _models, "memory": _memory}.get(args.command, _generate)(args)
    except (ValueError, ImportError, OSError) as error:  # bad settings, a missing package or file
        print(f"specops: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
