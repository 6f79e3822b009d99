"""scripts/mlr_scaling_experiment.py (docs/models.md, "Our default beside theirs"): a smoke run of its command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mlr_scaling_experiment.py"


@pytest.mark.slow  # two recipe runs and a report in subprocesses: ~1 min on the shared 2-core machine
def test_runs_both_scalings_of_a_seed_and_reports_the_paired_difference(tmp_path):
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SCRIPT), "run", "--steps", "2", "--seeds", "0", "--eval_every", "2",
                    "--eval_windows", "2", "--out", str(out)], check=True, capture_output=True, text=True, timeout=600)
    finals = {}
    for scaling in ("standard", "mup"):
        run_config = json.loads((out / f"{scaling}_s0" / "config.json").read_text())
        assert run_config["mlr_scaling"] == scaling and run_config["attention"] == "mlr"
        finals[scaling] = json.loads((out / f"{scaling}_s0" / "final_metrics.json").read_text())["eval_bits_per_byte"]
    report = subprocess.run([sys.executable, str(SCRIPT), "report", "--out", str(out)], check=True,
                            capture_output=True, text=True, timeout=600).stdout
    difference = finals["mup"] - finals["standard"]
    assert f"| 0 | {finals['standard']:.4f} | {finals['mup']:.4f} | {difference:+.4f} |" in report
    assert "| standard |" in report and "| mup |" in report  # the init logit scale by depth of both
