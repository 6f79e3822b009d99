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

from icl_rank_arms import shards  # noqa: E402
from icl_rank_experiment import (ArmRunner, arms, build, eval_prompts, schedule, score_rank,  # noqa: E402
                                 training_flops)
from icl_rank_report import (cheaper, cost_table, edge_runs, equal_compute_verdict,  # noqa: E402
                             flops_to_threshold, observations, verdict)

SEEDS, LRS = [0, 1, 2], [3e-4, 1e-3, 3e-3]


def _runs(errors: dict, by_lr: dict | None = None, solved_step: int = 100) -> list[dict]:
    """{arm: (final seed 0, seed 1, seed 2)} -> finished runs at every planned LR: the given final error at lr 1e-3,
    0.02 worse at the other two; ``by_lr`` {(arm, lr, seed): final} overrides single runs (and adds edge runs).
    Each run's evaluations: 1.0 at step 0, then its final error at ``solved_step``."""
    finals = {}
    for arm, values in errors.items():
        for seed, value in zip(SEEDS, values):
            for lr in LRS:
                finals[arm, lr, seed] = value if lr == 1e-3 else value + 0.02
    finals.update(by_lr or {})
    return [{"arm": arm, "lr": lr, "seed": seed, "final": value, "solved_at": None,
             "evals": [{"step": 0, "error_last": 1.0}, {"step": solved_step, "error_last": value}]}
            for (arm, lr, seed), value in finals.items()]


SOLVED_CONTROLS = {"ii_dense1": (0.02, 0.04, 0.01), "iii_btt8": (0.03, 0.01, 0.02),
                   "v_dense3_rank": (0.04, 0.02, 0.03), "iv_mlr8": (0.9, 0.9, 0.9), "vi_dense8_wide": (0.9, 0.9, 0.9)}
FAILING = {"i_dense12_half": (0.9, 0.7, 0.8)}


def test_rank_rule_solved_regime_is_yes_and_ignores_the_observed_arms():
    yes = verdict(_runs({**SOLVED_CONTROLS, **FAILING}), SEEDS)
    assert yes.startswith("YES") and "MLR" not in yes
    without_observed = {arm: v for arm, v in SOLVED_CONTROLS.items() if arm not in ("iv_mlr8", "vi_dense8_wide")}
    assert verdict(_runs({**without_observed, **FAILING}), SEEDS) == yes  # (iv), (vi) are not inputs of the rule


def test_rank_rule_failed_regime_is_no_from_one_finished_run_of_the_half_rank_arm():
    # (i) below 0.1 at one LR of one seed decides NO, even before the other runs exist
    one_run = [run for run in _runs({"i_dense12_half": (0.08, 0.9, 0.9)}) if run["lr"] == 1e-3 and run["seed"] == 0]
    no = verdict(one_run, SEEDS)
    assert no.startswith("NO") and "lr 0.001 seed 0 (0.080)" in no
    assert verdict(_runs({**SOLVED_CONTROLS, "i_dense12_half": (0.9, 0.9, 0.9)},
                         {("i_dense12_half", 3e-4, 2): 0.05}), SEEDS).startswith("NO")


def test_rank_rule_mixed_regimes_are_undecided_with_the_reasons():
    middle = verdict(_runs({**SOLVED_CONTROLS, "i_dense12_half": (0.9, 0.3, 0.9)}), SEEDS)
    assert middle.startswith("UNDECIDED") and "between 0.1 and 0.5" in middle
    control_fails = verdict(_runs({**SOLVED_CONTROLS, **FAILING, "v_dense3_rank": (0.04, 0.3, 0.02)}), SEEDS)
    assert control_fails.startswith("UNDECIDED") and "rank control" in control_fails
    # a control that solves at one LR only still counts (its best LR), a failing run at another LR does not matter
    best_lr_only = _runs({**SOLVED_CONTROLS, **FAILING}, {("ii_dense1", 3e-4, 1): 0.9, ("ii_dense1", 3e-3, 1): 0.9})
    assert verdict(best_lr_only, SEEDS).startswith("YES")


def test_rank_rule_is_partial_until_every_run_it_reads_has_finished():
    runs = _runs({**SOLVED_CONTROLS, **FAILING})
    missing = [run for run in runs if not (run["arm"] == "v_dense3_rank" and run["lr"] == 3e-3 and run["seed"] == 2)]
    assert verdict(missing, SEEDS).startswith("PARTIAL: 1 run")
    assert verdict([], SEEDS).startswith("PARTIAL")


def test_rank_rule_edge_clause_runs_one_more_lr_beyond_the_half_rank_arms_best_edge_lr():
    # seed 1: (i) is best at 3e-3, the grid's top; the rule then needs (i) at 9e-3 in seed 1 before any YES
    edge = {("i_dense12_half", 3e-3, 1): 0.6}
    runs = _runs({**SOLVED_CONTROLS, **FAILING}, edge)
    assert edge_runs(runs, SEEDS) == [("i_dense12_half", 9e-3, 1)]
    assert verdict(runs, SEEDS).startswith("PARTIAL: 1 run")
    assert verdict(_runs({**SOLVED_CONTROLS, **FAILING}, {**edge, ("i_dense12_half", 9e-3, 1): 0.8}),
                   SEEDS).startswith("YES")
    assert verdict(_runs({**SOLVED_CONTROLS, **FAILING}, {**edge, ("i_dense12_half", 9e-3, 1): 0.09}),
                   SEEDS).startswith("NO")
    between = verdict(_runs({**SOLVED_CONTROLS, **FAILING}, {**edge, ("i_dense12_half", 9e-3, 1): 0.4}), SEEDS)
    assert between.startswith("UNDECIDED") and "between 0.1 and 0.5" in between
    low_edge = _runs({**SOLVED_CONTROLS, **FAILING}, {("i_dense12_half", 3e-4, 0): 0.6})
    assert edge_runs(low_edge, SEEDS) == [("i_dense12_half", 9e-5, 0)]
    assert edge_runs(_runs({**SOLVED_CONTROLS, **FAILING}), SEEDS) == []  # best at 1e-3 in every seed


def test_bilinear_mlr_and_the_width_control_are_reported_as_observations():
    runs = _runs({**SOLVED_CONTROLS, **FAILING, "iv_mlr8": (0.04, 0.2, 0.01)})
    mlr, wide = observations(runs, SEEDS)
    assert "bilinear MLR" in mlr and "0.040, 0.200, 0.010" in mlr and "below 0.1 in 2 of 3" in mlr
    assert "width control" in wide and "below 0.1 in 0 of 3" in wide


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


def _costs(values: dict) -> dict:
    return {(arm, seed): value for arm, per_seed in values.items() for seed, value in zip(SEEDS, per_seed)}


INF = float("inf")


def test_equal_compute_rule_in_the_solved_regime_compares_flops_to_error_0_1():
    # every arm solves and freezes: the rule reads when each got below 0.1, not the frozen errors
    dense = {"i_dense12_half": (9e12, 8e12, 1e13), "ii_dense1": (5e12, 6e12, 5e12)}
    bilinear_cheaper = {**dense, "iii_btt8": (2e12, 3e12, 4e12), "iv_mlr8": (3e12, 4e12, 4e12)}
    assert equal_compute_verdict(_costs(bilinear_cheaper), SEEDS).startswith("YES")
    dense_cheaper = {**dense, "iii_btt8": (8e12, 9e12, 9e12), "iv_mlr8": (7e12, 9e12, 7e12)}
    assert equal_compute_verdict(_costs(dense_cheaper), SEEDS).startswith("NO")
    # 4.9e12 vs 6e12 is 0.82x: not cheaper by the 0.8x margin, so one seed leaves it undecided
    mixed = {**bilinear_cheaper, "iv_mlr8": (3e12, 4.9e12, 4e12)}
    undecided = equal_compute_verdict(_costs(mixed), SEEDS)
    assert undecided.startswith("UNDECIDED") and "bilinear MLR, 8 heads vs (ii) dense, 1 head" in undecided
    assert cheaper(4e12, 5e12) and not cheaper(4.1e12, 5e12)


def test_equal_compute_rule_counts_never_reaching_the_threshold_as_infinite():
    failed_dense = {"i_dense12_half": (INF, INF, INF), "ii_dense1": (INF, 6e12, INF),
                    "iii_btt8": (2e12, 3e12, 4e12), "iv_mlr8": (3e12, 4e12, 4e12)}
    assert equal_compute_verdict(_costs(failed_dense), SEEDS).startswith("YES")  # finite beats never
    nobody = {arm: (INF, INF, INF) for arm in COMPARED}
    assert equal_compute_verdict(_costs(nobody), SEEDS) == "UNDECIDED: no compared arm reached error 0.1"
    one_bilinear_never = {**failed_dense, "iv_mlr8": (3e12, INF, 4e12)}
    assert equal_compute_verdict(_costs(one_bilinear_never), SEEDS).startswith("UNDECIDED")
    assert not cheaper(INF, INF)
    partial = {arm: v for arm, v in failed_dense.items() if arm != "iii_btt8"}
    assert equal_compute_verdict(_costs(partial), SEEDS).startswith("PARTIAL: 3")


def test_flops_to_threshold_is_the_first_evaluation_below_0_1_and_freezing_does_not_hide_it():
    flops = [10.0 * step for step in range(101)]  # 10 FLOPs per step, 100 steps
    frozen = {"evals": [{"step": 0, "error_last": 1.0}, {"step": 25, "error_last": 0.3},
                        {"step": 50, "error_last": 0.08}, {"step": 75, "error_last": 0.04}]}  # frozen at 75
    assert flops_to_threshold(frozen, flops) == 500.0
    never = {"evals": [{"step": 0, "error_last": 1.0}, {"step": 100, "error_last": 0.1}]}
    assert flops_to_threshold(never, flops) == INF
    runs = [{"arm": "iii_btt8", "lr": lr, "seed": 0, **run} for lr, run in zip(LRS, (never, frozen, never))]
    assert cost_table(runs, {"iii_btt8": flops}, ["iii_btt8"], [0]) == {("iii_btt8", 0): 500.0}  # least over LRs
    assert cost_table(runs[:2], {"iii_btt8": flops}, ["iii_btt8"], [0]) == {}  # a planned run missing


def test_shards_cover_every_planned_run_once_per_kind_and_start_with_the_decisive_runs():
    table = shards(4)
    planned = {(arm, lr, seed) for arm in arms(4) for lr in LRS for seed in SEEDS}
    cpu = [run for sid, runs in table.items() if sid.startswith("c") for run in runs]
    gpu = [run for sid, runs in table.items() if sid.startswith("g") for run in runs]
    assert sorted(cpu) == sorted(planned) == sorted(gpu) and len(cpu) == len(planned) == 54
    assert table["c1"] == [("i_dense12_half", 1e-3, 0), ("iii_btt8", 1e-3, 0)]
    assert set(table) == {f"c{k}" for k in range(1, 28)} | {"g1", "g2"}
    for sid, runs in table.items():  # a CPU shard: 2 runs of distinct arms (one process per core)
        if sid.startswith("c"):
            assert len(runs) == 2 and len({arm for arm, _, _ in runs}) == 2


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
    interrupted.save_checkpoint()  # the same runs with another step count must not resume it
    with pytest.raises(ValueError, match="another configuration"):
        ArmRunner(4, "v_dense3_rank", [1e-3, 3e-3], [0], 9, 4, tmp_path / "b", dtype=torch.float64, layers=1,
                  eval_count=32)


def test_the_sweep_and_shard_commands_write_results_files_skip_finished_runs_and_report(tmp_path, capsys):
    # the deciding command, shrunk to two arms of 2 LRs x 1 seed (each arm one stacked model), 3 steps
    from icl_rank_experiment import main

    results = tmp_path / "results"
    small = ["--d", "4", "--out", str(tmp_path / "out"), "--results", str(results), "--steps", "3", "--layers", "2",
             "--eval_every", "2"]
    threads = torch.get_num_threads()  # main() sets one thread for its runs
    try:
        main(["run", *small, "--arms", "i_dense12_half", "v_dense3_rank", "--lrs", "1e-3", "3e-3", "--seeds", "0",
              "--jobs", "1"])  # the arms one after another in this process
        assert "all arms finished" in capsys.readouterr().out
        for arm in ("i_dense12_half", "v_dense3_rank"):
            for lr in ("0.001", "0.003"):
                record = json.loads((results / "d4" / f"{arm}_lr{lr}_s0.json").read_text())
                assert record["final_step"] == 3 and record["batched_with"] == 2 and record["layers"] == 2
                assert [e["step"] for e in record["evals"]] == [0, 2, 3]
                assert record["rank_init"]["span_min"] == score_rank(4, arm) and record["device"].startswith("cpu")
                assert len((results / "d4" / f"{arm}_lr{lr}_s0.json").read_text()) < 4000
        before = (results / "d4" / "i_dense12_half_lr0.001_s0.json").read_text()
        main(["shard", "c1", *small, "--jobs", "1"])  # c1: (i) is done, (iii) at 1e-3 seed 0 trains alone
        out = capsys.readouterr().out
        assert "start i_dense12_half" not in out and "start iii_btt8 (1 runs stacked)" in out
        assert (results / "d4" / "i_dense12_half_lr0.001_s0.json").read_text() == before
        assert json.loads((results / "d4" / "iii_btt8_lr0.001_s0.json").read_text())["batched_with"] == 1
        main(["shard", "c1", *small])  # idempotent: nothing left
        assert "start" not in capsys.readouterr().out
        main(["report", *small, "--figures", str(tmp_path / "figures")])
        out = capsys.readouterr().out
        assert "VERDICT (rank, Fig. 2/3a): PARTIAL" in out and "VERDICT (equal compute, Fig. 3b): PARTIAL" in out
        assert "CPU shards left: c2, c3" in out and "shard c2 --d 4 --device cpu --jobs 2" in out
        assert (tmp_path / "figures" / "icl_rank_d4.png").exists()
        main(["plan", "--shards", *small])
        assert "| c1 | (i) 0.001 s0, (iii) 0.001 s0 | 2/2 |" in capsys.readouterr().out
        with pytest.raises(SystemExit):
            main(["run", "--d", "4", "--arms", "vii"])
        assert "--arms: unknown vii" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(["shard", "c99", *small])
        with pytest.raises(SystemExit):
            main(["arm", *small, "--arm", "ii_dense1", "--runs", "0.001"])
        assert "--runs: each run is lr:seed, got '0.001'" in capsys.readouterr().err
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
