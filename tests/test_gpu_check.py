"""scripts/gpu_check.sh and benchmarks/gpu_check.py: the parts that run without a GPU (the no-CUDA exit, argument
handling, the report, failure isolation between parts, and every benchmark function at toy sizes on the CPU)."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
NO_GPU = shutil.which("nvidia-smi") is None and not torch.cuda.is_available()


def _run(command, timeout=600, **env):
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **env))


@pytest.mark.skipif(not NO_GPU, reason="checks the machine-without-CUDA exit")
def test_shell_script_without_cuda_prints_one_line_and_exits_0():
    result = _run(["bash", "scripts/gpu_check.sh", "--out", "/nonexistent/report.md"])
    assert result.returncode == 0
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]
    assert not os.path.exists("/nonexistent/report.md")


@pytest.mark.skipif(not NO_GPU, reason="checks the machine-without-CUDA exit")
def test_driver_without_cuda_prints_one_line_and_exits_0(tmp_path):
    result = _run([sys.executable, SCRIPT, "--out", str(tmp_path / "report.md")])
    assert result.returncode == 0
    assert len(result.stdout.strip().splitlines()) == 1 and "no CUDA device" in result.stdout
    assert not (tmp_path / "report.md").exists()


@pytest.mark.parametrize("argv, message", [
    (["--parts", "tests", "speed"], "--parts: 'speed' is not a part"),
    (["--budget-scale", "0"], "--budget-scale must be > 0, got 0.0"),
    (["--total-budget", "-5"], "--total-budget must be > 0, got -5.0"),
    (["--device", "tpu"], "--device must be cuda, cuda:N or cpu, got 'tpu'"),
    (["--device", "cpu"], "--device cpu is for --tiny runs"),
    (["--attention-lengths", "0"], "--attention-lengths must be >= 1, got 0"),
    (["--train-length", "1"], "--train-length must be >= 2, got 1"),
])
def test_bad_arguments_get_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        gpu_check.parse_args(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_render_report_lists_every_part_with_its_status_body_and_log():
    sections = [
        {"part": "tests", "status": "passed", "seconds": 12.4, "budget": 90, "body": "`pytest`: 5 passed",
         "log": "5 passed in 3s"},
        {"part": "attention", "status": "error (exit 1)", "seconds": 3, "budget": 90, "body": "",
         "log": "ValueError: T=100"},
        {"part": "decode", "status": "timed out (partial results)", "seconds": 170, "budget": 170,
         "body": "| a | b |\n|---|---|", "log": ""},
    ]
    text = gpu_check.render_report("Hardware: X", "bash scripts/gpu_check.sh", sections, 190.0, "setup ok")
    assert text.startswith("# GPU check\n")
    assert "Command: `bash scripts/gpu_check.sh`" in text and "Setup: setup ok" in text
    for section in sections:
        assert f"| {gpu_check.TITLES[section['part']]} | {section['status']} |" in text
        assert f"## {gpu_check.TITLES[section['part']]}" in text
    assert "```\nValueError: T=100\n```" in text and "| a | b |" in text
    assert "(c)" not in text  # only the parts that ran


def test_a_part_over_its_time_is_killed_with_its_output_kept():
    code, output = gpu_check._run_with_timeout(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=3)
    assert code is None and "started" in output


def test_time_call_and_peak_memory_on_cpu():
    calls = []
    times = gpu_check.time_call(lambda: calls.append(1), "cpu", warmup=2, max_repeats=5, budget_s=10.0)
    assert len(times) == 5 and len(calls) == 7
    assert gpu_check.peak_extra_mib(lambda: None, "cpu") != gpu_check.peak_extra_mib(lambda: None, "cpu")  # NaN


def test_attention_rows_time_every_variant_and_mode_at_a_toy_size():
    rows = gpu_check.attention_rows([128], "cpu", torch.float32, heads=1, cell_budget_s=0.01)
    (row,) = rows
    for name in ("sdpa", "sdpa_flash", "mlr"):
        assert len(row[name, "fwd"]) >= 3 and len(row[name, "fwd+bwd"]) >= 3
    table = gpu_check.attention_markdown(rows)
    assert table.count("| 128 |") == 2
    with pytest.raises(ValueError, match="T=100 is not a multiple of 128"):
        gpu_check.attention_rows([100], "cpu", torch.float32, heads=1)
    skipped = gpu_check.attention_rows([128], "cpu", torch.float32, heads=1, deadline=0.0)
    assert skipped == [{"T": 128, "skipped": "time budget used"}]


def test_training_results_interleave_both_models_at_a_toy_size():
    results = gpu_check.training_results(128, 1, 1, 64, "cpu", torch.float32, steps=2)
    assert set(results) == {"GPT-2 sdpa", "MLR"}
    assert all(len(result["seconds"]) == 2 for result in results.values())
    table = gpu_check.training_markdown(results, 128, 1)
    assert "| MLR | 2 |" in table and "| GPT-2 sdpa | 2 |" in table


def test_decode_markdown_runs_cells_while_time_is_left():
    texts = []
    gpu_check.decode_markdown("cpu", batches=[1], prompts=[8, 12], steps=1, warmup=2, backend="eager", n_layer=1,
                              n_embd=64, deadline=float("inf"), write=texts.append)
    assert "| 1 | 8 |" in texts[-1] and "| 1 | 12 |" in texts[-1] and "Skipped" not in texts[-1]
    assert "| GPT-2 | 1 | 8 | MLR compiled |" in texts[-1]
    texts.clear()
    gpu_check.decode_markdown("cpu", batches=[1], prompts=[8], steps=1, warmup=1, backend="eager", n_layer=1,
                              n_embd=64, deadline=0.0, write=texts.append)
    assert texts == ["No cell ran.\n\nSkipped (time budget): batch 1, prompt 8"]


def test_cpu_tiny_run_records_a_failing_part_and_runs_the_others(tmp_path):
    """T = 100 is no multiple of 128: the attention part fails, its error goes into the report, and the next part
    still runs and reports its table."""
    out = tmp_path / "report.md"
    result = _run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--parts", "attention", "training",
                   "--attention-lengths", "100", "--out", str(out)], OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith(f"gpu_check: report written to {out}")
    text = out.read_text()
    assert f"| {gpu_check.TITLES['attention']} | error (exit 1) |" in text
    assert "ValueError: T=100 is not a multiple of 128" in text
    assert f"| {gpu_check.TITLES['training']} | done |" in text and "| MLR | 3 |" in text
    assert gpu_check.TITLES["tests"] not in text  # the parts not asked for are not in the report
