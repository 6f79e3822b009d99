"""Generation speed: MLR vs dense vs stock transformers models, GPT-2 and T5 families (CPU).

GPT-2 family (6 layers, n_embd 512, 8 heads, n_positions 4096, greedy): prefill a random prompt, then time
single-token decode steps, the step generate() runs (``model(next_token, cache=cache)``), for
* ``MLR``: ``StructAttnGPT2LMHeadModel`` with MLR attention (ranks 32|8|6|4|4|4|4|2) and its hierarchical key cache;
* ``dense``: the same model with dense attention and the project's cache (``StructAttnCache``);
* ``stock GPT-2``: ``transformers.GPT2LMHeadModel`` of the same shape with its ``DynamicCache`` (sdpa);
* ``... static``: the same with ``new_cache(max_cache_len=...)`` (fixed-shape layers), and ``... compiled`` with
  ``model.forward = torch.compile(model.forward)`` on the static cache (``--compile``).
Variants are interleaved step by step; each cell is the median [min] over steps of the per-step time.

T5 family (greedy ``generate`` of ``--t5-new-tokens`` tokens after a 512-token encoder context): stock
``T5ForConditionalGeneration`` vs the same weights patched with ``hf_structattn.patch`` to MLR in encoder and decoder
self-attention (ranks 32|10|8|8|4|2, mlr_max_length 512), in two shapes: Chronos-T5-small (d_model 512, d_ff 2048,
6+6 layers, 8 heads of 64, vocab 4096) and Chronos-T5-mini (d_model 384, d_ff 1536, 4+4 layers, 8 heads of 64).
Cell: ms per generated token (whole generate call / new tokens), median [min] over interleaved repeats.

Clocks: ``--clock thread`` (CPU time of the calling thread: leaves out time other jobs hold the core; only meaningful
with one torch thread) and wall time; both are printed.

    OMP_NUM_THREADS=1 python benchmarks/bench_generation.py --threads 1 --output /tmp/gen_1thread.md
    python benchmarks/bench_generation.py --threads 2 --output /tmp/gen_2threads.md
"""

import argparse
import os
import platform
import statistics
import time

import torch
import transformers

import hf_structattn
from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel

MLR_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]
T5_RANKS = [32, 10, 8, 8, 4, 2]
T5_SHAPES = {
    "Chronos-T5-small": dict(d_model=512, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8, d_kv=64),
    "Chronos-T5-mini": dict(d_model=384, d_ff=1536, num_layers=4, num_decoder_layers=4, num_heads=8, d_kv=64),
}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def header(args) -> str:
    try:
        commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or "unknown"
    except OSError:
        commit = "unknown"
    return (f"Hardware: {cpu_name()}, {os.cpu_count()} cores visible, {torch.get_num_threads()} torch threads; "
            f"torch {torch.__version__}, transformers {transformers.__version__}, hf_structattn from "
            f"{os.path.dirname(hf_structattn.__file__)} (git {commit}); float32; clock {args.clock} and wall.")


class Clock:
    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self):
        return time.thread_time() if self.kind == "thread" else time.perf_counter()


def gpt2_models(args) -> dict:
    shape = dict(vocab_size=257, n_positions=4096, n_embd=512, n_head=8, n_layer=6, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0)
    torch.manual_seed(0)
    models = {"MLR": StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**shape, attention="mlr", mlr_ranks=MLR_RANKS)),
              "dense": StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**shape, attention="dense")),
              "stock GPT-2": transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape))}
    return {name: model.eval() for name, model in models.items()}


def new_cache(name: str, model, static_len=None):
    if name.startswith("stock"):
        return transformers.DynamicCache() if static_len is None else transformers.StaticCache(
            config=model.config, max_cache_len=static_len)
    if static_len is None:
        return model.transformer.new_cache()
    return model.transformer.new_cache(max_cache_len=static_len)


@torch.no_grad()
def bench_gpt2(args, clock: Clock, rows: list) -> None:
    models = gpt2_models(args)
    variants = [(name, name, None) for name in models]
    if args.static:
        variants += [(f"{name} static", name, "static") for name in ("MLR", "dense")]
    if args.compile:
        variants += [(f"{name} static compiled", name, "compiled") for name in ("MLR", "dense")]
    compiled = {}
    for batch in args.batches:
        for prompt in args.prompts:
            torch.manual_seed(1)
            ids = torch.randint(0, 256, (batch, prompt))
            token = torch.randint(0, 256, (batch, 1))
            state = {}
            for label, name, mode in variants:
                model = models[name]
                static_len = prompt + args.warmup + args.steps + 1 if mode else None
                cache = new_cache(name, model, static_len)
                forward = model.forward
                if mode == "compiled":
                    if name not in compiled:
                        compiled[name] = torch.compile(model.forward)
                    forward = compiled[name]
                forward(ids, cache=cache, use_cache=True, logits_to_keep=1)
                position = prompt
                for _ in range(args.warmup):  # compiles the decode graph on the first one
                    forward(token, cache=cache, use_cache=True, position_ids=torch.full((batch, 1), position))
                    position += 1
                state[label] = [forward, cache, position, [], []]
            for _ in range(args.steps):
                for label, _, _ in variants:
                    forward, cache, position, cpu_times, wall_times = state[label]
                    positions = torch.full((batch, 1), position)
                    start_cpu, start_wall = clock(), time.perf_counter()
                    forward(token, cache=cache, use_cache=True, position_ids=positions)
                    cpu_times.append(clock() - start_cpu)
                    wall_times.append(time.perf_counter() - start_wall)
                    state[label][2] = position + 1
            base = statistics.median(state["dense"][3])
            for label, _, _ in variants:
                cpu_times, wall_times = state[label][3], state[label][4]
                cpu, wall = statistics.median(cpu_times), statistics.median(wall_times)
                row = (f"| GPT-2 | {batch} | {prompt} | {label} | {cpu * 1e3:.2f} [{min(cpu_times) * 1e3:.2f}] | "
                       f"{wall * 1e3:.2f} [{min(wall_times) * 1e3:.2f}] | {cpu / base:.2f}x |")
                rows.append(row)
                print(row, flush=True)
            del state


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["thread", "wall"], default="thread")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 3584])
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per GPT-2 variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--static", action="store_true", help="add static-cache rows (project models)")
    parser.add_argument("--compile", action="store_true", help="add torch.compile rows (static cache)")
    parser.add_argument("--skip-gpt2", action="store_true")
    parser.add_argument("--skip-t5", action="store_true")
    parser.add_argument("--t5-shapes", nargs="+", default=list(T5_SHAPES), choices=list(T5_SHAPES))
    parser.add_argument("--t5-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--t5-new-tokens", type=int, default=24)
    parser.add_argument("--t5-repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = Clock(args.clock)
    lines = [header(args), "",
             f"| model | batch | prompt | variant | ms/token ({args.clock} clock) median [min] | ms/token wall "
             f"median [min] | / baseline ({args.clock}) |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    rows = []
    if not args.skip_gpt2:
        bench_gpt2(args, clock, rows)
    if not args.skip_t5:
        bench_t5(args, clock, rows)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write("\n".join(lines + rows) + "\n")


if __name__ == "__main__":
    main()
