"""The Chronos design (scripts/chronos_experiment.py): Chronos-T5's head layout, the logit-scale ablation's scales
measured on the patched model, the rules, and the pilot command at tiny size on CPU."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hf_structattn.modeling.structattn_attention import mlr_geometry_of
from hf_structattn.modeling.structattn_mlr_levels import depth_scale_vector

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import chronos_experiment as ce  # noqa: E402

TINY = dict(heads=2, d_kv=16, layers=1, context=64, horizon=16, n_tokens=256)
SEEDS, WIDTHS = (0, 1, 2), (128, 256, 512)


def test_the_design_uses_chronos_t5s_eight_heads_of_64_and_the_papers_ranks():
    for width in WIDTHS:
        config = ce.t5_config(width)
        assert (config.num_heads, config.d_kv, config.d_ff, config.dropout_rate) == (8, 64, 4 * width, 0.0)
    mlr = ce.model_config("mlr", 128)
    assert mlr.mlr_ranks == [32, 10, 8, 8, 4, 2] and mlr.encoder_attention == mlr.decoder_attention == "mlr"
    assert mlr.resolved_mlr_block_sizes == [256, 128, 64, 32, 16]
    rows = ce.design_rows()
    for width in WIDTHS:  # equal steps: MLR's fewer score FLOPs make it cheaper at every width
        per_arm = {row["arm"]: row["run_flops"] for row in rows if row["width"] == width}
        assert per_arm["mlr"] == per_arm["mlr_flat"] < per_arm["dense"]


@torch.no_grad()
def _logit_std_by_depth(model, ranks, average_levels, scales, pairs=4096):
    """Std of layer-0 encoder logits by depth for N(0, I) inputs through the layer's own q/k weights, with the
    per-depth multipliers of ``depth_scale_vector`` (T5: no 1/sqrt(d))."""
    attention = model.encoder.block[0].layer[0].SelfAttention
    hidden = torch.randn(2, pairs, model.config.d_model, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    heads = model.config.num_heads
    q = attention.q(hidden[0]).view(pairs, heads, -1)
    k = attention.k(hidden[1]).view(pairs, heads, -1)
    stds = []
    for depth in range(1, len(ranks) + 1):
        scale = depth_scale_vector(ranks, scales, depth, average_levels, torch.float64, q.device)
        stds.append(float(((q * scale) * k).sum(-1).std()))
    return stds


def test_the_ablation_gives_every_depth_the_dense_init_logit_scale_while_mlr_shrinks_distant_ones():
    ranks = (8, 4, 4)
    torch.manual_seed(0)
    flat = ce.build_model("mlr_flat", 32, ranks, **TINY).double()
    geometry = mlr_geometry_of(flat.encoder.block[0].layer[0].SelfAttention)
    assert geometry.average_levels and list(geometry.level_scales) == pytest.approx(ce.flat_scales(ranks))
    dense_std = _logit_std_by_depth(flat, [16], False, [1.0])[0]  # the same q/k weights scored as dense
    flat_std = _logit_std_by_depth(flat, ranks, True, geometry.level_scales)
    assert [s / dense_std for s in flat_std] == pytest.approx([1.0, 1.0, 1.0], abs=0.08)
    torch.manual_seed(0)
    plain = ce.build_model("mlr", 32, ranks, **TINY).double()
    plain_geometry = mlr_geometry_of(plain.encoder.block[0].layer[0].SelfAttention)
    plain_std = _logit_std_by_depth(plain, ranks, plain_geometry.average_levels, plain_geometry.scales(1.0))
    # T5's scale 1 on every level: depth 1 (only the 8 global dims) has sqrt(8/16) of dense's logit std
    assert plain_std[0] / dense_std == pytest.approx(0.5 ** 0.5, abs=0.06)
    assert plain_std[-1] / dense_std == pytest.approx(1.0, abs=0.06)
    for depth in range(1, 4):  # exactly: (1/k^2) sum_{l<=k} alpha_l^2 r_l = r
        vector = depth_scale_vector(ranks, ce.flat_scales(ranks), depth, True, torch.float64, "cpu")
        assert float((vector ** 2).sum()) == pytest.approx(16.0, rel=1e-12)


def _best(gaps: dict, flat_gaps: dict = None) -> dict:
    """(width) -> per-seed dense-minus-mlr gaps (default 0.05) and mlr_flat gaps -> best table."""
    best = {}
    for width in WIDTHS:
        for seed in SEEDS:
            best["dense", width, seed] = 3.0
            best["mlr", width, seed] = 3.0 - gaps.get(width, (0.05,) * 3)[seed]
            best["mlr_flat", width, seed] = 3.0 - (flat_gaps or {}).get(width, (0.05,) * 3)[seed]
    return best


def test_the_claims_rule_and_the_ablations_rule():
    yes = ce.verdict(_best({}))
    assert yes.startswith("YES")
    assert ce.ablation_verdict(_best({}), yes).startswith("SURVIVES")
    confounded = _best({}, {128: (0.0, 0.0, 0.0), 256: (0.05, 0.05, -0.01), 512: (0.05,) * 3})
    assert ce.ablation_verdict(confounded, yes).startswith("CONFOUNDED")
    mixed = _best({}, {128: (0.0, 0.0, 0.0)})
    assert ce.ablation_verdict(mixed, yes).startswith("MIXED")
    one_seed = _best({256: (0.05, 0.05, 0.0)})
    assert ce.verdict(one_seed).startswith("UNDECIDED") and "[256]" in ce.verdict(one_seed)
    assert ce.ablation_verdict(one_seed, ce.verdict(one_seed)).startswith("NOT APPLICABLE")
    dense_wins = _best({128: (-0.02,) * 3, 512: (-0.05,) * 3})
    assert ce.verdict(dense_wins).startswith("NO")
    incomplete = {key: value for key, value in _best({}).items() if key != ("dense", 128, 2)}
    assert ce.verdict(incomplete).startswith("PARTIAL: 1 of 18")


def _run(arm, lr, seed, value):
    return {"arm": arm, "name": f"{arm}_lr{lr:g}_s{seed}", "lr": lr, "seed": seed, "final": {"loss": value}}


def test_an_edge_pick_extends_that_arm_and_widths_grid_in_every_seed_and_the_score_reads_it(tmp_path):
    grid = {3e-4: (3.0, 3.0, 3.0), 1e-3: (2.9, 2.8, 2.95), 3e-3: (2.8, 2.9, 2.9)}  # seed 0 best at the top
    runs = [_run("mlr_D256", lr, seed, values[seed]) for lr, values in grid.items() for seed in (0, 1, 2)]
    assert ce.arm_lrs(runs, "mlr", 256) == [*ce.LRS, 0.009]
    assert ("mlr", 256, 0) not in ce.scores(runs)  # the edge runs are inputs of the score
    assert not any(sid.startswith("x") for sid in ce.shards(tmp_path))  # no results: no edge shard
    split = ce.shards(tmp_path, 1e16)  # below a D = 512 unit's 1.13e16: its LRs go to separate shards
    assert all(sum(unit["flops"] for unit in units) <= 1e16 for units in split.values())
    assert [u["name"] for u in split["s6"]] == ["dense_D512 s0 lr 0.0003", "dense_D512 s0 lr 0.001"]
    with pytest.raises(ValueError, match=r"unit dense_D512 s0 lr 0.0003 is one run of 3.78e\+15 FLOPs: it cannot "
                                         r"fit a shard of at most 3e\+15 FLOPs"):
        ce.shards(tmp_path, 3e15)  # one run over the limit is an error, not a longer shard
    runs += [_run("mlr_D256", 0.009, seed, value) for seed, value in ((0, 2.7), (1, 3.1), (2, 3.1))]
    best = ce.scores(runs)
    assert best["mlr", 256, 0] == 2.7 and best["mlr", 256, 1] == 2.8 and best["mlr", 256, 2] == 2.9
    inside = [_run("dense_D128", lr, seed, 3.0 - (lr == 1e-3)) for lr in ce.LRS for seed in (0, 1, 2)]
    assert ce.arm_lrs(inside, "dense", 128) == list(ce.LRS)


def test_every_shard_fits_eight_minutes_and_the_ablation_comes_last(tmp_path):
    table = ce.shards(tmp_path)
    limit = ce.SHARD_MINUTES * 60 * ce.ASSUMED_H100_FLOPS_PER_S
    assert all(sum(unit["flops"] for unit in units) <= limit for units in table.values())
    claim = [u for sid, units in table.items() if sid.startswith("s") for u in units]
    ablation = [u for sid, units in table.items() if sid.startswith("a") for u in units]
    assert {u["arm"] for u in claim} == {"dense", "mlr"} and {u["arm"] for u in ablation} == {"mlr_flat"}
    assert sum(u["runs"] for u in claim) == 54 and sum(u["runs"] for u in ablation) == 27


def test_windows_with_missing_values_are_refused():
    tokenizer = ce.tokenizer_for(64, 16, 256)
    windows = torch.randn(2, 80).cumsum(-1)
    ids, labels = ce.tokenize_windows(tokenizer, windows, 64)
    assert ids.shape == (2, 65) and labels.shape == (2, 17)
    windows[1, 3] = float("nan")
    with pytest.raises(ValueError, match="missing values"):
        ce.tokenize_windows(tokenizer, windows, 64)


def test_the_pilot_runs_at_tiny_size_and_writes_its_summary(tmp_path, capsys):
    ce.main(["pilot", "--tiny", "--device", "cpu", "--budget-s", "120", "--out", str(tmp_path / "pilot")])
    summary = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
    assert set(summary["arms"]) == {"dense", "mlr"} and summary["tiny"]
    for arm in summary["arms"].values():
        assert arm["steps_done"] == 4 and arm["finished"] and arm["flops_per_s"] > 0
        assert arm["loss_end"][-1] < arm["loss_start"][-1]  # 4 steps at the largest LR lower the held-out loss
    assert len(list((tmp_path / "pilot").glob("*/result.json"))) == 6
    assert set(summary["probe"]["arms"]) == set(ce.ARMS)
    assert all(probe["error"] is None and probe["ms_per_step"] > 0 for probe in summary["probe"]["arms"].values())
    ce.main(["report", "--results", str(tmp_path / "pilot")])  # the pilot's tiny runs are not the design's
    out = capsys.readouterr().out
    assert "(MLR vs dense, Fig. 5): PARTIAL: 18 of 18" in out and "shards left for the claim: s1," in out
    assert (tmp_path / "pilot" / "pilot.md").read_text().startswith("### Chronos pilot")
    with pytest.raises(SystemExit):
        ce.main(["pilot", "--tiny", "--budget-s", "-1", "--out", str(tmp_path / "other")])
    assert "--budget-s must be positive, got -1.0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------- the CPU design


@pytest.fixture
def threads():
    """--design cpu sets one thread (and one compile thread) for the process: restore them after the test."""
    import torch._inductor.config as inductor_config

    before = torch.get_num_threads(), inductor_config.compile_threads
    yield
    torch.set_num_threads(before[0])
    inductor_config.compile_threads = before[1]


def _grid(arm, values, seed=0):
    return [_run(ce.grid_arm(arm), lr, seed, value) for lr, value in values.items()]


def test_the_cpu_design_picks_each_arms_lr_on_a_short_seed0_grid_and_scores_its_three_seeds():
    stages = dict(ce.cpu_stages([]))
    assert [u["name"] for u in stages["g"]] == [f"{arm}_D128_grid s0 lr {lr:g}" for arm in ("dense", "mlr")
                                                for lr in ce.LRS]
    assert all(u["steps"] == 250 for u in stages["g"]) and stages["x"] == []
    assert [(u["chronos_arm"], u["seed"], u["steps"], u["lr"]) for u in stages["s"]] == \
        [(arm, seed, 1000, None) for seed in (0, 1, 2) for arm in ("dense", "mlr")]
    runs = _grid("dense", {3e-4: 3.0, 1e-3: 2.8, 3e-3: 2.9}) + _grid("mlr", {3e-4: 3.0, 1e-3: 2.9, 3e-3: 2.8})
    assert ce.cpu_lr(runs, "dense") == 1e-3 and ce.cpu_lr(runs, "mlr") is None  # mlr's best is the top edge
    assert [u["name"] for u in dict(ce.cpu_stages(runs))["x"]] == ["mlr_D128_grid s0 lr 0.009"]
    runs += _grid("mlr", {9e-3: 2.7})
    assert ce.cpu_lr(runs, "mlr") == 9e-3
    assert {u["arm"]: u["lr"] for u in dict(ce.cpu_stages(runs))["s"]} == {"dense_D128": 1e-3, "mlr_D128": 9e-3}
    # the grid runs are never scores; the scored runs at the arm's LR are
    runs += [_run("dense_D128", 1e-3, seed, 3.0) for seed in (0, 1, 2)]
    runs += [_run("mlr_D128", 9e-3, seed, 2.95) for seed in (0, 1)] + [_run("mlr_D128", 1e-3, 2, 1.0)]
    best = ce.cpu_scores(runs)
    assert set(best) == {("dense", 128, s) for s in (0, 1, 2)} | {("mlr", 128, 0), ("mlr", 128, 1)}
    assert ce.verdict(best, (128,), ce.CPU_SEEDS) == "PARTIAL: 1 of 6 (arm, width, seed) scores still missing"


def test_the_cpu_rule_at_one_width_in_every_regime():
    def rule(gaps):  # dense minus mlr per seed
        best = {("dense", 128, s): 3.0 for s in (0, 1, 2)}
        best.update({("mlr", 128, s): 3.0 - gap for s, gap in enumerate(gaps)})
        return ce.verdict(best, (128,), (0, 1, 2))

    assert rule((0.02, 0.05, 0.011)).startswith("YES")
    assert rule((-0.02, -0.05, -0.02)) == "NO: dense is lower than MLR by >= 0.01 nats in every seed at D = [128]"
    assert rule((0.02, 0.05, 0.005)) == "UNDECIDED: MLR is not lower than dense in every seed at D = [128]"
    assert rule((0.02, -0.05, 0.02)).startswith("UNDECIDED")


def test_a_diverged_chronos_run_is_the_worst_score_in_the_grid_and_in_the_rule():
    def scored(arm, seed, final, start=8.3):  # a scored run with its step-0 evaluation
        run = _run(f"{arm}_D128", 1e-3, seed, final)
        return {**run, "evals": [{"step": 0, "loss": start}, {"step": 1000, "loss": final}]}

    # the grid: 3e-3 went NaN and 3e-4 ended above its start; 1e-3 is the LR although it has the highest finite loss
    runs = _grid("dense", {3e-4: 3.0, 1e-3: 3.1, 3e-3: float("nan")}) + _grid("mlr", {3e-4: 2.9, 1e-3: 3.0, 3e-3: 3.1})
    runs[0]["evals"] = [{"step": 0, "loss": 2.5}, {"step": 250, "loss": 3.0}]
    assert ce.cpu_lr(runs, "dense") == 1e-3
    runs += _grid("mlr", {9e-5: 3.2})  # mlr's best is the bottom edge: its extension ran
    runs += [scored("dense", s, 2.0) for s in (0, 1, 2)]
    runs += [{**scored("mlr", s, 1.9), "lr": 3e-4, "name": f"mlr_D128_lr0.0003_s{s}"} for s in (0, 1)]
    runs.append({**scored("mlr", 2, float("nan")), "lr": 3e-4, "name": "mlr_D128_lr0.0003_s2"})
    best = ce.cpu_scores(runs)
    assert best["mlr", 128, 2] == math.inf
    # MLR lower in seeds 0 and 1, diverged in seed 2: not YES, and dense is not lower in every seed: UNDECIDED
    assert ce.verdict(best, (128,), ce.CPU_SEEDS).startswith("UNDECIDED")
    runs = [r for r in runs if r["arm"] != "dense_D128"] + [scored("dense", s, 9.0) for s in (0, 1, 2)]  # > start
    assert ce.verdict(ce.cpu_scores(runs), (128,), ce.CPU_SEEDS).startswith("UNDECIDED")  # inf vs inf in seed 2
    runs = [r for r in runs if r["name"] != "mlr_D128_lr0.0003_s2"] + \
        [{**scored("mlr", 2, 1.9), "lr": 3e-4, "name": "mlr_D128_lr0.0003_s2"}]
    assert ce.verdict(ce.cpu_scores(runs), (128,), ce.CPU_SEEDS).startswith("YES")  # dense diverged in every seed


def test_the_cpu_shards_fit_two_cpu_hours_and_the_rehearsal_of_the_cpu_pilot(tmp_path, capsys, threads):
    from sweep import CPU_SHARD_MINUTES

    table, _ = ce.cpu_shard_map(tmp_path)
    assert all(sum(s["minutes"] for s in members) <= CPU_SHARD_MINUTES for members in table.values())
    scored = [s for sid, members in table.items() if sid.startswith("s") for s in members]
    assert {(s["arm"], s["seed"]) for s in scored} == {(f"{a}_D128", seed) for a in ("dense", "mlr")
                                                        for seed in (0, 1, 2)}
    with pytest.raises(SystemExit, match="runs at a learning rate the design's grid picks"):
        ce.main(["shard", "s1", "--design", "cpu", "--results", str(tmp_path), "--out", str(tmp_path / "work")])
    ce.main(["pilot", "--design", "cpu", "--tiny", "--out", str(tmp_path / "pilot"), "--results",
             str(tmp_path / "results")])
    summary = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
    assert set(summary["arms"]) == {"dense_D32", "mlr_D32"} and summary["units"] == "windows"
    assert all(arm["measured"] and arm["step_s"] > 0 and arm["eval_s"] > 0 for arm in summary["arms"].values())
    assert not (tmp_path / "results").exists()
    ce.main(["report", "--design", "cpu", "--results", str(tmp_path)])
    assert "PARTIAL: 6 of 6" in capsys.readouterr().out
