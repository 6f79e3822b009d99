"""The recipes' training loop on ``accelerate``.

Exact resume by construction: the data of optimizer step ``s`` is a pure function of ``(seed, s)`` (each recipe's
``micro_batch_fn`` slices the step's *global* batch by rank and micro-step), the learning rate is a pure function of
``s`` (set on every step, so no scheduler state), evaluation runs inside ``torch.random.fork_rng`` with its own
seed, and ``accelerator.save_state`` stores model, optimizer and RNG states (dropout) together with the step. A run
resumed from the checkpoint of step ``k`` therefore replays steps ``k+1..`` exactly as the uninterrupted run did.
The same slicing makes ``n`` processes with per-device batch ``B`` train on the same global batch as one process
with ``n*B`` (gradient all-reduce averages equal-sized shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import ProjectConfiguration, parse_flag_from_env, set_seed
from tqdm.auto import tqdm

from .tracking import JSONLTracker


@dataclass
class CommonArgs:
    """Fields shared by every recipe (all overridable as ``--name value``)."""

    config: Optional[str] = None          # YAML/JSON config file
    output_dir: str = "outputs/run"
    seed: int = 0
    max_steps: int = 100
    per_device_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    lr_schedule: str = "cosine"          # constant | linear | cosine (after linear warm-up)
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    mixed_precision: Optional[str] = None  # no | bf16 | fp16; None: whatever `accelerate launch` was given
    mup: bool = False                     # hf_structattn.mup: muP logits, init and per-layer learning rates
    mup_base_width: int = 128
    log_every: int = 1
    eval_every: int = 50
    checkpoint_every: int = 50
    checkpoints_total_limit: int = 2
    resume_from: Optional[str] = None     # a checkpoint folder, or "latest" (newest under output_dir/checkpoints)
    stop_after_steps: Optional[int] = None  # stop (after checkpointing) at this step: simulates an interruption
    report_to: str = "all"                # "all" installed trackers (+ jsonl, always), "none", or a comma list
    run_name: Optional[str] = None
    disable_tqdm: bool = False
    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    hub_private: bool = False
    model: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("push_to_hub=True needs hub_model_id (e.g. --hub_model_id user/name)")


def finish_run(accelerator: Accelerator, args: CommonArgs, output_dir, summary: dict) -> dict:
    """Rank 0 uploads the finished output folder when asked; then every rank waits and closes the trackers."""
    if accelerator.is_main_process and args.push_to_hub:
        from .outputs import push_to_hub

        summary["hub_repo_id"] = push_to_hub(output_dir, args.hub_model_id, private=args.hub_private)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def make_accelerator(args: CommonArgs, run_name: str) -> Accelerator:
    """Accelerator with the JSONL tracker (+ any installed tracker) and the recipe's mixed precision."""
    out = Path(args.output_dir)
    # The tracker's main-process check creates accelerate's PartialState; create it first the way Accelerator
    # would, or ACCELERATE_USE_CPU (multi-process CPU runs) is ignored and every rank runs alone.
    PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    trackers: list = [JSONLTracker(run_name, out)]
    report = [t.strip() for t in (args.report_to or "none").split(",") if t.strip()]
    if "all" in report:
        trackers.append("all")
    else:
        trackers += [t for t in report if t not in ("none", "jsonl")]
    accelerator = Accelerator(mixed_precision=args.mixed_precision or None, log_with=trackers,
                              project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out)))
    set_seed(args.seed)  # identical on every rank: identical initialisation
    return accelerator


def build_optimizer(model: torch.nn.Module, args: CommonArgs) -> torch.optim.Optimizer:
    """AdamW; with ``args.mup`` the muP groups of :func:`hf_structattn.mup.mup_param_groups`.
    Every group remembers its ``base_lr`` (the schedule multiplies it each step)."""
    if args.mup:
        from ..mup import mup_param_groups

        groups = mup_param_groups(model, lr=args.learning_rate, base_width=args.mup_base_width,
                                  weight_decay=args.weight_decay)
        for group in groups:
            group.pop("names", None)
    else:
        decay, no_decay = [], []
        for _, param in model.named_parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        groups = [{"params": decay, "weight_decay": args.weight_decay, "lr": args.learning_rate},
                  {"params": no_decay, "weight_decay": 0.0, "lr": args.learning_rate}]
        groups = [g for g in groups if g["params"]]
    for group in groups:
        group["base_lr"] = group["lr"]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_eps)


def lr_factor(step: int, args: CommonArgs) -> float:
    """Multiplier of the base learning rate at (0-based) optimizer step ``step``."""
    if args.warmup_steps > 0 and step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    span = max(1, args.max_steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / span)
    if args.lr_schedule == "linear":
        return 1.0 - (1.0 - args.min_lr_ratio) * progress
    if args.lr_schedule == "cosine":
        return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule must be constant, linear or cosine, got {args.lr_schedule!r}")


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and
             (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resolve_checkpoint(resume_from: str, output_dir: str | Path) -> Path:
    if resume_from == "latest":
        found = checkpoint_dirs(output_dir)
        if not found:
            raise FileNotFoundError(f"--resume_from latest: no checkpoint under {output_dir}/checkpoints")
        return found[-1]
    path = Path(resume_from)
    if not (path / "trainer_state.json").exists():
        raise FileNotFoundError(f"--resume_from {path}: not a checkpoint folder (no trainer_state.json)")
    return path


@dataclass
class TrainResult:
    step: int
    interrupted: bool
    final_eval: dict
    train_seconds: float
    history: list = field(default_factory=list)


def train(accelerator: Accelerator, args: CommonArgs, model, optimizer, *,
          micro_batch_fn: Callable[[int, int, int, int], object],
          loss_fn: Callable[[torch.nn.Module, object], torch.Tensor],
          eval_fn: Callable[[torch.nn.Module], dict],
          tokens_per_step: int, flops_per_token: float, desc: str = "train") -> TrainResult:
    """Run optimizer steps ``start..max_steps``. ``model``/``optimizer`` must already be ``accelerator.prepare``d.

    ``micro_batch_fn(step, micro, rank, world)`` returns this rank's share of micro-step ``micro`` of step ``step``;
    ``loss_fn(model, batch)`` the mean loss of that share; ``eval_fn(unwrapped_model)`` a dict of metrics that is
    identical on every rank (reduce inside it). Logs ``train/loss``, ``train/lr``, ``tokens``, ``flops`` every
    ``log_every`` steps and ``eval/*`` every ``eval_every`` steps (and at step 0 and the end).
    """
    out = Path(args.output_dir)
    start_step = 0
    if args.resume_from:
        path = resolve_checkpoint(args.resume_from, out)
        accelerator.load_state(str(path))
        start_step = json.loads((path / "trainer_state.json").read_text())["step"]
        accelerator.print(f"resumed from {path} at step {start_step}")
    unwrapped = accelerator.unwrap_model(model)
    world, rank = accelerator.num_processes, accelerator.process_index
    accum = args.gradient_accumulation_steps

    def evaluate_now(step: int) -> dict:
        was_training = unwrapped.training
        unwrapped.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(args.seed + 1_000_003)
            metrics = eval_fn(unwrapped)
        unwrapped.train(was_training)
        record = {f"eval/{k}": v for k, v in metrics.items()}
        record.update(tokens=step * tokens_per_step, flops=step * tokens_per_step * flops_per_token)
        accelerator.log(record, step=step)
        return metrics

    final_eval: dict = {}
    if start_step == 0 and args.eval_every:
        final_eval = evaluate_now(0)
    progress = tqdm(total=args.max_steps, initial=start_step, desc=desc,
                    disable=args.disable_tqdm or not accelerator.is_local_main_process)
    started = time.perf_counter()
    step = start_step
    interrupted = False
    model.train()
    while step < args.max_steps:
        factor = lr_factor(step, args)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        total = torch.zeros(())
        for micro in range(accum):
            batch = micro_batch_fn(step, micro, rank, world)
            sync = contextlib.nullcontext() if micro == accum - 1 else accelerator.no_sync(model)
            with sync:
                loss = loss_fn(model, batch) / accum
                accelerator.backward(loss)
            total += loss.detach().float()
        grad_norm = None
        if args.max_grad_norm and args.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value = accelerator.reduce(total, reduction="mean").item()
        progress.update(1)
        progress.set_postfix(loss=f"{loss_value:.4f}")
        if step % max(1, args.log_every) == 0 or step == args.max_steps:
            record = {"train/loss": loss_value, "train/lr": args.learning_rate * factor,
                      "tokens": step * tokens_per_step, "flops": step * tokens_per_step * flops_per_token}
            if grad_norm is not None:
                record["train/grad_norm"] = float(grad_norm)
            accelerator.log(record, step=step)
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            final_eval = evaluate_now(step)
        stop = args.stop_after_steps is not None and step >= args.stop_after_steps and step < args.max_steps
        if (args.checkpoint_every and step % args.checkpoint_every == 0) or step == args.max_steps or stop:
            save_checkpoint(accelerator, args, step)
        if stop:
            interrupted = True
            break
    progress.close()
    if not final_eval or (not args.eval_every and not interrupted):
        final_eval = evaluate_now(step)
    return TrainResult(step=step, interrupted=interrupted, final_eval=final_eval,
                       train_seconds=time.perf_counter() - started)


def save_checkpoint(accelerator: Accelerator, args: CommonArgs, step: int) -> Path:
    path = Path(args.output_dir) / "checkpoints" / f"step_{step}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "seed": args.seed}))
        old = checkpoint_dirs(args.output_dir)
        for stale in old[:max(0, len(old) - max(1, args.checkpoints_total_limit))]:
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def args_as_dict(args) -> dict:
    return dataclasses.asdict(args)
