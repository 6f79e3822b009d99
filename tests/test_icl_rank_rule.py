"""The in-context-regression rank experiment (docs/results.md §1d): its decision rule as coded in
scripts/icl_rank_report.py, its arms (measured score rank, equal initial logit scale) and a smoke run of the
command."""

import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from icl_rank_experiment import arms, build, eval_prompts, schedule, score_rank  # noqa: E402
from icl_rank_report import verdict  # noqa: E402

SEEDS = [0, 1, 2]


def _table(errors: dict) -> dict:
    """{arm: (seed0, seed1, seed2)} -> the (arm, seed) -> (error, run) table of the report."""
    return {(arm, seed): (value, {}) for arm, values in errors.items() for seed, value in zip(SEEDS, values)}


SOLVED_CONTROLS = {"ii_dense1": (0.02, 0.04, 0.01), "iii_btt8": (0.03, 0.01, 0.02),
                   "v_dense3_rank": (0.05, 0.02, 0.03), "vi_dense8_wide": (0.9, 0.9, 0.9)}


def test_yes_needs_every_control_solved_and_the_half_rank_arm_failing_in_every_seed():
    low = {"i_dense12_half": (0.9, 0.7, 0.8)}
    yes = verdict(_table({**SOLVED_CONTROLS, **low, "iv_mlr8": (0.04, 0.2, 0.01)}), SEEDS, True)
    assert yes.startswith("YES") and "bilinear MLR does not" in yes  # (vi), the wide arm, is not ruled on
    assert "and bilinear MLR too" in verdict(_table({**SOLVED_CONTROLS, **low, "iv_mlr8": (0.04, 0.02, 0.03)}),
                                             SEEDS, True)
    rank_control_fails = {**SOLVED_CONTROLS, **low, "iv_mlr8": (1, 1, 1), "v_dense3_rank": (0.05, 0.3, 0.02)}
    undecided = verdict(_table(rank_control_fails), SEEDS, True)
    assert undecided.startswith("UNDECIDED") and "rank control" in undecided


def test_no_when_the_half_rank_arm_solves_in_one_seed_and_undecided_otherwise():
    assert verdict(_table({**SOLVED_CONTROLS, "i_dense12_half": (0.9, 0.08, 0.9), "iv_mlr8": (1, 1, 1)}), SEEDS,
                   True).startswith("NO")
    middle = verdict(_table({**SOLVED_CONTROLS, "i_dense12_half": (0.9, 0.3, 0.9), "iv_mlr8": (1, 1, 1)}), SEEDS,
                     True)
    assert middle.startswith("UNDECIDED") and "between 0.1 and 0.5" in middle
    unsolved = {**SOLVED_CONTROLS, "ii_dense1": (0.02, 0.9, 0.02), "i_dense12_half": (0.9, 0.9, 0.9),
                "iv_mlr8": (1, 1, 1)}
    assert "dense, 1 head" in verdict(_table(unsolved), SEEDS, True)
    assert verdict(_table(unsolved), SEEDS, False).startswith("PARTIAL")


def test_failing_arm_has_half_the_input_dim_and_the_rank_control_only_changes_the_head_split():
    for d in (4, 8):
        fields = arms(d)
        low, control = fields["i_dense12_half"], fields["v_dense3_rank"]
        assert low["n_embd"] // low["n_head"] <= d // 2
        assert control["n_embd"] == low["n_embd"] and control["attention"] == low["attention"]
        assert control["n_embd"] // control["n_head"] >= d
        assert score_rank(d, "iv_mlr8") >= d
    with pytest.raises(ValueError, match="multiple of 4"):
        arms(6)


def test_arms_have_the_ranks_the_rule_assumes():
    from hf_structattn.diagnostics import effective_rank

    for arm in arms(4):
        model = build(4, arm)
        model.transformer.h = model.transformer.h[:1]  # one layer is enough: every layer has the same structure
        assert {head.span for head in effective_rank(model, num_pairs=3)} == {score_rank(4, arm)}, arm
    assert [score_rank(4, arm) for arm in arms(4)] == [2, 24, 24, 5, 8, 8]


def test_arms_start_with_the_same_attention_logit_scale():
    # each score divided by the square root of its width (bilinear MLR also by sqrt(L) for its L summed levels):
    # the row-centred logits have RMS ~1 in every arm (the earlier design's 8/r arm had 4.4, 4.6x the smallest)
    from hf_structattn.mup import attention_logit_rms

    xs, ys = eval_prompts(4, 0, 64)
    scales = {}
    for arm in arms(4):
        torch.manual_seed(0)
        scales[arm] = attention_logit_rms(build(4, arm), xs=xs, ys=ys).mean().item()
    values = torch.tensor(list(scales.values()))
    assert ((values > 0.8) & (values < 1.2)).all(), scales
    assert values.max() / values.min() < 1.15, scales


@pytest.mark.parametrize("step, dims, points", [(0, 2, 4), (74, 2, 4), (75, 3, 6), (150, 4, 8), (2499, 4, 8)])
def test_curriculum_reaches_full_size_at_six_percent(step, dims, points):
    rate, active, length = schedule(step, 2500, 4, 1e-3)
    assert (active, length) == (dims, points)
    assert rate == pytest.approx(1e-3 * min(1.0, (step + 1) / 25))


def test_the_sweep_command_runs_and_reports(tmp_path, capsys):
    # the deciding command (docs/results.md §1d), shrunk to two arms, 3 steps, one LR and one seed
    from icl_rank_experiment import main

    small = ["--d", "4", "--out", str(tmp_path / "out"), "--arms", "i_dense12_half", "v_dense3_rank", "--lrs", "1e-3",
             "--seeds", "0"]
    threads = torch.get_num_threads()  # main() sets one thread for its runs
    try:
        main(["run", *small, "--steps", "3", "--eval_every", "2", "--jobs", "2"])  # one subprocess per run
        assert "all runs finished" in capsys.readouterr().out
        for arm in ("i_dense12_half", "v_dense3_rank"):
            result = json.loads((tmp_path / "out" / "d4" / f"{arm}_lr0.001_s0" / "result.json").read_text())
            assert result["final_step"] == 3 and result["final"]["step"] == 3
            assert result["rank_init"]["span_min"] == score_rank(4, arm)
            assert len(result["rank_init"]["logit_rms"]) == 6
        main(["report", *small, "--figures", str(tmp_path / "figures")])
        assert "VERDICT: UNDECIDED" in capsys.readouterr().out
        assert (tmp_path / "figures" / "icl_rank_d4.png").exists()
        with pytest.raises(SystemExit):
            main(["run", "--d", "4", "--arms", "vii"])
        assert "--arms: unknown vii" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
