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


# ------------------------------------------------------------------------------- the registered design and its shards

# The decisive d = 4 design (docs/results.md, "ICL rank: the decisive design"), registered before any of its runs.
# Seed 0 is the calibration: its runs (results/icl_rank/d4/, an earlier 3-LR design) chose the learning rate and the
# budgets and are reported, never ruled on. Every run follows the same schedule, that of SCHEDULE_STEPS (warm-up over
# its first 1 %, the curriculum over its first 6 %, then a constant LR), and stops at its arm's cap, so the failing
# arm's extra 20,000 steps continue exactly the run the other arms had.
DESIGN_D = 4
SCHEDULE_STEPS = 20_000
DESIGN_SEEDS = (1, 2, 3)
CALIBRATION_SEED = 0
LOW_RANK = "i_dense12_half"
RULED = (LOW_RANK, "iii_btt8", "v_dense3_rank")  # the rank rule's inputs
OBSERVED = ("ii_dense1",)  # the 1-head control: an observation (the paper's Fig. 3a needs it twice BTT's width)
CAPS = {LOW_RANK: 40_000, "iii_btt8": 20_000, "v_dense3_rank": 20_000, "ii_dense1": 20_000}
DESIGN_LR, LOW_RANK_EXTRA_LR, LOW_RANK_EXTRA_SEEDS = 1e-3, 3e-4, (1, 2)

# shard id -> its (arm, lr, seed) runs; a shard's runs of one arm train as one stacked model, its arms one after
# another in one process (one core). Order: the quick controls, then the failing arm.
SHARDS = {
    "r1": [("iii_btt8", DESIGN_LR, seed) for seed in DESIGN_SEEDS],
    "r2": [("v_dense3_rank", DESIGN_LR, seed) for seed in DESIGN_SEEDS] +
          [("ii_dense1", DESIGN_LR, seed) for seed in DESIGN_SEEDS],
    "r3": [(LOW_RANK, DESIGN_LR, seed) for seed in DESIGN_SEEDS],
    "r4": [(LOW_RANK, LOW_RANK_EXTRA_LR, seed) for seed in LOW_RANK_EXTRA_SEEDS],
}


def design_runs() -> list[tuple[str, float, int]]:
    """Every registered (arm, lr, seed) run, in shard order."""
    return [run for runs in SHARDS.values() for run in runs]


def cap(arm: str) -> int:
    """The registered step cap of ``arm``'s runs."""
    return CAPS[arm]
