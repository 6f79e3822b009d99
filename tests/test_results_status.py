"""docs/results.md's status table (scripts/results_status.py): the committed table is what the committed results files
say (so whoever commits a results file runs ``python scripts/results_status.py --write``), its rows follow a results
file appearing or going, ``--write`` touches nothing outside the markers, and every link within the page names a
section of it."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import chronos_experiment as chronos  # noqa: E402
import lm_experiment as lm  # noqa: E402
import results_status as status  # noqa: E402
from icl_rank_arms import CAPS, SHARDS  # noqa: E402
from test_docs_consistency import sections  # noqa: E402

DOC = ROOT / "docs" / "results.md"


def test_the_committed_table_is_what_the_committed_results_say():
    committed = status.split(DOC.read_text())[1]
    assert committed == status.table(ROOT / "results"), (
        "docs/results.md's status table differs from what results/ says: run python scripts/results_status.py --write "
        "and commit docs/results.md")


def test_every_link_within_the_page_names_one_of_its_sections():
    text = DOC.read_text()
    anchors = sections(DOC)
    missing = sorted({anchor for anchor in re.findall(r"\]\(#([\w-]+)\)", text) if anchor not in anchors})
    assert not missing, f"docs/results.md links to sections it does not have: {missing}"


@pytest.fixture
def results(tmp_path) -> Path:
    """A copy of the committed results folder without its run files and shard records (the pilots, which fix the
    CPU designs' shards, stay), so that the tests below do not depend on how far the designs have run."""
    folder = Path(shutil.copytree(ROOT / "results", tmp_path / "results"))
    for path in folder.rglob("*_lr*_s*.json"):
        path.unlink()
    for records in folder.rglob("shards"):
        shutil.rmtree(records)
    return folder


def _icl_run(folder: Path, arm: str, lr: float, seed: int, final: float, at: int) -> None:
    """A finished ICL run's record: error 1.0 at step 0, then ``final`` at step ``at`` (frozen there if < 0.05)."""
    frozen = final < 0.05
    record = {"arm": arm, "lr": lr, "seed": seed, "final_step": at if frozen else CAPS[arm],
              "solved_at": at if frozen else None, "final": {"step": at, "error_last": final},
              "best_error_last": final, "wall_s": 60.0, "batched_with": 3, "device": "cpu",
              "evals": [{"step": 0, "error_last": 1.0}, {"step": at, "error_last": final}]}
    (folder / f"{arm}_lr{lr:g}_s{seed}.json").write_text(json.dumps(record))


def _row(results: Path, row_of) -> dict:
    return row_of(results)._asdict()


def test_the_icl_rows_follow_its_results_files(results):
    folder = results / "icl_rank" / "decisive_d4"
    empty = _row(results, status.icl_rank_row)
    assert empty["result"].startswith("PARTIAL") and "0 / 4 done" in empty["shards"]
    for arm, lr, seed in SHARDS["r3"]:  # (i) at 1e-3 ends below 0.1 in seed 1: NO
        _icl_run(folder, arm, lr, seed, 0.08 if seed == 1 else 0.7, CAPS[arm])
    rank, compute = _row(results, status.icl_rank_row), _row(results, status.icl_equal_compute_row)
    assert rank["result"].startswith("NO") and rank["command"].startswith("decided") and "1 / 4 done" in rank["shards"]
    assert compute["result"].startswith("PARTIAL") and compute["result"].endswith("shards r1, r2, r4")
    assert compute["command"].startswith("`python scripts/icl_rank_experiment.py shard r1`")
    for shard in ("r1", "r2", "r4"):  # the rest: (iii) and (v) solve early, (ii) and (i) at 3e-4 never reach 0.1
        for arm, lr, seed in SHARDS[shard]:
            solves = arm in ("iii_btt8", "v_dense3_rank")
            _icl_run(folder, arm, lr, seed, 0.04 if solves else 0.7, 1_000 if solves else CAPS[arm])
    after, compute = _row(results, status.icl_rank_row), _row(results, status.icl_equal_compute_row)
    assert compute["result"].startswith("YES") and compute["command"].startswith("decided")
    assert "4 / 4 done" in compute["shards"] and after["result"] == rank["result"]  # no later run undoes a NO
    (folder / "i_dense12_half_lr0.001_s1.json").unlink()  # without the run that solved: not decided
    rank = _row(results, status.icl_rank_row)
    assert rank["result"].startswith("PARTIAL") and rank["command"].endswith("shard r3`")


def _sweep_run(folder: Path, name: str, lr: float, seed: int, metric: str, value: float) -> None:
    (folder / f"{name}_lr{lr:g}_s{seed}.json").write_text(
        json.dumps({"lr": lr, "seed": seed, "steps": 10, "final": {metric: value}, "evals": []}))


def test_the_cpu_design_rows_follow_their_results_files(results):
    designs = ((status.lm_row, lm.cpu_shard_map(results / "lm_cpu", lm.CPU)[0], results / "lm_cpu", "bits_per_byte",
                lm.LRS[1]),
               (status.chronos_row, chronos.cpu_shard_map(results / "chronos_cpu")[0], results / "chronos_cpu", "loss",
                chronos.LRS[1]))
    done = re.compile(r"CPU, D = \d+: (\d+) / (\d+) done")
    for row_of, table, folder, metric, middle in designs:
        before = row_of(results)
        assert done.search(before.shards).groups() == ("0", str(len(table)))
        assert "shard g1 --design cpu" in before.command and before.result.startswith("CPU: PARTIAL")
        for segment in table["g1"]:  # g1 finishes, the grid's middle LR best (a best edge LR would add a shard)
            _sweep_run(folder, segment["arm"], segment["lr"], segment["seed"], metric,
                       2.9 if segment["lr"] == middle else 3.0)
        after = row_of(results)
        assert done.search(after.shards).groups() == ("1", str(len(table)))
        assert "shard g1 --design cpu" not in after.command and after.result.startswith("CPU: PARTIAL")


def test_write_replaces_the_block_between_the_markers_and_nothing_else(results, tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text(f"# Title\n\nbefore\n\n{status.BEGIN}\nan old table\n{status.END}\n\nafter\n")
    arguments = ["--results", str(results), "--doc", str(doc)]
    assert status.main(arguments + ["--check"]) == 1
    assert status.main(arguments + ["--write"]) == 0
    text = doc.read_text()
    assert text.startswith(f"# Title\n\nbefore\n\n{status.BEGIN}\n") and text.endswith(f"\n{status.END}\n\nafter\n")
    assert status.split(text)[1] == status.table(results)
    assert status.main(arguments + ["--check"]) == 0
    doc.write_text("# A page without the markers\n")
    with pytest.raises(SystemExit):
        status.main(arguments + ["--write"])


def test_the_lm_cpu_split_in_the_page_is_the_one_every_committed_run_trained_on():
    # the sizes the page quotes, against the corpus description each run wrote (hf_structattn.training.data)
    records = [json.loads(path.read_text()) for path in sorted((ROOT / "results" / "lm_cpu").glob("*_s[0-9].json"))]
    assert records, "no committed LM CPU run"
    split = {re.search(r"(\d+) train files / ([\d,]+) bytes, (\d+) validation files / ([\d,]+) bytes",
                       record["corpus"]).groups() for record in records}
    assert len(split) == 1, f"the committed LM CPU runs trained on different splits: {split}"
    train_files, train_bytes, validation_files, validation_bytes = split.pop()
    quoted = (f"{int(train_files):,} training files ({int(train_bytes.replace(',', '')) / 1e6:.1f} MB), "
              f"{validation_files} held-out files ({int(validation_bytes.replace(',', '')) / 1e6:.2f} MB)")
    assert quoted in DOC.read_text(), quoted
