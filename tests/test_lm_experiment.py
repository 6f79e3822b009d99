"""The language-modelling design (scripts/lm_experiment.py): equal-FLOPs step counts, the arms' configurations,
the decision rule, and the pilot command at tiny size on CPU."""

import json
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
    assert lm.verdict(_best({}), {}).startswith("YES")
    assert lm.verdict(_best({}), {}, complete=False).startswith("PARTIAL")
    one_seed_tied = lm.verdict(_best({("swa", 256): (0.05, 0.005)}), {})
    assert one_seed_tied.startswith("UNDECIDED") and "D = 256: MLR vs swa" in one_seed_tied
    edge = lm.verdict(_best({}), {("mlr", 384, 1): True})
    assert edge.startswith("UNDECIDED: it would be YES") and "mlr D = 384 seed 1" in edge


def test_no_needs_a_baseline_lower_than_mlr_at_two_widths():
    lost_two = _best({("dense", 128): (-0.02, -0.03), ("gswa", 384): (-0.05, -0.01)})
    assert lm.verdict(lost_two, {}).startswith("NO") and "[128, 384]" in lm.verdict(lost_two, {})
    lost_one = _best({("dense", 128): (-0.02, -0.03)})
    assert lm.verdict(lost_one, {}).startswith("UNDECIDED")


def test_scores_take_the_best_learning_rate_and_flag_the_grids_edges():
    def run(arm, lr, seed, value):
        return {"arm": arm, "lr": lr, "seed": seed, "final": {"bits_per_byte": value}, "finished": True}

    runs = [run("mlr_D128", 1e-3, 0, 2.3), run("mlr_D128", 3e-3, 0, 2.1), run("mlr_D128", 1e-2, 0, 2.2),
            run("dense_D128", 1e-3, 0, 2.4), run("dense_D128", 3e-3, 0, 2.5), run("dense_D128", 1e-2, 0, 2.6)]
    best, edge = lm.scores(runs)
    assert best == {("mlr", 128, 0): 2.1, ("dense", 128, 0): 2.4}
    assert edge == {("mlr", 128, 0): False, ("dense", 128, 0): True}


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
    lm.main(["report", "--out", str(tmp_path / "pilot")])  # the pilot's tiny runs are not the design's
    out = capsys.readouterr().out
    assert "runs finished: 0/108" in out and "at equal FLOPs): PARTIAL" in out
