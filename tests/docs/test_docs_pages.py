"""Every ```python block of README.md and docs/ runs, so the pages never rot.

A page's blocks run in order in one fresh namespace (a page reads top to bottom), on the
8 simulated CPU devices of conftest.py. A block preceded by ``<!-- skip: REASON -->`` is
not run (it needs several processes, a TPU, a cluster...); the reasons are reported, and a
skip without a reason fails. The example scripts shown whole on docs/examples/scripts.md are
fenced as ```{.python .no-run} (the suite runs them as scripts); any other Python fence fails.
"""

import gc
import re
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_OPEN = re.compile(r"^```python\s*$")
_CLOSE = re.compile(r"^```\s*$")
_SKIP = re.compile(r"^<!--\s*skip:(.*?)-->\s*$")


class Block:
    def __init__(self, page, line, source, skip_reason):
        self.page, self.line, self.source, self.skip_reason = page, line, source, skip_reason

    def __repr__(self):
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def extract_blocks(page: Path) -> list[Block]:
    """The page's ```python blocks, each with its first line and skip reason (or None)."""
    lines = page.read_text().splitlines()
    blocks, index, previous = [], 0, ""
    while index < len(lines):
        line = lines[index]
        if _OPEN.match(line):
            start = index + 1
            end = start
            while end < len(lines) and not _CLOSE.match(lines[end]):
                end += 1
            assert end < len(lines), f"{page}:{index + 1}: a ```python block is never closed"
            skip = _SKIP.match(previous.strip())
            source = "\n".join(lines[start:end]) + "\n"
            blocks.append(Block(page, start + 1, source, skip.group(1).strip() if skip else None))
            index = end + 1
            previous = ""
            continue
        if line.strip():
            previous = line
        index += 1
    return blocks


def test_the_collector_finds_blocks_and_skips(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text\n\n```python\nx = 1\n```\n\n<!-- skip: needs several processes -->\n"
        "```python\nraise SystemExit\n```\n\n```sh\nls\n```\n\n```python\ny = x + 1\n```\n"
    )
    blocks = extract_blocks(page)
    assert [b.source for b in blocks] == ["x = 1\n", "raise SystemExit\n", "y = x + 1\n"]
    assert [b.skip_reason for b in blocks] == [None, "needs several processes", None]
    assert [b.line for b in blocks] == [4, 9, 17]


_FENCES_WE_KNOW = ("python", "{.python .no-run}")


def _unknown_python_fence(line: str) -> bool:
    info = line[3:].strip() if line.startswith("```") else ""
    return info.startswith(("py", "{.py")) and info not in _FENCES_WE_KNOW


def test_every_python_fence_is_one_the_collector_knows():
    odd = [
        f"{page.relative_to(ROOT)}:{number}: {line}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if _unknown_python_fence(line)
    ]
    assert odd == [], "write ```python (run) or ```{.python .no-run} (shown only)"
    assert [_unknown_python_fence(f) for f in ("```py", "```python3", "```{.python}")] == [True] * 3
    assert not any(_unknown_python_fence(f) for f in ("```python", "```{.python .no-run}", "```sh"))


def test_the_docs_have_code_to_run():
    runnable = [b for page in PAGES for b in extract_blocks(page) if b.skip_reason is None]
    assert len(runnable) >= 40, f"only {len(runnable)} runnable blocks in the docs"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_runs(page, capsys):
    blocks = extract_blocks(page)
    namespace = {"__name__": "__docs__"}
    skipped = []
    started = time.perf_counter()
    try:
        for block in blocks:
            if block.skip_reason is not None:
                assert block.skip_reason, f"{block}: a skipped block must say why"
                skipped.append(f"{block}: {block.skip_reason}")
                continue
            code = compile(block.source, str(block), "exec")
            try:
                exec(code, namespace)
            except Exception as error:
                raise AssertionError(f"the block at {block} failed: {error!r}") from error
    finally:
        # The page's functions hold its namespace (their globals): break the cycle,
        # so its models, iterators and read-ahead threads go now, not at some later
        # collection inside another test.
        namespace.clear()
        gc.collect()
    with capsys.disabled():
        if skipped:
            print(f"\n{page.relative_to(ROOT)}: not run: " + "; ".join(skipped))
    elapsed = time.perf_counter() - started
    assert elapsed < 40, f"{page.relative_to(ROOT)}'s blocks took {elapsed:.0f} s: keep them small"
