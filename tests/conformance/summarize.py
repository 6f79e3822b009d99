"""Per-class summary of a conformance run from pytest's JUnit XML (used to write FAILURES.md).

    python -m pytest tests/conformance --junitxml=conformance.xml -p no:cacheprovider
    python tests/conformance/summarize.py conformance.xml > summary.md
"""

import re
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter, defaultdict


def one_line(text: str) -> str:
    """The first informative line of a failure message (assertion text or exception), trimmed."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[0] if lines else ""
    line = re.sub(r"\s+", " ", line)
    return line[:240]


def summarize(path: str) -> str:
    tree = ElementTree.parse(path)
    results = defaultdict(lambda: {"passed": 0, "skipped": Counter(), "failed": []})
    for case in tree.iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name")
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            results[cls]["failed"].append((name, one_line(problem.get("message") or problem.text)))
        elif skipped is not None:
            results[cls]["skipped"][one_line(skipped.get("message"))] += 1
        else:
            results[cls]["passed"] += 1
    out = ["| class | passed | skipped | failed |", "|---|---:|---:|---:|"]
    for cls, result in results.items():
        out.append(f"| {cls} | {result['passed']} | {sum(result['skipped'].values())} | {len(result['failed'])} |")
    for cls, result in results.items():
        out.append(f"\n## {cls}\n")
        out.append("Skipped:")
        for reason, count in result["skipped"].most_common():
            out.append(f"- {count} x {reason}")
        out.append("\nFailed:")
        for name, message in result["failed"]:
            out.append(f"- `{name}`: {message}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
