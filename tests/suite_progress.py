"""Per-file progress lines for ``scripts/test.sh`` (registered by tests/conftest.py when HF_STRUCTATTN_PROGRESS is set).

In the process that reports (the xdist controller, or the only process without xdist) it prints

    [tests +125s] tests/test_mlr_ops.py: 85 tests (file 12 of 56)
    [tests +151s] tests/test_mlr_ops.py done in 26 s: 85 passed, 0 skipped, 0 failed, 0 subtests passed; 1,234 of
                  3,402 tests done, about 9 min left at this rate      (one line)
    [tests +410s] still running (61 s): tests/conformance/test_gpt2_family.py::...::test_torch_compile

A file's line comes when its first test starts; with two xdist workers two files can be open at once. "still
running" lines (xdist only: in a single process the running test's output capture would swallow them) name every
test that has run for a minute, once a minute. Subtests (``unittest``'s ``subTest``, the ``u`` in pytest's progress)
are counted apart from the tests, as pytest's own closing line counts them.

HF_STRUCTATTN_PROGRESS holds the Unix time the clock starts from (scripts/test.sh's start), or 1 for "now";
HF_STRUCTATTN_PROGRESS_SLOW_S the seconds after which a running test is named (60; tests/test_suite_progress.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, defaultdict

import pytest


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


class SuiteProgress:
    def __init__(self, config, start: float, slow_s: float = 60.0):
        self.config = config
        self.start = start
        self.slow_s = slow_s
        self.lock = threading.Lock()
        self.per_file: dict[str, int] = {}
        self.files_order: list[str] = []
        self.opened: dict[str, float] = {}
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.outcome_of: dict[str, str] = {}  # nodeid -> its outcome so far (failed > skipped > passed)
        self.done_in_file: Counter = Counter()
        self.done = 0
        self.total = 0
        self.subtests = Counter()
        self.running: dict[str, float] = {}  # nodeid -> start time
        self.loop_started: float | None = None
        self.session_started = time.time()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ output
    def _write(self, text: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        line = f"[tests +{time.time() - self.start:.0f}s] {text}"
        with self.lock:
            if reporter is not None:
                if getattr(reporter._tw, "width_of_current_line", 0):
                    reporter._tw.line()  # after the progress characters of pytest -q
                reporter.write_line(line)
            else:
                print(line, flush=True)

    # ------------------------------------------------------------ collection
    def _collected(self, nodeids) -> None:
        if self.total:
            return  # every xdist worker reports the same collection: the first one counts
        per_file = Counter(_file_of(nodeid) for nodeid in nodeids)
        self.per_file = dict(per_file)
        self.files_order = list(dict.fromkeys(_file_of(nodeid) for nodeid in nodeids))
        self.total = sum(per_file.values())
        files = f"{len(per_file)} file{'s' if len(per_file) != 1 else ''}"
        self._write(f"{self.total:,} tests in {files}; a line when each file starts and when it is done "
                    "(subtests, the 'u' in the progress, are counted apart from the tests)")

    def pytest_collection_finish(self, session) -> None:
        if session.items:  # without xdist (the xdist controller collects nothing itself)
            self._collected([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._collected(ids)

    def pytest_sessionstart(self, session) -> None:
        self.session_started = time.time()
        distributed = self.config.pluginmanager.has_plugin("dsession")
        what = "each worker imports" if distributed else "importing"
        self._write(f"collecting the tests: {what} torch, transformers and every test module first")
        if distributed and self.thread is None:
            self.thread = threading.Thread(target=self._watch, name="suite-progress", daemon=True)
            self.thread.start()

    # ----------------------------------------------------------------- tests
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session) -> None:
        self.loop_started = time.time()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        now = time.time()
        with self.lock:
            self.running[nodeid] = now
        path = _file_of(nodeid)
        if path not in self.opened:
            self.opened[path] = now
            index = self.files_order.index(path) + 1 if path in self.files_order else len(self.opened)
            count = self.per_file.get(path)
            self._write(f"{path}: {count if count is not None else '?'} tests (file {index} of "
                        f"{len(self.files_order) or '?'})")

    def pytest_runtest_logreport(self, report) -> None:
        path = _file_of(report.nodeid)
        if type(report).__name__ == "SubtestReport":
            if report.when == "call":
                kind = "passed" if report.passed else "failed" if report.failed else "skipped"
                self.outcomes[path][f"subtests {kind}"] += 1
                self.subtests[kind] += 1
            return
        outcome = None
        if report.failed:
            outcome = "failed"
        elif report.skipped and report.when in ("setup", "call"):
            outcome = "skipped"
        elif report.passed and report.when == "call":
            outcome = "passed"
        rank = ("passed", "skipped", "failed")
        before = self.outcome_of.get(report.nodeid)
        if outcome is not None and (before is None or rank.index(outcome) > rank.index(before)):
            self.outcome_of[report.nodeid] = outcome  # one outcome per test (a teardown error after a pass: failed)
        if report.when != "teardown":
            return
        with self.lock:
            self.running.pop(report.nodeid, None)
        self.outcomes[path][self.outcome_of.pop(report.nodeid, "passed")] += 1
        self.done += 1
        self.done_in_file[path] += 1
        if self.per_file and self.done_in_file[path] == self.per_file.get(path):
            self._file_done(path)

    def _file_done(self, path: str) -> None:
        counts = self.outcomes[path]
        took = time.time() - self.opened.get(path, time.time())
        text = (f"{path} done in {took:.0f} s: {counts['passed']} passed, {counts['skipped']} skipped, "
                f"{counts['failed']} failed, {counts['subtests passed']} subtests passed")
        if counts["subtests failed"]:
            text += f", {counts['subtests failed']} subtests failed"
        text += f"; {self.done:,} of {self.total:,} tests done"
        elapsed = time.time() - (self.loop_started or self.start)
        if self.done < self.total and self.done >= 0.05 * self.total and elapsed > 0:
            text += f", about {_minutes(elapsed / self.done * (self.total - self.done))} left at this rate"
        self._write(text)

    def _watch(self) -> None:
        while not self.stop.wait(self.slow_s / 4):
            now = time.time()
            waited = now - self.session_started
            if not self.total and waited >= self.slow_s and waited % self.slow_s < self.slow_s / 4:
                self._write(f"still collecting ({waited:.0f} s)")
            with self.lock:
                slow = [(nodeid, now - began) for nodeid, began in self.running.items()]
            for nodeid, running_s in slow:
                # once per minute of running: at 60 s, 120 s, ... (the wait above is a quarter of that)
                if running_s >= self.slow_s and running_s % self.slow_s < self.slow_s / 4:
                    self._write(f"still running ({running_s:.0f} s): {nodeid}")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        self.stop.set()
        if self.total:
            self._write(f"{self.done:,} of {self.total:,} tests run; subtests: {self.subtests['passed']:,} passed, "
                        f"{self.subtests['failed']:,} failed (pytest's closing line counts them apart from the tests: "
                        "'N subtests passed')")


def register(config) -> None:
    """Register the progress lines in the reporting process when HF_STRUCTATTN_PROGRESS is set (not in xdist workers,
    whose reports reach the controller)."""
    value = os.environ.get("HF_STRUCTATTN_PROGRESS")
    if not value or value == "0" or hasattr(config, "workerinput"):
        return
    try:
        start = float(value)
    except ValueError:
        start = 0.0
    if start < 1e9:  # "1" or another flag: the clock starts now
        start = time.time()
    slow_s = float(os.environ.get("HF_STRUCTATTN_PROGRESS_SLOW_S") or 60)
    config.pluginmanager.register(SuiteProgress(config, start, slow_s), "hf_structattn_suite_progress")
