"""scripts/test.sh's progress lines (tests/suite_progress.py): a line when each file starts and when it is done, with
its counts and subtests apart, and a line for a test that runs long; in one process and from the xdist controller.
Each case runs pytest in a fresh process on a small folder of tests made here."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

FILES = {
    "conftest.py": f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from suite_progress import register

def pytest_configure(config):
    register(config)
""",
    "test_with_subtests.py": """
import unittest

import pytest


class WithSubtests(unittest.TestCase):
    def test_three_subtests(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertGreaterEqual(i, 0)


def test_plain():
    pass


@pytest.mark.skip(reason="shown as skipped")
def test_skipped():
    pass
""",
    "test_slow_one.py": """
import time


def test_sleeps():
    time.sleep(2.5)


def test_fails():
    assert 1 == 2
""",
}


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HF_STRUCTATTN_"))}
    env.update(HF_STRUCTATTN_PROGRESS="1", HF_STRUCTATTN_PROGRESS_SLOW_S="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           *args, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.parametrize("workers", [None, "2"], ids=["one-process", "xdist"])
def test_each_file_gets_a_start_and_a_done_line_with_subtests_counted_apart(tmp_path, workers):
    if workers:
        pytest.importorskip("xdist")
    result = _run(tmp_path, *(["-n", workers] if workers else []))
    out = result.stdout
    assert result.returncode == 1, out + result.stderr  # test_fails fails
    assert re.search(r"^\[tests \+\d+s\] 5 tests in 2 files;", out, re.M), out
    assert re.search(r"^\[tests \+\d+s\] test_with_subtests\.py: 3 tests \(file \d of 2\)$", out, re.M), out
    assert re.search(r"^\[tests \+\d+s\] test_with_subtests\.py done in \d+ s: 2 passed, 1 skipped, 0 failed, "
                     r"3 subtests passed; \d of 5 tests done", out, re.M), out
    assert re.search(r"^\[tests \+\d+s\] test_slow_one\.py done in \d+ s: 1 passed, 0 skipped, 1 failed, "
                     r"0 subtests passed;", out, re.M), out
    assert re.search(r"^\[tests \+\d+s\] 5 of 5 tests run; subtests: 3 passed, 0 failed", out, re.M), out
    # pytest's own closing line counts the subtests apart from the tests, as the README says
    assert re.search(r"1 failed, 3 passed, 1 skipped, 3 subtests passed", out), out
    if workers:  # the controller names a test that has run past the threshold (1 s here, a minute in test.sh)
        assert re.search(r"^\[tests \+\d+s\] still running \(\d+ s\): test_slow_one\.py::test_sleeps$", out, re.M), out


def test_without_the_variable_pytest_prints_no_progress_lines(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HF_STRUCTATTN_"))}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                             str(tmp_path), str(tmp_path / "test_with_subtests.py")], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[tests " not in result.stdout
