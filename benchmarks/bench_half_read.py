"""Half precision on the in-step read: eager decode steps of the GPT-2 family model (6 layers, n_embd 512, 8 heads,
ranks 32|8|6|4|4|4|4|2) in bfloat16 or float16, rows in step, read by the in-step formulation (half-precision
products added onto float32 scores) and by the general one (what half precision took before), interleaved step by
step in one process (one thread, thread clock), each against the float64 model's logits at the same positions.

    OMP_NUM_THREADS=1 python benchmarks/bench_half_read.py --dtype bfloat16 --prompt 512 --steps 60

Prints one line: the median ms/token of each read, the median of the per-step ratios (in-step / general) and the
largest |logits - float64 logits| of each (the same weights, cast; 0 up to the dtype's rounding).
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import gpt2_models, prefilled_cache  # noqa: E402

from hf_structattn.modeling import structattn_mlr_plan  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    for name in ("batch", "prompt", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    return args


def _interleave(args, half, reference, ids, caches, times: dict, errors: dict) -> None:
    """The timed steps: both reads of each step, alternating which goes first, each against the float64 logits."""
    every_dtype = structattn_mlr_plan.READ_DTYPES
    float_only = (torch.float32, torch.float64)
    try:
        for index in range(args.warmup + args.steps):
            position = args.prompt + index
            token, positions = ids[:, position:position + 1], torch.full((args.batch, 1), position)
            expected = reference(token, cache=caches["float64"], position_ids=positions).logits
            order = ("in-step", "general") if index % 2 == 0 else ("general", "in-step")
            for name in order:
                # the formulation is planned before the first layer: which dtypes the in-step read takes decides it
                structattn_mlr_plan.READ_DTYPES = every_dtype if name == "in-step" else float_only
                start = time.thread_time()
                logits = half(token, cache=caches[name], position_ids=positions).logits
                elapsed = time.thread_time() - start
                if index >= args.warmup:
                    times[name].append(elapsed)
                    errors[name] = max(errors[name], float((logits.double() - expected).abs().max()))
    finally:
        structattn_mlr_plan.READ_DTYPES = every_dtype


@torch.no_grad()
def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    model = gpt2_models()["MLR"]
    reference = copy.deepcopy(model).double()
    half = model.to(dtype)
    torch.manual_seed(1)
    ids = torch.randint(2, 255, (args.batch, args.prompt + args.warmup + args.steps))
    new_tokens = args.warmup + args.steps + 1
    caches = {name: prefilled_cache(model, ids[:, :args.prompt], new_tokens=new_tokens)
              for name, model in (("in-step", half), ("general", half), ("float64", reference))}
    times = {"in-step": [], "general": []}
    errors = {"in-step": 0.0, "general": 0.0}
    _interleave(args, half, reference, ids, caches, times, errors)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    ratio = statistics.median(a / b for a, b in zip(times["in-step"], times["general"]))
    print(f"{args.dtype}, batch {args.batch}, prompt {args.prompt}, {args.steps} steps: "
          + ", ".join(f"{name} {value:.2f} ms" for name, value in medians.items())
          + f"; in-step / general {ratio:.3f}; max |logits - float64| in-step {errors['in-step']:.3g}, "
          f"general {errors['general']:.3g}")
    return {"medians": medians, "ratio": ratio, "errors": errors}


if __name__ == "__main__":
    main()
