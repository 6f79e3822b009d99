"""What the default MLR logit scale costs: ``mlr_scaling="standard"`` (uniform 1/sqrt(r), our config default) vs
``"mup"`` (1/r_l per level, the authors' LM code) on the README's main-job CLM recipe.

    OMP_NUM_THREADS=1 python scripts/mlr_scaling_experiment.py run --steps 300 --seeds 0 1 2 --out outputs/mlr_scaling
    python scripts/mlr_scaling_experiment.py report --out outputs/mlr_scaling

``run`` trains ``recipes/train_clm.py --config configs/clm_mlr_stdlib.yaml`` (MLR 32|16|8|8, T = 256, D = 128,
2 heads of 64, level averaging on, as the config has it) once per (seed, scaling), the two scalings of a seed side by
side in two one-thread processes (same seed: same init, same batches), and evaluates on ``--eval_windows`` windows
spread over the validation split. Nothing else differs between the arms. ``report`` prints the init logit scale by
pair depth of this configuration (``hf_structattn.diagnostics.mlr_logit_std_by_depth``) and, per seed, the final
validation bits/byte and the training loss of the last 50 steps of both arms with their paired difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hf_structattn.training.tracking import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
SCALINGS = ("standard", "mup")
CONFIG = "configs/clm_mlr_stdlib.yaml"


def run_dir(out: Path, scaling: str, seed: int) -> Path:
    return out / f"{scaling}_s{seed}"


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    for seed in args.seeds:
        processes = []
        for scaling in SCALINGS:  # the pair of a seed runs side by side: both see the same machine load
            folder = run_dir(out, scaling, seed)
            command = [sys.executable, str(ROOT / "recipes/train_clm.py"), "--config", str(ROOT / CONFIG),
                       "--max_steps", str(args.steps), "--mlr_scaling", scaling, "--seed", str(seed),
                       "--eval_every", str(args.eval_every), "--eval_windows", str(args.eval_windows),
                       "--checkpoint_every", "1000000", "--sample_new_tokens", "0", "--report_to", "none",
                       "--disable_tqdm", "--overwrite_output_dir", "--output_dir", str(folder)]
            log = (out / f"{scaling}_s{seed}.log").open("w")
            processes.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), folder))
        for process, folder in processes:
            if process.wait() != 0:
                raise SystemExit(f"run {folder.name} failed: see {folder}.log")
        print(f"[{time.time() - t0:6.0f} s] seed {seed} done", flush=True)
    (out / "run.json").write_text(json.dumps({"steps": args.steps, "seeds": args.seeds, "eval_windows":
                                              args.eval_windows, "wall_s": round(time.time() - t0, 1)}))
    print(f"all runs finished, wall {time.time() - t0:.0f} s")


def summarise(folder: Path) -> dict:
    records = read_jsonl(folder / "metrics.jsonl")
    evals = [r for r in records if "eval/bits_per_byte" in r]
    train = [r["train/loss"] for r in records if "train/loss" in r]
    final = json.loads((folder / "final_metrics.json").read_text())
    return {"bpb": final["eval_bits_per_byte"], "train_loss_last50": sum(train[-50:]) / len(train[-50:]),
            "curve": {r["step"]: r["eval/bits_per_byte"] for r in evals}, "train_s": final["train_seconds"]}


def init_logit_scales() -> list[tuple[str, list[float]]]:
    """Init logit std by pair depth (1 = only the global level shared) of the config's model, both scalings."""
    import torch
    import yaml

    from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
    from hf_structattn.diagnostics import mlr_logit_std_by_depth

    fields = yaml.safe_load((ROOT / CONFIG).read_text())["model"]
    rows = []
    for scaling in SCALINGS:
        torch.manual_seed(0)
        model = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**{**fields, "mlr_scaling": scaling}))
        rows.append((scaling, mlr_logit_std_by_depth(model)))
    return rows


def report(args) -> None:
    out = Path(args.out)
    meta = json.loads((out / "run.json").read_text())
    print(f"init logit std by pair depth ({CONFIG}, attention inputs N(0, I)):\n")
    print("| mlr_scaling | " + " | ".join(f"depth {d}" for d in range(1, 5)) + " | nearest / distant |")
    print("|---|" + "---|" * 5)
    for scaling, stds in init_logit_scales():
        print(f"| {scaling} | " + " | ".join(f"{s:.3f}" for s in stds) + f" | {stds[-1] / stds[0]:.2f} |")
    print(f"\n{meta['steps']} steps, validation bits/byte on {meta['eval_windows']} windows spread over the "
          f"validation split; wall {meta['wall_s']:.0f} s for all runs\n")
    print("| seed | bits/byte standard | bits/byte mup | mup - standard | train loss (last 50) standard | "
          "train loss mup | mup - standard | train s (standard / mup) |")
    print("|---|---|---|---|---|---|---|---|")
    deltas, train_deltas = [], []
    for seed in meta["seeds"]:
        standard, mup = (summarise(run_dir(out, s, seed)) for s in SCALINGS)
        deltas.append(mup["bpb"] - standard["bpb"])
        train_deltas.append(mup["train_loss_last50"] - standard["train_loss_last50"])
        print(f"| {seed} | {standard['bpb']:.4f} | {mup['bpb']:.4f} | {deltas[-1]:+.4f} | "
              f"{standard['train_loss_last50']:.4f} | {mup['train_loss_last50']:.4f} | {train_deltas[-1]:+.4f} | "
              f"{standard['train_s']:.0f} / {mup['train_s']:.0f} |")
    mean = sum(deltas) / len(deltas)
    print(f"| mean | | | {mean:+.4f} | | | {sum(train_deltas) / len(train_deltas):+.4f} | |")
    print("\nvalidation bits/byte during training (standard / mup):")
    for seed in meta["seeds"]:
        standard, mup = (summarise(run_dir(out, s, seed)) for s in SCALINGS)
        print(f"seed {seed}: " + ", ".join(f"{step}: {standard['curve'][step]:.3f} / {mup['curve'][step]:.3f}"
                                           for step in sorted(standard["curve"]) if step))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--out", default="outputs/mlr_scaling")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--eval_windows", type=int, default=128)
    args = parser.parse_args(argv)
    run_all(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
