"""Recipes launched the way the README launches them (``accelerate launch --quiet --config_file
configs/accelerate_one_process.yaml recipes/<recipe>.py ...``): a bad argument is the recipe's one line and a non-zero
exit status, with neither accelerate's traceback of the failed child nor its warning about defaulted values."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--config_file",
          os.path.join(ROOT, "configs", "accelerate_one_process.yaml")]


@pytest.mark.parametrize("recipe, argument, message", [
    ("train_clm.py", "--max_steps=-5", "train_clm.py: error: --max_steps must be >= 1, got -5"),
    ("finetune_patched.py", "--mlr_ranks=7,9", "finetune_patched.py: error: patch: mlr_ranks=[7, 9] sums to 16"),
])
def test_a_recipe_error_under_accelerate_launch_is_one_line(tmp_path, recipe, argument, message):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HOME=str(tmp_path / "hf"))  # no accelerate default config of the machine's user
    result = subprocess.run(LAUNCH + [os.path.join(ROOT, "recipes", recipe), argument,
                                      "--output_dir", str(tmp_path / "out")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), result.stdout + result.stderr
