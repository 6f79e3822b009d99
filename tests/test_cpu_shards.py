"""The CPU designs' shard machinery (sweep): runs packed into shards of at most two CPU-hours
at measured rates, long runs cut into segments that continue each other's checkpoint, the committed shard records,
and the shared rule helpers. Real tiny runs, no mocks."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from sweep import (ArmSpec, StackedArm, cpu_pilot, cpu_rates, cpu_shards, diverged,  # noqa: E402
                   evaluations_between, lower_in_every_seed, majority, read_run_jsons, read_shard_records,
                   run_cpu_shard, run_minutes, run_score, runnable_shards, segment_done)


def _unit(name, steps, rate="r", lr=1e-2, seed=0, eval_every=None):
    return dict(name=name, arm=name.split(" ")[0], lr=lr, seed=seed, steps=steps,
                eval_every=eval_every or max(1, steps // 4), rate=rate)


RATES = {"r": {"step_s": 6.0, "eval_s": 30.0, "setup_s": 60.0}}  # 0.1 min a step


def test_short_runs_pack_and_a_long_run_is_cut_into_segments_that_continue_each_other():
    assert evaluations_between(100, 25, 0, 100) == 5 and evaluations_between(100, 25, 50, 100) == 2
    assert evaluations_between(10, 3, 0, 10) == 5  # 0, 3, 6, 9 and the end
    # 2 + 100 x 0.1 + 5 x 0.5 = 14.5 minutes
    assert run_minutes(_unit("a", 100), RATES) == pytest.approx(1 + 10 + 2.5)
    stages = [("g", [_unit(f"short{k}", 100) for k in range(5)]), ("x", []),
              ("s", [_unit("long s0", 2000), _unit("other s0", 100)])]
    table = cpu_shards(stages, RATES, limit=30.0)
    assert all(sum(s["minutes"] for s in members) <= 30.0 for members in table.values())
    assert [len(table[sid]) for sid in ("g1", "g2", "g3")] == [2, 2, 1] and "x1" not in table
    long = [s for members in table.values() for s in members if s["name"] == "long s0"]
    # 2,000 steps = 200 minutes of steps: at least 7 segments of at most 30 minutes, each paying its own setup
    assert len(long) >= 7 and all(len(table[s["shard"]]) == 1 for s in long)
    assert [(s["start"], s["until"]) for s in long][0][0] == 0 and long[-1]["until"] == 2000
    assert all(a["until"] == b["start"] for a, b in zip(long, long[1:]))
    assert long[0]["after"] is None and all(b["after"] == a["shard"] for a, b in zip(long, long[1:]))
    assert table[f"s{len(long) + 1}"][0]["name"] == "other s0"  # the short run after it gets its own shard


def test_a_run_with_an_unknown_learning_rate_is_never_ready_and_dependencies_order_the_rest():
    table = cpu_shards([("s", [_unit("long s0", 400), _unit("later s1", 100, lr=None)])], RATES, limit=30.0)
    names, records = set(), {}
    assert runnable_shards(table, names, records) == ["s1"]  # s2 continues s1; s3 waits for its LR
    records["s1"] = {"reached": {"long_lr0.01_s0": table["s1"][0]["until"]}, "thread_s": 60.0}
    assert segment_done(table["s1"][0], names, records) and runnable_shards(table, names, records) == ["s2"]
    names.add("long_lr0.01_s0")  # the run finished: every segment of it is done
    assert all(segment_done(s, names, {}) for sid in ("s1", "s2") for s in table[sid])
    assert runnable_shards(table, names, records) == []


def _spec(name="tiny", dtype=torch.float64):
    """A real model (2-layer MLP regressor) whose loss and evaluation are float64 functions of its batches."""
    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def batch(seed, step):
        generator = torch.Generator().manual_seed(1000 * seed + step)
        x = torch.randn(16, 3, generator=generator, dtype=dtype)
        return x, x.sum(-1, keepdim=True).sin()

    def loss(forward, batch):
        x, y = batch
        return ((forward(input=x) - y) ** 2).mean()

    fixed = batch(99, 0)

    def evaluate(stack):
        return {"loss": stack.evaluate(loss, tuple(t[None].expand(stack.runs, *t.shape) for t in fixed))}

    return ArmSpec(name=name, build=build, batch=batch, loss=loss, evaluate=evaluate, flops_per_step=1.0)


def test_a_run_trained_in_segments_and_budget_stops_equals_it_trained_at_once_in_float64(tmp_path):
    steps = 24
    unit = dict(name="tiny s0", arm="tiny", lr=3e-2, seed=0, steps=steps, eval_every=6, rate="r")
    table = cpu_shards([("s", [unit])], {"r": {"step_s": 60.0, "eval_s": 0.0, "setup_s": 0.0}}, limit=13.0)
    assert list(table) == ["s1", "s2"] and table["s2"][0]["start"] == 12
    work, results = tmp_path / "work", tmp_path / "results"
    with pytest.raises(SystemExit, match="continues from step 12, but its checkpoint .* is at step 0: run shard s1"):
        run_cpu_shard("s2", table, lambda segment: _spec(), work, results, None, dtype=torch.float64)
    # s1 with a budget that stops it after its first chunk of steps, then resumed by the same command
    assert not run_cpu_shard("s1", table, lambda segment: _spec(), work, results, 1e-9, dtype=torch.float64,
                             chunk=4, checkpoints=1)
    assert StackedArm.checkpoint_step(work, "tiny", [3e-2], [0]) == 4
    assert run_cpu_shard("s1", table, lambda segment: _spec(), work, results, None, dtype=torch.float64, chunk=4,
                         checkpoints=1)
    assert StackedArm.checkpoint_step(work, "tiny", [3e-2], [0]) == 12
    record = read_shard_records(results)["s1"]
    assert record["invocations"] == 2 and record["done"] and record["reached"] == {"tiny_lr0.03_s0": 12}
    assert not read_run_jsons(results)  # the run is not finished: no results file yet
    assert run_cpu_shard("s2", table, lambda segment: _spec(), work, results, None, dtype=torch.float64, chunk=4,
                         checkpoints=1)
    (finished,) = read_run_jsons(results)
    assert finished["name"] == "tiny_lr0.03_s0" and [e["step"] for e in finished["evals"]] == [0, 6, 12, 18, 24]
    assert StackedArm.checkpoint_step(work, "tiny", [3e-2], [0]) is None  # removed with the checkpoint
    # the same run without interruption
    once = StackedArm(_spec(), [3e-2], [0], steps, 6, tmp_path / "once", checkpoint_every=1000,
                      dtype=torch.float64)
    assert once.run_until()
    segmented = json.loads((work / "tiny_lr0.03_s0" / "result.json").read_text())
    reference = once.finish()[0]
    assert segmented["final"]["loss"] == pytest.approx(reference["final"]["loss"], rel=1e-12, abs=0)
    assert segmented["final"]["loss"] < json.loads((work / "tiny_lr0.03_s0" / "progress.jsonl").read_text()
                                                   .splitlines()[0])["loss"]  # it learned
    # a rerun of a finished shard does nothing
    assert run_cpu_shard("s2", table, lambda segment: pytest.fail("built a spec"), work, results, None)


def test_an_unfinished_run_continues_on_another_machine_from_the_state_carried_in_the_results(tmp_path):
    """A session's checkout has no ignored files: the run's state between segments travels in the committed
    results folder, and the segmented run on two machines equals the run trained at once."""
    unit = dict(name="tiny s0", arm="tiny", lr=3e-2, seed=0, steps=24, eval_every=6, rate="r")
    table = cpu_shards([("s", [unit])], {"r": {"step_s": 60.0, "eval_s": 0.0, "setup_s": 0.0}}, limit=13.0)
    results = tmp_path / "results"
    assert run_cpu_shard("s1", table, lambda segment: _spec(), tmp_path / "first", results, None,
                         dtype=torch.float64, chunk=4, checkpoints=1)
    carried = results / "carried"
    assert sorted(p.name for p in carried.iterdir()) == ["tiny_lr0.03_s0", "tiny_lr0.03_s0.stack"]
    assert run_cpu_shard("s2", table, lambda segment: _spec(), tmp_path / "second", results, None,
                         dtype=torch.float64, chunk=4, checkpoints=1)
    assert not carried.exists() or not any(carried.iterdir())  # the results file took their place
    (finished,) = read_run_jsons(results)
    assert [e["step"] for e in finished["evals"]] == [0, 6, 12, 18, 24]
    once = StackedArm(_spec(), [3e-2], [0], 24, 6, tmp_path / "once", checkpoint_every=1000, dtype=torch.float64)
    assert once.run_until()
    assert finished["final"]["loss"] == pytest.approx(once.finish()[0]["final"]["loss"], rel=1e-12, abs=0)


def test_every_evaluation_record_carries_the_stacks_thread_time_across_resumes(tmp_path):
    def records(root):
        return [json.loads(line) for line in (root / "tiny_lr0.03_s0" / "progress.jsonl").read_text().splitlines()]

    arm = StackedArm(_spec(), [3e-2], [0], 12, 3, tmp_path / "a", checkpoint_every=6, chunk=3, dtype=torch.float64)
    assert not arm.run_until(until=6)  # stops with a checkpoint at step 6; a new process resumes from it
    assert StackedArm(_spec(), [3e-2], [0], 12, 3, tmp_path / "a", checkpoint_every=6, chunk=3,
                      dtype=torch.float64).run_until()
    evals = records(tmp_path / "a")
    assert [e["step"] for e in evals] == [0, 3, 6, 9, 12]
    threads = [e["thread"] for e in evals]
    assert all(t > 0 for t in threads) and threads == sorted(threads)  # cumulative over both processes
    assert all(0 < e["eval_thread"] <= e["thread"] for e in evals)
    assert [e["eval_thread"] for e in evals] == sorted(e["eval_thread"] for e in evals)
    # a checkpoint written before the thread time was kept: the records after the resume say so (null), not a
    # count that restarts from zero
    arm = StackedArm(_spec(), [3e-2], [0], 12, 3, tmp_path / "b", checkpoint_every=6, chunk=3, dtype=torch.float64)
    assert not arm.run_until(until=6)
    state = torch.load(arm.checkpoint, weights_only=True)
    del state["thread"], state["eval_thread"]
    torch.save(state, arm.checkpoint)
    assert StackedArm(_spec(), [3e-2], [0], 12, 3, tmp_path / "b", checkpoint_every=6, chunk=3,
                      dtype=torch.float64).run_until()
    evals = records(tmp_path / "b")
    assert [e["thread"] is None for e in evals] == [False, False, False, True, True]
    assert [e["eval_thread"] is None for e in evals] == [False, False, False, True, True]


def test_a_diverged_run_scores_worse_than_any_other_and_two_diverged_runs_tie():
    def run(final, start=2.0):
        return {"final": {"loss": final}, "evals": [{"step": 0, "loss": start}, {"step": 10, "loss": final}]}

    assert run_score(run(1.5), "loss") == 1.5
    assert run_score(run(float("nan")), "loss") == math.inf  # NaN
    assert run_score(run(2.5), "loss") == math.inf  # ended above the untrained model's loss
    assert run_score(run(2.0), "loss") == 2.0  # at the start exactly: learned nothing, did not diverge
    assert run_score({"final": {"loss": 2.5}}, "loss") == 2.5  # no step-0 record to compare with
    assert diverged({"final": {"loss": float("inf")}}, "loss")
    best = {("m", 1, 0): math.inf, ("m", 1, 1): 1.0, ("d", 1, 0): 1.2, ("d", 1, 1): 1.2}
    assert lower_in_every_seed(best, "d", "m", 1, (0,), 0.01)  # m diverged: d is lower, by any margin
    assert not lower_in_every_seed(best, "m", "d", 1, (0, 1), 0.01)
    assert lower_in_every_seed(best, "m", "d", 1, (1,), 0.01)
    best["d", 1, 0] = math.inf
    assert not lower_in_every_seed(best, "d", "m", 1, (0,), 0.01) and not lower_in_every_seed(best, "m", "d", 1, (0,),
                                                                                               0.01)


def test_the_shards_are_sized_by_a_committed_cpu_pilot_and_the_rule_helpers(tmp_path):
    assumed = {"a": {"step_s": 1.0, "eval_s": 1.0, "setup_s": 1.0}, "b": {"step_s": 2.0, "eval_s": 2.0, "setup_s": 2.0}}
    assert cpu_rates(tmp_path, assumed) == (assumed, "assumed (no CPU pilot committed yet)")
    pilot = {"design": "cpu", "machine": "Some CPU", "arms": {
        "a": {"measured": True, "step_s": 0.5, "eval_s": 3.0, "setup_s": 9.0},
        "b": {"measured": False, "step_s": 2.0, "eval_s": 2.0, "setup_s": 2.0}}}
    (tmp_path / "pilot.json").write_text(json.dumps(pilot))
    rates, source = cpu_rates(tmp_path, assumed)
    assert rates["a"] == {"step_s": 0.5, "eval_s": 3.0, "setup_s": 9.0} and rates["b"] == assumed["b"]
    assert source == "measured by the CPU pilot (Some CPU, one thread); assumed for b"
    best = {("m", 1, 0): 1.0, ("m", 1, 1): 1.0, ("d", 1, 0): 1.01, ("d", 1, 1): 1.5}
    assert lower_in_every_seed(best, "m", "d", 1, (0, 1), 0.01)
    assert not lower_in_every_seed(best, "m", "d", 1, (0, 1), 0.02)
    assert majority(1, (256,)) and majority(2, (1, 2, 3)) and not majority(1, (1, 2, 3))


def test_the_cpu_pilot_measures_each_arm_and_refuses_to_resize_shards_that_have_started(tmp_path):
    import time

    def spec():
        return _spec(dtype=torch.float32)  # the pilot builds float32 models, as the shards do

    arms = [("r", spec, False, 16), ("left", spec, False, 16)]
    assumed = {key: {"step_s": 9.0, "eval_s": 9.0, "setup_s": 9.0} for key in ("r", "left")}
    summary = cpu_pilot(arms[:1], 0.5, tmp_path / "out", tmp_path / "results", 60.0, time.perf_counter(), assumed)
    arm = summary["arms"]["r"]
    assert arm["measured"] and 0 < arm["step_s"] < 1 and arm["eval_s"] > 0 and arm["setup_s"] >= 0.5
    # step_s is kept to 4 digits
    assert len(arm["losses"]) == 7 and arm["units_per_s"] == pytest.approx(16 / arm["step_s"], rel=0.1)
    rates, _ = cpu_rates(tmp_path / "results", assumed)
    assert rates["r"]["step_s"] == arm["step_s"] and rates["left"] == assumed["left"]
    late = cpu_pilot(arms, 0.0, tmp_path / "late", None, 0.0, time.perf_counter() - 1, assumed)  # budget spent
    assert not late["arms"]["left"]["measured"] and late["arms"]["left"]["step_s"] == 9.0
    (tmp_path / "results" / "shards").mkdir()
    (tmp_path / "results" / "shards" / "s1.json").write_text(json.dumps({"thread_s": 1.0}))
    with pytest.raises(SystemExit, match="has shard records"):
        cpu_pilot(arms, 0.0, tmp_path / "again", tmp_path / "results", 60.0, time.perf_counter(), assumed)
