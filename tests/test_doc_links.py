"""The manual's links hold: every relative Markdown link in README.md, ARCHITECTURE.md, SECURITY.md and docs/ names a
file or folder that exists, and an anchor into a Markdown file names one of its headings (GitHub's slugs). The README
stays a landing page: at most 200 lines, the two set-up commands, links into docs/."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
SETUP_COMMANDS = {"bash scripts/quickstart.sh", "bash scripts/test.sh"}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets ([`a[0]`](x)), the target no spaces
# except before an optional "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, INLINE_CODE.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lowercased, punctuation other than '-' and '_' dropped,
    spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file's headings get; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link in a file's prose."""
    return [(number, m.group(1)) for number, line in prose_lines(path.read_text(encoding="utf-8"))
            for m in LINK.finditer(line)]


def broken_links(path: Path) -> list[str]:
    """One line per relative link of ``path`` whose file, folder or heading does not exist."""
    problems = []
    for number, target in links(path):
        if not target or target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.name}:{number}: ({target})"
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
            continue
        if anchor and dest.is_file() and dest.suffix.lower() == ".md" and unquote(anchor).lower() not in anchors(dest):
            problems.append(f"{where}: {dest.name} has no heading with the anchor #{anchor}")
    return problems


def doc_files(root: Path) -> list[Path]:
    files = [root / name for name in ("README.md", "ARCHITECTURE.md", "SECURITY.md") if (root / name).exists()]
    return files + sorted((root / "docs").rglob("*.md"))


def test_every_relative_link_resolves():
    files = doc_files(ROOT)
    assert (ROOT / "docs").is_dir() and len(files) > 3, "the manual is missing: expected README.md and docs/*.md"
    problems = [problem for path in files for problem in broken_links(path)]
    assert not problems, "broken links in the manual:\n" + "\n".join(problems)


def test_checker_finds_a_broken_link_and_passes_a_good_one(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# A page\n\n## Remote inference servers\n\n## Reading a run: `sandforge report` and `sandforge show`\n\n"
        "## Twice\n\n## Twice\n\n```\n## not a heading\n```\n"
    )
    (tmp_path / "folder").mkdir()
    good = tmp_path / "good.md"
    good.write_text(
        "[page](docs/page.md) and [a heading](docs/page.md#remote-inference-servers), "
        "[code in one](docs/page.md#reading-a-run-sandforge-report-and-sandforge-show), "
        "[the second Twice](docs/page.md#twice-1), [a folder](folder/), [here](#top), "
        "[out](https://example.com/nowhere.md), [mail](mailto:a@b.c)\n\n# Top\n\n"
        "`[not a link](missing.md)`\n\n```\n[not a link either](missing.md)\n```\n"
    )
    assert broken_links(good) == []
    bad = tmp_path / "bad.md"
    bad.write_text(
        "# Bad\n\n[gone](docs/gone.md)\n[no such heading](docs/page.md#local-servers)\n"
        "[inside a fence](docs/page.md#not-a-heading)\n[no third Twice](docs/page.md#twice-2)\n[self](#nowhere)\n"
    )
    problems = broken_links(bad)
    assert len(problems) == 5, problems
    assert "docs/gone.md does not exist" in problems[0]
    assert "#local-servers" in problems[1] and "#not-a-heading" in problems[2] and "#twice-2" in problems[3]
    assert "#nowhere" in problems[4]


def test_slug_follows_github():
    assert slug("Reading a run: `sandforge report` and `sandforge show`") == \
        "reading-a-run-sandforge-report-and-sandforge-show"
    assert slug("K3 from scratch (configs/k3-scratch.yaml)") == "k3-from-scratch-configsk3-scratchyaml"
    assert slug("Writing an environment; plugins") == "writing-an-environment-plugins"
    assert slug("trainer_ranks and [links](x.md)") == "trainer_ranks-and-links"


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: move the " \
                                           "rest into a page of docs/"
    into_docs = [t for _, t in links(ROOT / "README.md") if t.startswith("docs/")]
    assert into_docs, "README.md links to no page of docs/"
    assert "docs/README.md" in into_docs, "README.md should link the manual's index, docs/README.md"
    scripts = set(re.findall(r"bash scripts/[\w./-]+", text))
    assert scripts == SETUP_COMMANDS, f"README.md's set-up commands should be exactly {sorted(SETUP_COMMANDS)}, " \
                                      f"found {sorted(scripts)}"


def test_docs_index_lists_every_page():
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index) if not t.startswith(EXTERNAL)}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md") if p != index}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - listed)
    assert not missing, f"docs/README.md does not list: {missing}"
