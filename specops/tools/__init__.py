"""Developer tools that ship with specops but are not part of its API: `compile_check` (every Triton kernel
compiled for named GPU targets without a GPU; CI and bench/gpu_suite.sh run it)."""
