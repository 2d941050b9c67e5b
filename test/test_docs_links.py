"""The documentation's links resolve, and no file of the repository cites a path outside it.

- Every relative link of a Markdown file ([text](target), no scheme) names a file or folder of the
  repository, and a #fragment into a Markdown file names one of its headings (GitHub's slugs).
- docs/DESIGN.md's anchors (`path.py:function`, `path.py:Class.method`) name a file of the package and a
  def / class of that name in it.
- No text file names the team's design folder beside the checkout or an absolute path of the machine a
  file was made on: a user's clone has neither.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", ".pytest_cache"}
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".sh", ".cpp", ".h", ".json", ".jinja", ".yaml", ".yml", ".cfg",
                 ".ini", ".html"}
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
ANCHOR = re.compile(r"`([\w/]+\.(?:py|cpp|h)):([A-Za-z_][\w.]*)`?")
ANCHOR_ROOTS = (ROOT / "python" / "sglang_vericache", ROOT / "sgl-kernel-ext" / "python" / "sgl_kernel_ext", ROOT)
# Spelled in pieces so that this file does not match itself.
OUTSIDE = re.compile("|".join([re.escape(".." + "/shared"), r"(?<![\w.-])" + re.escape("/" + "work/")]))


def repo_files(suffixes: set[str]) -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and path.suffix in suffixes:
            found.append(path)
    return sorted(found)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


def links(md: Path, text: str | None = None) -> list[str]:
    """The link targets of a Markdown file (text: its text, else read), code blocks left out."""
    return LINK.findall(re.sub(r"```.*?```", "", md.read_text() if text is None else text, flags=re.S))


def dead_links(md: Path, text: str | None = None) -> list[str]:
    dead = []
    for target in links(md, text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            dead.append(target)
        elif fragment and dest.suffix == ".md" and fragment not in headings(dest):
            dead.append(target)
    return dead


def test_every_relative_link_of_the_docs_resolves():
    docs = repo_files({".md"})
    assert ROOT / "README.md" in docs and ROOT / "docs" / "DESIGN.md" in docs
    assert sum(len(links(md)) for md in docs) >= 10  # the checker sees the docs' links
    dead = {str(md.relative_to(ROOT)): found for md in docs if (found := dead_links(md))}
    assert dead == {}


def test_design_anchors_name_functions_that_exist():
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    anchors = sorted(set(ANCHOR.findall(text)))
    assert len(anchors) >= 8  # the life of a request and of a round
    missing = []
    for path, name in anchors:
        file = next((r / path for r in ANCHOR_ROOTS if (r / path).is_file()), None)
        source = file.read_text() if file else ""
        if not file or not all(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(n)}\b", source, re.M)
                               for n in name.split(".")):
            missing.append(f"{path}:{name}")
    assert missing == []


def test_no_file_cites_a_path_outside_the_repository():
    cited = [f"{path.relative_to(ROOT)}:{n}" for path in repo_files(TEXT_SUFFIXES)
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert cited == []


@pytest.mark.parametrize("target, ok", [("DESIGN.md", True), ("DESIGN.md#the-life-of-a-request", True),
                                        ("DESIGN.md#no-such-heading", False), ("no_such_file.md", False),
                                        ("https://example.com/x", True), ("../../../etc", False)])
def test_the_checker_tells_dead_links_from_live_ones(target, ok):
    probe = ROOT / "docs" / "probe.md"  # not written: its text is given
    assert (dead_links(probe, f"# Probe\n\n[x]({target})\n") == []) is ok
