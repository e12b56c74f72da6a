"""The README and docs/ hold together: every relative link and ``#anchor`` resolves, and the README stays a guide.

Links are checked as GitHub renders them: a path is relative to the linking file (a leading ``/`` is the repository
root), an anchor is a heading's GitHub slug (lowercase, punctuation dropped except hyphens and underscores, each
space a hyphen, ``-1``, ``-2``, … for repeated headings) or an explicit ``<a id=…>`` / ``<a name=…>``. Links to
other sites (``http:``, ``https:``, ``mailto:``) are not fetched. Code blocks and inline code are not read.

The README's limits (issue 39): at most 300 lines and 25 KB, a Quickstart heading, and at most 3 lines with a date
or a load average (measurements live in docs/results/, one page each).

Pure Python: no torch, no models. ``python tests/test_docs.py`` runs the same checks and prints every problem.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

MAX_README_LINES = 300
MAX_README_BYTES = 25 * 1024
MAX_DATED_LINES = 3
QUICKSTART_HEADING = re.compile(r"^#+ *quick ?start", re.IGNORECASE | re.MULTILINE)
DATED_LINE = re.compile(r"(20[0-9]{2}-[01][0-9]-[0-3][0-9])|load average")

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (an image inside a link)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+[\"'(][^)]*)?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, …


def doc_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for i, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield i, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup reduced to its text, lowercase, every character that is
    not a letter, mark, digit, connector (``_``), hyphen or space dropped, spaces made hyphens."""
    text = _INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("**", "").replace("__", "")
    out = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            out.append("-" if ch == " " else ch)
    return "".join(out)


def anchors(path: Path) -> set[str]:
    """Every anchor a link may name in ``path``: heading slugs (repeats numbered as GitHub does) and HTML ids."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    text = path.read_text(encoding="utf-8")
    for _, line in _prose_lines(text):
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(a.lower() for a in _HTML_ANCHOR.findall(line))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in ``path``'s prose, inline code left out."""
    out = []
    for i, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _REF_DEF.match(line)
        if m:
            out.append((i, m.group(1)))
            continue
        prose = _INLINE_CODE.sub("", line)
        out.extend((i, m.group(1)) for m in _LINK.finditer(prose))
    return out


def broken_links(files: list[Path] | None = None) -> list[str]:
    """One line per link that does not resolve: ``file:line: target: why``."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for path in files or doc_files():
        for line_no, target in links(path):
            target = target.strip("<>")
            where = f"{path.relative_to(ROOT)}:{line_no}: {target}"
            if not target or _EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            file_part = unquote(file_part.split("?")[0])
            if file_part:
                base = ROOT if file_part.startswith("/") else path.parent
                dest = (base / file_part.lstrip("/")).resolve()
                if ROOT != dest and ROOT not in dest.parents:
                    problems.append(f"{where}: outside the repository")
                    continue
                if not dest.exists():
                    problems.append(f"{where}: no such file")
                    continue
            else:
                dest = path
            if anchor:
                if dest.is_dir() or dest.suffix.lower() != ".md":
                    problems.append(f"{where}: an anchor into a file that is not Markdown")
                    continue
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if unquote(anchor).lower() not in cache[dest]:
                    problems.append(f"{where}: no heading or id #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def readme_problems() -> list[str]:
    """Where the README breaks issue 39's limits."""
    data = README.read_bytes()
    text = data.decode("utf-8")
    problems = []
    n_lines = len(text.splitlines())
    if n_lines > MAX_README_LINES:
        problems.append(f"README.md has {n_lines} lines (at most {MAX_README_LINES})")
    if len(data) > MAX_README_BYTES:
        problems.append(f"README.md has {len(data)} bytes (at most {MAX_README_BYTES})")
    if not QUICKSTART_HEADING.search(text):
        problems.append("README.md has no Quickstart heading")
    dated = [f"{i}: {ln}" for i, ln in enumerate(text.splitlines(), 1) if DATED_LINE.search(ln)]
    if len(dated) > MAX_DATED_LINES:
        problems.append(f"README.md has {len(dated)} lines with a date or a load average (at most "
                        f"{MAX_DATED_LINES}; measurements go to docs/results/):\n  " + "\n  ".join(dated))
    return problems


# ---------------------------------------------------------------------------------------------------------------


def test_slug_follows_github():
    assert slug("The feature-level head (`--drafter head`)") == "the-feature-level-head---drafter-head"
    assert slug("Speculation under load: a load-aware policy in minutes") == \
        "speculation-under-load-a-load-aware-policy-in-minutes"
    assert slug("Precision (`--dtype auto`)") == "precision---dtype-auto"
    assert slug("γ ≥ 1.10× the best_fixed") == "γ--110-the-best_fixed"
    assert slug("Use a learned policy in Hugging Face generate()") == "use-a-learned-policy-in-hugging-face-generate"


def test_link_checker_finds_broken_links(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## Part two\n\n## Part two\n")
    a = tmp_path / "a.md"
    a.write_text("[ok](docs/b.md#part-two) [ok](docs/b.md#part-two-1) [ok](#top) [ext](https://x.invalid/y)\n"
                 "# Top\n[bad](docs/c.md) [bad](docs/b.md#nope) [bad](#nowhere)\n"
                 "`[code](docs/none.md)`\n```\n[fenced](docs/none.md)\n```\n")
    problems = broken_links([a])
    assert len(problems) == 3, problems
    assert "docs/c.md: no such file" in problems[0]
    assert "#nope" in problems[1] and "#nowhere" in problems[2]


def test_every_relative_link_and_anchor_resolves():
    problems = broken_links()
    assert not problems, "broken links in README.md / docs/:\n" + "\n".join(problems)


def test_readme_is_a_short_guide():
    problems = readme_problems()
    assert not problems, "\n".join(problems)


def test_docs_have_results_and_guides():
    assert (ROOT / "docs" / "results" / "README.md").is_file()
    assert (ROOT / "docs" / "architecture.md").is_file()
    for guide in ("replay-training", "serving", "trees", "own-models", "gpu-check", "engines", "embedded-pair",
                  "benchmark"):
        assert (ROOT / "docs" / "guides" / f"{guide}.md").is_file(), guide
    index = (ROOT / "docs" / "results" / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs" / "results").glob("*.md") if p.name != "README.md")
    missing = [p for p in pages if f"({p})" not in index]
    assert not missing, f"results pages missing from docs/results/README.md: {missing}"


if __name__ == "__main__":
    found = broken_links() + readme_problems()
    print("\n".join(found) if found else "ok")
    raise SystemExit(1 if found else 0)
