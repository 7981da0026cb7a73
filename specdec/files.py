"""Writing a file whole or not at all, for files that readers open while writers may die."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` whole or not at all: `write` fills a file beside it, which then replaces it,
    so a process killed mid-write leaves the file as it was, never half of one (a half-written
    stats.json or target.json of distill used to end every later --resume in a JSONDecodeError),
    and a reader never sees half of one either."""
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
