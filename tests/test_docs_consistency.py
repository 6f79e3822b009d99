"""The documents agree with each other and describe the project as it is now.

* every number in README.md's tables appears in the docs section the table row links to (or, for a table without
  links, in the section named in ``UNLINKED_TABLES``), so the README cannot drift from the pages it summarises;
* every link from README.md into docs/ names an existing section;
* no document (README.md, docs/*.md, recipes/README.md) names a commit hash, an absolute path of a machine or a UTC
  launch time: history lives in CHANGELOG.md, and a reader's checkout is not ours;
* README's Layout names every file of the checkpoint payload (hf_structattn/modeling/) and none that is gone.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCUMENTS = [README, ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# a measured number: 2,007  0.80 (of 0.80x)  1024  0.76 and 0.87 (of 0.76-0.87x); not the digits of names (T5, GPT-2,
# Llama-3.2-1B, Qwen2/3, paper §4); single digits (6 layers) are not checked
NUMBER = re.compile(r"(?<![\w.§/])(?<![A-Za-z]-)\d[\d,]*(?:\.\d+)?(?![A-Za-wyz\d])")
LINK = re.compile(r"\]\((docs/[\w.-]+\.md)#([\w-]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$", re.M)
# README tables that link nowhere: the docs section that holds their numbers
UNLINKED_TABLES = {"Quick start": ("docs/benchmarks.md", "the-main-job")}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_\[\]()]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def sections(path: Path) -> dict:
    """anchor -> the text from that heading to the next heading of the same or a higher level."""
    text = path.read_text()
    headings = list(HEADING.finditer(text))
    out = {}
    for index, match in enumerate(headings):
        level = len(match.group(1))
        end = next((later.start() for later in headings[index + 1:] if len(later.group(1)) <= level), len(text))
        out[slug(match.group(2))] = text[match.start():end]
    return out


def numbers(text: str) -> set:
    return {number.replace(",", "") for number in NUMBER.findall(text) if len(number) > 1}


def readme_tables() -> list:
    """(README section heading, rows) of every markdown table in README.md; rows are lines, separator omitted."""
    tables, heading, rows = [], None, []
    for line in README.read_text().splitlines() + [""]:
        if line.startswith("## "):
            heading = line[3:].strip()
        if line.startswith("|"):
            if not re.fullmatch(r"\|[\s:|-]+\|", line):
                rows.append(line)
        elif rows:
            tables.append((heading, rows))
            rows = []
    return tables


def test_readme_tables_are_found():
    headings = [heading for heading, _ in readme_tables()]
    assert "At a glance" in headings and "Quick start" in headings


@pytest.mark.parametrize("heading, rows", readme_tables(), ids=lambda value: value if isinstance(value, str) else "")
def test_every_number_of_a_readme_table_is_in_the_section_it_links_to(heading, rows):
    cached = {}
    for row in rows[1:]:  # the first row is the header
        links = LINK.findall(row)
        if links:
            targets = links
        elif numbers(re.sub(r"`[^`]*`", "", row)) and heading in UNLINKED_TABLES:
            targets = [UNLINKED_TABLES[heading]]
        elif numbers(re.sub(r"`[^`]*`", "", row)):
            pytest.fail(f"README table under '{heading}' has numbers but links to no docs section: {row}")
        else:
            continue
        text = "".join(sections(cached.setdefault(doc, ROOT / doc)).get(anchor, "") for doc, anchor in targets)
        assert text, f"{targets}: no such section (README row: {row})"
        # the numbers of the row's content, not of its link targets or inline code (commands, field names)
        content = re.sub(r"\[[^\]]*\]\([^)]*\)", "", row)
        content = re.sub(r"`[^`]*`", "", content)
        missing = sorted(numbers(content) - numbers(text), key=len)
        assert not missing, f"README '{heading}' row {row!r}: {missing} not in {targets}"


def test_every_readme_link_into_docs_names_an_existing_section():
    for doc, anchor in LINK.findall(README.read_text()):
        assert anchor in sections(ROOT / doc), f"README links to {doc}#{anchor}, which has no such heading"


COMMIT_HASH = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/-])")
ABSOLUTE_PATH = re.compile(r"(?<![\w.~])/(?:work|home|root|tmp|Users|mnt|scratch|data)/")
UTC_TIME = re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\b[^\n]{0,25}\bUTC\b|\bUTC\b[^\n]{0,5}\d{1,2}:\d{2}")


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_document_names_a_commit_an_absolute_path_or_a_launch_time(path):
    text = path.read_text()
    found = []
    for what, pattern in (("commit hash", COMMIT_HASH), ("absolute path", ABSOLUTE_PATH), ("UTC time", UTC_TIME)):
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.name}:{line}: {what} {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_look_for():
    assert COMMIT_HASH.search("the payload before the lane (`d36bec2`)")
    assert not COMMIT_HASH.search("ranks 32|8|6|4, 2,754 passed, sha-free text, deadbeef-like words, 1234567")
    assert ABSOLUTE_PATH.search("Command (from /work/main): python x.py") and not ABSOLUTE_PATH.search("~/.cache/x")
    assert UTC_TIME.search("Wall time 8 s (14:12:46 - 14:12:54 UTC)") and not UTC_TIME.search("ratio 1:2 in UTC+0")
    assert slug("Decode, eager and static cache") == "decode-eager-and-static-cache"
    assert slug("A real checkpoint from the Hub, step by step") == "a-real-checkpoint-from-the-hub-step-by-step"
    assert numbers("0.76-0.87x at 2,007 tokens") == {"0.76", "0.87", "2007"}
    assert numbers("Llama-3.2-1B shape, T5, GPT-2, Qwen2/3, paper §4, 6 layers x 512, 1.49x") == {"512", "1.49"}


def test_readme_layout_names_every_payload_file():
    text = README.read_text()
    layout = text[text.index("## Layout"):]
    listed = set(re.findall(r"^\s+(\w+\.py)\s", layout.split("hf_structattn/\n")[0], re.M))
    payload = {path.name for path in (ROOT / "hf_structattn" / "modeling").glob("*.py")}
    assert listed == payload, (f"in hf_structattn/modeling/ but not in README's Layout: {sorted(payload - listed)}; "
                               f"in the Layout but gone: {sorted(listed - payload)}")
