"""End-to-end training throughput: a 6-layer MLR GPT-2 vs transformers.GPT2LMHeadModel (sdpa) of the same size.

One training step = forward + backward + AdamW step on a (batch, T) batch of random tokens, called the way the
project's training loop calls the model (``hf_structattn/training/clm.py``: ``use_cache=False``; pass
``--use_cache`` to let GPT-2 build its generation cache as the config default would; the MLR model builds none
in a grad-enabled training forward either way). Steps of the two
models are interleaved so that machine noise hits both alike; the table reports median [min] tokens/s over wall
time and over the process's CPU time (``time.process_time``: all threads, so on a machine shared with other jobs
it is less disturbed by time slices lost to them than wall time is).

    OMP_NUM_THREADS=1 python benchmarks/bench_training.py --lengths 1024 4096 --steps 5 --output docs/bench_training.md
"""

import argparse
import statistics
import time

import torch
import transformers

from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel

try:
    from bench_generation import cpu_name
except ImportError:  # run from another directory
    import platform

    def cpu_name():
        return platform.processor() or "unknown CPU"


def build_models(args, length):
    common = dict(vocab_size=args.vocab_size, n_positions=length, n_embd=args.n_embd, n_head=args.n_embd // 64,
                  n_layer=args.n_layer, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=0, eos_token_id=0)  # GPT-2's 50256 lies outside the byte vocabulary
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**common, attn_implementation="sdpa")).train()
    reference.loss_type = "ForCausalLM"  # stock GPT-2 names no loss and would say so at every step
    mlr = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**common, attention="mlr", mlr_ranks=args.mlr_ranks)).train()
    return {"gpt2 sdpa": reference, "mlr": mlr}


def build_all(args, length):
    """Eager models and, with ``--compile``, torch.compile'd copies (own parameters and optimizers); the compile
    itself happens in the untimed warm-up step."""
    models = build_models(args, length)
    if args.compile:
        compiled = build_models(args, length)
        models.update({f"{name} compiled": torch.compile(model) for name, model in compiled.items()})
    return models


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--n_embd", type=int, default=512)
    parser.add_argument("--vocab_size", type=int, default=257)
    parser.add_argument("--mlr_ranks", type=int, nargs="+", default=[32, 8, 6, 4, 4, 4, 4, 2])
    parser.add_argument("--use_cache", action="store_true",
                        help="pass use_cache=True (GPT-2 then builds its cache; the MLR model skips it in training)")
    parser.add_argument("--compile", action="store_true",
                        help="add rows for torch.compile'd models (the fused MLR op runs eagerly inside them)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    header = (f"# Training throughput\n\nMachine: {cpu_name()}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, transformers {transformers.__version__}, float32. Model: {args.n_layer} layers, "
              f"n_embd {args.n_embd}, head dim 64, vocab {args.vocab_size}, batch {args.batch}; MLR ranks "
              f"{'|'.join(map(str, args.mlr_ranks))} with dyadic blocks from T; use_cache={args.use_cache}. One "
              f"step = forward + backward + AdamW; median [min] of {args.steps} interleaved steps after one warm-up "
              f"step (the compile of --compile rows happens there), in tokens per wall second and per CPU second "
              f"of the process.\n")
    rows = ["| T | mode | GPT-2 sdpa tok/s wall | MLR tok/s wall | MLR / GPT-2 wall | GPT-2 sdpa tok/CPU-s | "
            "MLR tok/CPU-s | MLR / GPT-2 CPU |", "|---|---|---|---|---|---|---|---|"]
    print(header + "\n" + "\n".join(rows), flush=True)
    for length in args.lengths:
        models = build_all(args, length)
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
        ids = torch.randint(0, args.vocab_size, (args.batch, length))
        wall = {name: [] for name in models}
        cpu = {name: [] for name in models}
        warmup = {}
        for step in range(args.steps + 1):
            for name, model in models.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                loss = model(ids, labels=ids, use_cache=args.use_cache).loss
                loss.backward()
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
                if step:
                    wall[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
                else:
                    warmup[name] = time.perf_counter() - start
        tokens = args.batch * length
        for mode in ("eager", "compiled") if args.compile else ("eager",):
            suffix = "" if mode == "eager" else " compiled"
            cells = []
            for times in (wall, cpu):
                ref, mlr = ((tokens / statistics.median(times[name + suffix]), tokens / min(times[name + suffix]))
                            for name in ("gpt2 sdpa", "mlr"))
                cells.append(f"{ref[0]:.0f} [{ref[1]:.0f}] | {mlr[0]:.0f} [{mlr[1]:.0f}] | {mlr[0] / ref[0]:.2f}")
            if mode == "compiled":
                mode += (f" (warm-up incl. compile: {warmup['gpt2 sdpa compiled']:.0f} s / "
                         f"{warmup['mlr compiled']:.0f} s)")
            row = f"| {length} | {mode} | {cells[0]} | {cells[1]} |"
            rows.append(row)
            print(row, flush=True)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(header + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
