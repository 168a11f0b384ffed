"""Builds the C++ extension specops._C (CPU kernels + op schemas; CUDA C++ kernels where possible).

CUDA sources in csrc/cuda are compiled only when both a CUDA toolkit and a CUDA build of torch are
present; the CPU build never needs them.
"""

import glob
import os

from setuptools import setup

try:
    from torch.utils import cpp_extension
except ImportError as error:  # an isolated build environment, or torch not installed yet
    raise SystemExit(
        "specops compiles against the installed torch. Install torch first, then build without "
        "isolation:\n    pip install torch\n    pip install --no-build-isolation -e .") from error

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extension():
    sources = _sources("csrc/registration.cpp") + _sources("csrc/cpu/*.cpp")
    # -g0: Python's own CFLAGS ask for debug information, which doubles the compile time and makes the
    # objects 20x larger (take it out here for a build to debug).
    # -std=c++20: the kernels use it (std::bit_cast, std::popcount); torch 2.11 compiles extensions as C++17
    # unless told (2.13 as C++20).
    # _GLIBCXX_USE_CXX11_ABI as torch was built: torch's extension builder does not pass it, and a compiler
    # whose default differs (toolchains made for an old glibc keep the pre-C++11 std::string) builds every
    # std::string handed to torch, an error's message first, as an object torch reads differently. On the
    # lent H200 machine (/opt/gcc/bin/g++, torch 2.11, 2026-12-04) every error a C++ kernel raised crashed
    # the process while correct calls ran; this define is the suspected fix, still to be seen there.
    cxx_flags = ["-std=c++20", "-O3", "-g0", "-fopenmp", "-Wno-psabi",
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(_torch_cxx11_abi())}"]
    cuda_sources = _sources("csrc/cuda/*.cu")
    use_cuda = bool(cuda_sources) and cpp_extension.CUDA_HOME is not None and _torch_has_cuda()
    if use_cuda:
        return cpp_extension.CUDAExtension(
            "specops._C", sources + cuda_sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=["-fopenmp"])
    return cpp_extension.CppExtension("specops._C", sources, extra_compile_args=cxx_flags,
                                      extra_link_args=["-fopenmp"])


def _torch_cxx11_abi() -> bool:
    import torch

    return bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def _torch_has_cuda() -> bool:
    import torch

    return torch.version.cuda is not None


class _BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """Object files in the checkout's build/ rather than the temporary directory pip's editable build
    gives: ninja then rebuilds only what changed, after an edit and when another environment with the
    same torch installs the same checkout (CI's second and third environments)."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", "temp")


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExtension},
)
