"""The pre-registered decision rule of the in-context-regression rank experiment (docs/results.md §1c) as coded
in scripts/icl_rank_report.py, and the experiment's arms (their measured score rank)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from icl_rank_experiment import build, schedule  # noqa: E402
from icl_rank_report import verdict  # noqa: E402

SEEDS = [0, 1]


def _table(errors: dict) -> dict:
    """{arm: (seed0, seed1)} -> the (arm, seed) -> (error, run) table of the report."""
    return {(arm, seed): (value, {}) for arm, pair in errors.items() for seed, value in zip(SEEDS, pair)}


SOLVED_CONTROLS = {"ii_dense1": (0.02, 0.04), "iii_btt8": (0.03, 0.01), "v_dense8_high": (0.05, 0.02)}


def test_yes_needs_every_control_solved_and_low_rank_failing_in_both_seeds():
    yes = verdict(_table({**SOLVED_CONTROLS, "i_dense8_low": (0.9, 0.7), "iv_mlr8": (0.04, 0.2)}), SEEDS, True)
    assert yes.startswith("YES") and "bilinear MLR does not" in yes
    assert "and bilinear MLR too" in verdict(_table({**SOLVED_CONTROLS, "i_dense8_low": (0.9, 0.7),
                                                     "iv_mlr8": (0.04, 0.02)}), SEEDS, True)


def test_no_when_low_rank_solves_in_one_seed_and_undecided_otherwise():
    assert verdict(_table({**SOLVED_CONTROLS, "i_dense8_low": (0.9, 0.08), "iv_mlr8": (1, 1)}), SEEDS,
                   True).startswith("NO")
    middle = verdict(_table({**SOLVED_CONTROLS, "i_dense8_low": (0.9, 0.3), "iv_mlr8": (1, 1)}), SEEDS, True)
    assert middle.startswith("UNDECIDED") and "between 0.1 and 0.5" in middle
    unsolved = {**SOLVED_CONTROLS, "ii_dense1": (0.02, 0.9), "i_dense8_low": (0.9, 0.9), "iv_mlr8": (1, 1)}
    assert "dense, 1 head" in verdict(_table(unsolved), SEEDS, True)
    assert verdict(_table(unsolved), SEEDS, False).startswith("PARTIAL")


def test_arms_have_the_ranks_the_rule_assumes():
    from hf_structattn.diagnostics import effective_rank

    expected = {"i_dense8_low": 3, "ii_dense1": 24, "iii_btt8": 24, "iv_mlr8": 5, "v_dense8_high": 8}
    for arm, rank in expected.items():
        model = build(4, arm)
        model.transformer.h = model.transformer.h[:1]  # one layer is enough: every layer has the same structure
        assert {head.span for head in effective_rank(model, num_pairs=3)} == {rank}, arm


@pytest.mark.parametrize("step, dims, points", [(0, 2, 4), (74, 2, 4), (75, 3, 6), (150, 4, 8), (2499, 4, 8)])
def test_curriculum_reaches_full_size_at_six_percent(step, dims, points):
    rate, active, length = schedule(step, 2500, 4, 1e-3)
    assert (active, length) == (dims, points)
    assert rate == pytest.approx(1e-3 * min(1.0, (step + 1) / 25))
