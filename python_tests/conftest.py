"""Test configuration shared by the specops tests.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. The interpreter is chosen
when a kernel is decorated, so TRITON_INTERPRET must be set before anything imports triton or specops:
conftest.py is imported before the test modules, so it is set here, first.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import specops  # noqa: E402,F401  (registers the ops; after TRITON_INTERPRET is set)

# The README's test command runs the suite in pytest-xdist workers, one per core: each worker's torch takes
# its share of the cores rather than all of them, so the workers do not oversubscribe the machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# Devices the public wrapper is tested on: CPU runs the C++ kernel, CUDA the Triton kernel.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def pytest_generate_tests(metafunc):
    """Every test that takes a `device` argument runs once per available device."""
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


def pytest_collection_modifyitems(config, items):
    """Without a GPU every Triton case runs in the interpreter, a second to tens of seconds each: those cases
    (a test named test_triton_*, or a parameter id "triton") are `slow`, whatever their module marked. The fast
    subset (`-m "not slow"`) checks the same contracts on the C++ kernel and the reference."""
    if HAS_CUDA:
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        ids = callspec.id.split("-") if callspec is not None else []
        if getattr(item, "originalname", item.name).startswith("test_triton") or "triton" in ids:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny-model tests: they gain nothing from more, and a shared
    2-core machine is oversubscribed by two threads per process."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def private_specops_cache(tmp_path_factory):
    """specops' on-disk caches (vocabulary maps, model n-grams) go to a temporary directory for a module,
    never to the user's ~/.cache."""
    before = os.environ.get("SPECOPS_CACHE")
    os.environ["SPECOPS_CACHE"] = str(tmp_path_factory.mktemp("specops-cache"))
    yield
    if before is None:
        del os.environ["SPECOPS_CACHE"]
    else:
        os.environ["SPECOPS_CACHE"] = before


@pytest.fixture(autouse=True)
def fresh_embedded_models(request):
    """Models decode loads by name are kept for the process (specops.decoding._load_embedded), so the tests
    that name the real models (the README's blocks, test_decode_real) load each once per worker. A test that
    can replace specops.models' loaders (it uses monkeypatch) must neither see another test's models nor
    leave its own behind: the cache is emptied around it."""
    from specops.decoding import _load_embedded

    if "monkeypatch" not in request.fixturenames:
        yield
        return
    _load_embedded.cache_clear()
    yield
    _load_embedded.cache_clear()
