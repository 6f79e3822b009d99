"""Generation speed: MLR vs dense (vs stock transformers models), GPT-2 and T5 families, eager and compiled.

GPT-2 family (6 layers, n_embd 512, 8 heads, n_positions 4096, float32, greedy): prefill a random prompt, then time
single-token decode steps, the step generate() runs (``model(next_token, cache=cache)``), for
* ``MLR``: ``StructAttnGPT2LMHeadModel`` with MLR attention (ranks 32|8|6|4|4|4|4|2) and its hierarchical key cache;
* ``dense``: the same model with dense attention (and the project's cache for it);
* ``stock GPT-2`` (``--stock``): ``transformers.GPT2LMHeadModel`` of the same shape (sdpa),
in the modes (``--modes``, default ``eager compiled``):
* ``eager``: the model's default generation cache (what ``generate`` builds without arguments);
* ``static``: ``cache_implementation="static"``, eager forward;
* ``compiled``: ``cache_implementation="static"`` and the forward compiled with ``torch.compile`` (inductor unless
  ``--compile-backend``), i.e. transformers' fast decoding path (``model.forward = torch.compile(model.forward)``;
  here the compiled forward is kept beside the eager one so one model serves every mode).
Every cache comes from public API: ``model.generate(prompt, max_new_tokens=N, return_dict_in_generate=True,
[cache_implementation="static", max_cache_len=...])``, stopped after its first token by a ``StoppingCriteria``,
prefills it and returns it, sized as generate sizes it for the N = warmup + steps + 1 tokens of the cell (the
dynamic MLR cache reserves the final length, as in ``generate``; dense's ``DynamicLayer`` grows by concatenation
either way). ``--warmup`` decode steps per
variant and cell are not timed (the compile happens in the first); then the variants are interleaved step by step
for ``--steps`` steps. A cell is the median [min] over steps of the per-step time; ``/ dense`` divides medians of
the same mode. After the per-variant rows, a summary table has one row per (batch, prompt) cell.

T5 family (greedy ``generate`` of ``--t5-new-tokens`` tokens after a 512-token encoder context): stock
``T5ForConditionalGeneration`` vs the same weights patched with ``hf_structattn.patch`` to MLR in encoder and decoder
self-attention (ranks 32|10|8|8|4|2, mlr_max_length 512), in two shapes: Chronos-T5-small (d_model 512, d_ff 2048,
6+6 layers, 8 heads of 64, vocab 4096) and Chronos-T5-mini (d_model 384, d_ff 1536, 4+4 layers, 8 heads of 64).
Cell: ms per generated token (whole generate call / new tokens), median [min] over interleaved repeats.

Clocks: ``--clock thread`` (CPU time of the calling thread: leaves out time other jobs hold the core; only meaningful
with one torch thread) and wall time; both are printed. On CUDA (``--device cuda``) both are wall time around a
synchronised step.

    # the decode table: eager and compiled, MLR and dense, batch 1 and 16, prompt 512 and 3584 (~15-25 min)
    OMP_NUM_THREADS=1 python benchmarks/bench_generation.py --skip-t5 --output /tmp/gen_compiled.md
    OMP_NUM_THREADS=1 python benchmarks/bench_generation.py --modes eager static --stock --output /tmp/gen.md
    python benchmarks/bench_generation.py --threads 2 --clock wall --output /tmp/gen_2threads.md
"""

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch
import transformers

import hf_structattn
from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
from hf_structattn.cache_memory import returned_cache

MLR_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]
T5_RANKS = [32, 10, 8, 8, 4, 2]
T5_SHAPES = {
    "Chronos-T5-small": dict(d_model=512, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8, d_kv=64),
    "Chronos-T5-mini": dict(d_model=384, d_ff=1536, num_layers=4, num_decoder_layers=4, num_heads=8, d_kv=64),
}
MODES = ("eager", "static", "compiled")
GPT2_SHAPE = dict(vocab_size=257, n_positions=4096, n_embd=512, n_head=8, n_layer=6)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_commit() -> str:
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = result.stdout.strip() or "unknown"
    if commit != "unknown":
        # results/ holds the science shards' records and logs, which a shard running beside a benchmark appends to
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", ":!/results"],
                               capture_output=True, text=True, timeout=10,
                               cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        commit += " + uncommitted changes" if dirty else ""
    return commit


def header_line(details: str, device: str = "cpu") -> str:
    """One line naming the hardware, the versions and the revision, then ``details``."""
    if device.startswith("cuda"):
        hardware = f"{torch.cuda.get_device_name(torch.device(device))} (CUDA {torch.version.cuda}), CPU {cpu_name()}"
    else:
        hardware = f"{cpu_name()}, {os.cpu_count()} cores visible, {torch.get_num_threads()} torch threads"
    return (f"Hardware: {hardware}; torch {torch.__version__}, transformers {transformers.__version__}, "
            f"hf_structattn git {git_commit()}; {details}.")


class Clock:
    """``thread``: CPU time of the calling thread; ``wall``: perf_counter. On CUDA, synchronises first."""

    def __init__(self, kind: str, device: str = "cpu"):
        self.kind = kind
        self.cuda = device.startswith("cuda")

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time() if self.kind == "thread" else time.perf_counter()


def gpt2_models(stock: bool = False, device: str = "cpu", **shape_overrides) -> dict:
    """The GPT-2 family models of the table (random weights, eval mode): MLR, dense, and optionally stock GPT-2."""
    shape = dict(GPT2_SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
                 pad_token_id=1)
    shape.update(shape_overrides)
    ranks = shape.pop("mlr_ranks", MLR_RANKS)
    torch.manual_seed(0)
    models = {"MLR": StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**shape, attention="mlr", mlr_ranks=ranks)),
              "dense": StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**shape, attention="dense"))}
    if stock:
        models["stock GPT-2"] = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape))
    return {name: model.to(device).eval() for name, model in models.items()}



class StopAfterPrefill(transformers.StoppingCriteria):
    """Stops ``generate`` after its first token: what the timed steps continue from."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def prefilled_cache(model, ids: torch.Tensor, static_len=None, new_tokens: int = 1):
    """The cache ``generate`` builds and fills with the prompt ``ids`` (B, P) (public API only), sized as for
    ``new_tokens`` generated tokens (a dynamic MLR cache reserves the final length, as ``generate(...,
    max_new_tokens=new_tokens)`` does; generate is stopped after the first); with ``static_len`` a
    ``cache_implementation="static"`` cache of at least that many slots."""
    kwargs = dict(max_new_tokens=max(1, new_tokens), min_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                  disable_compile=True,  # on CUDA generate would compile a static-cache forward by itself
                  stopping_criteria=transformers.StoppingCriteriaList([StopAfterPrefill()]))
    if static_len is not None:
        kwargs.update(cache_implementation="static", max_cache_len=static_len)
    return returned_cache(model.generate(ids, **kwargs))


def decode_variants(names, modes) -> list:
    """(label, model name, mode) of every variant, in interleaving order."""
    return [(name if mode == "eager" else f"{name} {mode}", name, mode) for mode in modes for name in names]


@torch.no_grad()
def decode_cell(models: dict, variants: list, batch: int, prompt: int, steps: int, warmup: int, clock: Clock,
                compiled: dict, compile_backend: str = "inductor", device: str = "cpu") -> dict:
    """Per-step (clock, wall) seconds of every variant at one (batch, prompt) cell, interleaved step by step.

    ``compiled`` maps model names to their compiled forward (filled on first use, reused across cells)."""
    torch.manual_seed(1)
    vocab = min(model.config.vocab_size for model in models.values()) - 1
    ids = torch.randint(2, vocab, (batch, prompt), device=device)
    token = torch.randint(2, vocab, (batch, 1), device=device)
    static_len = prompt + warmup + steps + 1
    state = {}
    for label, name, mode in variants:
        model = models[name]
        cache = prefilled_cache(model, ids, static_len if mode in ("static", "compiled") else None,
                                new_tokens=warmup + steps + 1)
        forward = model.forward
        if mode == "compiled":
            if name not in compiled:
                compiled[name] = torch.compile(model.forward, backend=compile_backend)
            forward = compiled[name]
        position = prompt
        for _ in range(warmup):  # the first compiles the decode graph
            forward(token, cache=cache, use_cache=True, position_ids=torch.full((batch, 1), position, device=device))
            position += 1
        state[label] = {"forward": forward, "cache": cache, "position": position, "clock": [], "wall": []}
    for _ in range(steps):
        for label, _, _ in variants:
            entry = state[label]
            positions = torch.full((batch, 1), entry["position"], device=device)
            start_clock, start_wall = clock(), time.perf_counter()
            entry["forward"](token, cache=entry["cache"], use_cache=True, position_ids=positions)
            entry["clock"].append(clock() - start_clock)
            entry["wall"].append(time.perf_counter() - start_wall)
            entry["position"] += 1
    return {label: (entry["clock"], entry["wall"]) for label, entry in state.items()}


def cell_rows(batch: int, prompt: int, variants: list, times: dict) -> list:
    """Markdown rows of one cell: ms/token median [min] on both clocks and the ratio to dense of the same mode."""
    rows = []
    for label, name, mode in variants:
        clock_times, wall_times = times[label]
        base_label = "dense" if mode == "eager" else f"dense {mode}"
        ratio = (f"{statistics.median(clock_times) / statistics.median(times[base_label][0]):.2f}x"
                 if base_label in times else "–")
        rows.append(f"| GPT-2 | {batch} | {prompt} | {label} | {1e3 * statistics.median(clock_times):.2f} "
                    f"[{1e3 * min(clock_times):.2f}] | {1e3 * statistics.median(wall_times):.2f} "
                    f"[{1e3 * min(wall_times):.2f}] | {ratio} |")
    return rows


def summary_table(cells: list, modes) -> list:
    """One row per (batch, prompt): MLR and dense median ms/token per mode, their ratio, and compiled / eager."""
    head = "| batch | prompt |"
    rule = "|---:|---:|"
    for mode in modes:
        head += f" MLR {mode} | dense {mode} | MLR / dense {mode} |"
        rule += "---:|---:|---:|"
    if "compiled" in modes and "eager" in modes:
        head += " MLR compiled / MLR eager | dense compiled / dense eager |"
        rule += "---:|---:|"
    lines = [head, rule]
    for batch, prompt, times in cells:
        def median(label):
            return statistics.median(times[label][0]) if label in times else float("nan")
        row = f"| {batch} | {prompt} |"
        for mode in modes:
            suffix = "" if mode == "eager" else f" {mode}"
            mlr, dense = median("MLR" + suffix), median("dense" + suffix)
            row += f" {1e3 * mlr:.2f} | {1e3 * dense:.2f} | **{mlr / dense:.2f}x** |"
        if "compiled" in modes and "eager" in modes:
            row += (f" {median('MLR compiled') / median('MLR'):.2f}x |"
                    f" {median('dense compiled') / median('dense'):.2f}x |")
        lines.append(row)
    return lines


def bench_gpt2(args, clock: Clock, rows: list) -> list:
    """Runs every (batch, prompt) cell, appends per-variant rows to ``rows``; returns the summary table lines."""
    models = gpt2_models(stock=args.stock, device=args.device)
    variants = decode_variants(list(models), args.modes)
    if "compiled" in args.modes:
        # every model's compiled forward shares one code object, whose guards count towards one recompile limit;
        # models x batch sizes x prompts pass the default 8, after which Dynamo would silently run eagerly
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled, cells = {}, []
    for batch in args.batches:
        for prompt in args.prompts:
            times = decode_cell(models, variants, batch, prompt, args.steps, args.warmup, clock, compiled,
                                args.compile_backend, args.device)
            cells.append((batch, prompt, times))
            for row in cell_rows(batch, prompt, variants, times):
                rows.append(row)
                print(row, flush=True)
    return summary_table(cells, args.modes)


def t5_models(shape_name: str):
    fields = dict(T5_SHAPES[shape_name], vocab_size=4096, feed_forward_proj="relu", dropout_rate=0.0,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    stock = transformers.T5ForConditionalGeneration(transformers.T5Config(**fields)).eval()
    mlr = hf_structattn.patch(stock, attention="mlr", mlr_ranks=T5_RANKS, mlr_max_length=512).eval()
    return {"stock T5": stock, "MLR (patched)": mlr}


@torch.no_grad()
def bench_t5(args, clock: Clock, rows: list) -> None:
    for shape_name in args.t5_shapes:
        models = t5_models(shape_name)
        for batch in args.t5_batches:
            torch.manual_seed(2)
            ids = torch.randint(2, 4096, (batch, 512))
            common = dict(max_new_tokens=args.t5_new_tokens, min_new_tokens=args.t5_new_tokens, do_sample=False)
            times = {name: ([], []) for name in models}
            for name, model in models.items():  # warm-up
                model.generate(ids, **common)
            for _ in range(args.t5_repeats):
                for name, model in models.items():
                    start_cpu, start_wall = clock(), time.perf_counter()
                    model.generate(ids, **common)
                    times[name][0].append((clock() - start_cpu) / args.t5_new_tokens)
                    times[name][1].append((time.perf_counter() - start_wall) / args.t5_new_tokens)
            base = statistics.median(times["stock T5"][0])
            for name, (cpu_times, wall_times) in times.items():
                cpu, wall = statistics.median(cpu_times), statistics.median(wall_times)
                row = (f"| {shape_name} | {batch} | 512 | {name} | {cpu * 1e3:.2f} [{min(cpu_times) * 1e3:.2f}] | "
                       f"{wall * 1e3:.2f} [{min(wall_times) * 1e3:.2f}] | {cpu / base:.2f}x |")
                rows.append(row)
                print(row, flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["thread", "wall"], default="thread")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (then both clocks are synchronised wall time)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 3584])
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per GPT-2 variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps per variant and cell (>= 1)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["eager", "compiled"],
                        help="eager: default cache; static: static cache; compiled: static cache + torch.compile")
    parser.add_argument("--static", action="store_true", help="add the static mode (same as listing it in --modes)")
    parser.add_argument("--compile", action="store_true", help="add the compiled mode (default already)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled mode")
    parser.add_argument("--stock", action="store_true", help="add transformers.GPT2LMHeadModel rows")
    parser.add_argument("--skip-gpt2", action="store_true")
    parser.add_argument("--skip-t5", action="store_true")
    parser.add_argument("--t5-shapes", nargs="+", default=list(T5_SHAPES), choices=list(T5_SHAPES))
    parser.add_argument("--t5-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--t5-new-tokens", type=int, default=24)
    parser.add_argument("--t5-repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="also write the markdown tables to this file")
    args = parser.parse_args(argv)
    for field in ("threads", "steps", "warmup", "t5_new_tokens", "t5_repeats"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    for field in ("batches", "prompts", "t5_batches"):
        bad = [value for value in getattr(args, field) if value < 1]
        if bad:
            parser.error(f"--{field.replace('_', '-')} must be >= 1, got {bad[0]}")
    if args.prompts and max(args.prompts) + args.warmup + args.steps + 1 > GPT2_SHAPE["n_positions"]:
        parser.error(f"--prompts {max(args.prompts)} + warm-up + steps exceeds n_positions "
                     f"{GPT2_SHAPE['n_positions']}")
    modes = list(args.modes) + (["static"] if args.static else []) + (["compiled"] if args.compile else [])
    args.modes = [mode for mode in MODES if mode in modes]  # eager, static, compiled order, no duplicates
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = Clock(args.clock, args.device)
    clock_name = "synchronised wall" if args.device.startswith("cuda") else args.clock
    lines = [header_line(f"float32, device {args.device}; GPT-2 family {GPT2_SHAPE['n_layer']} layers, n_embd "
                         f"{GPT2_SHAPE['n_embd']}, {GPT2_SHAPE['n_head']} heads, MLR ranks "
                         f"{'|'.join(map(str, MLR_RANKS))}; modes {', '.join(args.modes)} (compile backend "
                         f"{args.compile_backend}); {args.warmup} untimed + {args.steps} timed decode steps per "
                         f"variant, interleaved; clock {clock_name} and wall", args.device), "",
             f"| model | batch | prompt | variant | ms/token ({clock_name} clock) median [min] | ms/token wall "
             f"median [min] | / baseline ({clock_name}) |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    rows, summary = [], []
    if not args.skip_gpt2:
        summary = bench_gpt2(args, clock, rows)
    if not args.skip_t5:
        bench_t5(args, clock, rows)
    text = "\n".join(lines + rows)
    if summary:
        summary_text = "\n".join(["", f"GPT-2 family decode, ms/token ({clock_name} clock), median over steps:", "",
                                   *summary])
        print(summary_text, flush=True)
        text += "\n" + summary_text
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
