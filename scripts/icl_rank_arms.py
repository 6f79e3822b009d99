"""The arms of the ICL rank experiment and its decision thresholds, shared by ``scripts/icl_rank_experiment.py``
(which trains them) and ``scripts/icl_rank_report.py`` (which rules on them); docs/results.md §1d."""

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
        # most rank on the finest level, as in the paper's 8|4|4|16; two summed levels, hence 1/sqrt(2)
        "iv_mlr8": dict(n_embd=width, n_head=8, attention="bilinear_mlr", bilinear_mlr_ranks=[d // 4, d // 2],
                        bilinear_scale_constant=2 ** -0.5),
        "v_dense3_rank": dict(n_embd=width, n_head=3, attention="dense"),
        "vi_dense8_wide": dict(n_embd=16 * d, n_head=8, attention="dense"),
    }
