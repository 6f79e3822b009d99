"""The conformance harness itself: the sdist fetch fails loudly, never by skipping."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_failed_fetch_raises_with_pip_error(tmp_path):
    """With an empty cache and an index that cannot be reached, loading transformers' test modules raises an error
    that names the download and pip's own message (the conformance tests then fail at collection)."""
    env = {**os.environ, "HF_STRUCTATTN_CACHE": str(tmp_path / "cache"), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "3"}
    result = subprocess.run([sys.executable, str(HERE / "upstream.py")], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "could not download the transformers==" in result.stderr
    assert "No matching distribution" in result.stderr or "transformers" in result.stderr.splitlines()[-1]
    # nothing half-extracted is left to be mistaken for a complete download on the next run
    version_dir = next((tmp_path / "cache").glob("transformers-*"))
    assert list(version_dir.iterdir()) == []


def test_loaded_modules_are_the_installed_versions_sdist():
    """The mixins come from the cached sdist of the installed transformers, completed by our stand-ins."""
    import transformers

    from .upstream import module, upstream_tests_dir

    common = module("test_modeling_common")
    assert Path(common.__file__).parent == upstream_tests_dir()
    assert upstream_tests_dir().parent.name == f"transformers-{transformers.__version__}"
    from .generation_tester import GenerationTesterMixin

    assert common.GenerationTesterMixin is GenerationTesterMixin
