"""The LM design's arms on one CPU thread: a stacked training step and an evaluation of 8 windows, dense against MLR
with the materialised MLR path forming the finer levels on their diagonal blocks ("after") and over all T x T pairs
("before": the same function without the aligned start, the path the design's MLR arm took until the block form).

The design's stacked runs call the model under ``torch.func.vmap``, where attention runs its ``eager`` (materialised)
implementation: that path formed every level's T x T scores and masks, which cost the MLR arm 3.7x dense's step and
2.3x its evaluation here. Thread clock, arms interleaved in one process, the minimum of ``--repeats`` after one
warm-up. Writes benchmarks/results/design_arms.md (``--out`` elsewhere).

    python benchmarks/bench_design_arms.py [--width 256] [--repeats 3]
"""

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "design_arms.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers

    import hf_structattn.modeling.structattn_attention as attention
    import lm_experiment as lm
    from stacked_runs import StackedRuns

    blocks = attention.mlr_attention_full_keys

    def all_pairs(*positional, aligned_start=None, **keywords):
        return blocks(*positional, **keywords)

    batch = torch.randint(0, 256, (1, lm.CPU.batch, lm.SEQ_LEN), generator=torch.Generator().manual_seed(0))
    windows = torch.randint(0, 256, (1, 8, lm.SEQ_LEN), generator=torch.Generator().manual_seed(1))
    stacks = {}
    for variant in ("dense", "mlr"):
        model = lm.build_model(variant, args.width)
        stacks[variant] = StackedRuns(model, [model.state_dict()], [1e-3])
    arms = [("dense", "dense", blocks), ("MLR, all pairs (before)", "mlr", all_pairs),
            ("MLR, diagonal blocks (after)", "mlr", blocks)]
    times = {name: {"step": [], "evaluation": []} for name, _, _ in arms}

    def thread_seconds(fn) -> float:
        start = time.thread_time()
        fn()
        return time.thread_time() - start

    for _ in range(args.repeats + 1):
        for name, variant, implementation in arms:
            attention.mlr_attention_full_keys = implementation
            stack = stacks[variant]
            times[name]["step"].append(thread_seconds(lambda: stack.train_step(lm.lm_loss, (batch,), 1.0)))
            times[name]["evaluation"].append(thread_seconds(lambda: stack.evaluate(lm.window_nll_sum, (windows,))))
    attention.mlr_attention_full_keys = blocks
    best = {name: {kind: min(values[1:]) for kind, values in row.items()} for name, row in times.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [f"Hardware: {cpu}, 1 torch thread; torch {torch.__version__}, transformers {transformers.__version__}, "
             f"hf_structattn git {commit.strip()}; Python {platform.python_version()}, float32. The LM design's arm "
             f"at D = {args.width} ({lm.LAYERS} layers, head dim {lm.HEAD_DIM}, MLR ranks 32|8|6|4|4|4|4|2 with "
             f"level averaging), one run stacked, eager (vmap); a training step of {lm.CPU.batch} x {lm.SEQ_LEN} "
             f"tokens, an evaluation of 8 windows; thread seconds, the best of {args.repeats} after a warm-up.",
             "", "| arm | step s | / dense | evaluation s | / dense |", "|---|---|---|---|---|"]
    for name, row in best.items():
        lines.append(f"| {name} | {row['step']:.2f} | {row['step'] / best['dense']['step']:.2f} | "
                     f"{row['evaluation']:.2f} | {row['evaluation'] / best['dense']['evaluation']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
