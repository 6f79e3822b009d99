"""The status table of docs/results.md: one row per claim of the paper, built from the committed results files by
the design scripts' own functions (those their ``report`` and ``plan --shards`` commands call), so the table says
what ``report`` says.

    python scripts/results_status.py             # print the table
    python scripts/results_status.py --write     # put it between the markers in docs/results.md
    python scripts/results_status.py --check     # exit 1 when docs/results.md's table is not what the results say

Whoever commits a results file runs ``--write`` and commits docs/results.md with it (tests/test_results_status.py
fails otherwise). ``--results DIR`` reads another copy of results/ (the tests use copies).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "scripts"):  # this checkout's package and design scripts, whatever is installed
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import chronos_experiment as chronos  # noqa: E402
import lm_experiment as lm  # noqa: E402
from icl_rank_arms import DESIGN_D, OBSERVED, RULED, SHARDS, cap  # noqa: E402
from icl_rank_report import (EQUAL_COMPUTE_BILINEAR, EQUAL_COMPUTE_DENSE, cost_table,  # noqa: E402
                             equal_compute_verdict, load_runs, verdict)

from sweep import read_run_jsons, read_shard_records, runnable_shards, segment_done  # noqa

DOC = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- results_status.py: begin -->", "<!-- results_status.py: end -->"
ICL = "python scripts/icl_rank_experiment.py"
LM = "python scripts/lm_experiment.py"
CHRONOS = "python scripts/chronos_experiment.py"


class Row(NamedTuple):
    claim: str
    rule: str
    shards: str
    result: str
    command: str


# ------------------------------------------------------------------------------------------------ shard bookkeeping


def _ids(ids) -> str:
    return ", ".join(ids) if ids else "none"


def _icl_runs(results: Path):
    """The ICL design's finished runs and its shards not done (``icl_rank_arms.SHARDS``)."""
    runs = load_runs(results / "icl_rank" / f"decisive_d{DESIGN_D}")
    done = {(r["arm"], r["lr"], r["seed"]) for r in runs}
    left = [sid for sid, members in SHARDS.items() if not all(run in done for run in members)]
    return runs, done, left


@functools.lru_cache(maxsize=None)
def _icl_flops() -> dict:
    """Arm -> cumulative training FLOPs per step at its cap (what ``report`` passes the equal-compute reading)."""
    from icl_rank_experiment import training_flops

    return {arm: training_flops(DESIGN_D, arm, cap(arm)) for arm in RULED + OBSERVED}


def _icl_shards(left) -> str:
    done = [sid for sid in SHARDS if sid not in left]
    return f"d = {DESIGN_D}, CPU or GPU: {len(done)} / {len(SHARDS)} done ({_ids(done)})"


def _cpu_progress(table: dict, results: Path) -> tuple[list, list]:
    """(shards done, shards ready to start) of a CPU design's shard map, as its ``report`` counts them."""
    names, records = {r["name"] for r in read_run_jsons(results)}, read_shard_records(results)
    done = [sid for sid, members in table.items() if all(segment_done(s, names, records) for s in members)]
    return done, runnable_shards(table, names, records)


def _gpu_left(table: dict, unit_done, results: Path) -> list:
    """The shards of a GPU design's ``table`` with runs still to finish, as its ``report`` counts them."""
    runs = read_run_jsons(results)
    return [sid for sid, units in table.items()
            if sum(unit_done(u, runs) for u in units) < sum(u["runs"] for u in units)]


def _ready(command: str, ready: list, beside: str = "on the other core") -> str:
    """The command of the first shard in ``ready`` (and the id of the second, which can run beside it)."""
    if not ready:
        return "none left"
    text = f"`{command.format(id=ready[0])}`"
    return text + (f" (and {ready[1]} {beside})" if len(ready) > 1 and beside else "")


# ---------------------------------------------------------------------------------------------------- one row a claim


def icl_rank_row(results: Path) -> Row:
    runs, _, left = _icl_runs(results)
    result = verdict(runs)
    decided = not result.startswith("PARTIAL")
    return Row("ICL rank bottleneck (Fig. 2, 3a): dense heads with r well below d cannot learn in-context regression",
               "[ICL rank rule](#icl-rank-rule)", _icl_shards(left), result,
               f"decided: `{ICL} report`" if decided else f"`{ICL} shard {left[0]}`")


def icl_equal_compute_row(results: Path) -> Row:
    runs, done, left = _icl_runs(results)
    arms = (EQUAL_COMPUTE_BILINEAR,) + EQUAL_COMPUTE_DENSE
    result = equal_compute_verdict(cost_table(runs, _icl_flops(), arms))
    needed = [sid for sid in left if any(arm in arms and (arm, lr, seed) not in done for arm, lr, seed in SHARDS[sid])]
    if result.startswith("PARTIAL"):
        result += f"; its runs are in shards {_ids(needed)}"
    command = f"decided: `{ICL} report`" if not needed else \
        f"`{ICL} shard {needed[0]}`" + (f" (then {', '.join(needed[1:])}; one process a core)" if needed[1:] else "")
    return Row("ICL at equal compute (Fig. 3b): bilinear BTT reaches error 0.1 with fewer training FLOPs than dense",
               "[ICL equal-compute rule](#icl-equal-compute-rule)", _icl_shards(left), result, command)


def lm_row(results: Path) -> Row:
    cpu_folder, gpu_folder = results / "lm_cpu", results / "lm"
    cpu_table, _ = lm.cpu_shard_map(cpu_folder, lm.CPU)
    cpu_done, ready = _cpu_progress(cpu_table, cpu_folder)
    gpu_table = lm.shards(gpu_folder)
    gpu_left = _gpu_left(gpu_table, lm.unit_done, gpu_folder)
    cpu_result = lm.verdict(lm.scores(read_run_jsons(cpu_folder), lm.CPU), lm.CPU.widths, lm.CPU.seeds)
    gpu_result = lm.verdict(lm.scores(read_run_jsons(gpu_folder)))
    return Row("LM (Fig. 4): MLR reaches a lower loss than dense, SWA and global + SWA at equal training FLOPs",
               "[LM rule](#lm-rule)",
               f"CPU, D = 256: {len(cpu_done)} / {len(cpu_table)} done; GPU, 3 widths: "
               f"{len(gpu_table) - len(gpu_left)} / {len(gpu_table)} done",
               f"CPU: {cpu_result}. GPU: {gpu_result}",
               f"CPU: {_ready(LM + ' shard {id} --design cpu', ready)}; "
               f"GPU: {_ready(LM + ' shard {id} --device cuda', gpu_left, '')}")


def chronos_row(results: Path) -> Row:
    cpu_folder, gpu_folder = results / "chronos_cpu", results / "chronos"
    cpu_table, _ = chronos.cpu_shard_map(cpu_folder)
    cpu_done, ready = _cpu_progress(cpu_table, cpu_folder)
    gpu_table = {sid: units for sid, units in chronos.shards(gpu_folder).items() if not sid.startswith("a")}
    gpu_left = _gpu_left(gpu_table, chronos.unit_done, gpu_folder)
    cpu_result = chronos.verdict(chronos.cpu_scores(read_run_jsons(cpu_folder)), (chronos.CPU_WIDTH,),
                                 chronos.CPU_SEEDS)
    gpu_result = chronos.verdict(chronos.scores(read_run_jsons(gpu_folder)))
    return Row("Chronos (Fig. 5): MLR self-attention gives a lower validation loss with fewer training FLOPs",
               "[Chronos rule](#chronos-rule-and-ablation)",
               f"CPU, D = 128: {len(cpu_done)} / {len(cpu_table)} done; GPU, 3 widths: "
               f"{len(gpu_table) - len(gpu_left)} / {len(gpu_table)} done",
               f"CPU: {cpu_result}. GPU: {gpu_result}",
               f"CPU: {_ready(CHRONOS + ' shard {id} --design cpu', ready)}; "
               f"GPU: {_ready(CHRONOS + ' shard {id} --device cuda', gpu_left, '')}")


def chronos_ablation_row(results: Path) -> Row:
    folder = results / "chronos"
    runs = read_run_jsons(folder)
    best = chronos.scores(runs)
    table = {sid: units for sid, units in chronos.shards(folder).items() if sid.startswith("a")}
    left = _gpu_left(table, chronos.unit_done, folder)
    claim = chronos.verdict(best)
    command = _ready(CHRONOS + " shard {id} --device cuda", left, "")
    return Row("Chronos, logit-scale confound: is MLR's advantage its rank structure or its smaller distant logits?",
               "[ablation rule](#chronos-rule-and-ablation)", f"GPU only: {len(table) - len(left)} / {len(table)} done",
               f"GPU: {chronos.ablation_verdict(best, claim)}",
               command if claim.startswith("YES") or not left else f"{command}, once the GPU claim is YES")


ROWS = (icl_rank_row, icl_equal_compute_row, lm_row, chronos_row, chronos_ablation_row)


# ------------------------------------------------------------------------------------------------------- the block


def table(results: Path = ROOT / "results") -> str:
    """The markdown status table of the results files under ``results``."""
    lines = ["| claim (paper) | rule | shards (done / total, per design) | result | command that continues |",
             "|---|---|---|---|---|"]
    for row_of in ROWS:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row_of(Path(results))) + " |")
    return "\n".join(lines)


def split(text: str) -> tuple[str, str, str]:
    """(before, the block between the markers, after) of a document's text."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{DOC.relative_to(ROOT)} needs one {BEGIN} line before one {END} line")
    before, rest = text.split(BEGIN)
    block, after = rest.split(END)
    return before, block.strip("\n"), after


def written(text: str, block: str) -> str:
    """``text`` with ``block`` between its markers."""
    before, _, after = split(text)
    return f"{before}{BEGIN}\n{block}\n{END}{after}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(ROOT / "results"), help="the committed results folder")
    parser.add_argument("--doc", default=str(DOC), help="the document whose block --write / --check use")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the block between the markers in --doc")
    mode.add_argument("--check", action="store_true", help="exit 1 when --doc's block differs")
    args = parser.parse_args(argv)
    block, doc = table(Path(args.results)), Path(args.doc)
    if args.write:
        text = doc.read_text()
        new = written(text, block)
        if new != text:
            doc.write_text(new)
        print(f"{doc}: status table {'updated' if new != text else 'unchanged'}")
    elif args.check:
        if split(doc.read_text())[1] != block:
            print(f"{doc}: the status table differs from the results; run python scripts/results_status.py --write")
            return 1
        print(f"{doc}: the status table is what the results say")
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
