"""The in-context-regression rank experiment (docs/results.md, "ICL rank: the decisive design"): its decision rules
as coded in scripts/icl_rank_report.py (rank, equal compute), its registered runs and shards, its arms (measured score
rank, equal initial logit scale), its FLOP count, its data streams, the batched arm runner's resume and compiled
step, and runs of the shard, report and pilot commands at tiny size."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from icl_rank_arms import CAPS, DESIGN_SEEDS, SCHEDULE_STEPS, SHARDS, design_runs  # noqa: E402
from icl_rank_experiment import (EVAL_STREAM, TRAIN_STREAM, ArmRunner, arms, build, eval_prompts,  # noqa: E402
                                 generator_seed, schedule, score_rank, train_batch, training_flops)
from icl_rank_report import (Cost, cheaper, cost_table, equal_compute_verdict, flops_to_threshold,  # noqa: E402
                             observations, verdict)

LOW = "i_dense12_half"


def _runs(finals: dict, overrides: dict | None = None, solved_step: int = 100) -> list[dict]:
    """{arm: final error in seeds 1, 2, 3} -> a finished run for every registered run of those arms, each with that
    final error (an arm's two LRs alike); ``overrides`` {(arm, lr, seed): final} replaces single runs and ``None``
    drops one. Each run's evaluations: 1.0 at step 0, then its final error at ``solved_step``."""
    values = {(arm, lr, seed): finals[arm][DESIGN_SEEDS.index(seed)] for arm, lr, seed in design_runs()
              if arm in finals}
    values.update(overrides or {})
    return [{"arm": arm, "lr": lr, "seed": seed, "final": value, "solved_at": None, "final_step": CAPS[arm],
             "evals": [{"step": 0, "error_last": 1.0}, {"step": solved_step, "error_last": value}]}
            for (arm, lr, seed), value in values.items() if value is not None]


SOLVED = {"iii_btt8": (0.03, 0.01, 0.02), "v_dense3_rank": (0.04, 0.02, 0.03), "ii_dense1": (0.6, 0.4, 0.7)}
FAILING = {LOW: (0.9, 0.7, 0.8)}


def test_the_registered_design_is_seeds_1_to_3_with_the_failing_arm_given_twice_the_steps_and_a_second_lr():
    runs = design_runs()
    assert len(runs) == len(set(runs)) == 14  # each run in exactly one shard
    assert sorted(seed for arm, lr, seed in runs if arm == LOW and lr == 1e-3) == [1, 2, 3]
    assert sorted(seed for arm, lr, seed in runs if arm == LOW and lr == 3e-4) == [1, 2]
    for arm in ("iii_btt8", "v_dense3_rank", "ii_dense1"):
        assert sorted((lr, seed) for a, lr, seed in runs if a == arm) == [(1e-3, 1), (1e-3, 2), (1e-3, 3)]
    assert CAPS == {LOW: 40_000, "iii_btt8": 20_000, "v_dense3_rank": 20_000, "ii_dense1": 20_000}
    assert 0 not in {seed for _, _, seed in runs}  # seed 0 is the calibration, never ruled on
    for shard in SHARDS.values():  # a shard stacks an arm's runs; its arms train one after another in one process
        assert len(shard) <= 6


def test_rank_rule_is_yes_when_btt_and_the_rank_control_solve_everywhere_and_every_low_rank_run_stays_above_0_5():
    assert verdict(_runs({**SOLVED, **FAILING})).startswith("YES")
    without_observation = {arm: v for arm, v in SOLVED.items() if arm != "ii_dense1"}
    assert verdict(_runs({**without_observation, **FAILING})).startswith("YES")  # (ii) is not an input


def test_rank_rule_is_no_from_one_finished_low_rank_run_below_0_1_even_before_the_others():
    one = [run for run in _runs(FAILING, {(LOW, 3e-4, 2): 0.08}) if run["lr"] == 3e-4 and run["seed"] == 2]
    no = verdict(one)
    assert no.startswith("NO") and "(i) lr 0.0003 seed 2 (0.080)" in no
    assert verdict(_runs({**SOLVED, **FAILING}, {(LOW, 1e-3, 3): 0.099})).startswith("NO")


def test_rank_rule_is_undecided_with_the_reasons_in_the_middle_and_when_a_control_fails():
    middle = verdict(_runs({**SOLVED, **FAILING}, {(LOW, 3e-4, 1): 0.3}))
    assert middle.startswith("UNDECIDED") and "(i) lr 0.0003 seed 1 (0.300) ends between 0.1 and 0.5" in middle
    control = verdict(_runs({**SOLVED, **FAILING, "v_dense3_rank": (0.04, 0.3, 0.02)}))
    assert control.startswith("UNDECIDED") and "(v) lr 0.001 seed 2 (0.300) does not end below 0.1" in control
    edge = verdict(_runs({**SOLVED, LOW: (0.5, 0.7, 0.8)}))  # 0.5 is not above 0.5
    assert edge.startswith("UNDECIDED")


def test_rank_rule_is_partial_until_every_input_run_has_finished():
    assert verdict(_runs({**SOLVED, **FAILING}, {("iii_btt8", 1e-3, 3): None})).startswith("PARTIAL: 1 of the rule's "
                                                                                          "11 runs")
    assert verdict(_runs({**SOLVED, **FAILING}, {(LOW, 3e-4, 1): None})).startswith("PARTIAL")
    assert verdict([]).startswith("PARTIAL")
    # the observation (ii) missing does not hold the rule back
    assert verdict(_runs({"iii_btt8": SOLVED["iii_btt8"], "v_dense3_rank": SOLVED["v_dense3_rank"],
                          **FAILING})).startswith("YES")


def test_the_one_head_control_and_the_calibration_seed_are_reported_as_observations():
    runs = _runs({**SOLVED, **FAILING})
    calibration = [{"arm": "iii_btt8", "lr": 1e-3, "seed": 0, "final": 0.049, "solved_at": 5250}]
    one_head, seed0 = observations(runs, calibration)
    assert "(ii) dense, 1 head" in one_head and "seed 2 0.400" in one_head and "below 0.1 in 0 of 3" in one_head
    assert seed0.startswith("seed 0 calibration") and "not ruled on" in seed0 and "solved at 5,250" in seed0


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


COMPARED = ("i_dense12_half", "ii_dense1", "iii_btt8")
INF = math.inf
BUDGET = {LOW: 2e13, "ii_dense1": 1e13, "iii_btt8": 1.2e13}  # total FLOPs at the caps (censoring budgets)


def _costs(values: dict) -> dict:
    return {(arm, seed): Cost(value, BUDGET[arm]) for arm, per_seed in values.items()
            for seed, value in zip(DESIGN_SEEDS, per_seed)}


def test_equal_compute_rule_compares_flops_to_error_0_1_with_a_0_8_margin():
    dense = {LOW: (9e12, 8e12, 1e13), "ii_dense1": (5e12, 6e12, 5e12)}
    assert equal_compute_verdict(_costs({**dense, "iii_btt8": (2e12, 3e12, 4e12)})).startswith("YES")
    assert equal_compute_verdict(_costs({**dense, "iii_btt8": (8e12, 9e12, 9e12)})).startswith("NO")
    # 4.9e12 vs 6e12 is 0.82x: not cheaper by the margin in seed 2
    undecided = equal_compute_verdict(_costs({**dense, "iii_btt8": (2e12, 4.9e12, 4e12)}))
    assert undecided.startswith("UNDECIDED") and "seed 2: (iii) is not cheaper than (ii)" in undecided
    assert cheaper(Cost(4e12, 9e12), Cost(5e12, 9e12)) and not cheaper(Cost(4.1e12, 9e12), Cost(5e12, 9e12))


def test_equal_compute_rule_compares_a_finite_cost_with_0_8x_a_censored_runs_total_flops():
    # (i) never reaches 0.1 within its 2e13 FLOPs: (iii) at <= 1.6e13 is cheaper, beyond that it cannot tell
    never = {LOW: (INF, INF, INF), "ii_dense1": (INF, 6e12, INF)}
    assert equal_compute_verdict(_costs({**never, "iii_btt8": (2e12, 3e12, 4e12)})).startswith("YES")
    assert cheaper(Cost(1.6e13, 1.7e13), Cost(INF, 2e13)) is True
    assert cheaper(Cost(1.7e13, 1.8e13), Cost(INF, 2e13)) is None  # the latent flaw: not "cheaper than infinity"
    assert cheaper(Cost(INF, 1e13), Cost(INF, 2e13)) is False
    late = {LOW: (INF, INF, INF), "ii_dense1": (INF, INF, INF), "iii_btt8": (2e12, 3e12, 9e12)}
    undecided = equal_compute_verdict(_costs(late))  # 9e12 > 0.8 x (ii)'s censored 1e13
    assert undecided.startswith("UNDECIDED") and "seed 3: (ii) stopped (never below 0.1) at 1e+13 FLOPs" in undecided
    early = {LOW: (INF, INF, INF), "ii_dense1": (INF, INF, INF), "iii_btt8": (2e12, 3e12, 8e12)}
    assert equal_compute_verdict(_costs(early)).startswith("YES")
    dense_only = {LOW: (INF, INF, INF), "ii_dense1": (5e12, 5e12, 5e12), "iii_btt8": (INF, INF, INF)}
    assert equal_compute_verdict(_costs(dense_only)).startswith("NO")
    partial = {arm: v for arm, v in early.items() if arm != "iii_btt8"}
    assert equal_compute_verdict(_costs(partial)).startswith("PARTIAL: 3")


def test_flops_to_threshold_is_the_first_evaluation_below_0_1_and_freezing_does_not_hide_it():
    flops = [10.0 * step for step in range(101)]  # 10 FLOPs per step, 100 steps
    frozen = {"final_step": 75, "evals": [{"step": 0, "error_last": 1.0}, {"step": 25, "error_last": 0.3},
                                          {"step": 50, "error_last": 0.08}, {"step": 75, "error_last": 0.04}]}
    assert flops_to_threshold(frozen, flops) == Cost(500.0, 750.0)
    never = {"final_step": 100, "evals": [{"step": 0, "error_last": 1.0}, {"step": 100, "error_last": 0.1}]}
    assert flops_to_threshold(never, flops) == Cost(INF, 1000.0)
    runs = [{"arm": LOW, "lr": lr, "seed": 1, **run} for lr, run in ((1e-3, never), (3e-4, frozen))]
    assert cost_table(runs, {LOW: flops}, [LOW], [1]) == {(LOW, 1): Cost(500.0, 1000.0)}  # least over its LRs
    assert cost_table(runs[:1], {LOW: flops}, [LOW], [1]) == {}  # a registered run missing


def test_a_stacks_cost_per_step_is_its_wall_over_the_steps_the_stack_ran_not_a_frozen_runs(tmp_path):
    from icl_rank_experiment import measured_cpu_ms
    from icl_rank_report import stack_ms_per_step

    def record(arm, lr, seed, final_step, wall, runs=3, device="cpu, 1 thread(s)"):
        return {"arm": arm, "lr": lr, "seed": seed, "final_step": final_step, "wall_s": wall, "batched_with": runs,
                "device": device, "final": {"error_last": 0.04}, "evals": []}

    # three runs stacked for 20,000 steps (one never froze): 4,000 s of wall is 200 ms a step of the stack, although
    # the run frozen at step 5,000 would say 800
    btt = [record("iii_btt8", 1e-3, 1, 10_000, 3999.0), record("iii_btt8", 1e-3, 2, 5_000, 3999.5),
           record("iii_btt8", 1e-3, 3, 20_000, 4000.0)]
    # every run froze: the stack stopped at the last freeze, step 8,000
    rank = [record("v_dense3_rank", 1e-3, seed, step, 800.0) for seed, step in ((1, 8_000), (2, 4_000), (3, 2_000))]
    # (i) in two stacks: the slower one's rate is the arm's
    low = [record(LOW, 1e-3, seed, 40_000, 8_000.0) for seed in (1, 2, 3)] + \
        [record(LOW, 3e-4, seed, 10_000, 3_000.0, runs=2) for seed in (1, 2)]
    gpu = [record("ii_dense1", 1e-3, 1, 20_000, 100.0, device="NVIDIA H100")]
    rates = stack_ms_per_step(btt + rank + low + gpu)
    assert rates[("iii_btt8", 1e-3, 3, "cpu, 1 thread(s)")] == pytest.approx(200.0)
    assert rates[("v_dense3_rank", 1e-3, 3, "cpu, 1 thread(s)")] == pytest.approx(100.0)
    assert rates[(LOW, 3e-4, 2, "cpu, 1 thread(s)")] == pytest.approx(300.0)
    for run in btt + rank + low + gpu:
        (tmp_path / f"{run['arm']}_lr{run['lr']:g}_s{run['seed']}.json").write_text(
            json.dumps({**run, "final": {"error_last": 0.04}}))
    assert measured_cpu_ms(tmp_path) == pytest.approx({"iii_btt8": 200.0, "v_dense3_rank": 100.0, LOW: 300.0})


def test_the_low_rank_arms_cost_to_error_0_1_is_reported_against_the_rank_control():
    from icl_rank_report import cost_ratio_line, cost_ratios

    flops = {arm: [10.0 * step for step in range(40_001)] for arm in (LOW, "v_dense3_rank")}

    def run(arm, lr, seed, crossed):  # below 0.1 first at step ``crossed`` (None: never)
        evals = [{"step": 0, "error_last": 1.0}] + \
            ([{"step": crossed, "error_last": 0.08}] if crossed else [{"step": 20_000, "error_last": 0.3}])
        return {"arm": arm, "lr": lr, "seed": seed, "final_step": evals[-1]["step"], "evals": evals}

    runs = [run("v_dense3_rank", 1e-3, 1, 1_000), run("v_dense3_rank", 1e-3, 2, 2_000),
            run("v_dense3_rank", 1e-3, 3, None), run(LOW, 1e-3, 1, 3_800), run(LOW, 1e-3, 2, None),
            run(LOW, 1e-3, 3, 9_000), run(LOW, 3e-4, 1, 500)]
    ratios = cost_ratios(runs, flops)
    assert ratios == {(1e-3, 1): pytest.approx(3.8), (1e-3, 2): math.inf, (1e-3, 3): None,
                      (3e-4, 1): pytest.approx(0.5)}  # (i) at 3e-4 seed 2 has not finished: absent
    assert cost_ratio_line(ratios) == ("(i) against (v), training FLOPs to error 0.1, (i)'s over (v)'s: lr 0.001: "
                                       "seed 1 3.8x, seed 2 never, seed 3 -; lr 0.0003: seed 1 0.5x")
    assert cost_ratio_line({}) is None


def test_no_training_step_draws_the_evaluation_prompts():
    # every training draw of the design (4 seeds incl. the calibration, 40,000 steps) against each evaluation draw
    evaluation = {generator_seed(seed, EVAL_STREAM, 0) for seed in range(4)}
    training = {generator_seed(seed, TRAIN_STREAM, step) for seed in range(4) for step in range(40_000)}
    assert len(training) == 4 * 40_000 and not evaluation & training
    xs, _ = eval_prompts(4, 1, 8)
    for step in (0, 7_919, 19_999):  # 7,919 was the earlier formula's collision
        assert not torch.equal(train_batch(4, 1, step)[0][:8], xs)


def test_every_run_follows_the_same_schedule_whatever_its_cap():
    assert SCHEDULE_STEPS == 20_000
    assert [schedule(s, SCHEDULE_STEPS, 4, 1e-3)[2] for s in (0, 599, 600, 1199, 1200, 39_999)] == [4, 4, 6, 6, 8, 8]
    assert schedule(39_999, SCHEDULE_STEPS, 4, 1e-3)[0] == pytest.approx(1e-3)
    flops_40k = training_flops(4, LOW, 40_000)
    assert flops_40k[:20_001] == training_flops(4, LOW, 20_000)  # the first 20k steps are the 20k-cap run's


def test_training_flops_follow_the_curriculum_and_rank_the_arms_by_cost():
    from hf_structattn.flops import flops_per_token

    steps = 200
    for arm in COMPARED:
        cumulative = training_flops(4, arm, steps, schedule_steps=steps)
        per_step = [b - a for a, b in zip(cumulative, cumulative[1:])]
        assert len(cumulative) == steps + 1 and cumulative[0] == 0
        full = flops_per_token(build(4, arm).config, 16, training=True) * 64 * 16  # 64 prompts of 2N = 16 tokens
        assert per_step[-1] == pytest.approx(full, rel=1e-12)
        assert per_step[0] < per_step[-1]  # the curriculum starts with d = 4 points (8 tokens)
        assert [schedule(s, steps, 4, 1.0)[2] for s in (0, 6, 12)] == [4, 6, 8]
    # the bilinear arms spend more per step than 1-head dense at D = 24 (BTT: full-width keys, MLR: 5 dims + V)
    cost = {arm: training_flops(4, arm, 10, schedule_steps=10)[-1] for arm in COMPARED}
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
    for other in (dict(steps=9), dict(schedule_steps=16)):  # another cap or another schedule must not resume it
        with pytest.raises(ValueError, match="another configuration"):
            ArmRunner(4, "v_dense3_rank", [1e-3, 3e-3], [0], other.get("steps", 8), 4, tmp_path / "b",
                      dtype=torch.float64, layers=1, eval_count=32, schedule_steps=other.get("schedule_steps"))


def test_the_run_shard_and_report_commands_write_results_files_skip_finished_runs_and_report(tmp_path, capsys):
    # a custom grid of two arms (each one stacked model of 2 LRs), then shard r1 shrunk to 3 steps: (iii) in seeds
    # 1-3 as one stack; eager steps (the compiled step is tests/test_batched_runs.py's)
    from icl_rank_experiment import main

    results = tmp_path / "results"
    small = ["--out", str(tmp_path / "out"), "--results", str(results), "--steps", "3", "--layers", "2",
             "--eval_every", "2", "--eager"]
    threads = torch.get_num_threads()  # main() sets one thread for its runs
    try:
        main(["run", *small, "--arms", "i_dense12_half", "v_dense3_rank", "--lrs", "1e-3", "3e-3", "--seeds", "1",
              "--jobs", "1"])
        assert "all arms finished" in capsys.readouterr().out
        for arm in ("i_dense12_half", "v_dense3_rank"):
            for lr in ("0.001", "0.003"):
                record = json.loads((results / f"{arm}_lr{lr}_s1.json").read_text())
                assert record["final_step"] == 3 and record["batched_with"] == 2 and record["layers"] == 2
                assert record["schedule_steps"] == 3 and [e["step"] for e in record["evals"]] == [0, 2, 3]
                assert record["rank_init"]["span_min"] == score_rank(4, arm) and record["device"].startswith("cpu")
                assert len((results / f"{arm}_lr{lr}_s1.json").read_text()) < 4000
        before = (results / "i_dense12_half_lr0.001_s1.json").read_text()
        main(["shard", "r1", *small])
        out = capsys.readouterr().out
        assert "start iii_btt8 (3 runs stacked)" in out and "start i_dense12_half" not in out
        assert (results / "i_dense12_half_lr0.001_s1.json").read_text() == before
        assert json.loads((results / "iii_btt8_lr0.001_s3.json").read_text())["batched_with"] == 3
        main(["shard", "r1", *small])  # idempotent: nothing left
        assert "start" not in capsys.readouterr().out
        main(["report", *small, "--figures", str(tmp_path / "figures"), "--calibration", str(tmp_path / "none")])
        out = capsys.readouterr().out
        assert "VERDICT (rank, Fig. 2/3a): PARTIAL" in out and "VERDICT (equal compute, Fig. 3b, bilinear BTT " \
            "only): PARTIAL" in out
        assert "| r1 | (iii) 0.001 s1,2,3; 20,000 | 3/3 |" in out and "shard r2   (shards left: r2, r3, r4)" in out
        assert (tmp_path / "figures" / "icl_rank_decisive_d4.png").exists()
        main(["plan", "--shards", *small])
        assert "| r1 | (iii) 0.001 s1, (iii) 0.001 s2, (iii) 0.001 s3 | 3/3 |" in capsys.readouterr().out
        for argv, message in ((["run", "--arms", "vii"], "--arms: unknown vii"),
                              (["shard", "r9", *small], None),
                              (["arm", *small, "--arm", "ii_dense1", "--runs", "0.001"],
                               "--runs: each run is lr:seed, got '0.001'"),
                              (["report", "--d", "8"], "--d 8: the registered design is at d = 4"),
                              (["run", "--lrs", "1e-3"], "--lrs and --seeds come together")):
            with pytest.raises(SystemExit):
                main(argv)
            if message:
                assert message in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_a_custom_grid_writes_its_results_under_its_out_folder_not_the_designs(tmp_path, capsys):
    from icl_rank_experiment import RESULTS, main

    design_folder = Path(RESULTS)  # relative to the working directory, as the command writes it
    before = sorted(design_folder.iterdir())
    threads = torch.get_num_threads()
    try:
        main(["run", "--d", "8", "--out", str(tmp_path / "grid"), "--arms", "v_dense3_rank", "--lrs", "1e-3",
              "--seeds", "1", "--steps", "2", "--layers", "1", "--eval_every", "2", "--eager", "--jobs", "1"])
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "grid" / "results" / "v_dense3_rank_lr0.001_s1.json").read_text())
    assert record["d"] == 8 and record["final_step"] == 2
    assert sorted(design_folder.iterdir()) == before


def test_budget_s_covers_the_whole_command_not_each_arm(tmp_path, capsys):
    # a spent budget stops the first arm at its first chunk (checkpointed) and starts no other arm
    from icl_rank_experiment import main

    small = ["--out", str(tmp_path / "out"), "--results", str(tmp_path / "results"), "--steps", "40", "--layers",
             "1", "--eval_every", "20", "--eager", "--jobs", "1"]
    threads = torch.get_num_threads()
    try:
        main(["run", *small, "--arms", "i_dense12_half", "v_dense3_rank", "--lrs", "1e-3", "--seeds", "1",
              "--budget-s", "0.001"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "i_dense12_half: stopped by --budget-s" in out and "--budget-s spent: v_dense3_rank not started" in out
    assert "stopped by --budget-s after" in out and "all arms finished" not in out
    assert list((tmp_path / "out").glob("i_dense12_half_*.stack/checkpoint.pt"))
    # no results file; the stopped stack's state is carried in the results folder (a new checkout lacks outputs/)
    assert sorted(path.name for path in (tmp_path / "results").iterdir()) == ["carried"]
    assert list((tmp_path / "results" / "carried").glob("i_dense12_half_*.stack/checkpoint.pt"))


def test_a_stopped_stack_continues_on_another_machine_from_the_carried_state(tmp_path, capsys):
    """Stopped by its budget with one working folder, finished with another (a new checkout: no outputs/), it equals
    the run trained at once; the carried state is gone once the run has its results file."""
    from icl_rank_experiment import main

    common = ["--steps", "40", "--layers", "1", "--eval_every", "20", "--eager", "--jobs", "1", "--arms",
              "ii_dense1", "--lrs", "1e-3", "--seeds", "1"]
    threads = torch.get_num_threads()
    try:
        results = str(tmp_path / "results")
        main(["run", "--out", str(tmp_path / "first"), "--results", results, *common, "--budget-s", "0.001"])
        main(["run", "--out", str(tmp_path / "second"), "--results", results, *common])
        main(["run", "--out", str(tmp_path / "once"), "--results", str(tmp_path / "once_results"), *common])
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()

    def first_record(machine):  # the evaluation at step 0, with the wall time it was measured at
        return (tmp_path / machine / "ii_dense1_lr0.001_s1" / "progress.jsonl").read_text().splitlines()[0]

    assert first_record("second") == first_record("first")  # the second machine resumed the first's stack
    segmented = json.loads((tmp_path / "results" / "ii_dense1_lr0.001_s1.json").read_text())
    once = json.loads((tmp_path / "once_results" / "ii_dense1_lr0.001_s1.json").read_text())
    assert segmented["final_step"] == once["final_step"] == 40
    def metrics(record):
        return [(e["step"], e["error_last"], e["mse_all"]) for e in record["evals"]]

    assert [step for step, *_ in metrics(segmented)] == [0, 20, 40]
    for got, want in zip(metrics(segmented), metrics(once)):
        assert got == pytest.approx(want, rel=1e-5)  # results files round to 6 significant digits
    assert not list((tmp_path / "results" / "carried").iterdir())


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
