"""Wall time and peak extra memory of every attention variant against ``F.scaled_dot_product_attention``.

    python benchmarks/bench_attention.py                      # CPU, fp32, T = 512 .. 8192, H = 8, B = 1
    python benchmarks/bench_attention.py --device cuda        # GPU, bf16 (MLR runs its Triton kernel if present)
    python benchmarks/bench_attention.py --lengths 4096 8192 --only sdpa mlr_fused --output docs/run.md

Every variant has head dim 64 per head (the value width of the bilinear ones too), causal, batch ``--batch``,
``--heads`` heads. Variants:

* ``sdpa``: dense causal ``F.scaled_dot_product_attention`` (the baseline of every ratio);
* ``mlr_fused`` / ``mlr_math`` / ``mlr_reference``: ``mlr_attention`` with r = 64, ranks 32|8|6|4|4|4|4|2 and
  dyadic blocks from T (``block_sizes = [T >> 1, ..., T >> 7]``), through the fused CPU kernel path, the
  materialised-score path (the one that differentiates a learned bias) and the naive T x T reference (only up to ``--reference-max-len``). On CUDA
  ``mlr_fused`` means ``implementation="auto"`` (the Triton kernel when it is installed);
* ``swa``: sliding window w = T/8 via ``fused_attention`` with a boolean ``allowed`` mask (built once, outside
  the timed call; the additive mask that ``fused_attention`` derives from it is built inside);
* ``bilinear_mlr``: ``BilinearMLRProjection`` for q and k from x (D = H*64, ranks 32|16|8|8, width 160 per head)
  plus ``fused_attention``; ``bilinear_btt``: ``BilinearBTTKeyProjection`` from x (query = x, width D) plus
  ``fused_attention``. For these two the timed call **includes the structured q/k projections from x**, since
  they are the attention's scoring function; the value projection is excluded as for every other variant.

Timing: inputs are built once per length; one warm-up call per variant and mode; then repeats are interleaved
round-robin across variants (a co-running process then slows every variant alike) until ``--repeats`` or, after
``--min-repeats``, until a variant's cell has used ``--budget`` seconds (a warm-up call longer than half the
budget counts as a repeat: only the slowest cells, where one call is seconds). Reported: median and min ms,
wall clock unless ``--clock thread``.
Forward is timed under ``torch.no_grad``; forward+backward is ``out.backward(dO)`` with every input (and the
bilinear projection weights) requiring grad.

Memory: peak of live bytes allocated during one call, inputs and ``dO`` excluded (they exist before the call),
outputs and gradients included. CPU: the torch profiler's allocator events (``profile_memory=True``), summed in
time order; memory that MKL/oneDNN allocate outside the torch allocator is not seen. CUDA:
``torch.cuda.max_memory_allocated`` minus the allocation before the call.
"""

import argparse
import importlib.util
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def _load_package(name: str, folder: str) -> str:
    """Import ``folder`` (a payload folder) as the top-level package ``name``; returns ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return name


def _payload():
    """The attention code lives in the self-contained payload folder ``hf_structattn/modeling``; if the full
    package cannot be imported (e.g. an optional dependency of another subpackage is missing), load that folder
    on its own, the way a remote-code checkpoint does."""
    try:
        import hf_structattn.modeling as package  # noqa: F401
        return "hf_structattn.modeling"
    except ImportError:
        return _load_package("_structattn_payload", os.path.join(ROOT, "hf_structattn", "modeling"))


PAYLOAD = _payload()
_bilinear = importlib.import_module(PAYLOAD + ".structattn_bilinear")
_ops = importlib.import_module(PAYLOAD + ".structattn_ops")
mlr_attention = importlib.import_module(PAYLOAD + ".structattn_mlr").mlr_attention
BilinearBTTKeyProjection, BilinearMLRProjection = _bilinear.BilinearBTTKeyProjection, _bilinear.BilinearMLRProjection
default_btt_factors = _bilinear.default_btt_factors
fused_attention, sliding_window_allowed = _ops.fused_attention, _ops.sliding_window_allowed

HEAD_DIM = 64
MLR_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]
BILINEAR_RANKS = [32, 16, 8, 8]
VARIANTS = ("sdpa", "mlr_fused", "mlr_fused_before", "mlr_math", "mlr_reference", "swa", "bilinear_mlr",
            "bilinear_btt")
LABELS = {
    "sdpa": "SDPA dense causal",
    "mlr_fused": "MLR fused (exact, group + LSE merge)",
    "mlr_fused_before": "MLR fused, --before-mlr file",
    "mlr_math": "MLR math path (materialised scores)",
    "mlr_reference": "MLR naive reference (T x T)",
    "swa": "SWA w = T/8 (fused_attention + mask)",
    "bilinear_mlr": "bilinear MLR (proj. from x + fused attn)",
    "bilinear_btt": "bilinear BTT (key proj. from x + fused attn)",
}


def hardware_line(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        hw = f"{torch.cuda.get_device_name(device)}"
    else:
        model = platform.processor() or "unknown CPU"
        try:
            with open("/proc/cpuinfo") as handle:
                for line in handle:
                    if line.startswith("model name"):
                        model = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        hw = f"{model}, {os.cpu_count()} cores visible, {torch.get_num_threads()} torch threads"
    return f"{hw}; torch {torch.__version__}; dtype {str(dtype).replace('torch.', '')}"


def load_module_from_path(path: str):
    """``mlr_attention`` of another revision, importable next to the current one. ``path`` is that revision's
    payload folder (``hf_structattn/modeling``, e.g. from ``git worktree add``), loaded as its own package so
    every backend module comes from it; or a single ``structattn_mlr.py`` of a revision that kept the whole op in
    that file, loaded into the current payload package (its helpers, geometry and reference, resolve there)."""
    if os.path.isdir(path):
        return importlib.import_module(_load_package("_bench_payload_before", path) + ".structattn_mlr")
    name = PAYLOAD + "._bench_mlr_before"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Case:
    """One variant at one length: ``call()`` runs the attention, ``params`` are the tensors that need grad."""

    def __init__(self, call, params):
        self.call, self.params = call, params

    def zero_grad(self):
        for tensor in self.params:
            tensor.grad = None


def build_case(name, length, args, device, dtype, before_module):
    gen = torch.Generator(device="cpu").manual_seed(length)
    heads, batch = args.heads, args.batch

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype).requires_grad_()

    if args.layout == "bhtd":
        qkv_leaves = [rand(batch, heads, length, HEAD_DIM) for _ in range(3)]

        def qkv():
            return qkv_leaves
    else:  # what a model's fused qkv projection gives: views of (B, T, 3 * H * 64), sequence-major memory
        qkv_leaves = [rand(batch, length, 3 * heads * HEAD_DIM)]

        def qkv():
            return [t.view(batch, length, heads, HEAD_DIM).transpose(1, 2)
                    for t in qkv_leaves[0].split(heads * HEAD_DIM, -1)]
    blocks = [length >> level for level in range(1, len(MLR_RANKS))]
    mlr_impl = "fused" if device.type == "cpu" else "auto"
    if name == "sdpa":
        return Case(lambda: F.scaled_dot_product_attention(*qkv(), is_causal=True), qkv_leaves)
    if name in ("mlr_fused", "mlr_math", "mlr_reference", "mlr_fused_before"):
        impl = {"mlr_fused": mlr_impl, "mlr_math": "math", "mlr_reference": "reference",
                "mlr_fused_before": mlr_impl}[name]
        function = before_module.mlr_attention if name == "mlr_fused_before" else mlr_attention
        return Case(lambda: function(*qkv(), ranks=MLR_RANKS, block_sizes=blocks, causal=True,
                                     implementation=impl), qkv_leaves)
    if name == "swa":
        positions = torch.arange(length, device=device)[None]
        allowed = sliding_window_allowed(positions, positions, max(length // 8, 1), causal=True)
        return Case(lambda: fused_attention(*qkv(), scale=HEAD_DIM ** -0.5, causal=True, allowed=allowed),
                    qkv_leaves)
    hidden = heads * HEAD_DIM
    x = rand(batch, length, hidden)
    if name == "bilinear_mlr":
        q_proj = BilinearMLRProjection(hidden, heads, BILINEAR_RANKS).to(device=device, dtype=dtype)
        k_proj = BilinearMLRProjection(hidden, heads, BILINEAR_RANKS).to(device=device, dtype=dtype)
        scales = [w ** -0.5 for w in q_proj.level_widths]

        def call():
            query = torch.cat([s * t for s, t in zip(scales, q_proj(x))], dim=-1)
            key = torch.cat(k_proj(x), dim=-1)
            return fused_attention(query, key, qkv()[2], scale=1.0, causal=True)

        return Case(call, [x, *qkv_leaves, *q_proj.parameters(), *k_proj.parameters()])
    if name == "bilinear_btt":
        k_proj = BilinearBTTKeyProjection(hidden, heads, default_btt_factors(hidden), 1).to(device=device,
                                                                                           dtype=dtype)

        def call():
            query = (x[:, None] * hidden ** -0.5).expand(-1, heads, -1, -1)
            return fused_attention(query, k_proj(x), qkv()[2], scale=1.0, causal=True)

        return Case(call, [x, *qkv_leaves, *k_proj.parameters()])
    raise ValueError(name)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCK = time.perf_counter


def run_once(case, backward, grad_out, device):
    """Seconds of one call (forward, or forward+backward) on ``CLOCK``."""
    case.zero_grad()
    sync(device)
    start = CLOCK()
    if backward:
        case.call().backward(grad_out)
    else:
        with torch.no_grad():
            case.call()
    sync(device)
    return CLOCK() - start


def peak_memory_mib(case, backward, grad_out, device):
    case.zero_grad()
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_once(case, backward, grad_out, device)
        peak = torch.cuda.max_memory_allocated(device) - before
        case.zero_grad()
        return peak / 2 ** 20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if backward:
            case.call().backward(grad_out)
        else:
            with torch.no_grad():
                case.call()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    case.zero_grad()
    return peak / 2 ** 20


def benchmark_length(length, variants, args, device, dtype, before_module):
    grad_out = torch.randn(args.batch, args.heads, length, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    grad_out = grad_out.to(device=device, dtype=dtype)
    cases = {name: build_case(name, length, args, device, dtype, before_module) for name in variants}
    results = {}
    for mode, backward in (("fwd", False), ("fwd+bwd", True)):
        times = {name: [] for name in cases}
        spent = {name: 0.0 for name in cases}
        for name, case in cases.items():  # warm-up (and first-touch of the inputs)
            elapsed = run_once(case, backward, grad_out, device)
            if elapsed > args.budget / 2:  # a call this slow has nothing left to warm up: keep it as a sample
                times[name].append(elapsed * 1e3)
                spent[name] += elapsed
        for _ in range(args.repeats):
            active = [name for name in cases
                      if len(times[name]) < args.min_repeats or spent[name] < args.budget]
            if not active:
                break
            for name in active:
                elapsed = run_once(cases[name], backward, grad_out, device)
                times[name].append(elapsed * 1e3)
                spent[name] += elapsed
        for name, case in cases.items():
            memory = peak_memory_mib(case, backward, grad_out, device) if not args.no_memory else float("nan")
            results[(name, mode)] = (statistics.median(times[name]), min(times[name]), len(times[name]), memory)
            print(f"  T={length:5d} {mode:8s} {name:17s} median {results[(name, mode)][0]:9.1f} ms  "
                  f"min {results[(name, mode)][1]:9.1f} ms  n={len(times[name]):2d}  peak {memory:8.1f} MiB",
                  file=sys.stderr, flush=True)
    return results


def markdown(all_results, lengths, variants, header):
    lines = [header, ""]
    for mode in ("fwd", "fwd+bwd"):
        title = "forward (no grad)" if mode == "fwd" else "forward + backward"
        lines += [f"**{title}: ms, median [min] (x = median / SDPA median)**", "",
                  "| variant | " + " | ".join(f"T={t}" for t in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for name in variants:
            cells = []
            for length in lengths:
                entry = all_results.get((length, name, mode))
                if entry is None:
                    cells.append("–")
                    continue
                median, low, count, _ = entry
                base = all_results.get((length, "sdpa", mode))
                ratio = f" ({median / base[0]:.2f}x)" if base is not None and name != "sdpa" else ""
                cells.append(f"{median:.1f} [{low:.1f}]{ratio}")
            lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
        lines.append("")
    for mode in ("fwd", "fwd+bwd"):
        lines += [f"**peak extra memory, {mode}: MiB (x = / SDPA)**", "",
                  "| variant | " + " | ".join(f"T={t}" for t in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for name in variants:
            cells = []
            for length in lengths:
                entry = all_results.get((length, name, mode))
                if entry is None or math.isnan(entry[3]):
                    cells.append("–")
                    continue
                base = all_results.get((length, "sdpa", mode))
                ratio = f" ({entry[3] / base[3]:.2f}x)" if base is not None and name != "sdpa" and base[3] > 0 else ""
                cells.append(f"{entry[3]:.1f}{ratio}")
            lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--repeats", type=int, default=5, help="most timed repeats per cell")
    parser.add_argument("--min-repeats", type=int, default=2, help="repeats a cell gets even over budget")
    parser.add_argument("--budget", type=float, default=5.0, help="seconds per cell before repeats stop")
    parser.add_argument("--layout", choices=("bhtd", "bthd"), default="bhtd",
                        help="q/k/v as contiguous (B, H, T, 64) tensors, or as the (B, T, H, 64)-memory views "
                             "a model's qkv projection produces (then the leaf is the packed projection)")
    parser.add_argument("--reference-max-len", type=int, default=2048)
    parser.add_argument("--only", nargs="+", choices=VARIANTS, default=None, help="subset of variants")
    parser.add_argument("--before-mlr", default=None,
                        help="another revision's payload folder (hf_structattn/modeling) or single-file structattn_mlr.py, "
                             "timed as 'mlr_fused_before'")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); 1 is robust to co-running jobs")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="wall time, or the CPU time of the calling thread (with --threads 1 it leaves out "
                             "the time co-running jobs hold the core; CPU only)")
    parser.add_argument("--no-memory", action="store_true", help="skip the profiled memory pass")
    parser.add_argument("--output", default=None, help="write the markdown tables to this path")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    if args.clock == "thread":
        if args.device != "cpu" or torch.get_num_threads() != 1:
            parser.error("--clock thread measures one CPU thread: use it with --device cpu --threads 1")
        CLOCK = time.thread_time
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    before_module = load_module_from_path(args.before_mlr) if args.before_mlr else None
    variants = [v for v in (args.only or VARIANTS) if v != "mlr_fused_before" or before_module is not None]
    if "sdpa" not in variants:
        variants.insert(0, "sdpa")
    clock = "wall" if args.clock == "wall" else "CPU time of the (single) compute thread"
    memory = ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
              "torch profiler allocator events (torch allocator only)")
    header = (f"Hardware: {hardware_line(device, dtype)}. Clock: {clock}. B={args.batch}, H={args.heads}, "
              f"head dim {HEAD_DIM}, causal, q/k/v layout {args.layout}; MLR ranks {'|'.join(map(str, MLR_RANKS))}, "
              f"blocks T/2..T/128; bilinear MLR ranks {'|'.join(map(str, BILINEAR_RANKS))}, D = H*64. "
              f"Memory: {memory}.")
    print(header, file=sys.stderr)
    all_results = {}
    for length in args.lengths:
        names = [n for n in variants if n != "mlr_reference" or length <= args.reference_max_len]
        for (name, mode), entry in benchmark_length(length, names, args, device, dtype, before_module).items():
            all_results[(length, name, mode)] = entry
    text = markdown(all_results, args.lengths, variants, header)
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
