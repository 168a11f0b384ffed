"""Prints the requirements of specops' test, model and plot extras (pyproject.toml) with transformers
pinned to the floor of the declared range, one per line, for `pip install -r`: the environment in which
.ci/run tests the transformers-facing code at the oldest transformers specops admits."""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]
(spec,) = [r for r in extras["decode"] if r.startswith("transformers")]
floor = re.search(r">=\s*([0-9.]+)", spec)
if floor is None:
    sys.exit(f"floor_requirements: the decode extra's {spec!r} declares no floor (>=)")
version = floor.group(1) + ".0" * (2 - floor.group(1).count("."))  # 5.17 -> 5.17.0
requirements = [f"transformers=={version}", *project["dependencies"]]
for extra in ("test", "models", "bench"):
    requirements += [r for r in extras[extra] if not r.startswith("specops[") and r not in requirements]
print("\n".join(requirements))
