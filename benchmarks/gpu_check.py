"""The GPU check in one report: run by ``bash scripts/gpu_check.sh`` (which installs the carried wheels first).

    python benchmarks/gpu_check.py [--out outputs/gpu_check.md] [--parts tests attention training decode]
                                   [--total-budget 480] [--budget-scale 1.0]

Parts, in order of value, each in its own process with its own time budget (a part that fails or runs out of time
is recorded in the report with its error or partial results, and the next part runs; the report is rewritten after
every part, so a killed run keeps what finished):

* ``tests`` (a): ``pytest tests/test_cuda_paths.py tests/test_triton_kernel.py tests/test_import_cost.py``: the
  Triton kernel and the dispatcher's CUDA paths against the float64 reference (outputs and gradients, bf16 and fp32,
  odd shapes, padding, causal and bidirectional, learned bias), decode steps on CUDA (cached and compiled static)
  against the CPU float64 forward, and the kernel at real sizes;
* ``attention`` (b): ``hf_structattn.mlr_attention`` (ranks 32|8|6|4|4|4|4|2, head dim 64, dyadic blocks
  T/2..T/128, causal; on CUDA its Triton kernel) against ``F.scaled_dot_product_attention`` with the default backend
  choice and with the flash backend forced (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``), forward (no grad) and
  forward + backward, at T = 1k, 2k, 4k, 8k, 16k, bf16, batch 1, 16 heads: median ms, peak extra memory, and MLR's
  score and score + PV FLOP ratios to dense beside each row;
* ``training`` (c): one training step (forward + backward + AdamW, bf16 autocast) of the GPT-2 family with MLR and
  with dense attention against ``transformers.GPT2LMHeadModel`` with SDPA of the same size (6 layers, n_embd 512,
  8 heads, T = 4096, batch 4), steps interleaved: median tokens/s and peak memory;
* ``decode`` (d): ``benchmarks/bench_generation.py``'s decode cells on the GPU: MLR vs dense, eager (default cache)
  and compiled (``cache_implementation="static"`` + ``torch.compile`` of the forward), batch 1 and 16, prompt 512
  (then 4096 while time is left);
* ``icl`` (e): the ICL pilot, ``scripts/icl_rank_experiment.py pilot`` (when that command exists in this checkout).

Without CUDA it prints one line and exits 0. ``--device cpu --tiny`` runs every part at toy sizes on the CPU (what
tests/test_gpu_check.py and the rehearsal, ``bash scripts/gpu_check.sh --rehearse``, do); its numbers mean nothing.
The last line is ``gpu_check: N/M parts passed`` (``rehearsal: ...`` with ``--rehearse``); the exit status is 0 only
when every part passed.
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

PARTS = ("tests", "attention", "training", "decode", "icl")
TITLES = {
    "tests": "(a) Correctness on the device: Triton kernel, dispatcher, decode steps",
    "attention": "(b) MLR attention vs SDPA / FlashAttention, forward and forward + backward",
    "training": "(c) Training step: GPT-2 family (MLR, dense) vs transformers GPT2LMHeadModel (SDPA)",
    "decode": "(d) Decode: MLR vs dense, eager and compiled static cache",
    "icl": "(e) ICL pilot",
}
# seconds per part at --budget-scale 1: with ~30 s of setup they fill the 8 minutes (480 s) of the default total
BUDGETS = {"tests": 60, "attention": 70, "training": 45, "decode": 125, "icl": 150}
TEST_FILES = ["tests/test_cuda_paths.py", "tests/test_triton_kernel.py", "tests/test_import_cost.py"]
PASSED = ("passed", "done")
MLR_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]
HEAD_DIM = 64
SIZES = {  # full size on CUDA, and toy sizes for --tiny (the CPU tests of this script)
    "full": dict(lengths=[1024, 2048, 4096, 8192, 16384], heads=16, train_length=4096, train_batch=4, n_layer=6,
                 n_embd=512, decode_batches=[1, 16], decode_prompts=[512, 3584], decode_steps=20, decode_warmup=3,
                 compile_backend="inductor"),
    "tiny": dict(lengths=[256], heads=2, train_length=128, train_batch=1, n_layer=2, n_embd=128,
                 decode_batches=[1, 2], decode_prompts=[16], decode_steps=2, decode_warmup=2, compile_backend="eager"),
}


# ------------------------------------------------------------------------------------------------ timing


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn, device: str, warmup: int = 2, max_repeats: int = 20, budget_s: float = 1.0) -> list:
    """Seconds of ``fn()`` per call (synchronised wall clock), after ``warmup`` calls; stops after ``max_repeats``
    calls or once ``budget_s`` is used (at least 3 calls)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times, spent = [], 0.0
    while len(times) < max_repeats and (len(times) < 3 or spent < budget_s):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return times


def peak_extra_mib(fn, device: str) -> float:
    """Peak bytes allocated during ``fn()`` above what was allocated before it, in MiB (CUDA caching allocator;
    NaN on other devices: benchmarks/bench_memory.py measures the CPU allocator)."""
    import torch

    if not device.startswith("cuda"):
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def _cell(times: list) -> str:
    return f"{1e3 * statistics.median(times):.3f}"


# --------------------------------------------------------------------------------------------- the parts


def flop_ratios(length: int, blocks) -> tuple:
    """(score, score + PV) FLOPs of causal MLR (MLR_RANKS, ``blocks``) over dense attention of the same head dim."""
    from hf_structattn.flops import pv_macs, score_macs

    mlr = dict(ranks=MLR_RANKS, block_sizes=blocks)
    dense = dict(head_dim=HEAD_DIM)
    score = score_macs("mlr", length, causal=True, **mlr) / score_macs("dense", length, causal=True, **dense)
    both = ((score_macs("mlr", length, causal=True, **mlr) + pv_macs("mlr", length, causal=True, **mlr))
            / (score_macs("dense", length, causal=True, **dense) + pv_macs("dense", length, causal=True, **dense)))
    return score, both


def attention_rows(lengths, device: str, dtype, heads: int = 16, batch: int = 1, deadline: float = math.inf,
                   cell_budget_s: float = 1.0, implementation: str = "auto") -> list:
    """One dict per T: median seconds and peak extra MiB of SDPA (default backend), SDPA flash and MLR, forward
    (no grad) and forward + backward, and MLR's FLOP ratios (``flops``); ``error`` entries for variants that could
    not run (e.g. no flash kernel). ``implementation``: mlr_attention's (auto = the Triton kernel on CUDA)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_structattn import mlr_attention

    rows = []
    for length in lengths:
        if time.time() > deadline:
            rows.append({"T": length, "skipped": "time budget used"})
            continue
        if length % 2 ** (len(MLR_RANKS) - 1):
            raise ValueError(f"T={length} is not a multiple of {2 ** (len(MLR_RANKS) - 1)}, which the dyadic "
                             f"blocks T/2..T/{2 ** (len(MLR_RANKS) - 1)} need")
        blocks = [length >> level for level in range(1, len(MLR_RANKS))]
        generator = torch.Generator().manual_seed(length)
        q, k, v, grad = [torch.randn(batch, heads, length, HEAD_DIM, generator=generator).to(device, dtype)
                         for _ in range(4)]
        for t in (q, k, v):
            t.requires_grad_()

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def sdpa_flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def mlr():
            return mlr_attention(q, k, v, ranks=MLR_RANKS, block_sizes=blocks, causal=True,
                                 implementation=implementation)

        row = {"T": length, "flops": flop_ratios(length, blocks)}
        for name, fn in (("sdpa", sdpa), ("sdpa_flash", sdpa_flash), ("mlr", mlr)):
            def forward(fn=fn):
                with torch.no_grad():
                    fn()

            def both(fn=fn):
                fn().backward(grad)
                for t in (q, k, v):
                    t.grad = None
            try:
                for mode, call in (("fwd", forward), ("fwd+bwd", both)):
                    row[name, mode] = time_call(call, device, budget_s=cell_budget_s)
                    row[name, mode, "MiB"] = peak_extra_mib(call, device)
            except Exception as error:  # e.g. no flash kernel for this GPU / dtype: the other variants still run
                row[name, "error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        rows.append(row)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def attention_markdown(rows: list) -> str:
    lines = ["| T | mode | SDPA ms | SDPA flash ms | MLR ms | MLR / SDPA | MLR / flash | MLR FLOPs / dense (scores; "
             "+ PV) | peak MiB SDPA / flash / MLR |", "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    errors = []
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['T']} | skipped: {row['skipped']} | | | | | | | |")
            continue
        for name in ("sdpa", "sdpa_flash", "mlr"):
            if (name, "error") in row:
                errors.append(f"T={row['T']} {name}: {row[name, 'error']}")
        for mode in ("fwd", "fwd+bwd"):
            medians = {name: statistics.median(row[name, mode]) if (name, mode) in row else math.nan
                       for name in ("sdpa", "sdpa_flash", "mlr")}
            cells = [f"{1e3 * medians[name]:.3f}" if not math.isnan(medians[name]) else "–"
                     for name in ("sdpa", "sdpa_flash", "mlr")]
            memory = " / ".join(f"{row.get((name, mode, 'MiB'), math.nan):.1f}" for name in ("sdpa", "sdpa_flash", "mlr"))
            score, both = row["flops"]
            lines.append(f"| {row['T']} | {mode} | {' | '.join(cells)} | {medians['mlr'] / medians['sdpa']:.2f}x | "
                         f"{medians['mlr'] / medians['sdpa_flash']:.2f}x | {score:.2f}; {both:.2f} | {memory} |")
    if errors:
        lines += ["", "Variants that could not run:", ""] + [f"* {error}" for error in errors]
    return "\n".join(lines)


def training_models(length: int, n_layer: int, n_embd: int, device: str) -> dict:
    """transformers' GPT-2 with SDPA and the GPT-2 family with MLR and with dense attention, same size and init
    seed, training mode."""
    import torch
    import transformers

    from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel

    common = dict(vocab_size=257, n_positions=length, n_embd=n_embd, n_head=n_embd // HEAD_DIM, n_layer=n_layer,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    stock = transformers.GPT2LMHeadModel(transformers.GPT2Config(**common, attn_implementation="sdpa"))
    mlr = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**common, attention="mlr", mlr_ranks=MLR_RANKS))
    dense = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**common, attention="dense"))
    return {name: model.to(device).train() for name, model in
            (("GPT-2 sdpa", stock), ("MLR", mlr), ("dense (ours)", dense))}


def training_results(length: int, batch: int, n_layer: int, n_embd: int, device: str, dtype,
                     steps: int = 10, deadline: float = math.inf) -> dict:
    """Per model: seconds of each interleaved training step (after one warm-up step) and peak MiB of a step."""
    import torch

    models = training_models(length, n_layer, n_embd, device)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
    ids = torch.randint(0, 256, (batch, length), device=device)
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32)

    def step(name):
        with autocast:
            loss = models[name](ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    results = {name: {"seconds": []} for name in models}
    for name in models:  # warm-up (Triton and cuBLAS autotuning happen here), then the memory of one step
        step(name)
        results[name]["MiB"] = peak_extra_mib(lambda: step(name), device)
    for _ in range(steps):
        if time.time() > deadline and all(len(r["seconds"]) >= 2 for r in results.values()):
            break
        for name in models:
            _sync(device)
            start = time.perf_counter()
            step(name)
            _sync(device)
            results[name]["seconds"].append(time.perf_counter() - start)
    return results


def training_markdown(results: dict, length: int, batch: int) -> str:
    tokens = length * batch
    base = statistics.median(results["GPT-2 sdpa"]["seconds"])
    lines = ["| model | steps | ms/step median [min] | tokens/s | / GPT-2 sdpa (time) | peak MiB of a step |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, result in results.items():
        seconds = result["seconds"]
        median = statistics.median(seconds)
        lines.append(f"| {name} | {len(seconds)} | {1e3 * median:.1f} [{1e3 * min(seconds):.1f}] | "
                     f"{tokens / median:,.0f} | {median / base:.2f}x | {result['MiB']:.0f} |")
    return "\n".join(lines)


def decode_markdown(device: str, batches, prompts, steps: int, warmup: int, backend: str, n_layer: int, n_embd: int,
                    deadline: float, write) -> None:
    """bench_generation's decode cells (eager and compiled, MLR and dense), one cell after another while time is
    left; ``write(text)`` gets the tables so far after every cell."""
    import bench_generation as generation
    import torch

    # the models' compiled forwards share one code object and its recompile limit: beyond the default 8, Dynamo
    # would silently run eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    overrides = {} if (n_layer, n_embd) == (6, 512) else dict(n_layer=n_layer, n_embd=n_embd,
                                                                n_head=n_embd // HEAD_DIM)
    longest = max(prompts) + warmup + steps + 1
    if longest > generation.GPT2_SHAPE["n_positions"]:  # e.g. prompt 4096: a training length that holds the cell
        overrides["n_positions"] = 2 ** math.ceil(math.log2(longest))
    models = generation.gpt2_models(device=device, **overrides)
    modes = ["eager", "compiled"]
    variants = generation.decode_variants(list(models), modes)
    clock = generation.Clock("wall", device)
    compiled, cells, rows, skipped = {}, [], [], []
    plan = [(batch, prompt) for prompt in prompts for batch in batches]  # every batch at the first prompt first
    last = 0.0

    def tables() -> str:
        text = "\n".join(["| model | batch | prompt | variant | ms/token median [min] | ms/token wall median [min] "
                          "| / dense (same mode) |", "|---|---|---|---|---|---|---|", *rows, "",
                          *generation.summary_table(cells, modes)]) if cells else "No cell ran."
        return text + ("\n\nSkipped (time budget): " + "; ".join(skipped) if skipped else "")

    for batch, prompt in plan:
        if time.time() + last > deadline:  # the next cell would likely not finish in time
            skipped.append(f"batch {batch}, prompt {prompt}")
            continue
        started = time.time()
        times = generation.decode_cell(models, variants, batch, prompt, steps, warmup, clock, compiled, backend,
                                       device)
        last = time.time() - started
        cells.append((batch, prompt, times))
        rows += generation.cell_rows(batch, prompt, variants, times)
        write(tables())
    write(tables())


def run_part(part: str, args) -> int:
    """Runs one part in this process, writing its markdown body to ``args.body`` as results arrive."""
    import torch

    sizes = SIZES["tiny" if args.tiny else "full"]
    device = args.device
    dtype = torch.float32 if args.tiny else torch.bfloat16
    dtype_name = str(dtype).replace("torch.", "")
    deadline = args.deadline

    def write(text):
        with open(args.body, "w") as handle:
            handle.write(text + "\n")

    if part == "attention":
        lengths = args.attention_lengths or sizes["lengths"]
        implementation = args.mlr_implementation
        header = (f"{dtype_name}, batch 1, {sizes['heads']} heads, head dim {HEAD_DIM}, causal; MLR ranks "
                  f"{'|'.join(map(str, MLR_RANKS))} (`hf_structattn.mlr_attention`, implementation {implementation}), "
                  "blocks T/2..T/128; SDPA = `F.scaled_dot_product_attention` (default backend), flash = the same "
                  "under `sdpa_kernel(SDPBackend.FLASH_ATTENTION)`; median of up to 20 calls after 2 warm-ups; "
                  "peak = max_memory_allocated above the inputs (outputs and gradients included); FLOP ratios from "
                  "`hf_structattn.flops` (causal, one head).\n\n")
        write(header + "(running)")
        rows = []
        for length in lengths:  # row by row, so that a time-out still leaves the finished rows in the report
            rows += attention_rows([length], device, dtype, heads=sizes["heads"], deadline=deadline,
                                   cell_budget_s=0.05 if args.tiny else 1.0, implementation=implementation)
            write(header + attention_markdown(rows))
        failed = [f"T={row['T']}: {row['mlr', 'error']}" for row in rows if ("mlr", "error") in row]
        if failed:  # SDPA's flash backend may be missing on some GPUs; MLR itself must run
            print("MLR could not run: " + "; ".join(failed), file=sys.stderr)
            return 1
    elif part == "training":
        length = args.train_length or sizes["train_length"]
        batch = sizes["train_batch"]
        write("(running)")
        results = training_results(length, batch, sizes["n_layer"], sizes["n_embd"], device, dtype,
                                   steps=3 if args.tiny else 10, deadline=deadline)
        write(f"{sizes['n_layer']} layers, n_embd {sizes['n_embd']}, {sizes['n_embd'] // HEAD_DIM} heads, vocab 257, "
              f"T = {length}, batch {batch}, AdamW, autocast {dtype_name}, `use_cache=False`; "
              "one warm-up step each, then steps interleaved.\n\n" + training_markdown(results, length, batch))
    elif part == "decode":
        header = (f"GPT-2 family {sizes['n_layer']} layers, n_embd {sizes['n_embd']}, float32, n_positions 4096 "
                  "(the next power of two when a cell needs more); eager = default cache, compiled = "
                  "`cache_implementation=\"static\"` + `torch.compile(model.forward)` (backend "
                  f"{sizes['compile_backend']}); {sizes['decode_warmup']} untimed + {sizes['decode_steps']} timed "
                  "steps per variant, interleaved; synchronised wall clock.\n\n")
        write(header + "(running)")
        decode_markdown(device, sizes["decode_batches"], args.decode_prompts or sizes["decode_prompts"],
                        sizes["decode_steps"], sizes["decode_warmup"], sizes["compile_backend"], sizes["n_layer"],
                        sizes["n_embd"], deadline, lambda text: write(header + text))
    else:
        raise ValueError(f"part={part!r} does not run in-process; expected one of attention, training, decode")
    return 0


ICL_SCRIPT = os.path.join(ROOT, "scripts", "icl_rank_experiment.py")


def icl_pilot_available() -> bool:
    """Whether this checkout's ICL experiment has its ``pilot`` command (the batched runner's short GPU run)."""
    return os.path.exists(ICL_SCRIPT) and "def pilot" in open(ICL_SCRIPT).read()


def run_icl_part(args, budget: float, env) -> dict:
    """``scripts/icl_rank_experiment.py pilot``: the single-head dense arm and the rank control, batched, for the
    part's budget; its markdown summary becomes the section."""
    if not icl_pilot_available():
        return {"status": "skipped (this checkout has no ICL pilot command)", "body": "", "log": ""}
    out_dir = os.path.join(args.workdir, "icl_pilot")
    shutil.rmtree(out_dir, ignore_errors=True)  # the pilot refuses a non-empty folder (an earlier check's)
    command = [sys.executable, ICL_SCRIPT, "pilot", "--device", args.device, "--out", out_dir,
               "--budget-s", f"{max(budget - 20.0, 5.0):.0f}"] + (["--tiny"] if args.tiny else [])
    code, output = _run_with_timeout(command, budget, env)
    summary = os.path.join(out_dir, "pilot.md")
    body = f"`{' '.join(['python'] + command[1:])}`\n\n" + (open(summary).read() if os.path.exists(summary) else "")
    if code == 0:
        return {"status": "done", "body": body, "log": ""}
    status = "timed out (partial results)" if code is None else f"error (exit {code})"
    return {"status": status, "body": body, "log": _tail(output)}


# ------------------------------------------------------------------------------------------- the report


def environment_line(device: str) -> str:
    """The versions actually imported (transformers with the folder it came from: the carried wheels or the
    image's own), the GPU, the CPU and the commit."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_generation import cpu_name, git_commit
    from gpu_env import versions_line

    return (f"Versions used: {versions_line(device)}. CPU {cpu_name()}, {os.cpu_count()} cores; hf_structattn git "
            f"{git_commit()}.")


def render_report(environment: str, command: str, sections: list, total_s: float, setup: str = "") -> str:
    """The markdown report. ``sections``: dicts with ``part``, ``status`` (passed / failed / error / timed out /
    skipped / done), ``seconds``, ``budget``, ``body`` (markdown) and ``log`` (text shown in a code block)."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# GPU check", "", environment, "", f"Command: `{command}`, {when}, {total_s:.0f} s in all."]
    if setup:
        lines += ["", f"Setup: {setup}"]
    lines += ["", "| part | status | seconds (budget) |", "|---|---|---|"]
    lines += [f"| {TITLES[s['part']]} | {s['status']} | {s['seconds']:.0f} ({s['budget']:.0f}) |" for s in sections]
    for section in sections:
        lines += ["", f"## {TITLES[section['part']]}", "", f"Status: **{section['status']}** after "
                  f"{section['seconds']:.0f} s (budget {section['budget']:.0f} s)."]
        if section.get("body"):
            lines += ["", section["body"].rstrip()]
        if section.get("log"):
            lines += ["", "```", section["log"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_with_timeout(command: list, timeout: float, env=None) -> tuple:
    """(returncode or None on time-out, stdout + stderr) of ``command`` in its own process group, killed whole
    when the time is up."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=env)
    try:
        output, _ = process.communicate(timeout=max(timeout, 1.0))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def run_tests_part(budget: float, env) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TEST_FILES]
    code, output = _run_with_timeout(command, budget, env)
    if code is None:
        status = "timed out"
    else:
        status = {0: "passed", 1: "failed", 5: "no tests ran"}.get(code, f"error (pytest exit {code})")
    summary = [line for line in output.splitlines() if " passed" in line or " failed" in line or "error" in line]
    body = f"`{' '.join(['python', '-m', 'pytest', '-q', *TEST_FILES])}`" + (
        f": {summary[-1].strip('= ')}" if summary else "")
    return {"status": status, "body": body, "log": _tail(output, 60)}


def run_benchmark_part(part: str, args, budget: float, env) -> dict:
    body_path = os.path.join(args.workdir, f"{part}.md")
    if os.path.exists(body_path):
        os.remove(body_path)
    # the part stops starting new cells 15 % (at least 10 s) before its hard limit, so it usually ends cleanly
    deadline = time.time() + budget - max(10.0, 0.15 * budget)
    command = [sys.executable, os.path.join(HERE, "gpu_check.py"), "--part", part, "--body", body_path,
               "--device", args.device, "--deadline", f"{deadline:.1f}"]
    if args.tiny:
        command.append("--tiny")
    command += ["--mlr-implementation", args.mlr_implementation]
    for field in ("attention_lengths", "decode_prompts"):
        if getattr(args, field):
            command += [f"--{field.replace('_', '-')}", *map(str, getattr(args, field))]
    if args.train_length:
        command += ["--train-length", str(args.train_length)]
    code, output = _run_with_timeout(command, budget, env)
    body = open(body_path).read() if os.path.exists(body_path) else ""
    if code == 0:
        return {"status": "done", "body": body, "log": ""}
    status = "timed out (partial results)" if code is None else f"error (exit {code})"
    return {"status": status, "body": body, "log": _tail(output)}


def _nvidia_smi_lists_a_gpu() -> bool:
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0 and "GPU" in result.stdout


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", default=os.path.join("outputs", "gpu_check.md"), help="the markdown report")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), help=f"a subset of {', '.join(PARTS)}")
    parser.add_argument("--total-budget", type=float, default=480.0,
                        help="seconds for the whole check, counted from --started (setup included)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every part's budget")
    parser.add_argument("--started", type=float, default=None, help="epoch seconds the check started (setup)")
    parser.add_argument("--setup", default="", help="one line about the setup step, copied into the report")
    parser.add_argument("--command", default="", help="the command line to name in the report")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only together with --tiny (the tests)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU tests of this script)")
    parser.add_argument("--rehearse", action="store_true",
                        help="the CPU rehearsal of scripts/gpu_check.sh: --device cpu --tiny, the attention part "
                             "through the Triton kernel under its interpreter (when triton is installed)")
    parser.add_argument("--mlr-implementation", default=None, choices=["auto", "triton", "math", "fused"],
                        help="mlr_attention's implementation in the attention part (default auto; triton when "
                             "rehearsing)")
    parser.add_argument("--attention-lengths", type=int, nargs="+", default=None)
    parser.add_argument("--train-length", type=int, default=None)
    parser.add_argument("--decode-prompts", type=int, nargs="+", default=None)
    parser.add_argument("--workdir", default=None, help="where parts write their bodies (default: next to --out)")
    # internal: run one part in this process
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--body", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rehearse:
        args.device, args.tiny = "cpu", True
        if args.mlr_implementation is None:
            args.mlr_implementation = "triton" if importlib.util.find_spec("triton") is not None else "auto"
    args.mlr_implementation = args.mlr_implementation or "auto"
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"--parts: {unknown[0]!r} is not a part; expected some of {', '.join(PARTS)}")
    if not (args.budget_scale > 0):
        parser.error(f"--budget-scale must be > 0, got {args.budget_scale}")
    if not (args.total_budget > 0):
        parser.error(f"--total-budget must be > 0, got {args.total_budget}")
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu is for --tiny runs (the CPU tests of this script); the check itself needs CUDA")
    for field in ("attention_lengths", "decode_prompts"):
        bad = [value for value in getattr(args, field) or [] if value < 1]
        if bad:
            parser.error(f"--{field.replace('_', '-')} must be >= 1, got {bad[0]}")
    if args.train_length is not None and args.train_length < 2:
        parser.error(f"--train-length must be >= 2, got {args.train_length}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part is not None:
        return run_part(args.part, args)
    started = args.started if args.started is not None else time.time()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        if _nvidia_smi_lists_a_gpu():  # a GPU is there, but this torch cannot use it: a broken setup, not "no CUDA"
            print(f"gpu_check: nvidia-smi lists a GPU but torch {torch.__version__} at {os.path.dirname(torch.__file__)}"
                  " has no CUDA device; remove .venv (or install a CUDA build of torch) and run again.")
            return 1
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__} on this machine; nothing to check.")
        return 0
    args.workdir = args.workdir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "gpu_check_parts")
    os.makedirs(args.workdir, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    environment = environment_line(args.device)
    if args.rehearse:
        environment = ("**Rehearsal on a CPU** (`bash scripts/gpu_check.sh --rehearse`): every part at toy size, "
                       "the Triton kernel under its interpreter; the numbers mean nothing. " + environment)
    print(environment, flush=True)
    budgets = {part: BUDGETS[part] * args.budget_scale for part in args.parts}
    sections = []
    for index, part in enumerate(args.parts):
        remaining = started + args.total_budget - time.time()
        # behind schedule (slow setup, a slow part): the parts left share what is left in proportion
        later = sum(budgets[p] for p in args.parts[index:])
        budget = max(min(budgets[part], remaining * budgets[part] / later), 0.0)
        print(f"gpu_check: {part} (budget {budget:.0f} s) ...", flush=True)
        part_start = time.time()
        if budget < 5:
            result = {"status": "skipped (no time left)", "body": "", "log": ""}
        elif part == "tests":
            result = run_tests_part(budget, env)
        elif part == "icl":
            result = run_icl_part(args, budget, env)
        else:
            result = run_benchmark_part(part, args, budget, env)
        result.update(part=part, seconds=time.time() - part_start, budget=budget)
        print(f"gpu_check: {part}: {result['status']} in {result['seconds']:.0f} s", flush=True)
        sections.append(result)
        report = render_report(environment, args.command or "python benchmarks/gpu_check.py "
                               + shlex.join(sys.argv[1:] if argv is None else argv), sections,
                               time.time() - started, args.setup)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:  # rewritten after every part: a killed run still leaves a report
            handle.write(report)
    with open(os.path.join(args.workdir, "summary.json"), "w") as handle:
        json.dump([{k: v for k, v in s.items() if k in ("part", "status", "seconds", "budget")} for s in sections],
                  handle, indent=1)
    print(f"gpu_check: report written to {args.out} ({time.time() - started:.0f} s)")
    passed = sum(section["status"] in PASSED for section in sections)
    print(f"{'rehearsal' if args.rehearse else 'gpu_check'}: {passed}/{len(sections)} parts passed")
    return 0 if passed == len(sections) else 1


if __name__ == "__main__":
    sys.exit(main())
