"""The documentation: the README stays short and true to CI, the docs site builds with no broken link or anchor,
and measurements stay on the two pages that hold them.

The runnable examples inside the pages are executed by tests/serve/test_doc_examples.py; the generated
configuration page is checked by test_config_reference.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: the only pages that may carry measured figures, dates and history
MEASUREMENT_PAGES = {"benchmarks.md", "experiments.md"}
SERVE_COMMAND = "bash scripts/setup.sh && .venv/bin/specray serve"
TEST_COMMAND = "bash scripts/setup.sh --dev && .venv/bin/python -m pytest -q"

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")
#: a measured figure: a speed ratio (0.95x, 1.3x), a time in ms, or a rate in tok/s
_FIGURE = re.compile(r"\b\d+(\.\d+)?x\b|\b\d+(\.\d+)?\s?ms\b|\b\d+(\.\d+)?\s?tok/s\b")
_HISTORY = re.compile(r"\b[Ii]ssue [0-9]+|\b[Ss]top [0-9]+|\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown text outside fenced code blocks.

    >>> prose_lines("a\\n```\\nb\\n```\\nc")
    [(1, 'a'), (5, 'c')]
    """
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def anchors(text: str) -> set[str]:
    """The heading anchors MkDocs gives a page (Python-Markdown's toc slugify, duplicates numbered).

    >>> sorted(anchors("# A/B arms\\n## Prompt cache\\n## Prompt cache"))
    ['ab-arms', 'prompt-cache', 'prompt-cache_1']
    """
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"`([^`]*)`", r"\1", m.group(2))
        slug = slugify(title, "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}_{n}")
    return out


def test_readme_is_short_and_keeps_the_two_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert f"```bash\n{SERVE_COMMAND}\n```" in text
    assert f"```bash\n{TEST_COMMAND}\n```" in text


def test_ci_runs_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci


def test_readme_links_point_at_files_and_headings_that_exist():
    text = README.read_text()
    links = [m.group(1) for _, line in prose_lines(text) for m in _LINK.finditer(line)]
    local = [link for link in links if not re.match(r"[a-z]+://|mailto:", link)]
    assert any(link.startswith("docs/") for link in local), "the README links into the docs"
    for link in local:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), f"README links to {link}, which does not exist"
        if anchor:
            assert anchor in anchors(target.read_text()), f"README links to {link}: no such heading"


def _pages_without_measurements() -> list[Path]:
    return [README] + [p for p in sorted(DOCS.glob("*.md")) if p.name not in MEASUREMENT_PAGES]


@pytest.mark.parametrize("page", _pages_without_measurements(), ids=lambda p: p.name)
def test_no_figure_date_or_history_outside_the_measurement_pages(page: Path):
    bad = [f"{page.name}:{i}: {line.strip()}" for i, line in prose_lines(page.read_text())
           if _FIGURE.search(line) or _HISTORY.search(line)]
    assert not bad, "figures belong in docs/benchmarks.md, history in docs/experiments.md:\n" + "\n".join(bad)


def test_code_cites_no_issue_or_stop():
    dirs = ["engine", "deployments", "native", "bench", "cli", "train"]
    out = subprocess.run(["grep", "-rnE", r"[Ii]ssue [0-9]+|stop [0-9]+", "--include=*.py", *dirs],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1, out.stdout


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.glob("*.md"):
        assert f" {page.name}\n" in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict` with anchor validation on: a broken page link or heading anchor fails."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").exists()
