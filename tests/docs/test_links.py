"""Every relative link in README.md and docs/ resolves: the file exists, and so does its anchor.

A guide split into pages (the training quickstart, testing, effectiveness) leaves links into
sections that moved; this check finds them. Links are `[text](target)` and `![alt](target)` outside
fenced code blocks and inline code; `http:`, `https:` and `mailto:` targets are not followed. An
anchor (`page.md#section`, or `#section` in the same page) must be the slug GitHub gives one of the
target's headings: the heading's text with inline code, emphasis and link targets dropped,
lowercased, every character that is not a letter, digit, space, `-` or `_` removed, each space made
`-`; a repeated slug gets `-1`, `-2`, ... in order.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines of `text` outside fenced code blocks, with 1-based numbers."""
    out, fenced = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line.lstrip())
        if m:
            if fenced is None:
                fenced = m.group(1)
            elif m.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link in `text` outside code."""
    out = []
    for n, line in _prose_lines(text):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((n, m.group(1)))
    return out


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file or anchor does not exist, as `page:line: target: why`."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for line, target in links(page.read_text(encoding="utf-8")):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{line}: `{target}`"
        if not dest.exists():
            problems.append(f"{where}: no such file `{dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}`")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                problems.append(f"{where}: an anchor into something that is not a Markdown page")
                continue
            if dest not in cache:
                cache[dest] = anchors(dest.read_text(encoding="utf-8"))
            if anchor not in cache[dest]:
                problems.append(f"{where}: no heading with anchor `#{anchor}`")
    return problems


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("5. `preflight`: will it fit?", "5-preflight-will-it-fit"),
        ("Qwen3.5 and Qwen3.6 targets (`qwen3_5`, `qwen3_5_moe`)", "qwen35-and-qwen36-targets-qwen3_5-qwen3_5_moe"),
        ("A hybrid teacher: what the rollback costs (`--family qwen3_5`)", "a-hybrid-teacher-what-the-rollback-costs---family-qwen3_5"),
        ("`bench/load.py` figures", "benchloadpy-figures"),
        ("See [the guide](x.md) now", "see-the-guide-now"),
    ],
)
def test_slug_follows_github(heading, expected):
    assert slug(heading) == expected


def test_repeated_headings_are_numbered_and_code_is_not_a_heading():
    text = "# Setup\n\n## Setup\n\n```sh\n# not a heading\n```\n\n## Setup\n"
    assert anchors(text) == {"setup", "setup-1", "setup-2"}


def test_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Real section\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text(
        "# A\n\n[ok](b.md#real-section) [self](#a) [web](https://example.com/x#y) `[code](nope.md)`\n\n"
        "[gone](missing.md) [moved](b.md#old-section) [here](#nowhere)\n\n```\n[fenced](nope.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert "no such file" in problems[0] and "missing.md" in problems[0]
    assert "#old-section" in problems[1] and "#nowhere" in problems[2]
    assert all(":5:" in p for p in problems)


def test_every_relative_link_in_the_docs_resolves():
    found = [p for p in pages() if p.exists()]
    assert len(found) > 10 and ROOT / "README.md" in found
    problems = [problem for p in found for problem in broken_links(p)]
    assert not problems, "broken links:\n" + "\n".join(problems)
