"""scripts/gpu_check.sh, benchmarks/gpu_check.py and the carried wheels: what runs without a GPU (the no-CUDA exit,
argument handling, the report, failure isolation between parts, every benchmark function at toy sizes on the CPU,
what the GPU machine is missing, and the offline install of the wheels with an import of the plugin from them)."""

import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_env  # noqa: E402

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
    # causal MLR 32|8|6|4|4|4|4|2 with dyadic blocks: scores 0.60x dense (paper App. D), 0.80x with the PV product
    assert re.search(r"\| 0\.6\d; 0\.8\d \|", table), table
    with pytest.raises(ValueError, match="T=100 is not a multiple of 128"):
        gpu_check.attention_rows([100], "cpu", torch.float32, heads=1)
    skipped = gpu_check.attention_rows([128], "cpu", torch.float32, heads=1, deadline=0.0)
    assert skipped == [{"T": 128, "skipped": "time budget used"}]


def test_training_results_interleave_every_model_at_a_toy_size():
    results = gpu_check.training_results(128, 1, 1, 64, "cpu", torch.float32, steps=2)
    assert set(results) == {"GPT-2 sdpa", "MLR", "dense (ours)"}
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
    still runs and reports its table; the run ends with the count of parts passed and a non-zero status."""
    out = tmp_path / "report.md"
    result = _run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--parts", "attention", "training",
                   "--attention-lengths", "100", "--out", str(out)], OMP_NUM_THREADS="1")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-2].startswith(f"gpu_check: report written to {out}")
    assert lines[-1] == "gpu_check: 1/2 parts passed"
    text = out.read_text()
    assert f"| {gpu_check.TITLES['attention']} | error (exit 1) |" in text
    assert "ValueError: T=100 is not a multiple of 128" in text
    assert f"| {gpu_check.TITLES['training']} | done |" in text and "| MLR | 3 |" in text
    assert gpu_check.TITLES["tests"] not in text  # the parts not asked for are not in the report


def test_flop_ratios_follow_the_papers_formula_at_large_t():
    """Score MACs of causal MLR / dense -> sum_l r_l 2^-(l-1) / r as T grows (App. D), here 38.3125 / 64."""
    length = 16384
    score, both = gpu_check.flop_ratios(length, [length >> level for level in range(1, 8)])
    expected = sum(rank / 2 ** level for level, rank in enumerate(gpu_check.MLR_RANKS)) / gpu_check.HEAD_DIM
    assert abs(score - expected) < 2e-3 and abs(both - (expected + 1) / 2) < 2e-3


# ----------------------------------------------------------------------------------- the carried wheels

CACHE = os.environ.get("HF_STRUCTATTN_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_structattn")
WHEELS = os.path.join(CACHE, "gpu-wheels")  # scripts/test.sh runs scripts/gpu_wheels.sh --dest here


def _pinned_wheels() -> dict:
    lines = [line.split("#")[0].strip() for line in open(os.path.join(ROOT, "scripts", "gpu_wheels.txt"))]
    return dict(line.split("==") for line in lines if line)


def test_carried_wheels_pin_versions_the_project_accepts_and_never_torch():
    from packaging.specifiers import SpecifierSet

    pinned = _pinned_wheels()
    assert "transformers" in pinned
    assert not [name for name in pinned if name in ("torch", "triton") or name.startswith("nvidia")]
    requirements = gpu_env.project_requirements()
    for name, version in pinned.items():
        if name in requirements:
            assert SpecifierSet(requirements[name]).contains(version), (name, version, requirements[name])


def test_what_the_gpu_image_misses_is_said_in_one_line():
    requirements = gpu_env.project_requirements()
    image = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "accelerate": "1.15.0", "huggingface-hub": "1.33.0",
             "safetensors": "0.8.0", "tqdm": "4.67.1"}
    missing = gpu_env.unmet(requirements, image)
    assert missing == [f"transformers 5.17.0 (needs {requirements['transformers']})"]
    assert gpu_env.unmet(requirements, dict(image, transformers=_pinned_wheels()["transformers"])) == []
    asked = []

    def unreachable():
        asked.append(1)
        return False

    line = gpu_env.plan(missing, [], unreachable)
    assert line.startswith("missing: transformers 5.17.0") and "scripts/gpu_wheels.sh" in line and "\n" not in line
    assert gpu_env.plan(missing, ["transformers-5.24.0-py3-none-any.whl"], unreachable) == "install"
    assert gpu_env.plan(missing, [], lambda: True) == "download"
    assert gpu_env.plan([], [], unreachable) == "ready"
    assert len(asked) == 1  # the index is only asked when nothing else decides


def test_offline_install_of_the_carried_wheels_and_an_import_of_the_plugin_from_them(tmp_path):
    wheels = gpu_env.wheels_in(WHEELS)
    assert wheels, f"no wheels in {WHEELS}: run bash scripts/test.sh (it runs scripts/gpu_wheels.sh --dest there)"
    target = tmp_path / "site"
    result = _run(["bash", "scripts/offline_install.sh", WHEELS, str(target), sys.executable], timeout=300,
                  PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (target / "transformers").is_dir() and not (target / "torch").exists()
    script = """
import json, sys, torch, transformers
from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
config = StructAttnGPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=1, n_head=2, attention="mlr",
                              mlr_ranks=[4, 2, 2])
model = StructAttnGPT2LMHeadModel(config).eval()
out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False, pad_token_id=1)
print(json.dumps([transformers.__version__, transformers.__file__, out.shape[1]]))
"""
    result = _run([sys.executable, "-c", script], timeout=300,
                  PYTHONPATH=os.pathsep.join([str(target), ROOT]), HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr[-3000:]
    version, where, length = __import__("json").loads(result.stdout.strip().splitlines()[-1])
    assert version == _pinned_wheels()["transformers"]
    assert where.startswith(str(target)) and length == 7
    # the plan the GPU run makes with these wheels at hand, and the versions line of its report
    assert subprocess.run([sys.executable, "scripts/gpu_env.py", "plan", WHEELS], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() == "install"
    line = subprocess.run([sys.executable, "scripts/gpu_env.py", "versions", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(target))).stdout
    assert f"transformers {version} (from {target})" in line and f"torch {torch.__version__}" in line


def test_offline_install_without_wheels_says_so():
    result = _run(["bash", "scripts/offline_install.sh", "/nonexistent-wheels", "/tmp/unused-target"])
    assert result.returncode == 2 and "no wheels in /nonexistent-wheels" in result.stderr


@pytest.mark.slow
def test_rehearsal_passes_every_part():
    """The whole CPU rehearsal (builds its environment on first use: ~2 min, then ~5 min of parts)."""
    result = _run(["bash", "scripts/gpu_check.sh", "--rehearse"], timeout=3000)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.fullmatch(r"rehearsal: (\d+)/\1 parts passed", result.stdout.strip().splitlines()[-1])


def test_icl_part_runs_the_pilot_and_puts_its_summary_in_the_report(tmp_path):
    out = tmp_path / "report.md"
    result = _run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--parts", "icl", "--out", str(out)],
                  OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "gpu_check: 1/1 parts passed"
    text = out.read_text()
    assert f"| {gpu_check.TITLES['icl']} | done |" in text
    assert "### ICL rank pilot" in text and "| (ii) dense, 1 head" in text
