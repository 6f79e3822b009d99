"""The arms of the ICL rank experiment, its decision thresholds and its shards, shared by
``scripts/icl_rank_experiment.py`` (which trains them) and ``scripts/icl_rank_report.py`` (which rules on them)."""

from __future__ import annotations

SOLVED, FAILED = 0.1, 0.5  # the decision rule's thresholds on the normalised last-query error

LABELS = {
    "i_dense12_half": "(i) dense, 12 heads, r = d/2",
    "ii_dense1": "(ii) dense, 1 head, r = D",
    "iii_btt8": "(iii) bilinear BTT, 8 heads",
    "iv_mlr8": "(iv) bilinear MLR, 8 heads",
    "v_dense3_rank": "(v) dense, 3 heads, r = 2d (rank control)",
    "vi_dense8_wide": "(vi) dense, 8 heads, r = 2d, D = 16d (width control)",
}


def arms(d: int) -> dict[str, dict]:
    """Model fields of the six arms at input dim d (module docstring). Width D = 6d."""
    if d < 4 or d % 4:
        raise ValueError(f"--d must be a positive multiple of 4 (r = d/2 at 12 heads, bilinear-MLR ranks d/4 | d/2), "
                         f"got {d}")
    width = 6 * d
    return {
        "i_dense12_half": dict(n_embd=width, n_head=12, attention="dense"),
        "ii_dense1": dict(n_embd=width, n_head=1, attention="dense"),
        "iii_btt8": dict(n_embd=width, n_head=8, attention="bilinear_btt", btt_rank=1),
        # rank d/4 on the coarse level, d/2 on the fine one (a design choice here); two summed levels: 1/sqrt(2)
        "iv_mlr8": dict(n_embd=width, n_head=8, attention="bilinear_mlr", bilinear_mlr_ranks=[d // 4, d // 2],
                        bilinear_scale_constant=2 ** -0.5),
        "v_dense3_rank": dict(n_embd=width, n_head=3, attention="dense"),
        "vi_dense8_wide": dict(n_embd=16 * d, n_head=8, attention="dense"),
    }


# ----------------------------------------------------------------------------------------------------- the shards

DECIDING_LRS, DECIDING_SEEDS = (3e-4, 1e-3, 3e-3), (0, 1, 2)
ARM_ORDER = ("i_dense12_half", "iii_btt8", "ii_dense1", "v_dense3_rank", "iv_mlr8", "vi_dense8_wide")
CPU_SHARD_RUNS = 2  # runs per CPU shard: one one-thread process per core (a run at most ~100 min on the loaded cores)


def design_runs(d: int) -> list[tuple[str, float, int]]:
    """The planned (arm, lr, seed) runs, in the order the CPU shards take them: seed by seed, lr 1e-3 first, the
    failing arm (i) and bilinear BTT (iii) first."""
    arms(d)
    order = []
    for seed in DECIDING_SEEDS:
        for lr in (1e-3, 3e-4, 3e-3):
            order += [(arm, lr, seed) for arm in ARM_ORDER]
    return order


def shards(d: int) -> dict[str, list[tuple[str, float, int]]]:
    """Shard id -> its (arm, lr, seed) runs. ``c1``..``c27``: CPU-sized, 2 runs each (c1 is seed 0 of (i) and (iii)
    at lr 1e-3, the rule's quickest decisive NO); ``g1``, ``g2``: the whole design in two GPU shards of 3 arms,
    an arm's 9 runs one stacked model. A run belongs to one c-shard and one g-shard; whichever runs first writes its
    results file and the other skips it."""
    runs = design_runs(d)
    out = {f"c{index // CPU_SHARD_RUNS + 1}": runs[index:index + CPU_SHARD_RUNS]
           for index in range(0, len(runs), CPU_SHARD_RUNS)}
    out["g1"] = [run for run in runs if run[0] in ARM_ORDER[:3]]
    out["g2"] = [run for run in runs if run[0] in ARM_ORDER[3:]]
    return out
