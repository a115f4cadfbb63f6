"""The README and docs/ stay true: every ```python block runs on its own in a fresh Python process
on CPU (its own imports and inputs), every local link points at a file, and benchmarks/results/
holds exactly the runs they cite. ```bash blocks are not run."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"


def python_blocks(path: pathlib.Path):
    """[(line of the opening fence, code)] of the ```python blocks of a Markdown file (fences may
    be indented, as inside a list item; the code is dedented by the fence's indent)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```python\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, start = m.group(1), i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{path.name}:{start}: unclosed ```python block"
        code = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[start:end]]
        blocks.append((start, "\n".join(code) + "\n"))
        i = end + 1
    return blocks


BLOCKS = [
    pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}")
    for path in DOCS
    for line, code in python_blocks(path)
]


def test_blocks_are_found():
    """The extractor sees the README's examples and the docs' (a broken fence would hide them)."""
    ids = [p.id for p in BLOCKS]
    assert sum(i.startswith("README.md:") for i in ids) >= 4, ids
    assert any(i.startswith("docs/") for i in ids), ids


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_on_its_own(code, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,  # a fresh process, away from the source tree; files it writes go here
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"


def _local_links(text: str):
    """Targets of Markdown links that are paths in the repository (no URL, no anchor only)."""
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
            yield target.split("#")[0]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(path):
    missing = [t for t in _local_links(path.read_text()) if not (path.parent / t).exists()]
    assert not missing, missing


def _tracked_results():
    try:
        out = subprocess.run(
            ["git", "ls-files", "benchmarks/results"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked result files are unknown")
    return sorted(pathlib.Path(p).name for p in out.split())


def test_results_are_the_cited_runs():
    """benchmarks/results/ keeps what README.md and docs/ cite (a run as `kind_*_STAMP`, or a
    file by name) and the notes; every cited run is there."""
    text = "\n".join(p.read_text() for p in DOCS)
    stamps = set(re.findall(r"`(prefill|decode|e2e)_\*_(\d{8}T\d{6})`", text))
    files = _tracked_results()
    for kind, stamp in stamps:
        assert any(f.startswith(kind + "_") and stamp in f for f in files), (kind, stamp)
    for f in files:
        cited = f in text or any(f.startswith(k + "_") and s in f for k, s in stamps)
        assert cited or f.startswith("NOTES-"), f"{f} is cited nowhere: git rm it"
        assert f.endswith((".json", ".png", ".md")), f"{f}: runs keep JSON and PNG only"
