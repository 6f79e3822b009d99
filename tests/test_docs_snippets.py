"""Every Python snippet in README.md, docs/*.md and recipes/README.md runs as written.

A document's ```python blocks run in order in one fresh interpreter (a later block may use what an earlier block of
the same document defined, as a reader would), in an empty temporary folder, offline, with the checkout importable.
A snippet that needs a model builds a tiny one locally; nothing is downloaded."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
PRINTED = re.compile(r"^[ \t]*print\(.*?\)[ \t]+#[ \t]*(\S.*?)[ \t]*$", re.M)  # print(...)  # what it prints


def python_blocks(path: Path) -> list:
    return BLOCK.findall(path.read_text())


WITH_SNIPPETS = [path for path in DOCUMENTS if python_blocks(path)]


def test_the_documents_with_snippets_are_found():
    assert ROOT / "README.md" in WITH_SNIPPETS


@pytest.mark.parametrize("path", WITH_SNIPPETS, ids=lambda path: str(path.relative_to(ROOT)))
def test_python_snippets_run_as_written(path, tmp_path):
    blocks = python_blocks(path)
    program = "\n".join(f"# --- block {index + 1} of {path.name}\n{block}" for index, block in enumerate(blocks))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"{path.name}: {result.stderr[-3000:]}"
    if path.name == "README.md":  # the README shows what it prints: each commented print's output appears as written
        for expected in PRINTED.findall(program):
            assert expected in result.stdout, (expected, result.stdout[-2000:])
