"""The documentation's links hold: every relative markdown link in the README and the room pages
points at a file that exists and, when it names an ``#anchor``, at a heading of that file (GitHub's
heading slugs); the top README stays a one-sitting read. Reads text only: fast, no imports of aotlm.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 450
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)  # fenced code blocks, dropped before parsing
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title"); text may wrap
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def doc_files() -> list[Path]:
    """The README and every markdown page beside the code and scripts."""
    found = {ROOT / "README.md"}
    for folder in ("engine", "models", "scripts"):
        found.update((ROOT / folder).rglob("*.md"))
    return sorted(found)


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (their ``#`` lines are not headings, ``[x](y)`` not links)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's ``-1``, ``-2`` ... for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path.read_text(encoding="utf-8"))):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """``file: target (why)`` for each relative link of ``path`` that does not resolve (paths shown
    relative to ``root``)."""
    bad = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no heading #{anchor} in {dest.relative_to(root)})")
    return bad


def test_every_relative_link_and_anchor_resolves() -> None:
    files = doc_files()
    assert ROOT / "README.md" in files and len(files) > 5, files
    assert [b for f in files for b in broken_links(f)] == []


def test_top_readme_fits_one_sitting() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move reference material to a room page"


def test_checker_sees_broken_files_and_anchors(tmp_path: Path) -> None:
    """The checks themselves: a missing file, a missing anchor, slugs of code and punctuation,
    repeated headings and links inside code blocks (ignored)."""
    (tmp_path / "b.md").write_text("# Top\n\n## Job arrays (`--shard I/N`)\n\n## Same\n\n## Same\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#job-arrays---shard-in) [ok](b.md#same-1) [ok](#here) [web](https://x.org/#nope)\n"
        "## Here\n[gone](c.md) [bad](b.md#nope) [wrapped\ntext](b.md#top-1)\n"
        "```\n[in code](missing.md)\n# not a heading\n```\n"
    )
    assert broken_links(page, tmp_path) == [
        "a.md: c.md (no such file)",
        "a.md: b.md#nope (no heading #nope in b.md)",
        "a.md: b.md#top-1 (no heading #top-1 in b.md)",
    ]
    assert slug("4-bit weights: `aotlm_wmm_q4` (`int4.h`)") == "4-bit-weights-aotlm_wmm_q4-int4h"
