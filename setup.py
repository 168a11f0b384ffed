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
    cxx_flags = ["-O3", "-g0", "-fopenmp", "-Wno-psabi"]
    cuda_sources = _sources("csrc/cuda/*.cu")
    use_cuda = bool(cuda_sources) and cpp_extension.CUDA_HOME is not None and _torch_has_cuda()
    if use_cuda:
        return cpp_extension.CUDAExtension(
            "specops._C", sources + cuda_sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=["-fopenmp"])
    return cpp_extension.CppExtension("specops._C", sources, extra_compile_args=cxx_flags,
                                      extra_link_args=["-fopenmp"])


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
