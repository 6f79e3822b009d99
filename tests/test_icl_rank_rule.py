"""The in-context-regression rank experiment (docs/results.md, experiment 1): its decision rules as coded in
scripts/icl_rank_report.py (rank, equal compute), its arms (measured score rank, equal initial logit scale), its
FLOP count, the batched arm runner's resume, and runs of the sweep and pilot commands at tiny size."""

import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from icl_rank_experiment import (ArmRunner, arms, build, eval_prompts, schedule, score_rank,  # noqa: E402
                                 training_flops)
from icl_rank_report import (equal_compute_table, equal_compute_verdict, error_at_flops, lower,  # noqa: E402
                             observations, verdict)

SEEDS = [0, 1, 2]


def _table(errors: dict) -> dict:
    """{arm: (seed0, seed1, seed2)} -> the (arm, seed) -> (error, run) table of the report."""
    return {(arm, seed): (value, {}) for arm, values in errors.items() for seed, value in zip(SEEDS, values)}


SOLVED_CONTROLS = {"ii_dense1": (0.02, 0.04, 0.01), "iii_btt8": (0.03, 0.01, 0.02),
                   "v_dense3_rank": (0.05, 0.02, 0.03), "vi_dense8_wide": (0.9, 0.9, 0.9)}


def test_yes_needs_every_control_solved_and_the_half_rank_arm_failing_in_every_seed():
    low = {"i_dense12_half": (0.9, 0.7, 0.8)}
    yes = verdict(_table({**SOLVED_CONTROLS, **low, "iv_mlr8": (0.04, 0.2, 0.01)}), SEEDS, True)
    assert yes.startswith("YES") and "MLR" not in yes  # (iv) and (vi), the wide arm, are not ruled on
    assert verdict(_table({**SOLVED_CONTROLS, **low, "iv_mlr8": (1, 1, 1)}), SEEDS, True) == yes
    rank_control_fails = {**SOLVED_CONTROLS, **low, "iv_mlr8": (1, 1, 1), "v_dense3_rank": (0.05, 0.3, 0.02)}
    undecided = verdict(_table(rank_control_fails), SEEDS, True)
    assert undecided.startswith("UNDECIDED") and "rank control" in undecided


def test_bilinear_mlr_and_the_width_control_are_reported_as_observations():
    table = _table({**SOLVED_CONTROLS, "i_dense12_half": (0.9, 0.7, 0.8), "iv_mlr8": (0.04, 0.2, 0.01)})
    mlr, wide = observations(table, SEEDS)
    assert "bilinear MLR" in mlr and "0.040, 0.200, 0.010" in mlr and "below 0.1 in 2 of 3 seeds" in mlr
    assert "width control" in wide and "below 0.1 in 0 of 3 seeds" in wide


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


COMPARED = ("i_dense12_half", "ii_dense1", "iii_btt8", "iv_mlr8")


def _at_budget(values: dict) -> dict:
    return {(arm, seed): value for arm, per_seed in values.items() for seed, value in zip(SEEDS, per_seed)}


def test_equal_compute_rule_needs_both_bilinear_arms_lower_than_both_dense_arms_in_every_seed():
    dense = {"i_dense12_half": (0.8, 0.9, 0.85), "ii_dense1": (0.5, 0.6, 0.55)}
    bilinear_lower = {**dense, "iii_btt8": (0.2, 0.3, 0.1), "iv_mlr8": (0.3, 0.4, 0.2)}
    assert equal_compute_verdict(_at_budget(bilinear_lower), SEEDS, True).startswith("YES")
    assert equal_compute_verdict(_at_budget(bilinear_lower), SEEDS, False).startswith("PARTIAL")
    one_seed_tied = {**bilinear_lower, "iv_mlr8": (0.3, 0.58, 0.2)}  # 0.58 vs 0.6: within the 10 % margin
    undecided = equal_compute_verdict(_at_budget(one_seed_tied), SEEDS, True)
    assert undecided.startswith("UNDECIDED") and "bilinear MLR, 8 heads vs (ii) dense, 1 head" in undecided
    dense_lower = {**dense, "iii_btt8": (0.7, 0.8, 0.9), "iv_mlr8": (0.9, 0.95, 0.9)}
    assert equal_compute_verdict(_at_budget(dense_lower), SEEDS, True).startswith("NO")
    missing = {arm: v for arm, v in bilinear_lower.items() if arm != "iii_btt8"}
    assert equal_compute_verdict(_at_budget(missing), SEEDS, True).startswith("PARTIAL")
    assert lower(0.5, 0.6) and not lower(0.55, 0.6) and not lower(0.001, 0.009) and lower(0.001, 0.02)


def test_error_at_equal_flops_reads_the_last_evaluation_within_the_budget():
    flops = [10.0 * step for step in range(101)]  # 10 FLOPs per step, 100 steps
    evals = [{"step": step, "error_last": 1.0 - step / 200} for step in (0, 25, 50, 75, 100)]
    finished = {"evals": evals, "finished": True, "step": 100, "solved_at": None, "arm": "iii_btt8", "seed": 0}
    assert error_at_flops(finished, flops, 600.0) == 1.0 - 50 / 200  # step 60's budget: the step-50 evaluation
    running = {**finished, "evals": evals[:3], "finished": False, "step": 50}
    assert error_at_flops(running, flops, 600.0) is None  # not there yet
    assert error_at_flops(running, flops, 500.0) == 0.75
    slower = {**finished, "seed": 0, "arm": "iii_btt8", "evals": [{"step": 0, "error_last": 1.0},
                                                                   {"step": 100, "error_last": 0.1}]}
    table = equal_compute_table([finished, slower], {"iii_btt8": flops}, 600.0, ["iii_btt8"], [0])
    assert table == {("iii_btt8", 0): 0.75}  # best over the two runs at 600 FLOPs, not at their ends


def test_training_flops_follow_the_curriculum_and_rank_the_arms_by_cost():
    from hf_structattn.flops import flops_per_token

    steps = 200
    for arm in COMPARED:
        cumulative = training_flops(4, arm, steps)
        per_step = [b - a for a, b in zip(cumulative, cumulative[1:])]
        assert len(cumulative) == steps + 1 and cumulative[0] == 0
        full = flops_per_token(build(4, arm).config, 16, training=True) * 64 * 16  # 64 prompts of 2N = 16 tokens
        assert per_step[-1] == pytest.approx(full, rel=1e-12)
        assert per_step[0] < per_step[-1]  # the curriculum starts with d = 4 points (8 tokens)
        assert [schedule(s, steps, 4, 1.0)[2] for s in (0, 6, 12)] == [4, 6, 8]
    # the bilinear arms spend more per step than 1-head dense at D = 24 (BTT: full-width keys, MLR: 5 dims + V)
    cost = {arm: training_flops(4, arm, 10)[-1] for arm in COMPARED}
    assert cost["iii_btt8"] > cost["ii_dense1"]


def test_an_interrupted_arm_resumes_to_the_same_parameters(tmp_path):
    def runner(root):
        return ArmRunner(4, "v_dense3_rank", [1e-3, 3e-3], [0], 8, 4, root, dtype=torch.float64, layers=1,
                         eval_count=32)

    straight = runner(tmp_path / "a")
    while not straight.finished:
        straight.advance()
    interrupted = runner(tmp_path / "b")
    while interrupted.step < 4:  # chunks end at the curriculum's stages (steps 1, 2) and the evaluation at 4
        interrupted.advance()
    interrupted.save_checkpoint()
    resumed = runner(tmp_path / "b")
    assert resumed.step == 4
    while not resumed.finished:
        resumed.advance()
    assert torch.equal(resumed.stack.flat, straight.stack.flat)
    progress = (tmp_path / "b" / "v_dense3_rank_lr0.001_s0" / "progress.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in progress] == [0, 4, 8]
    with pytest.raises(ValueError, match="another configuration"):
        ArmRunner(4, "v_dense3_rank", [1e-3], [0], 8, 4, tmp_path / "b", dtype=torch.float64, layers=1,
                  eval_count=32)


def test_the_sweep_command_runs_and_reports(tmp_path, capsys):
    # the deciding command, shrunk to two arms of 2 LRs x 1 seed (each arm one stacked model), 3 steps
    from icl_rank_experiment import main

    small = ["--d", "4", "--out", str(tmp_path / "out"), "--arms", "i_dense12_half", "v_dense3_rank", "--lrs", "1e-3",
             "3e-3", "--seeds", "0", "--steps", "3", "--layers", "2"]
    threads = torch.get_num_threads()  # main() sets one thread for its runs
    try:
        main(["run", *small, "--eval_every", "2", "--jobs", "1"])  # the arms one after another in this process
        assert "all arms finished" in capsys.readouterr().out
        for arm in ("i_dense12_half", "v_dense3_rank"):
            for lr in ("0.001", "0.003"):
                result = json.loads((tmp_path / "out" / "d4" / f"{arm}_lr{lr}_s0" / "result.json").read_text())
                assert result["final_step"] == 3 and result["final"]["step"] == 3 and result["batched_with"] == 2
                assert result["rank_init"]["span_min"] == score_rank(4, arm)
                assert len(result["rank_init"]["logit_rms"]) == 2 and result["layers"] == 2
        before = (tmp_path / "out" / "d4" / "v_dense3_rank_lr0.001_s0" / "progress.jsonl").read_text()
        main(["arm", *small, "--arm", "v_dense3_rank", "--eval_every", "2"])  # a finished arm is not retrained
        assert "nothing to train" in capsys.readouterr().out
        assert (tmp_path / "out" / "d4" / "v_dense3_rank_lr0.001_s0" / "progress.jsonl").read_text() == before
        main(["report", *small, "--figures", str(tmp_path / "figures")])
        out = capsys.readouterr().out
        assert "VERDICT (rank, Fig. 2/3a): UNDECIDED" in out and "training FLOPs per step" in out
        assert "VERDICT (equal compute, Fig. 3b): PARTIAL" in out  # neither bilinear arm was run
        assert (tmp_path / "figures" / "icl_rank_d4.png").exists()
        with pytest.raises(SystemExit):
            main(["run", "--d", "4", "--arms", "vii"])
        assert "--arms: unknown vii" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_the_pilot_command_runs_at_tiny_size_and_writes_its_summary(tmp_path, capsys):
    # the GPU check's part (e) runs: pilot --device cuda --budget-s 170 --out DIR; here its CPU rehearsal
    from icl_rank_experiment import main

    threads = torch.get_num_threads()
    try:
        main(["pilot", "--tiny", "--device", "cpu", "--budget-s", "120", "--out", str(tmp_path / "pilot")])
        summary = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
        assert set(summary["arms"]) == {"ii_dense1", "v_dense3_rank"} and summary["tiny"]
        for arm in summary["arms"].values():
            assert arm["steps_done"] == 30 and arm["ms_per_step"] > 0 and 0 < arm["error_last"] < 2
        markdown = (tmp_path / "pilot" / "pilot.md").read_text()
        assert markdown.startswith("### ICL rank pilot") and "| (ii) dense, 1 head, r = D | 30 |" in markdown
        assert "not asked: a rehearsal" in markdown and "Projected d = 4 sweep" in markdown
        with pytest.raises(SystemExit):
            main(["pilot", "--tiny", "--out", str(tmp_path / "pilot")])
        assert "is not empty: a pilot starts from scratch" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(["pilot", "--tiny", "--budget-s", "0", "--out", str(tmp_path / "other")])
        assert "--budget-s must be positive, got 0.0" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
