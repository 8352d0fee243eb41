"""Docs that stand on their own: every section the code cites exists in docs/numerics.md.

Docstrings and comments cite the numerics reference as "docs/numerics.md" followed by a section
sign and number; several sections of one parenthesis or sentence share one mention of the file
(a list, a range "1.1-1.2", or "7.2/7.3", each number with its sign). These tests read the
citations that way: per line, a "scope" is the inside of a parenthesis or a sentence, and a
section number is a citation of docs/numerics.md when the file is named earlier in its scope (or
in the scope the previous comment/docstring line left open). The section sign is never written
literally in this file, so that it cites nothing itself.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = "docs/numerics.md"
SIGN = "\u00a7"
SEC = r"\d+(?:\.\d+)*"
#: one cited section, or a range "n-m" / "n–m" whose end is checked too
CITATION = re.compile(SIGN + r"(" + SEC + r")(?:\s*[-\u2013]\s*" + SIGN + r"?(" + SEC + r"))?")
#: why: these trees are the project's Python code; .venv, caches and build output are not
SOURCE_DIRS = ("expstream", "stages", "schemas", "bench", "tests")


def _headings() -> set[str]:
    """Section numbers that appear in a markdown heading of docs/numerics.md."""
    found: set[str] = set()
    for line in (ROOT / DOC).read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            found.update(m.group(1) for m in re.finditer(SIGN + r"(" + SEC + r")", line))
    return found


def _scopes(line: str) -> tuple[list[int], int]:
    ids = [0] * len(line)
    next_id, stack = 1, [0]
    for i, ch in enumerate(line):
        if ch == "(":
            stack.append(next_id)
            next_id += 1
            ids[i] = stack[-1]
        elif ch == ")":
            ids[i] = stack[-1]
            if len(stack) > 1:
                stack.pop()
            else:
                stack[-1], next_id = next_id, next_id + 1
        elif ch in ".;" and (i + 1 == len(line) or line[i + 1] == " "):
            ids[i] = stack[-1]
            stack[-1], next_id = next_id, next_id + 1
        else:
            ids[i] = stack[-1]
    return ids, stack[-1]


def _text_lines(source: str) -> dict[int, int]:
    """1-based line number -> column where its comment or docstring text starts."""
    out: dict[int, int] = {}
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.setdefault(tok.start[0], tok.start[1])
        elif tok.type == tokenize.STRING and prev in (None, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            for k in range(tok.start[0], tok.end[0] + 1):
                out[k] = 0
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    return out


def _citations() -> tuple[list[tuple[str, str]], list[str]]:
    """([(where, section) cited as docs/numerics.md], [where a section sign cites no file])."""
    cited: list[tuple[str, str]] = []
    bare: list[str] = []
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            if SIGN not in source:
                continue
            lines = source.splitlines()
            text = _text_lines(source)
            carried = False
            for no, line in enumerate(lines, start=1):
                if no not in text:
                    carried = False
                    continue
                part = line[text[no]:]
                ids, last = _scopes(part)
                for m in CITATION.finditer(part):
                    sid = ids[m.start()]
                    before = "".join(c for c, s in zip(part[: m.start()], ids, strict=False) if s == sid)
                    where = f"{path.relative_to(ROOT)}:{no}"
                    if DOC in before or (sid == 0 and carried):
                        cited += [(where, g) for g in m.groups() if g]
                    elif not re.search(r"[\w./-]+\.(?:md|rst|txt)\b", before):
                        bare.append(f"{where}: {part.strip()}")
                open_text = "".join(c for c, s in zip(part, ids, strict=True) if s == last)
                carried = DOC in open_text or (last == 0 and carried)
    return cited, bare


def test_every_cited_section_has_a_heading() -> None:
    headings = _headings()
    cited, _ = _citations()
    missing = [f"{where}: {SIGN}{sec}" for where, sec in cited if sec not in headings]
    assert not missing, f"{DOC} has no heading for: " + "; ".join(missing)


def test_no_section_is_cited_without_naming_the_file() -> None:
    _, bare = _citations()
    assert not bare, f"cite sections as '{DOC} {SIGN}n': " + "; ".join(bare)


def test_numerics_md_cites_only_its_own_headings() -> None:
    """The page's own "\u00a7n" references (tables, prose) land on its Reference part."""
    headings = _headings()
    body = (ROOT / DOC).read_text(encoding="utf-8")
    missing = sorted({g for m in CITATION.finditer(body) for g in m.groups() if g and g not in headings})
    assert not missing, f"{DOC} refers to sections it does not have: {missing}"
