"""The language-modelling design (scripts/lm_experiment.py): equal-FLOPs step counts, the arms' configurations,
the decision rule, and the pilot command at tiny size on CPU."""

import json
import math
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import lm_experiment as lm  # noqa: E402

SEEDS, WIDTHS = (0, 1), (128, 256, 384)


def test_every_variant_of_a_width_ends_at_the_dense_runs_compute():
    for width in WIDTHS:
        dense = lm.DENSE_STEPS * lm.flops_per_step("dense", width)
        for variant in lm.VARIANTS:
            per_step = lm.flops_per_step(variant, width)
            steps = lm.equal_flops_steps(variant, width)
            assert abs(steps * per_step - dense) <= per_step / 2, (variant, width)
        # SWA and MLR score fewer pairs / dims than dense, so they get more steps for the same FLOPs
        assert lm.equal_flops_steps("swa", width) > lm.equal_flops_steps("mlr", width) > lm.DENSE_STEPS


def test_the_arms_are_the_papers_variants_under_mup():
    mlr = lm.model_config("mlr", 256)
    assert mlr.mlr_ranks == [32, 8, 6, 4, 4, 4, 4, 2] and mlr.mlr_average_levels and mlr.mlr_scaling == "mup"
    assert mlr.n_head == 4 and mlr.n_embd // mlr.n_head == 64 and not mlr.tie_word_embeddings
    assert lm.model_config("swa", 256).sliding_window == 129  # the paper's T' = 128 sees 129 keys
    gswa = lm.model_config("gswa", 256)
    assert [gswa.layer_attention(i) for i in range(6)] == ["dense", "swa", "swa", "dense", "swa", "swa"]
    with pytest.raises(ValueError, match="width must be a multiple of the head dim 64, got 100"):
        lm.model_config("dense", 100)
    with pytest.raises(ValueError, match="got 'nope'"):
        lm.variant_fields("nope")


def _best(gaps: dict, base_loss: float = 2.0) -> dict:
    """{(baseline, width): (gap seed 0, gap seed 1)} -> best table with MLR at base_loss and each baseline at
    base_loss + gap (bilinear variants absent)."""
    best = {}
    for width in WIDTHS:
        for seed in SEEDS:
            best["mlr", width, seed] = base_loss
            for baseline in lm.BASELINES:
                best[baseline, width, seed] = base_loss + gaps.get((baseline, width), (0.05, 0.05))[seed]
    return best


def test_yes_needs_mlr_lower_than_every_baseline_at_every_width_in_both_seeds():
    assert lm.verdict(_best({})).startswith("YES")
    incomplete = {key: value for key, value in _best({}).items() if key != ("gswa", 384, 1)}
    assert lm.verdict(incomplete) == "PARTIAL: 1 of 24 (variant, width, seed) scores still missing"
    one_seed_tied = lm.verdict(_best({("swa", 256): (0.05, 0.005)}))
    assert one_seed_tied.startswith("UNDECIDED") and "D = 256: MLR vs swa" in one_seed_tied


def test_no_needs_a_baseline_lower_than_mlr_at_two_widths():
    lost_two = _best({("dense", 128): (-0.02, -0.03), ("gswa", 384): (-0.05, -0.01)})
    assert lm.verdict(lost_two).startswith("NO") and "[128, 384]" in lm.verdict(lost_two)
    lost_one = _best({("dense", 128): (-0.02, -0.03)})
    assert lm.verdict(lost_one).startswith("UNDECIDED")


def _run(arm, lr, seed, value):
    return {"arm": arm, "name": f"{arm}_lr{lr:g}_s{seed}", "lr": lr, "seed": seed, "final": {"bits_per_byte": value}}


def _grid(variant, values):
    """{lr: (seed 0, seed 1)} -> the D = 128 runs of ``variant``."""
    return [_run(f"{variant}_D128", lr, seed, pair[seed]) for lr, pair in values.items() for seed in SEEDS]


def test_an_edge_pick_at_d128_triggers_one_more_lr_that_way_and_the_lowest_mean_lr_transfers():
    inside = _grid("mlr", {1e-3: (2.3, 2.3), 3e-3: (2.1, 2.2), 1e-2: (2.2, 2.25)})
    assert lm.planned_lrs(inside, "mlr") == list(lm.LRS) and lm.transfer_lr(inside, "mlr") == 3e-3
    top_edge = _grid("dense", {1e-3: (2.4, 2.4), 3e-3: (2.3, 2.2), 1e-2: (2.2, 2.3)})  # seed 0 best at 1e-2
    assert lm.planned_lrs(top_edge, "dense") == [*lm.LRS, 0.033]
    assert lm.transfer_lr(top_edge, "dense") is None  # the edge runs are inputs of the transfer
    assert lm.planned_lrs(top_edge[:-1], "dense") is None  # a grid run missing: nothing is decided yet
    extended = top_edge + [_run("dense_D128", 0.033, 0, 2.5), _run("dense_D128", 0.033, 1, 2.6)]
    assert lm.transfer_lr(extended, "dense") == 3e-3  # lowest mean over the seeds (2.25), not seed 0's 1e-2
    both = _grid("swa", {1e-3: (2.1, 2.5), 3e-3: (2.3, 2.3), 1e-2: (2.4, 2.2)})  # one seed at each edge
    assert lm.planned_lrs(both, "swa") == [*lm.LRS, 0.00033, 0.033]
    # the shards: x1 holds the triggered edge runs, right after the D = 128 grid shards
    assert [unit["name"] for unit in lm.edge_shards(extended + both, 1e16)["x1"]] == \
        ["dense_D128 lr 0.033", "swa_D128 lr 0.00033", "swa_D128 lr 0.033"]


def test_scores_read_the_best_lr_at_d128_and_the_transferred_lr_above():
    runs = []
    for variant in lm.COMPARED:
        runs += _grid(variant, {1e-3: (2.3, 2.3), 3e-3: (2.1, 2.2), 1e-2: (2.2, 2.25)})
        for width in (256, 384):
            runs += [_run(f"{variant}_D{width}", 3e-3, seed, 2.0) for seed in SEEDS]
            runs += [_run(f"{variant}_D{width}", 1e-3, seed, 1.0) for seed in SEEDS]  # not the transferred LR
    best = lm.scores(runs)
    assert best["mlr", 128, 0] == 2.1 and best["mlr", 128, 1] == 2.2 and best["dense", 384, 1] == 2.0
    assert len(best) == 24 and lm.verdict(best).startswith("UNDECIDED")


def test_every_shard_fits_eight_minutes_at_the_assumed_rate(tmp_path):
    table = lm.shards(tmp_path)
    limit = lm.SHARD_MINUTES * 60 * lm.ASSUMED_H100_FLOPS_PER_S
    assert list(table) == [f"s{k}" for k in range(1, 9)]
    assert all(sum(unit["flops"] for unit in units) <= limit for units in table.values())
    names = [unit["name"] for units in table.values() for unit in units]
    assert names[:4] == ["dense_D128", "swa_D128", "gswa_D128", "mlr_D128"] and len(names) == 12
    with pytest.raises(SystemExit, match="needs every D = 128 run of dense"):
        lm.main(["shard", "s3", "--results", str(tmp_path), "--out", str(tmp_path / "work")])


def test_the_pilot_runs_at_tiny_size_and_writes_its_summary(tmp_path, capsys):
    lm.main(["pilot", "--tiny", "--device", "cpu", "--budget-s", "120", "--out", str(tmp_path / "pilot")])
    summary = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
    assert set(summary["arms"]) == {"dense", "mlr"} and summary["tiny"]
    for arm in summary["arms"].values():
        assert arm["steps_done"] == 6 and arm["finished"] and arm["flops_per_s"] > 0
        # zero-initialised read-out (muP): every run starts at the uniform 8.006 bits/byte, and 6 steps at the
        # largest LR already learn byte frequencies
        assert arm["bits_per_byte_start"] == pytest.approx([8.006] * 3, abs=2e-3)
        assert arm["bits_per_byte_end"][-1] < arm["bits_per_byte_start"][-1] - 1.0
    assert summary["probe"]["width"] == 48 and set(summary["probe"]["arms"]) == set(lm.VARIANTS)
    for probe in summary["probe"]["arms"].values():  # two steps of every variant at the widest (tiny) width
        assert probe["error"] is None and probe["ms_per_step"] > 0 and probe["peak_gib"] is None  # CPU: no peak
    results = sorted(p.parent.name for p in (tmp_path / "pilot").glob("*/result.json"))
    assert len(results) == 6 and results[0] == "dense_D32_lr0.001_s0"
    markdown = (tmp_path / "pilot" / "pilot.md").read_text()
    assert markdown.startswith("### LM pilot") and "Projected full design" in markdown
    with pytest.raises(SystemExit):
        lm.main(["pilot", "--tiny", "--out", str(tmp_path / "pilot")])
    assert "is not empty" in capsys.readouterr().err
    lm.main(["report", "--results", str(tmp_path / "pilot")])  # the pilot's tiny runs are not the design's
    out = capsys.readouterr().out
    assert "at equal FLOPs): PARTIAL: 24 of 24" in out and "shards left: s1, s2," in out


def test_shards_are_sized_by_a_gpu_pilots_measured_rate_once_one_is_committed(tmp_path):
    from sweep import keep_pilot, shard_rate

    assert shard_rate(tmp_path, 3e13) == (3e13, "assumed (no GPU pilot yet)")
    summary = {"device": "NVIDIA H100 80GB HBM3 (torch 2.13.0)", "tiny": False,
               "arms": {"dense": {"flops_per_s": 2e13}, "mlr": {"flops_per_s": 1e13}}}
    keep_pilot({**summary, "tiny": True}, "cuda", tmp_path)  # a rehearsal is not kept
    keep_pilot(summary, "cpu", tmp_path)  # nor a CPU run
    assert shard_rate(tmp_path, 3e13)[0] == 3e13
    keep_pilot(summary, "cuda", tmp_path)
    rate, source = shard_rate(tmp_path, 3e13)
    assert rate == 1.5e13 and source.startswith("measured by the pilot (NVIDIA H100")
    halved = lm.shards(tmp_path)  # the measured rate is half the assumed one: shards hold half the FLOPs
    assert all(sum(unit["flops"] for unit in units) <= lm.SHARD_MINUTES * 60 * 1.5e13 for units in halved.values())
    assert len(halved) > len(lm.shards(tmp_path / "none"))


def test_a_shard_unit_writes_one_small_results_file_per_run_and_a_rerun_skips_them(tmp_path):
    import torch

    from sweep import ArmSpec, read_run_jsons, run_unit

    size = dict(seq_len=32, layers=1, head_dim=16)
    windows = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    spec = ArmSpec(name="mlr_D32", build=lambda seed: lm.build_model("mlr", 32, **size),
                   batch=lambda seed, step: (torch.randint(0, 257, (2, 32),
                                                           generator=torch.Generator().manual_seed(seed + step)),),
                   loss=lm.lm_loss, evaluate=lm.make_evaluate(windows), flops_per_step=10.0,
                   lr_multipliers=lm.mup_multipliers)
    results = tmp_path / "results"
    assert run_unit(spec, [1e-3, 3e-3], [0, 1], 2, 1, tmp_path / "work", results, "cpu", None)
    records = read_run_jsons(results)
    assert sorted(r["name"] for r in records) == ["mlr_D32_lr0.001_s0", "mlr_D32_lr0.001_s1", "mlr_D32_lr0.003_s0",
                                                  "mlr_D32_lr0.003_s1"]
    for record in records:
        assert record["arm"] == "mlr_D32" and [e["step"] for e in record["evals"]] == [0, 1, 2]
        assert record["final"]["flops"] == 20.0 and record["batched_with"] == 4
    assert max(path.stat().st_size for path in results.glob("*.json")) < 4000
    before = {path.name: path.read_text() for path in results.glob("*.json")}
    assert run_unit(spec, [1e-3, 3e-3], [0, 1], 2, 1, tmp_path / "other", results, "cpu", None)  # nothing to do
    assert {path.name: path.read_text() for path in results.glob("*.json")} == before
    assert not (tmp_path / "other").exists()


# ------------------------------------------------------------------------------------------------- the CPU design


def test_the_cpu_design_is_d256_at_equal_flops_with_a_short_seed0_grid_at_d128():
    assert lm.CPU.widths == (256,) and lm.CPU.seeds == (0, 1) and lm.CPU.grid_seeds == (0,) and lm.CPU.batch == 4
    rows = {(row["variant"], row["width"]): row for row in lm.design_rows(lm.CPU, lm.COMPARED)}
    assert rows["dense", 256]["steps"] * 4 * 1024 == 9_994_240  # about 10M tokens per dense run
    assert rows["dense", 128]["steps"] * 4 * 1024 == 1_998_848  # the grid: about 2M
    for width in (128, 256):  # equal FLOPs within a width
        dense = rows["dense", width]["run_flops"]
        assert all(abs(rows[v, width]["run_flops"] - dense) <= rows[v, width]["flops_per_step"] / 2
                   for v in lm.COMPARED)
    stages = dict(lm.cpu_stages([]))
    assert [u["name"] for u in stages["g"]][:3] == ["dense_D128 lr 0.001 s0", "dense_D128 lr 0.003 s0",
                                                    "dense_D128 lr 0.01 s0"] and len(stages["g"]) == 12
    assert stages["x"] == [] and len(stages["s"]) == 8
    assert all(u["lr"] is None and u["width"] == 256 for u in stages["s"])  # transferred LRs: not known yet
    assert [u["seed"] for u in stages["s"]] == [0, 0, 0, 0, 1, 1, 1, 1]


def _cpu_grid(values: dict) -> list:
    """{variant: {lr: bits/byte}} -> the CPU design's seed-0 grid runs at D = 128."""
    return [_run(f"{variant}_D128", lr, 0, value) for variant, lrs in values.items() for lr, value in lrs.items()]


def test_the_cpu_design_transfers_each_variants_seed0_best_and_extends_an_edge_pick(tmp_path):
    inside = {1e-3: 2.5, 3e-3: 2.3, 1e-2: 2.4}
    runs = _cpu_grid({"dense": inside, "swa": inside, "gswa": inside, "mlr": {1e-3: 2.5, 3e-3: 2.4, 1e-2: 2.3}})
    assert [lm.transfer_lr(runs, v, lm.CPU) for v in ("dense", "swa", "gswa")] == [3e-3] * 3
    assert lm.planned_lrs(runs, "mlr", lm.CPU) == [*lm.LRS, 0.033] and lm.transfer_lr(runs, "mlr", lm.CPU) is None
    stages = dict(lm.cpu_stages(runs))
    assert [u["name"] for u in stages["x"]] == ["mlr_D128 lr 0.033 s0"]
    assert {u["variant"]: u["lr"] for u in stages["s"]} == {"dense": 3e-3, "swa": 3e-3, "gswa": 3e-3, "mlr": None}
    runs.append(_run("mlr_D128", 0.033, 0, 2.35))
    assert lm.transfer_lr(runs, "mlr", lm.CPU) == 1e-2  # the edge run did not beat the edge
    # the rule reads the D = 256 runs at the transferred LR only, never the grid
    runs += [_run(f"{v}_D256", lr, seed, 2.0 + 0.02 * (v != "mlr")) for v, lr in
             (("dense", 3e-3), ("swa", 3e-3), ("gswa", 3e-3), ("mlr", 1e-2)) for seed in (0, 1)]
    runs += [_run("mlr_D256", 3e-3, seed, 9.0) for seed in (0, 1)]  # not mlr's LR: ignored
    best = lm.scores(runs, lm.CPU)
    assert set(best) == {(v, 256, s) for v in lm.COMPARED for s in (0, 1)} and best["mlr", 256, 1] == 2.0
    assert lm.verdict(best, lm.CPU.widths, lm.CPU.seeds).startswith("YES")


def test_the_cpu_rule_at_one_width_in_every_regime():
    def best(gaps):  # {baseline: (gap seed 0, gap seed 1)}, baseline minus MLR
        table = {("mlr", 256, s): 2.0 for s in (0, 1)}
        table.update({(b, 256, s): 2.0 + gaps.get(b, (0.05, 0.05))[s] for b in lm.BASELINES for s in (0, 1)})
        return table

    rule = lambda table: lm.verdict(table, (256,), (0, 1))  # noqa: E731
    assert rule(best({})).startswith("YES")
    assert rule(best({"swa": (-0.02, -0.03)})) == ("NO: a baseline is lower than MLR by >= 0.01 bits/byte in both "
                                                    "seeds at D = [256] (D = 256: swa)")
    assert rule(best({"swa": (-0.02, -0.03), "dense": (-0.5, -0.01)})).endswith("(D = 256: dense, swa)")
    undecided = rule(best({"gswa": (0.05, 0.009)}))  # one seed inside the margin
    assert undecided.startswith("UNDECIDED") and "D = 256: MLR vs gswa" in undecided
    assert rule(best({"dense": (-0.05, 0.05)})).startswith("UNDECIDED")  # the seeds disagree
    partial = best({})
    del partial["swa", 256, 1]
    assert rule(partial) == "PARTIAL: 1 of 8 (variant, width, seed) scores still missing"


def _scored(variant, seed, evals, lr=None, final=None):
    """A D = 256 run of the CPU design with its evaluation records ((step, bits/byte, thread, eval_thread) each;
    thread None: a record without thread time); FLOPs 1e12 a step."""
    lr = lr or {"dense": 1e-2, "swa": 3e-3, "gswa": 1e-2, "mlr": 3e-3}[variant]
    records = [{"step": step, "bits_per_byte": value, "flops": 1e12 * step, "wall": 2.0 * step,
                **({} if thread is None else {"thread": thread, "eval_thread": eval_thread})}
               for step, value, thread, eval_thread in evals]
    run = _run(f"{variant}_D256", lr, seed, records[-1]["bits_per_byte"] if final is None else final)
    run["final"].update(records[-1], **({} if final is None else {"bits_per_byte": final}))
    return {**run, "evals": records}


def _cpu_design_runs(scored: list) -> list:
    """A finished seed-0 grid that transfers dense 1e-2, SWA 3e-3, global + SWA 1e-2, MLR 3e-3, plus ``scored``."""
    grid = _cpu_grid({"dense": {1e-3: 2.5, 3e-3: 2.4, 1e-2: 2.3, 0.033: 2.35},
                      "swa": {1e-3: 2.5, 3e-3: 2.3, 1e-2: 2.4},
                      "gswa": {1e-3: 2.5, 3e-3: 2.4, 1e-2: 2.3, 0.033: 2.4},
                      "mlr": {1e-3: 2.5, 3e-3: 2.3, 1e-2: 2.4}})
    return grid + scored


def test_a_diverged_run_loses_its_comparison_and_is_never_picked_as_the_best_lr():
    start = (0, 8.0, 1.0, 1.0)
    ok = {v: [_scored(v, s, [start, (100, 3.0, 50.0, 2.0)]) for s in (0, 1)] for v in lm.BASELINES}
    mlr = [_scored("mlr", 0, [start, (100, 2.9, 50.0, 2.0)]), _scored("mlr", 1, [start, (100, 2.9, 50.0, 2.0)])]
    runs = _cpu_design_runs([r for rs in ok.values() for r in rs] + mlr)
    rule = lambda runs: lm.verdict(lm.scores(runs, lm.CPU), (256,), (0, 1))  # noqa: E731
    assert rule(runs).startswith("YES")
    # MLR's seed-1 run went NaN: it scores worst, so every baseline is lower in seed 1 while MLR is lower in seed 0:
    # UNDECIDED by the rule (not by the NaN); a run ending above its start in both seeds is a NO naming every baseline
    nan = [mlr[0], _scored("mlr", 1, [start, (100, 2.9, 50.0, 2.0)], final=float("nan"))]
    runs = _cpu_design_runs([r for rs in ok.values() for r in rs] + nan)
    assert lm.scores(runs, lm.CPU)["mlr", 256, 1] == math.inf and rule(runs).startswith("UNDECIDED")
    above = [_scored("mlr", s, [start, (100, 8.5, 50.0, 2.0)]) for s in (0, 1)]  # ended above its start: diverged
    runs = _cpu_design_runs([r for rs in ok.values() for r in rs] + above)
    assert rule(runs) == ("NO: a baseline is lower than MLR by >= 0.01 bits/byte in both seeds at D = [256] "
                          "(D = 256: dense, swa, gswa)")
    # a diverged baseline loses to MLR; two diverged runs are lower than neither
    runs = _cpu_design_runs([r for rs in ok.values() for r in rs if r["arm"] != "swa_D256"] + mlr +
                            [_scored("swa", s, [start, (100, 9.0, 50.0, 2.0)]) for s in (0, 1)])
    assert rule(runs).startswith("YES")
    runs = _cpu_design_runs([r for rs in ok.values() for r in rs if r["arm"] != "swa_D256"] + above +
                            [_scored("swa", s, [start, (100, 9.0, 50.0, 2.0)]) for s in (0, 1)])
    assert rule(runs).endswith("(D = 256: dense, gswa)")
    # the grid: a diverged LR is never the best, even with the lowest number on record
    grid = _cpu_grid({"mlr": {1e-3: 2.5, 3e-3: 2.3, 1e-2: float("nan")}})
    assert lm.planned_lrs(grid, "mlr", lm.CPU) == list(lm.LRS) and lm.transfer_lr(grid, "mlr", lm.CPU) == 3e-3
    grid = _cpu_grid({"mlr": {1e-3: 2.5, 3e-3: 2.3, 1e-2: 2.2}})
    grid[-1]["evals"] = [{"step": 0, "bits_per_byte": 2.1}, {"step": 10, "bits_per_byte": 2.2}]  # above its start
    assert lm.transfer_lr(grid, "mlr", lm.CPU) == 3e-3


def test_the_readout_gives_each_baselines_gap_and_what_each_arm_needs_to_reach_its_final_loss():
    start = (0, 8.0, 0.5, 0.5)
    runs = _cpu_design_runs([
        # dense: final 3.0 first reached at its step 200
        _scored("dense", 0, [start, (100, 3.5, 40.0, 1.0), (200, 3.0, 80.0, 1.5)]),
        _scored("dense", 1, [start, (100, 3.4, 40.0, 1.0), (200, 3.1, 80.0, 1.5)]),
        # swa ends above its best: its final 3.2 is first reached at step 100
        _scored("swa", 0, [start, (100, 3.2, 30.0, 1.0), (200, 3.1, 60.0, 1.5), (300, 3.2, 90.0, 2.0)]),
        _scored("swa", 1, [start, (100, 3.3, 30.0, 1.0), (300, 3.3, 90.0, 2.0)]),
        _scored("gswa", 0, [start, (100, 3.3, 30.0, 1.0), (200, 2.8, 60.0, 1.5)]),
        _scored("gswa", 1, [start, (100, 3.3, 30.0, 1.0), (200, 2.8, 60.0, 1.5)], final=float("nan")),
        # MLR seed 0: 3.0 at step 100 (thread 70, 4 of it evaluations); 2.9 at the end
        _scored("mlr", 0, [start, (100, 3.0, 70.0, 4.0), (200, 2.9, 140.0, 8.0)]),
        # MLR seed 1 was resumed from a checkpoint without thread time: n/a where the records lack it
        _scored("mlr", 1, [start, (100, 3.25, None, None), (200, 3.15, None, None)]),
    ])
    rows = {(row["baseline"], row["seed"]): row for row in lm.readout(runs, lm.CPU)}
    assert len(rows) == 6 and {row["width"] for row in rows.values()} == {256}
    dense = rows["dense", 0]
    assert dense["gap"] == pytest.approx(-0.1) and dense["target"] == 3.0
    assert dense["reach"]["base"] == {"step": 200, "flops": 2e14, "cpu_s": 78.5}
    assert dense["reach"]["mlr"] == {"step": 100, "flops": 1e14, "cpu_s": 66.0}
    assert rows["dense", 1]["gap"] == pytest.approx(0.05) and rows["dense", 1]["reach"]["mlr"] is None
    assert rows["swa", 0]["reach"]["base"]["step"] == 100  # first reached, not where it ended
    assert rows["swa", 1]["reach"]["mlr"] == {"step": 100, "flops": 1e14, "cpu_s": None}
    assert math.isnan(rows["gswa", 1]["gap"]) and rows["gswa", 1]["reach"] == {}
    text = "\n".join(lm.readout_lines(lm.readout(runs, lm.CPU)))
    assert "| 256 | dense | 0 | 3.0000 | 2.9000 | -0.1000 | 2e+14, 78 (step 200) | 1e+14, 66 (step 100) |" in text
    assert "| 256 | dense | 1 | 3.1000 | 3.1500 | +0.0500 | 2e+14, 78 (step 200) | not reached |" in text
    assert "| 256 | swa | 1 | 3.3000 | 3.1500 | -0.1500 | 1e+14, 29 (step 100) | 1e+14, n/a (step 100) |" in text
    assert "| 256 | gswa | 1 | diverged | 3.1500 | diverged | - | - |" in text
    # while a scored run is missing, the row says so
    text = "\n".join(lm.readout_lines(lm.readout([r for r in runs if r["name"] != "mlr_D256_lr0.003_s0"], lm.CPU)))
    assert "| 256 | dense | 0 | 3.0000 | not yet | - | - | - |" in text


@pytest.fixture
def threads():
    """--design cpu sets one thread (and one compile thread) for the process: restore them after the test."""
    import torch
    import torch._inductor.config as inductor_config

    before = torch.get_num_threads(), inductor_config.compile_threads
    yield
    torch.set_num_threads(before[0])
    inductor_config.compile_threads = before[1]


def test_the_cpu_shards_fit_two_cpu_hours_and_refuse_to_start_out_of_order(tmp_path, capsys, threads):
    from sweep import CPU_SHARD_MINUTES

    table, source = lm.cpu_shard_map(tmp_path)
    assert source.startswith("assumed") and all(sum(s["minutes"] for s in members) <= CPU_SHARD_MINUTES
                                                 for members in table.values())
    assert [sid for sid in table if sid.startswith("g")] == ["g1", "g2"]
    scored = [s for sid, members in table.items() if sid.startswith("s") for s in members]
    assert {s["name"] for s in scored} == {f"{v}_D256 s{seed}" for v in lm.COMPARED for seed in (0, 1)}
    assert all(s["parts"] >= 2 for s in scored if s["variant"] == "swa")  # ~3 CPU-hours: cut in segments
    with pytest.raises(SystemExit, match="runs at a learning rate the design's grid picks"):
        lm.main(["shard", "s1", "--design", "cpu", "--results", str(tmp_path), "--out", str(tmp_path / "work")])
    with pytest.raises(SystemExit):
        lm.main(["shard", "s1", "--design", "cpu", "--device", "cuda"])
    assert "--design cpu runs on the CPU" in capsys.readouterr().err
    lm.main(["report", "--design", "cpu", "--results", str(tmp_path)])
    out = capsys.readouterr().out
    assert "PARTIAL: 8 of 8" in out and "ready to start (one process per core): python scripts/lm_experiment.py " \
                                         "shard g1 --design cpu; python scripts/lm_experiment.py shard g2" in out


def test_the_cpu_pilot_rehearsal_measures_every_variant_and_writes_no_results(tmp_path, threads):
    lm.main(["pilot", "--design", "cpu", "--tiny", "--out", str(tmp_path / "pilot"), "--results",
             str(tmp_path / "results")])
    summary = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
    assert summary["design"] == "cpu" and summary["tiny"] and summary["threads"] == 1
    assert set(summary["arms"]) == {f"{v}_D32" for v in lm.COMPARED}
    for arm in summary["arms"].values():
        assert arm["measured"] and arm["step_s"] > 0 and arm["eval_s"] > 0 and arm["units_per_s"] > 0
        assert arm["evaluation"]["bits_per_byte"] < 8.1 and not arm["compiled"]
    assert "held-out files that are near-copies" in summary["corpus"]
    assert not (tmp_path / "results").exists()
