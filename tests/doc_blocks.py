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
- A block without a language is output or a diagram, not code; so is a ``mermaid`` block (a picture GitHub draws).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

MARKER = re.compile(r"<!--\s*doc-test:\s*(run|commands|config|excerpt|api|skip)\b\s*:?\s*(.*?)\s*-->")
DEFAULT_KIND = {"python": "run", "bash": "commands", "yaml": "config", "": "text", "mermaid": "text"}


@dataclass
class Block:
    path: str  # the markdown file
    line: int  # the line of the opening fence (1-based)
    lang: str
    kind: str  # run | commands | config | excerpt | skip | text
    arg: str  # the excerpt's file, or the reason to skip
    text: str
    section: str = ""  # the ``## `` heading the block sits under

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(path: str, text: str | None = None) -> list[Block]:
    """The fenced blocks of the markdown file ``path`` (or of ``text``), each with its kind."""
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    lines = text.split("\n")
    out, i, section = [], 0, ""
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            section = lines[i][3:].strip() if lines[i].startswith("## ") else section
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"{path}:{i + 1}: a code block that is never closed")
        above = [ln for ln in lines[max(0, i - 3):i] if ln.strip()]
        marker = MARKER.search(above[-1]) if above else None
        lang = m.group(1)
        kind, arg = (marker.group(1), marker.group(2)) if marker else (DEFAULT_KIND.get(lang, "unknown"), "")
        out.append(Block(path, i + 1, lang, kind, arg, "\n".join(lines[i + 1:end]), section))
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


def target(argv: list[str]) -> tuple[str, list[str]]:
    """What a documented command runs, and its arguments: ``("train", args)`` for train.py (directly, under torchrun
    or the launcher), ``("tool", [module, *args])`` for ``python -m``, ``("script", [path, *args])``, ``("make",
    args)``, or ``("other", argv)``. ``VAR=value`` words before the command are left out."""
    while argv and "=" in argv[0] and not argv[0].startswith("-"):
        argv = argv[1:]
    if argv and argv[0] == "make":
        return "make", argv[1:]
    if not argv or argv[0] not in ("python", "python3", "torchrun"):
        return "other", argv
    rest = argv[1:]
    if argv[0] == "torchrun":  # its own options, then the script or -m module
        while rest and rest[0].startswith("--") and rest[0] != "-m":
            rest = rest[1:]
    if rest[:2] == ["-m", "mtl.tools.launch"] and "train.py" in rest:
        rest = rest[rest.index("train.py"):]
    if rest and rest[0] == "train.py":
        return "train", rest[1:]
    if rest and rest[0] == "-m":
        return "tool", rest[1:]
    return "script", rest


def _option(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args``."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def _key(args: list[str], key: str) -> str | None:
    """The value of the override ``key=VALUE`` in ``args``."""
    found = [a[len(key) + 1:] for a in args if a.startswith(key + "=")]
    return found[-1] if found else None


def model_paths_read(argv: list[str]) -> list[str]:
    """The model folders a command reads: a tool's ``--checkpoint`` / ``--model``, a run's ``init_from`` and
    ``resume`` (a folder, not ``auto``)."""
    kind, args = target(argv)
    if kind == "tool":
        found = [_option(args, "--checkpoint"), _option(args, "--model")]
    elif kind == "train":
        resume = _key(args, "resume")
        found = [_key(args, "init_from"), None if resume in (None, "auto", "null") else resume]
    else:
        found = []
    return [os.path.normpath(p) for p in found if p]


def checkpoint_steps(max_steps: int, every_steps: int, keep_last: int = 0) -> list[int]:
    """The steps whose checkpoints a finished run keeps (``mtl.run.run_folder``: every ``every_steps`` and the
    last step; ``keep_last`` > 0 keeps only that many)."""
    steps = [s for s in range(every_steps, max_steps, every_steps)] if every_steps else []
    steps.append(max_steps)
    return steps[-keep_last:] if keep_last else steps


def paths_made(argv: list[str], run_folder, makefile: dict[str, str]) -> list[str]:
    """The folders a finished command leaves: a run's ``output_dir`` and its ``checkpoints/step_<N>`` (``run_folder(
    config, overrides)`` gives ``(output_dir, steps)``), ``make train``'s (with the Makefile's ``CONFIG`` and
    ``ARGS``), an export's ``--out``, scripts/make_tiny_pretrained.py's folders."""
    kind, args = target(argv)
    if kind == "make" and "train" in args:
        config = next((a[7:] for a in args if a.startswith("CONFIG=")), makefile["CONFIG"])
        extra = next((shlex.split(a[5:]) for a in args if a.startswith("ARGS=")), [])
        kind, args = "train", ["--config", config, *extra]
    if kind == "train":
        output_dir, steps = run_folder(args[1], [a for a in args[2:] if "=" in a])
        output_dir = os.path.normpath(output_dir)
        return [output_dir] + [os.path.join(output_dir, "checkpoints", f"step_{n}") for n in steps]
    if kind == "tool" and args[0] == "mtl.tools.export" and _option(args, "--out"):
        return [os.path.normpath(_option(args, "--out"))]
    if kind == "script" and args[0] == "scripts/make_tiny_pretrained.py":
        out = next((a for a in args[1:] if not a.startswith("-")), "runs/pretrained")
        return [os.path.normpath(os.path.join(out, name)) for name in ("vit", "dinov2", "gpt2", "vit-gpt2")]
    return []


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
