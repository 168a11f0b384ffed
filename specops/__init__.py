"""specops: speculative-decoding kernels for PyTorch.

Public API: `specops.ops` (the kernels, as typed wrappers over `torch.ops.specops.*`).
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from specops import _C  # noqa: F401  (registers the op schemas and the C++ CPU kernels)
from specops import ops
from specops import kernels  # noqa: F401  (registers the Triton kernels for CUDA)

__all__ = ["ops"]
__version__ = "0.1.0"
