"""The shape of the package, checked: decoding methods are siblings (no method module imports another), the
front door and the command line know no method by name (they ask the registry), and no import cycle
exists anywhere in specops/ (imports inside functions included)."""

import ast
import re
from pathlib import Path

from specops.decoding import registry

PACKAGE = Path(__file__).resolve().parent.parent / "specops"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every specops module `name` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specops"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("specops"))
    return {m for m in out if m in modules and m != name}


def test_methods_import_no_other_method():
    modules = _modules()
    methods = {f"specops.decoding.{m}" for m in registry._MODULES}
    for method in methods:
        others = _imports(method, modules[method], modules) & (methods - {method})
        assert not others, f"{method} imports the method module(s) {sorted(others)}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_no_import_cycle():
    modules = _modules()
    cycle = _cycle({name: _imports(name, path, modules) for name, path in modules.items()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found():
    """The cycle check can fail: a two-module cycle written to a scratch package is reported."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "specops"
        root.mkdir()
        (root / "__init__.py").write_text("")
        (root / "a.py").write_text("def f():\n    from specops import b\n")
        (root / "b.py").write_text("from specops.a import f\n")
        modules = {"specops": root / "__init__.py", "specops.a": root / "a.py", "specops.b": root / "b.py"}
        graph = {name: _imports(name, path, modules) for name, path in modules.items()}
        assert _cycle(graph) == ["specops.a", "specops.b", "specops.a"]


def test_front_door_and_command_line_name_no_method():
    """decode() and the command line take every method from the registry: no method's name appears in
    their code as a string (docstrings and help text aside)."""
    names = set(registry.METHODS)
    for path in (PACKAGE / "decoding" / "__init__.py", PACKAGE / "cli.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        named = [node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                 and node.value in names]
        assert not named, f"{path.name} names methods {named}"
    assert re.search(r"choices=registry\.NAMES", (PACKAGE / "cli.py").read_text(encoding="utf-8"))


def test_importing_specops_touches_no_device():
    """`import specops` (with the Triton kernels registered, as under TRITON_INTERPRET) asks torch nothing about
    GPUs: torch.cuda's device queries raise in the child, and the import still succeeds with CUDA left as it was."""
    import os
    import subprocess
    import sys

    code = ("import torch\n"
            "def refuse(*args, **kwargs):\n    raise AssertionError('import specops queried a device')\n"
            "torch.cuda.is_available = torch.cuda.device_count = torch._C._cuda_getDeviceCount = refuse\n"
            "import specops, specops.ops\n"
            "assert not torch.cuda.is_initialized()\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# --- From decode() to a kernel launch -----------------------------------------------------------------------------
# A newcomer follows one call from `decode()` down to the op it launches. The route is the specops files on the
# call stack when the op is called, plus the kernel's own source; DEVELOPERS.md ("From decode() to a kernel")
# lists every route a decoding step takes for `sd` and `ngram` on CPU, and this test holds that list against a
# traced run, so neither the routes nor the list can drift.

MOST_FILES_ON_A_ROUTE = 8
ROUTES_DOC = PACKAGE.parent / "DEVELOPERS.md"


def _traced_routes(monkeypatch, method: str) -> set[tuple[str, tuple[str, ...]]]:
    """(op, files on the stack from decode() down) for every specops op that `method` launches while it decodes:
    the steps, not the setup before the loop."""
    import inspect

    import torch
    from toy_models import byte_tokenizer, tiny_llama

    import specops
    import specops.decoding.cpu_forward as cpu_forward
    import specops.decoding.llama_forward as llama_forward

    # The row counts that pick a path depend on the CPU (cpu_forward._blas_is_slow_here): the documented
    # routes are those of a CPU whose BLAS is slow for few rows (skinny_linear for every product, the
    # few-call path up to 64 rows), so that every machine traces the same ones.
    monkeypatch.setattr(cpu_forward, "_SKINNY_ROWS", 1 << 30)
    monkeypatch.setattr(llama_forward, "_FEW_ROWS", 64)
    root = PACKAGE.parent
    routes = set()
    packet_call = torch._ops.OpOverloadPacket.__call__

    def launching(self, *args, **kwargs):
        if self._qualified_op_name.startswith("specops::"):
            files, frame = [], inspect.currentframe().f_back
            while frame is not None:
                name = Path(frame.f_code.co_filename).resolve()
                if name.is_relative_to(PACKAGE):
                    file = name.relative_to(root).as_posix()
                    if not files or files[-1] != file:
                        files.append(file)
                frame = frame.f_back
            files.reverse()
            if "specops/decoding/loop.py" in files:
                routes.add((self._qualified_op_name.split("::")[1], tuple(files)))
        return packet_call(self, *args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverloadPacket, "__call__", launching)
    drafter = {"drafter": tiny_llama(layers=1, seed=1), "drafter_tokenizer": byte_tokenizer()} if method == "sd" else {}
    if method == "ngram":  # a fixed shape of two rows: "auto" picks rows by measured time, so its route varied
        drafter["num_draft_tokens"] = (2, 4)  # (on a loaded machine a step drafted two rows: tree_verify)
    specops.decode(["abcabcabcabc abc", "the cat sat; the cat"], target=tiny_llama(), tokenizer=byte_tokenizer(),
                   method=method, max_new_tokens=12, **drafter)
    monkeypatch.undo()
    return routes


def _documented_routes() -> dict[str, set[tuple[str, tuple[str, ...]]]]:
    text = ROUTES_DOC.read_text(encoding="utf-8").split("<!-- routes -->")[1]
    routes: dict[str, set] = {}
    for row in re.findall(r"^\| `(\w+)` \| `(\w+)` \| (.+?) \|$", text, flags=re.M):
        method, op, route = row
        files = tuple("specops/" + f for f in re.findall(r"`([\w/.]+\.py)`", route))
        routes.setdefault(method, set()).add((op, files))
    return routes


def _kernel_source(op: str) -> Path:
    return PACKAGE.parent / "csrc" / "cpu" / f"{op}.cpp"


def test_every_route_from_decode_to_a_kernel_is_short_and_documented(monkeypatch):
    documented = _documented_routes()
    assert set(documented) == {"sd", "ngram"}, "DEVELOPERS.md lists the routes of sd and ngram"
    for method in ("sd", "ngram"):
        traced = _traced_routes(monkeypatch, method)
        assert {op for op, _ in traced} >= {"chain_verify", "skinny_linear"}, traced
        for op, files in traced:
            assert _kernel_source(op).is_file(), op
            assert len(files) + 1 <= MOST_FILES_ON_A_ROUTE, (method, op, files)
        assert traced == documented[method], (
            f"DEVELOPERS.md's routes for {method} differ from a traced run:\n"
            f"  not documented: {sorted(traced - documented[method])}\n"
            f"  not taken: {sorted(documented[method] - traced)}")

