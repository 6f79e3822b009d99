"""Transient memory of the fused MLR op against SDPA on CPU: peak of a prefill and of a training step.

    python benchmarks/bench_memory.py [--lengths 1024 2048 4096 8192] [--layouts bthd bhtd] [--breakdown]

Ops: ``hf_structattn.mlr_attention(q, k, v, ranks=[32, 8, 6, 4, 4, 4, 4, 2], block_sizes=[T/2, ..., T/128],
causal=True, implementation="fused")`` and ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``; batch 1,
8 heads, head dim 64, float32, one thread. Inputs in two layouts: ``bthd``, the (B, T, H, 64)-memory views of one
packed (B, T, 3*H*64) projection that a model's qkv projection produces (the leaf being the packed tensor), and
``bhtd``, three contiguous (B, H, T, 64) tensors.

* prefill: one forward under ``torch.no_grad()``;
* training step: ``op(q, k, v).backward(dO)`` with the inputs requiring grad (the output and the input gradients
  are part of the step).

Measured: the peak of the bytes live in the torch CPU allocator during the call, above what was live before it
(inputs and ``dO`` exist before the call and are not counted; outputs, gradients and every scratch buffer are),
reconstructed from the allocator's events recorded by ``torch.profiler`` (``profile_memory=True``: one event per
allocation and free, summed in time order). Not RSS: freed blocks the allocator keeps, and memory that MKL/oneDNN
allocate outside the torch allocator, are not seen. The numbers are deterministic (no clock involved).
``--breakdown`` adds the MLR op's allocations at the largest T, grouped by the op that made them and their size.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import header_line  # noqa: E402

from hf_structattn import mlr_attention  # noqa: E402

MLR_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]
HEAD_DIM = 64
LAYOUTS = ("bthd", "bhtd")
OPS = ("SDPA", "MLR fused")


def make_inputs(length: int, heads: int, layout: str, grad: bool, seed: int = 0):
    """(leaves, q, k, v, dO): q/k/v (1, H, T, 64) in the given layout, ``leaves`` the tensors that get grads."""
    generator = torch.Generator().manual_seed(seed)
    if layout == "bthd":
        packed = torch.randn(1, length, 3 * heads * HEAD_DIM, generator=generator).requires_grad_(grad)
        q, k, v = (t.view(1, length, heads, HEAD_DIM).transpose(1, 2) for t in packed.split(heads * HEAD_DIM, -1))
        leaves = [packed]
    elif layout == "bhtd":
        leaves = [torch.randn(1, heads, length, HEAD_DIM, generator=generator).requires_grad_(grad) for _ in range(3)]
        q, k, v = leaves
    else:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    grad_out = torch.randn(1, heads, length, HEAD_DIM, generator=generator)
    return leaves, q, k, v, grad_out


def attention(op: str, q, k, v):
    if op == "SDPA":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if op == "MLR fused":
        blocks = [q.shape[2] >> level for level in range(1, len(MLR_RANKS))]
        return mlr_attention(q, k, v, ranks=MLR_RANKS, block_sizes=blocks, causal=True, implementation="fused")
    raise ValueError(f"op={op!r} is not one of {OPS}")


def peak_bytes(fn) -> tuple:
    """(peak bytes live above the start, profiler) of ``fn()``, from the allocator events of torch.profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak, prof


def measure(op: str, length: int, heads: int, layout: str, training: bool) -> tuple:
    """(peak bytes, profiler) of one prefill (``training=False``) or training step of ``op``."""
    leaves, q, k, v, grad_out = make_inputs(length, heads, layout, training)

    def prefill():
        with torch.no_grad():
            attention(op, q, k, v)

    def step():
        attention(op, q, k, v).backward(grad_out)

    attention_fn = step if training else prefill
    attention_fn()  # first touch and one-time setup outside the measured call
    for leaf in leaves:
        leaf.grad = None
    return peak_bytes(attention_fn)


def breakdown(prof, top: int = 12) -> list:
    """Markdown rows: the bytes each op allocated and kept (allocations minus frees inside it) in one call,
    grouped by (op, size), largest total first: which buffers a call makes, not which are live together."""
    groups = {}
    for event in prof.profiler.function_events:
        if event.name == "[memory]" or event.self_cpu_memory_usage <= 0:
            continue
        named = event
        while named.name.startswith(("aten::empty", "aten::new_", "aten::zeros")) and named.cpu_parent is not None:
            named = named.cpu_parent  # name the op that asked for the buffer, not aten::empty
        key = (named.name, event.self_cpu_memory_usage)
        groups[key] = groups.get(key, 0) + 1
    rows = ["| allocating op | size MiB | count |", "|---|---:|---:|"]
    for (name, size), count in sorted(groups.items(), key=lambda item: -item[0][1] * item[1])[:top]:
        rows.append(f"| `{name}` | {size / 2 ** 20:.2f} | {count} |")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--breakdown", action="store_true", help="MLR's allocations at the largest T by op and size")
    parser.add_argument("--output", default=None, help="also write the markdown to this file")
    args = parser.parse_args(argv)
    blocks = 2 ** (len(MLR_RANKS) - 1)
    for length in args.lengths:
        if length < blocks or length % blocks:
            parser.error(f"--lengths: T={length} must be a positive multiple of {blocks} (dyadic blocks T/2..T/128)")
    if args.heads < 1:
        parser.error(f"--heads must be >= 1, got {args.heads}")
    torch.set_num_threads(1)
    lines = [header_line(f"float32, batch 1, {args.heads} heads, head dim {HEAD_DIM}, causal; MLR ranks "
                         f"{'|'.join(map(str, MLR_RANKS))}, blocks T/2..T/128, implementation fused; peak bytes "
                         "live in the torch CPU allocator above the inputs (torch.profiler allocator events)"), ""]
    for phase, training in (("prefill (forward, no grad)", False), ("training step (forward + backward)", True)):
        lines += [f"**{phase}: peak MiB above the inputs (MLR / SDPA)**", "",
                  "| layout | op | " + " | ".join(f"T={t}" for t in args.lengths) + " |",
                  "|---|---|" + "---:|" * len(args.lengths)]
        for layout in args.layouts:
            peaks = {op: [measure(op, length, args.heads, layout, training)[0] for length in args.lengths]
                     for op in OPS}
            for op in OPS:
                cells = []
                for index, value in enumerate(peaks[op]):
                    ratio = value / peaks["SDPA"][index] if peaks["SDPA"][index] else float("nan")
                    cells.append(f"{value / 2 ** 20:.1f}" + (f" ({ratio:.2f}x)" if op != "SDPA" else ""))
                lines.append(f"| {layout} | {op} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
        lines.append("")
    if args.breakdown:
        for training in (False, True):
            _, prof = measure("MLR fused", max(args.lengths), args.heads, args.layouts[0], training)
            lines += [f"**MLR fused, {'training step' if training else 'prefill'}, T={max(args.lengths)}, "
                      f"{args.layouts[0]}: allocations by op**", "", *breakdown(prof), ""]
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
