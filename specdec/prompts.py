"""Prompt files: JSON Lines, one JSON value per line, blank lines skipped.

`specdec bench` and `specdec soak` read {"prompt": ..., "kind": ...} lines, `specdec distill`
{"prompt": ...} or {"messages": [...]} lines with a "split"; each checks the shape of its own lines,
and all read them, and word a file that cannot be read or a line that is not JSON, here.
"""

from __future__ import annotations

import json
import os
from importlib import resources

from specdec.ranges import undecodable


class PromptFileError(ValueError):
    """A prompts file that cannot be read, or a line of it that is not JSON; says which."""


def read_json_lines(path: str | os.PathLike | None, packaged: str = "") -> list[tuple[str, object]]:
    """[(where, value)] for each non-blank line of `path`, or of the file `packaged` in
    specdec/data when `path` is None; `where` is "FILE:LINE", for the caller's own errors."""
    if path is None:
        name, text = packaged, resources.files("specdec.data").joinpath(packaged).read_text(encoding="utf-8")
    else:
        try:
            name, text = str(path), open(path, encoding="utf-8").read()
        except OSError as exc:
            raise PromptFileError(f"cannot read the prompts file {str(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise PromptFileError(f"the prompts file {str(path)!r} is not UTF-8: {undecodable(exc)}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append((f"{name}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise PromptFileError(f"{name}:{number}: not JSON: {exc}") from None
    return rows
