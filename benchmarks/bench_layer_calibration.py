"""Layer-by-layer calibration of a patched SmolLM2-135M, the cheap alternative to fine-tuning that was tried and not
kept: each patched layer's q/k projections are fitted, with the rest frozen, so that its attention output matches
the stock layer's on the stock model's own inputs to that layer (calibration text; no backward through the model).

Prints perplexity / stock and top-1 agreement with stock on held-out windows before and after, the per-layer
relative error of the attention output at the first and last fitting step, and the fitting's CPU minutes (thread
clock, one thread); appends one JSON line to ``--results``. About 8 CPU-minutes with the defaults.

    python benchmarks/bench_layer_calibration.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import hf_structattn
from hf_structattn.modeling.structattn_decoder_spec import attention_modules
from hf_structattn.real_weights import RealWeightsUnavailable, load_smollm2, smollm2_folder, token_windows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import header_line  # noqa: E402

CONTEXT = 2048
LAYER_INPUTS = ("hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache_position")


@torch.no_grad()
def window_scores(model, windows: torch.Tensor) -> tuple:
    """(mean next-token loss over ``windows`` (N, T), the argmax tokens (N, T - 1))."""
    losses, argmax = [], []
    for window in windows:
        logits = model(window[None], use_cache=False).logits[0, :-1].float()
        losses.append(torch.nn.functional.cross_entropy(logits, window[1:], reduction="none"))
        argmax.append(logits.argmax(-1))
    return float(torch.cat(losses).mean()), torch.stack(argmax)


def stock_layer_io(stock, windows: torch.Tensor) -> list:
    """Per attention module of ``stock``: [(its keyword inputs, its output (1, T, D))] for each window."""
    modules = list(attention_modules(stock).values())
    captured = [[] for _ in modules]
    handles = []
    for index, module in enumerate(modules):
        def before(module, args, kwargs, index=index):
            captured[index].append([{name: kwargs[name] for name in LAYER_INPUTS if name in kwargs}, None])

        def after(module, args, kwargs, output, index=index):
            captured[index][-1][1] = output[0].detach()

        handles += [module.register_forward_pre_hook(before, with_kwargs=True),
                    module.register_forward_hook(after, with_kwargs=True)]
    with torch.no_grad():
        for window in windows:
            stock(window[None], use_cache=False)
    for handle in handles:
        handle.remove()
    return captured


def calibrate(patched, captured: list, steps: int, learning_rate: float) -> list:
    """Fit each patched layer's q_proj / k_proj (Adam, ``steps`` steps cycling over the captured windows) to the
    stock layer's output; returns [(first, last) relative squared error] per layer."""
    patched.requires_grad_(False)
    errors = []
    for module, samples in zip(attention_modules(patched).values(), captured):
        params = [module.q_proj.weight, module.k_proj.weight]
        for param in params:
            param.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=learning_rate)
        trace = []
        for step in range(steps):
            inputs, target = samples[step % len(samples)]
            loss = (module(**inputs)[0] - target).pow(2).mean() / target.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trace.append(loss.item())
        for param in params:
            param.requires_grad_(False)
        errors.append((trace[0], trace[-1]))
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="32,16,8,8")
    parser.add_argument("--steps", type=int, default=30, help="Adam steps per layer")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--calibration_windows", type=int, default=2, help="2,048-token windows of calibration text")
    parser.add_argument("--heldout_windows", type=int, default=6)
    parser.add_argument("--results", default="benchmarks/results/layer_calibration.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        smollm2_folder()
    except RealWeightsUnavailable as error:
        print(f"real weights unavailable: {error}", file=sys.stderr)
        return 1
    ranks = [int(rank) for rank in args.ranks.split(",")]
    stock, tokenizer = load_smollm2(torch.float32)
    stock.eval()
    patched = hf_structattn.patch(stock, mlr_ranks=ranks, mlr_max_length=CONTEXT).eval()
    heldout = token_windows(tokenizer, "heldout", CONTEXT, args.heldout_windows)
    stock_loss, stock_argmax = window_scores(stock, heldout)

    def quality(model) -> dict:
        loss, argmax = window_scores(model, heldout)
        return {"perplexity_ratio": math.exp(loss - stock_loss),
                "top1_agreement": float((argmax == stock_argmax).double().mean())}

    before = quality(patched)
    started = time.thread_time()
    captured = stock_layer_io(stock, token_windows(tokenizer, "calibration", CONTEXT, args.calibration_windows))
    errors = calibrate(patched, captured, args.steps, args.learning_rate)
    cpu_minutes = (time.thread_time() - started) / 60
    row = {"ranks": args.ranks, "steps": args.steps, "learning_rate": args.learning_rate,
           "calibration_windows": args.calibration_windows, "heldout_windows": args.heldout_windows,
           "before": before, "after": quality(patched), "cpu_minutes": cpu_minutes,
           "layer_rel_error": errors, "hardware": header_line("float32, SmolLM2-135M-Instruct")}
    print(row["hardware"])
    for index, (first, last) in enumerate(errors):
        print(f"layer {index:2d}: relative error of the attention output {first:.4f} -> {last:.4f}")
    print(f"perplexity / stock {before['perplexity_ratio']:.4f} -> {row['after']['perplexity_ratio']:.4f}, "
          f"top-1 {before['top1_agreement']:.3f} -> {row['after']['top1_agreement']:.3f}, "
          f"{cpu_minutes:.1f} CPU-minutes of calibration")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as handle:
        handle.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
