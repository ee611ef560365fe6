"""The code blocks of README.md, docs/*.md and an export's README.md, and what the tests do with each.

Every fenced block has a kind, from a marker comment on the line(s) just above it, or else from its language:

- ``<!-- doc-test: run -->``: executed in a workspace that has a trained tiny run (default for ``python``).
- ``<!-- doc-test: commands -->`` (default for ``bash``): each command is checked without running it: a
  ``train.py`` command's config and overrides load (``load_run_config``), a ``python -m mtl.tools.X`` command's
  arguments parse with that tool's own parser, a ``make X`` target exists in the Makefile, a script or file it
  names exists.
- ``<!-- doc-test: config -->`` (default for ``yaml``): the block loads as a config file on top of
  configs/tiny.yaml.
- ``<!-- doc-test: excerpt PATH -->``: code quoted from PATH: each line's code (comments and ``...`` left out)
  appears in PATH, in order.
- ``<!-- doc-test: api PATH -->``: an interface summary of code in PATH: every class, attribute and method it
  declares (``class X``, ``x: ...``, ``x = ...``, ``def x(``) is defined in PATH.
- ``<!-- doc-test: skip: WHY -->``: not checked, for the reason given (a GPU, a cluster, a template).
- A block without a language is output or a diagram, not code.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

MARKER = re.compile(r"<!--\s*doc-test:\s*(run|commands|config|excerpt|api|skip)\b\s*:?\s*(.*?)\s*-->")
DEFAULT_KIND = {"python": "run", "bash": "commands", "yaml": "config", "": "text"}


@dataclass
class Block:
    path: str  # the markdown file
    line: int  # the line of the opening fence (1-based)
    lang: str
    kind: str  # run | commands | config | excerpt | skip | text
    arg: str  # the excerpt's file, or the reason to skip
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(path: str, text: str | None = None) -> list[Block]:
    """The fenced blocks of the markdown file ``path`` (or of ``text``), each with its kind."""
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"{path}:{i + 1}: a code block that is never closed")
        above = [ln for ln in lines[max(0, i - 3):i] if ln.strip()]
        marker = MARKER.search(above[-1]) if above else None
        lang = m.group(1)
        kind, arg = (marker.group(1), marker.group(2)) if marker else (DEFAULT_KIND.get(lang, "unknown"), "")
        out.append(Block(path, i + 1, lang, kind, arg, "\n".join(lines[i + 1:end])))
        i = end + 1
    return out


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block as argument lists: continuation lines joined, comments dropped, and a
    documentation-only optional group (``[--beams 3]``, ``[key=value ...]``) left out."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.split("\n"):
        words = shlex.split(line, comments=True)
        kept, depth = [], 0
        for w in words:
            if depth or (w.startswith("[") and not w.startswith("[[")):
                depth = 0 if w.endswith("]") else 1
                continue
            kept.append(w)
        if kept:
            out.append(kept)
    return out


def code_lines(text: str) -> list[str]:
    """The lines of an excerpt that must appear in its source: comments, blank lines and ``...`` left out, each
    line stripped of indentation and of a trailing comment."""
    out = []
    for line in text.split("\n"):
        code = re.sub(r"\s+#.*$", "", line).strip()
        if code and not code.startswith("#") and code != "...":
            out.append(code)
    return out


def missing_excerpt_lines(block: Block, root: str) -> list[str]:
    """The excerpt's lines not found, in order, among the stripped lines of its source file."""
    with open(os.path.join(root, block.arg), encoding="utf-8") as f:
        source = [re.sub(r"\s+#.*$", "", ln).strip() for ln in f]
    missing, at = [], 0
    for code in code_lines(block.text):
        try:
            at = source.index(code, at) + 1
        except ValueError:
            missing.append(code)
    return missing


DECLARED = re.compile(r"^\s*(?:class\s+(\w+)|def\s+(\w+)\s*\(|(\w+)\s*(?::[^=]*)?=|(\w+)\s*:)")


def undefined_names(block: Block, root: str) -> list[str]:
    """The names an api block declares that its source file does not define."""
    with open(os.path.join(root, block.arg), encoding="utf-8") as f:
        source = f.read()
    missing = []
    for code in code_lines(block.text):
        m = DECLARED.match(code)
        name = m and next(g for g in m.groups() if g)
        if name and not re.search(rf"^\s*(class\s+{name}\b|def\s+{name}\s*\(|{name}\s*(:|=))", source, re.M):
            missing.append(name)
    return missing
