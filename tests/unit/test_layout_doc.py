"""docs/layout.md, the source map README.md links to, names only files that exist, and its opening answers
(where a unit is gathered, gradients reduce-scattered, the CPU step launched, a feature switched on) name
functions and classes that are defined where they say (issue #29): a file or function moved, split or renamed
without its line in the map fails here instead of sending a newcomer to nothing.

The map is a tree: a line starting at column 0 names a top-level directory (``tests/``, ``lightning_zero/``),
one starting at column 2 a name inside the package; the names at the head of a line (before the first wide
gap; ``ops/, optim/`` names two) are where the file names on that line and its continuation lines live,
at any depth below them, or, for a name with a slash, under the checkout or the package.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "layout.md"
FILE = re.compile(r"(?<![\w/<>.*-])((?:[\w-]+/)*[\w-]+\.(?:py|md|sh|yaml))\b")
"""A file name in the map (``stage3.py``, ``checkpoint/strategy_io.py``); patterns (``tests/<suite>/...``) aside."""


def _tree(text: str) -> list[str]:
    """The lines of the map's code block."""
    block = re.search(r"^```\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/layout.md has no code block with the tree"
    return block.group(1).splitlines()


def _heads(line: str) -> list[Path]:
    """The directories a head line names, or [] for a continuation line."""
    indent = len(line) - len(line.lstrip(" "))
    if indent not in (0, 2) or not line.strip():
        return []
    head = re.split(r" {2,}", line.strip(), maxsplit=1)[0]
    base = ROOT if indent == 0 else ROOT / "lightning_zero"
    dirs = []
    for name in (n.strip() for n in head.split(",")):
        path = base / name.rstrip("/")
        dirs.append(path if name.endswith("/") else path.parent)  # apply.py, comm/collectives.py: their folder
    return dirs


def missing_names(text: str) -> list[str]:
    """``line: name`` for every file name of the map that is not where its line says."""
    bad, where = [], [ROOT]
    for n, line in enumerate(_tree(text), 1):
        where = _heads(line) or where
        for name in FILE.findall(line):
            found = (ROOT / name).is_file() or (ROOT / "lightning_zero" / name).is_file() or any(
                p.is_file() for base in where for p in [base / name, *base.rglob(name)]
            ) or any(p.as_posix().endswith("/" + name) for base in where for p in base.rglob(Path(name).name))
            if not found:
                bad.append(f"line {n}: {name}")
    return bad


def _bullets(text: str) -> list[str]:
    """The map's opening answers: the ``- **...**`` items before the tree."""
    prelude = text.split("```", 1)[0]
    return [b for b in re.split(r"\n(?=- \*\*)", prelude) if b.startswith("- **")]


def _defined(name: str, files: list[Path]) -> bool:
    pattern = re.compile(rf"^\s*(?:def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.M)
    return any(pattern.search(f.read_text()) for f in files)


def unresolved_answers(text: str) -> list[str]:
    """Every backticked name of an opening answer (``Stage3Engine.gather``: ``gather``) that no file or folder
    of the same answer defines, and every backticked path that does not exist."""
    bad = []
    for bullet in _bullets(text):
        quoted = re.findall(r"`([^`]+)`", bullet)
        paths = [q for q in quoted if q.endswith((".py", "/"))]
        files: list[Path] = []
        for q in paths:
            found = [b / q for b in (ROOT, ROOT / "lightning_zero") if (b / q).exists()]
            if not found:
                bad.append(f"no path {q}")
            files += [f for p in found for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
        for q in quoted:
            if q in paths or not re.fullmatch(r"[A-Za-z_]\w*(\.\w+)?", q):
                continue
            if not _defined(q.rsplit(".", 1)[-1], files):
                bad.append(f"{q} not defined in {[str(p) for p in paths]}")
    return bad


def test_the_opening_answers_name_what_exists() -> None:
    text = LAYOUT.read_text()
    assert len(_bullets(text)) == 4
    assert unresolved_answers(text) == []
    stale = text.replace("`Stage3Engine.gather`", "`Stage3Engine.gather_unit`").replace("`zero/units.py`", "`zero/unit.py`")
    assert unresolved_answers(stale) == ["no path zero/unit.py", "Stage3Engine.gather_unit not defined in "
                                         "['lightning_zero/zero/stage3.py', 'zero/unit.py']"]


def test_every_file_the_map_names_exists() -> None:
    text = LAYOUT.read_text()
    assert len(_tree(text)) > 20 and len(FILE.findall(text)) > 80  # the map was read, not skipped
    assert missing_names(text) == []


def test_the_check_finds_a_stale_name() -> None:
    good = "```\nlightning_zero/\n  zero/              stage3.py (units.py), engine.py\n  ops/, optim/       reference.py\n```\n"
    assert missing_names(good) == []
    stale = good.replace("units.py", "unit_hooks.py").replace("reference.py", "references.py")
    assert missing_names(stale) == ["line 2: unit_hooks.py", "line 3: references.py"]
    assert missing_names("```\nlightning_zero/\n  core.py            the mixin\n```\n") == ["line 2: core.py"]
