"""MLR Triton kernel vs FlashAttention (SDPA flash backend) on CUDA: forward and forward+backward wall time.

    python benchmarks/bench_triton.py [--batch 1] [--heads 16] [--seqlens 1024 2048 4096 8192 16384]

bf16, head dim r = 64, ranks 32|8|6|4|4|4|4|2, dyadic blocks b_l = T / 2^(l-1) for each T, causal (unless
--bidirectional). Prints a markdown table (median ms from triton.testing.do_bench). MLR multiplies ~0.60x the
score FLOPs of dense attention (0.80x with PV); the kernel's 16-dim chunks with 64x64 tiles do ~0.67x / 0.83x
(causal, T=4096).
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RANKS = [32, 8, 6, 4, 4, 4, 4, 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--bidirectional", action="store_true")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        raise SystemExit("bench_triton.py needs a CUDA GPU (the Triton kernel is only timed on GPU; "
                         "on CPU run tests/test_triton_kernel.py, which uses TRITON_INTERPRET=1)")
    try:
        import triton
        from triton.testing import do_bench
    except ImportError:
        raise SystemExit("bench_triton.py needs triton: pip install triton")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_structattn.modeling.structattn_triton import mlr_attention_triton

    causal = not args.bidirectional
    head_dim = sum(RANKS)
    print(f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"bf16, B={args.batch}, H={args.heads}, r={head_dim}, ranks {'|'.join(map(str, RANKS))}, "
          f"{'causal' if causal else 'bidirectional'}")
    print()
    print("| T | SDPA flash fwd ms | MLR-triton fwd ms | fwd ratio | SDPA flash fwd+bwd ms | "
          "MLR-triton fwd+bwd ms | fwd+bwd ratio |")
    print("|---|---|---|---|---|---|---|")

    for seq_len in args.seqlens:
        if seq_len % 2 ** (len(RANKS) - 1):
            print(f"| {seq_len} | skipped: T must be divisible by {2 ** (len(RANKS) - 1)} for dyadic blocks |"
                  " | | | | |")
            continue
        print(_bench_row(seq_len, args.batch, args.heads, causal, do_bench, sdpa_kernel, SDPBackend,
                         mlr_attention_triton), flush=True)
        torch.cuda.empty_cache()


def _bench_row(seq_len, batch, heads, causal, do_bench, sdpa_kernel, backend, mlr_attention_triton) -> str:
    """One markdown row: median ms of SDPA flash and MLR-triton, forward and forward+backward."""
    head_dim = sum(RANKS)
    scales = [1.0 / math.sqrt(head_dim)] * len(RANKS)
    block_sizes = [seq_len // 2 ** level for level in range(1, len(RANKS))]
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def sdpa():
        with sdpa_kernel(backend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def mlr():
        return mlr_attention_triton(q, k, v, ranks=RANKS, block_sizes=block_sizes, causal=causal,
                                    level_scales=scales)

    timings = {}
    for name, fn in (("sdpa", sdpa), ("mlr", mlr)):
        with torch.no_grad():
            timings[name, "fwd"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
        timings[name, "both"] = do_bench(lambda: fn().backward(grad_out), warmup=25, rep=100,
                                         grad_to_none=[q, k, v], return_mode="median")
    row = [str(seq_len)]
    for phase in ("fwd", "both"):
        base, ours = timings["sdpa", phase], timings["mlr", phase]
        row += [f"{base:.3f}", f"{ours:.3f}", f"{ours / base:.2f}x"]
    return "| " + " | ".join(row) + " |"


if __name__ == "__main__":
    main()
