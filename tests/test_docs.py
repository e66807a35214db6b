"""The README is a front door and every page it leads to exists: relative links in README.md and
docs/*.md resolve (files, and #anchors to a heading of the target page), the README stays short,
its CI test block is where .ci/run reads it, and every subcommand has its page."""
import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images excluded
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", text)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if ROOT in dest.parents else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links: {broken_links(page)}"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): "
                                            f"move the detail to a page under docs/")


def test_readme_has_the_ci_test_block_that_ci_runs():
    text = (ROOT / "README.md").read_text()
    block = re.findall(r"<!-- ci:test -->\n```bash\n(.+?)\n```\n<!-- /ci:test -->", text, re.S)
    assert len(block) == 1 and "python -m pytest" in block[0] and "\n" not in block[0]


def test_every_subcommand_has_its_page_linked_from_the_readme():
    import argparse

    from rlperf.cli import build_parser

    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    readme = (ROOT / "README.md").read_text()
    for name in action.choices:
        assert (ROOT / "docs" / f"{name}.md").exists(), f"rlperf {name} has no docs/{name}.md"
        assert f"(docs/{name}.md)" in readme, f"README.md does not link docs/{name}.md"


def test_the_default_runs_time_is_one_number_in_the_readme_docs_and_help():
    """`rlperf train --help`, the README and docs/train.md state the one measured wall time of the default run."""
    from rlperf.cli import build_parser

    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    help_text = " ".join(action.choices["train"].description.split())
    (seconds,) = re.findall(r"\((\d+) s on an idle 2-core", help_text)
    readme = " ".join((ROOT / "README.md").read_text().split())
    train = " ".join((ROOT / "docs" / "train.md").read_text().split())
    assert f"took {seconds} s in all" in readme and f"took {seconds} s of wall time" in train
    assert not re.search(r"under a minute|\b69 s\b", readme + train + help_text)


def test_every_docs_page_has_the_one_nav_bar_naming_every_page():
    """The line under each page's title links the README and every page of docs/ (a page added without
    joining the bar, or a bar left behind, fails here)."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    bars = {}
    for page in docs:
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and lines[1] == "", f"{page.name}: a title, then a blank line"
        bars[page.name] = lines[2]
    assert len(set(bars.values())) == 1, {k: v[:60] for k, v in bars.items()}
    (bar,) = set(bars.values())
    targets = relative_links(bar)
    assert targets[0] == "../README.md" and sorted(targets[1:]) == sorted(p.name for p in docs), targets


def test_the_link_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Some `code` part\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md) [ok](docs/a.md#some-code-part) [web](https://x.org/y) ![img](nope.png)\n"
                    "[gone](docs/b.md) [bad](docs/a.md#nowhere)\n```\n[in code](docs/c.md)\n```\n")
    missing_file, missing_heading = broken_links(page)  # exactly these two: code blocks, URLs, images skipped
    assert missing_file.startswith("docs/b.md (no file ") and missing_file.endswith("docs/b.md)")
    assert missing_heading == "docs/a.md#nowhere (no heading #nowhere in a.md)"
