"""specops' files on disk: where its caches live, and how a file is written so that nobody reads half of it.

`cache_root()` is $SPECOPS_CACHE, or ~/.cache/specops when it is unset or empty; embedded models, vocabulary
maps and model n-gram tables each keep a folder under it. `write_atomically(path, write)` writes through a
temporary file named for the process and the thread (two threads of one process may write the same file at
once) and moves it into place: a reader sees the whole old file or the whole new one.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

__all__ = ["cache_root", "write_atomically"]


def cache_root() -> Path:
    """$SPECOPS_CACHE, or ~/.cache/specops where it is unset or empty."""
    return Path(os.environ.get("SPECOPS_CACHE") or Path.home() / ".cache" / "specops")


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call write(temporary) and move the temporary file to `path` (removed if write raises)."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
