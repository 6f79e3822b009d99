"""The documents agree with each other and describe the project as it is now.

* every number in README.md's tables appears in the docs section the table row links to (or, for a table without
  links, in the section named in ``UNLINKED_TABLES``), so the README cannot drift from the pages it summarises;
* every link from README.md into docs/ names an existing section;
* no document (README.md, docs/*.md, recipes/README.md) names a commit hash, an absolute path of a machine or a UTC
  launch time: history lives in CHANGELOG.md, and a reader's checkout is not ours;
* README's Layout names every file of the checkpoint payload (hf_structattn/modeling/) and none that is gone;
* a quantity that several documents quote (``QUANTITIES``: a measured ratio and every place that repeats it) has the
  same number everywhere, the number of the measured table;
* every ``--flag`` given to a recipe (``recipes/NAME.py ...``) in the documents' code (blocks and inline code, the
  comment lines that continue a recipe command included) and in ``scripts/*.sh`` (through the variables and
  functions a recipe command expands) is one the recipe's argument parser accepts;
* docs/config_reference.md is what ``scripts/config_reference.py`` generates from the config classes, lists every
  config field, and describes every ``mlr_*`` field a patched decoder's config gets or its code reads.
"""

import importlib
import re
import sys
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



# ---------------------------------------------------------------- one quantity, one number in every document
# (name, the numbers, {document: [pattern, ...]}): each pattern matches its document exactly once (a space in a pattern
# matches any run of whitespace, so a quote may wrap) and its groups are the numbers as that document gives them. The
# first place named is the measured table, whose command the table's section names; the others repeat it.
QUANTITIES = [
    ("patched Llama eager decode / stock at prompts 512 and 2048 (benchmarks/bench_decoder_patching.py)",
     ("1.15", "0.91"), {
         "docs/benchmarks.md": [r"\| 512 \| MLR \| [\d.]+ \| [\d.]+ \| \*\*([\d.]+)x\*\* \|.*?"
                                r"\| 2048 \| MLR \| [\d.]+ \| [\d.]+ \| \*\*([\d.]+)x\*\* \|",
                                r"patched Llama eager decode vs stock \| ([\d.]+)x at prompt 512, ([\d.]+)x at 2048"],
         "docs/patching.md": [r"decode ([\d.]+)x stock at prompt 512 and ([\d.]+)x at 2048"],
         "README.md": [r"([\d.]+)x stock for a patched 4-layer Llama at prompt 512 \(([\d.]+)x at 2048\)"],
     }),
    ("the main job's decode / dense (scripts/run.sh, scripts/compare_runs.py)", ("1.26",), {
        "docs/benchmarks.md": [r"## The main job.*?\| mlr \| [\d.]+ \| [\d,]+ \| [^|]+ \| ([\d.]+) \[",
                               r"decode ([\d.]+)x dense \(Intel Xeon VM\) \| \[The main job\]"],
        "README.md": [r"\| mlr \| [\d.]+ \| [\d,]+ \| [^|]+ \| ([\d.]+) \[",
                      r"([\d.]+)x on the main job's 4-layer, 128-wide model",
                      r"([\d.]+)x dense on the main job's 4-layer 128-wide model"],
    }),
    ("the main job's validation bits/byte, dense and MLR (scripts/run.sh)", ("3.499", "3.182"), {
        "docs/benchmarks.md": [r"## The main job.*?\| dense \| ([\d.]+) \|.*?\| mlr \| ([\d.]+) \|",
                               r"against ([\d.]+) and ([\d.]+) here\)",
                               r"MLR (?P<b>[\d.]+) vs dense (?P<a>[\d.]+) bits/byte after 500 steps"],
        "README.md": [r"\| dense \| ([\d.]+) \|.*?\| mlr \| ([\d.]+) \|"],
    }),
    ("the fused MLR op, forward + backward / SDPA at T = 1024 and 4096 (benchmarks/bench_attention.py)",
     ("1.20", "0.96"), {
         "docs/benchmarks.md": [r"\*\*forward \+ backward: ms.*?\| MLR fused [^|]*\| [^|]*\(([\d.]+)x\) \| "
                                r"[^|]*\(([\d.]+)x\) \|",
                                r"forward \+ backward vs SDPA \| MLR ([\d.]+)x at T = 1024, ([\d.]+)x at 4096"],
         "README.md": [r"at 4096; forward \+ backward ([\d.]+)x and ([\d.]+)x"],
     }),
]


def quoted_numbers(text: str, pattern: str) -> list:
    """The numbers each match of ``pattern`` quotes (named groups a, b, ... in that order, else the groups in order)."""
    found = []
    for match in re.finditer(pattern.replace(" ", r"\s+"), text, re.S):
        named = match.groupdict()
        found.append(tuple(named[key] for key in sorted(named)) if named else match.groups())
    return found


@pytest.mark.parametrize("name, value, places", QUANTITIES, ids=[quantity[0].split(" (")[0] for quantity in QUANTITIES])
def test_a_quantity_quoted_in_several_documents_has_one_number(name, value, places):
    problems = []
    for doc, patterns in places.items():
        text = (ROOT / doc).read_text()
        for pattern in patterns:
            found = quoted_numbers(text, pattern)
            if len(found) != 1:
                problems.append(f"{doc}: {len(found)} quotes of {name!r} in the registered form {pattern!r} (update "
                                f"the pattern in QUANTITIES if the sentence was reworded)")
            elif found[0] != value:
                problems.append(f"{doc} gives {name} as {', '.join(found[0])}, the measured table {', '.join(value)}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- recipe flags in the documents and the scripts
RECIPE = re.compile(r"recipes/(\w+)\.py")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]*recipes/\w+\.py[^`\n]*)`(?!`)")
COMMAND_END = re.compile(r"\s(?:\||;|&&|\d?>)\s")
# a flag a document gives that the recipe refuses, left for the document's owner: (document, recipe, flag). The test
# below fails once the document no longer has it, so that the exemption goes too.
KNOWN_REFUSED: set = set()


def recipe_options(recipe: str) -> set:
    """Every option string the recipe's argument parser accepts (``--max_steps`` and ``--max-steps``, ``--config``)."""
    from hf_structattn.training.args import RecipeArgumentParser

    source = (ROOT / "recipes" / f"{recipe}.py").read_text()
    module = importlib.import_module("hf_structattn.training." + re.search(r'run_recipe\("(\w+)"', source).group(1))
    classes = re.search(r"parse_recipe_args\((\w+), (\w+)", Path(module.__file__).read_text()).groups()
    parser = RecipeArgumentParser([getattr(module, name) for name in classes])
    return set(parser._option_string_actions)


def flags_after_recipes(text: str) -> list:
    """(recipe, flag) for each ``--flag`` after ``recipes/NAME.py`` on a command line of ``text`` (a code block or
    inline code; backslash continuations joined), and on the comment lines right after such a command, which a doc
    uses to list more arguments of it (``# mlr: --attention mlr ...``); another command ends the recipe's lines."""
    found, current = [], None
    for line in text.replace("\\\n", " ").splitlines():
        calls = list(RECIPE.finditer(line))
        if calls:
            current = calls[-1].group(1)
            for index, call in enumerate(calls):
                end = calls[index + 1].start() if index + 1 < len(calls) else len(line)
                rest = COMMAND_END.split(line[call.end():end])[0]
                found += [(call.group(1), "--" + flag.split("=")[0]) for flag in FLAG.findall(rest)]
        elif current and line.lstrip().startswith("#"):
            found += [(current, "--" + flag.split("=")[0]) for flag in FLAG.findall(line)]
        elif line.strip():
            current = None
    return found


def document_recipe_flags(text: str) -> list:
    blocks = [body for language, body in FENCE.findall(text) if language != "python"]
    spans = INLINE.findall(FENCE.sub("", text))
    return [pair for part in blocks + spans for pair in flags_after_recipes(part)]


SHELL_STRING = r'"(?:\\.|[^"\\])*"|' + r"'[^']*'"


def _balanced(code: str, start: int) -> str:
    depth = 0
    for index in range(start, len(code)):
        depth += {"(": 1, ")": -1}.get(code[index], 0)
        if depth == 0:
            return code[start:index + 1]
    return code[start:]


def shell_expansions(text: str, code: str, seen: set) -> list:
    """The values assigned to the variables (``NAME=...``, ``local NAME=...``, ``NAME[key]=...``, ``NAME=( ... )``)
    and the bodies of the functions (``$(name ...)``) that ``text`` expands, recursively."""
    out = []
    for name in re.findall(r"\$\{?\(?(\w+)", text):
        if name in seen:
            continue
        seen.add(name)
        values = []
        for match in re.finditer(rf"(?:^|[\s;])(?:local\s+)?{name}(?:\[[^\]]*\])?=", code, re.M):
            rest = code[match.end():]
            quoted = re.match(SHELL_STRING, rest)
            values.append(quoted.group(0) if quoted else _balanced(rest, 0) if rest.startswith("(") else
                          rest.split(None, 1)[0] if rest.strip() else "")
        values += re.findall(rf"^{name}\(\)\s*\{{(.*?)^\}}", code, re.M | re.S)
        for value in values:
            out += [value] + shell_expansions(value, code, seen)
    return out


def shell_recipe_flags(text: str) -> list:
    """(recipe, flag) for every ``--flag`` a recipe command of a shell script gets: on its line, and in the variables
    and functions that line expands (comments dropped)."""
    code = "\n".join(re.sub(r"(^|\s)#\s.*$", "", line) for line in text.splitlines()
                     if not line.lstrip().startswith("#")).replace("\\\n", " ")
    found = []
    for line in code.splitlines():
        for call in RECIPE.finditer(line):
            rest = COMMAND_END.split(line[call.end():])[0]
            words = [rest] + shell_expansions(rest, code, set())
            found += [(call.group(1), "--" + flag.split("=")[0]) for word in words for flag in FLAG.findall(word)]
    return found


RECIPE_SOURCES = [*DOCUMENTS, *sorted((ROOT / "scripts").glob("*.sh"))]


@pytest.mark.parametrize("path", RECIPE_SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_recipe_flag_in_the_docs_and_scripts_is_one_the_recipe_accepts(path):
    text = path.read_text()
    pairs = shell_recipe_flags(text) if path.suffix == ".sh" else document_recipe_flags(text)
    where = str(path.relative_to(ROOT))
    options = {}
    refused = sorted({f"recipes/{recipe}.py {flag}" for recipe, flag in pairs
                      if flag not in options.setdefault(recipe, recipe_options(recipe))
                      and (where, recipe, flag) not in KNOWN_REFUSED})
    assert not refused, f"{where} gives flags the recipes refuse (`python recipes/NAME.py --help` lists theirs): {refused}"
    for document, recipe, flag in KNOWN_REFUSED:
        if document == where:
            assert (recipe, flag) in pairs, (f"{where} no longer gives recipes/{recipe}.py {flag}: remove it from "
                                             f"KNOWN_REFUSED")


def test_the_recipe_flag_checks_find_what_they_look_for():
    block = ("accelerate launch --quiet --config_file c.yaml recipes/train_clm.py --config x.yaml \\\n"
             "    --max_steps 5 --seq-len=3 | tee log --not_this\n# mlr: --attention mlr\necho --other\n# --not_this\n")
    assert flags_after_recipes(block) == [("train_clm", "--config"), ("train_clm", "--max_steps"),
                                          ("train_clm", "--seq-len"), ("train_clm", "--attention")]
    assert document_recipe_flags("use `recipes/finetune_patched.py --level_order` or `--x`") == [
        ("finetune_patched", "--level_order")]
    script = ('COMMON="--config a.yaml\n  --seed 0"\nV[mlr]=\'--attention mlr\'\nargs_of() {\n  echo "--n_head 8"\n}\n'
              'local args="--chronos_config {\\"a\\":1} --seed 1"\n# python recipes/train_icl.py --commented\n'
              'python recipes/train_clm.py $COMMON ${V[$v]} $(args_of) $args --n_embd "$d" > log 2>&1\n')
    assert sorted(flag for _, flag in shell_recipe_flags(script)) == sorted(
        ["--config", "--seed", "--attention", "--n_head", "--chronos_config", "--seed", "--n_embd"])
    assert "--attention_layers" not in recipe_options("train_clm") and "--layer_types" in recipe_options("train_clm")
    assert {"--max_steps", "--max-steps", "--config"} <= recipe_options("finetune_patched")


# ---------------------------------------------------------------- the config reference (docs/config_reference.md)
CONFIG_REFERENCE = ROOT / "docs" / "config_reference.md"


def config_reference():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module("config_reference")
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_config_reference_lists_every_field_of_every_config():
    module = config_reference()
    text = CONFIG_REFERENCE.read_text()
    missing = []
    for config_class, *_ in module.config_classes():
        section = sections(CONFIG_REFERENCE)[slug(config_class.__name__)]
        missing += [f"{config_class.__name__}.{field.name}" for field in module.own_fields(config_class)
                    if f"| `{field.name}` |" not in section]
    section = sections(CONFIG_REFERENCE)[slug("Patched decoders: `MLR<Arch>Config`")]
    missing += [f"MLR<Arch>Config.{row[0]}" for row in module.PATCHED_DECODER_FIELDS if f"| `{row[0]}` |" not in section]
    assert not missing, f"docs/config_reference.md lacks {missing}: run python scripts/config_reference.py"
    assert "[docs/config_reference.md](docs/config_reference.md)" in README.read_text()
    assert "[config_reference.md](config_reference.md)" in (ROOT / "docs" / "models.md").read_text()


def test_the_config_reference_is_what_the_generator_writes():
    import transformers

    recorded = re.search(r"from the config classes \(transformers ([\w.]+)\)", CONFIG_REFERENCE.read_text())
    if recorded and recorded.group(1) != transformers.__version__:
        pytest.skip(f"docs/config_reference.md was generated with transformers {recorded.group(1)}, whose docstrings "
                    f"give the architecture fields' meanings; {transformers.__version__} is installed")
    assert CONFIG_REFERENCE.read_text() == config_reference().render(), (
        "docs/config_reference.md differs from the code: run python scripts/config_reference.py")


def test_the_config_reference_describes_every_mlr_field_of_a_patched_decoder():
    from hf_structattn.modeling.structattn_decoder import MLR_FIELDS

    patcher = (ROOT / "hf_structattn" / "decoder_patching.py").read_text()
    payload = "".join(path.read_text() for path in (ROOT / "hf_structattn" / "modeling").glob("structattn_decoder*.py"))
    used = set(MLR_FIELDS) | set(re.findall(r"new_config\.(mlr_\w+) =", patcher))
    used |= set(re.findall(r"getattr\(\w*config\w*, \"(mlr_\w+)\"", payload))
    used |= set(re.findall(r"\bconfig\.(mlr_\w+)\b(?!\s*\()", payload))
    described = {row[0] for row in config_reference().PATCHED_DECODER_FIELDS}
    assert used == described, (f"set or read but not described in scripts/config_reference.py's PATCHED_DECODER_FIELDS: "
                               f"{sorted(used - described)}; described but used nowhere: {sorted(described - used)}")


# ---------------------------------------------------------------- the real-weights guide (docs/patching.md)
PATCHING = ROOT / "docs" / "patching.md"
REAL_MODEL = "what-a-real-model-gets-smollm2-135m-instruct"


def bench_real_checkpoint():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("bench_real_checkpoint")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_guides_recovery_command_is_the_run_that_made_its_table():
    """The guide called its command "the same run as the table's", but the benchmark added held-out evaluation files,
    --max_validation_bytes none and --eval_windows 4: the guide's run stopped on a validation split of 347 tokens."""
    import shlex

    text = sections(PATCHING)[REAL_MODEL]
    block = text[text.index("**The recovery step on a CPU.**"):]
    code = FENCE.search(block).group(2).replace("\\\n", " ")
    assert "write-split finetune smollm2-text/finetune" in code and "write-split heldout smollm2-text/heldout" in code
    line = next(line for line in code.splitlines() if "recipes/finetune_patched.py" in line)
    documented = shlex.split(line.split("recipes/finetune_patched.py", 1)[1], comments=True)
    bench = bench_real_checkpoint()
    args = bench.build_parser().parse_args([])
    expected = bench.recovery_command(args, [32, 16, 8, 8], "smollm2-135m-mlr", "smollm2-text",
                                      "~/.cache/hf_structattn/smollm2-135m")
    assert documented == expected, (documented, expected)
    assert bench.LAUNCH in code  # launched as the benchmark prints it
    # the table's numbers come from the committed run, which only --update-committed rewrites
    assert "python benchmarks/bench_real_checkpoint.py --update-committed" in text
    assert bench.output_paths(args)[1] == Path(args.work) / "real_checkpoint.md"


def test_the_guide_says_the_real_weights_are_a_dequantised_q4_1_gguf_and_readme_does_not_deny_them():
    first = sections(PATCHING)[REAL_MODEL].split("\n\n")[1]  # where the real model is introduced
    assert "Q4_1" in first and "de-quantised to float32" in first, first
    readme = README.read_text()
    assert "SmolLM2" in readme and "docs/patching.md#what-a-real-model-gets-smollm2-135m-instruct" in readme
    limitations = sections(README)["known-limitations"]
    assert "not measured on real" not in " ".join(limitations.lower().split())
    assert "Q4_1" in limitations


def test_documented_usage_reads_the_cache_not_the_deprecated_past_key_values():
    """transformers 5.25 warns on ``past_key_values`` (keyword and output attribute): documents, benchmarks and
    scripts use ``cache`` (the payload's own deprecation shims, which accept the old keyword, are not usage)."""
    sources = [*DOCUMENTS, *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "scripts").glob("*")),
               *sorted(path for path in (ROOT / "hf_structattn").rglob("*.py") if "modeling" not in path.parts),
               *sorted((ROOT / "recipes").glob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{number}" for path in sources if path.is_file()
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if "past_key_values" in line]
    assert not found, found
