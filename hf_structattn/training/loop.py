"""The recipes' training loop on ``accelerate``, and the output-folder contract every recipe run follows.

**Output folder.** A run owns its ``output_dir``. A non-empty folder is refused unless ``--overwrite_output_dir``
(which deletes its contents first) or ``--resume_from`` is given. A new run stores its configuration in
``run_config.json`` (and in every checkpoint); a resume compares the checkpoint's stored configuration with the
current one and refuses, naming the fields, when anything that shapes training differs (seed, model, data, optimizer,
schedule, batch; only the fields in :data:`.args.FREE_ON_RESUME` may change). On resume ``metrics.jsonl`` keeps only the
records up to the checkpoint's step, so the file always holds one run's history.

**Exact resume.** The data of optimizer step ``s`` is a pure function of ``(seed, s)`` (each recipe's
``micro_batch_fn`` slices the step's *global* batch by rank and micro-step), evaluation runs inside
``torch.random.fork_rng`` with its own seed, and a checkpoint (:mod:`.checkpoints`: atomic, verified, rotated only
after success, no pickles) stores model, optimizer, learning-rate scheduler (``transformers.get_scheduler``), RNG
states (dropout) and the step. The same slicing makes ``n`` processes with per-device batch ``B`` train on the same
global batch as one process with ``n*B`` (gradient all-reduce averages equal-sized shards).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

import torch

from ..command_io import apply_umask
from .args import ConfigError, RunComplete, RunFailure, arg, configuration_differences, missing_extra, run_configuration

try:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import LoggerType, ProjectConfiguration, parse_flag_from_env, set_seed
except ModuleNotFoundError as error:  # the core install (torch, transformers, safetensors) has no recipes
    raise missing_extra(error) from None
from tqdm.auto import tqdm

from .checkpoints import (CHECKPOINT_STATE, CheckpointWriter, checkpoint_dirs, load_checkpoint,  # noqa: F401
                          remove_partial_checkpoints, resolve_checkpoint)
from .tracking import JSONLTracker, read_log_lines

RUN_CONFIG = "run_config.json"   # in the output folder
LR_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr", "cosine_with_restarts",
                "polynomial", "inverse_sqrt")
# fields that may change when a run is resumed: they do not change what the run computes


@dataclass
class CommonArgs:
    """Fields shared by every recipe (each is ``--name value`` on the command line or ``name: value`` in a file)."""

    config: Optional[str] = arg("YAML or JSON file of field: value entries (the command line overrides it)",
                                  default=None)
    output_dir: str = arg("the run's folder; a loadable checkpoint with model card when done", default="outputs/run")
    overwrite_output_dir: bool = arg("delete the contents of a non-empty output_dir and start a new run",
                                       default=False)
    resume_from: Optional[str] = arg("continue a run: 'latest' (newest complete checkpoint in output_dir) or a "
                                       "checkpoints/checkpoint_<i> folder; its stored configuration must match",
                                       default=None)
    seed: int = arg("model init, data order, evaluation sampling", default=0)
    max_steps: int = arg("number of optimizer steps", default=100)
    per_device_batch_size: int = arg("sequences per process per micro-step", default=8)
    gradient_accumulation_steps: int = arg("micro-steps per optimizer step (global batch = per-device x "
                                             "processes x this)", default=1)
    learning_rate: float = arg("peak learning rate of AdamW", default=1e-3)
    lr_schedule: str = arg("transformers.get_scheduler name: " + ", ".join(LR_SCHEDULES),
                             default="cosine_with_min_lr")
    warmup_steps: int = arg("linear warm-up steps of the schedule", default=10)
    min_lr_ratio: float = arg("final learning rate / peak for cosine_with_min_lr", default=0.1)
    weight_decay: float = arg("AdamW weight decay of matrices (biases and norms: 0)", default=0.0)
    adam_beta1: float = arg("AdamW beta1", default=0.9)
    adam_beta2: float = arg("AdamW beta2", default=0.95)
    adam_eps: float = arg("AdamW epsilon", default=1e-8)
    max_grad_norm: float = arg("gradient clipping norm (0: no clipping)", default=1.0)
    mixed_precision: Optional[Literal["no", "bf16", "fp16"]] = arg(
        "no, bf16 or fp16; none: whatever `accelerate launch --mixed_precision` says", default=None)
    mup: bool = arg("muP: logit scales, init and per-layer learning rates (hf_structattn.mup)", default=False)
    mup_base_width: int = arg("muP base width", default=128)
    log_every: int = arg("log train/loss every this many steps", default=1)
    eval_every: int = arg("evaluate every this many steps (also at step 0 and at the end); 0: only at the end",
                            default=50)
    checkpoint_every: int = arg("save a resumable checkpoint every this many steps (and at the end); 0: only at "
                                  "the end", default=50)
    checkpoints_total_limit: int = arg("complete checkpoints kept: the oldest are deleted only after a new one is "
                                         "saved completely", default=2)
    stop_after_steps: Optional[int] = arg("stop after checkpointing at this step (simulates an interruption)",
                                            default=None)
    report_to: str = arg("trackers besides metrics.jsonl: 'all' installed ones, 'none', or a comma list of "
                           "accelerate trackers (tensorboard, wandb, ...)", default="all")
    run_name: Optional[str] = arg("tracker run name (default: the recipe's name)", default=None)
    disable_tqdm: bool = arg("no progress bar (progress lines instead, see --progress_every_s)", default=False)
    progress_every_s: float = arg("without the progress bar: print a progress line (step, loss, tokens/s, ETA) "
                                  "every this many seconds; 0: never", default=30.0)
    final_weights_only: bool = arg("when the run finishes, delete its resumable checkpoints (checkpoints/: weights "
                                   "and optimizer state, about 3x the model) and keep the final model only; the run "
                                   "can then not be resumed", default=False)
    push_to_hub: bool = arg("upload the finished output folder to the Hub (token and access checked first)",
                              default=False)
    hub_model_id: Optional[str] = arg("Hub repository id (user/name) for push_to_hub", default=None)
    hub_private: bool = arg("create the Hub repository private", default=False)
    # the model-config fields (set by parse_recipe_args from the recipe's model dataclass; not a CLI option itself)
    model: dict = field(default_factory=dict, init=False)

    def __post_init__(self):
        positive = ("max_steps", "per_device_batch_size", "gradient_accumulation_steps", "log_every",
                    "checkpoints_total_limit", "mup_base_width")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "weight_decay", "max_grad_norm", "adam_eps",
                     "progress_every_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        for name in ("learning_rate", "adam_eps"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"--{name} must be a finite number > 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2", "min_lr_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name} must be in [0, 1], got {getattr(self, name)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"--lr_schedule {self.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
        if self.lr_schedule == "constant" and self.warmup_steps:
            raise ConfigError(f"--lr_schedule constant has no warm-up but --warmup_steps is {self.warmup_steps}; use "
                              "constant_with_warmup (or --warmup_steps 0)")
        if self.stop_after_steps is not None and not 1 <= self.stop_after_steps:
            raise ConfigError(f"--stop_after_steps must be >= 1, got {self.stop_after_steps}")
        if self.resume_from is not None and self.overwrite_output_dir:
            raise ConfigError("--resume_from continues the run in output_dir and --overwrite_output_dir deletes it: "
                              "give one of them")
        report_trackers(self.report_to)
        if self.push_to_hub and not self.hub_model_id:
            raise ConfigError("--push_to_hub needs --hub_model_id (e.g. --hub_model_id user/name)")
        if self.hub_model_id is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+|[\w.-]+", self.hub_model_id):
            raise ConfigError(f"--hub_model_id {self.hub_model_id!r} is not a Hub repository id like user/name")

    def check_model(self) -> None:
        """Recipes validate ``self.model`` here (build the model config); raise ValueError/ConfigError."""


def report_trackers(report_to: str) -> list[str]:
    """accelerate tracker names of ``--report_to`` (besides the JSONL log); unknown or missing ones are errors."""
    from accelerate.tracking import get_available_trackers

    names = [t.strip().lower() for t in (report_to or "none").split(",") if t.strip()]
    known = {t.value for t in LoggerType}
    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    trackers = []
    for name in names:
        if name in ("none", "jsonl"):
            continue
        if name not in known:
            raise ConfigError(f"--report_to {name!r} is not a tracker: use all, none or some of "
                              f"{', '.join(sorted(known - {'all'}))}")
        if name != "all" and name not in available:
            raise ConfigError(f"--report_to {name!r}: that tracker is not installed (pip install {name})")
        trackers.append(name)
    return trackers


# ------------------------------------------------------------------------------------------ output-folder contract


def prepare_output_dir(args: CommonArgs, recipe: str, state: PartialState) -> Optional[Path]:
    """Apply the output-folder contract (module docstring); returns the checkpoint to resume from, if any (verified
    by :func:`.checkpoints.resolve_checkpoint`). Raises :class:`RunComplete` when that checkpoint ends a run whose
    outputs are written.

    Every rank checks (so every rank raises the same error); only the main process changes the folder. Nothing is
    written to the folder before every check passed (a refused resume leaves ``metrics.jsonl`` as it was).
    """
    out = Path(args.output_dir)
    current = run_configuration(args, recipe)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output_dir {out} exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    checkpoint = None
    if args.resume_from:
        checkpoint, checkpoint_state = resolve_checkpoint(args.resume_from, out, state.num_processes)
        stored = checkpoint_state["configuration"]
        differences = configuration_differences(stored, current)
        if not differences and entries and checkpoint.resolve().parent.parent != out.resolve():
            if (out / RUN_CONFIG).exists():  # a checkpoint from elsewhere into a folder that holds a run
                differences = configuration_differences(json.loads((out / RUN_CONFIG).read_text()), current)
            else:
                raise ConfigError(f"--output_dir {out} is not empty and holds no recipe run ({RUN_CONFIG} missing); "
                                  f"resume into an empty folder or the checkpoint's own run folder")
        if differences:
            raise ConfigError(f"--resume_from {checkpoint}: the stored run configuration differs in "
                              f"{'; '.join(differences)}. Resume with the same settings, or start a new run in "
                              "another --output_dir")
        finished = out / "final_metrics.json"
        if checkpoint_state["step"] >= args.max_steps and is_finished_run(out):
            # (not finished -- the final save killed midway: the resume from the last checkpoint writes it again)
            raise RunComplete(f"the run in {out} is already complete ({checkpoint.name} is at step "
                              f"{checkpoint_state['step']} of {args.max_steps}, final metrics in {finished}); "
                              f"nothing to train. To upload it (again): hf-structattn push {out} --repo-id USER/NAME")
    elif entries and not args.overwrite_output_dir:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ConfigError(f"--output_dir {out} is not empty ({shown}): pass --overwrite_output_dir to delete it "
                          "and start a new run, or --resume_from latest to continue the run it holds")
    if entries and args.overwrite_output_dir:
        here = Path.cwd().resolve()
        if out.resolve() == here or out.resolve() in here.parents:
            raise ConfigError(f"--overwrite_output_dir would delete {out}, which contains the working directory")
    state.wait_for_everyone()  # every rank has checked before the main process changes anything
    if state.is_main_process:
        if entries and args.overwrite_output_dir:
            for entry in out.iterdir():
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        out.mkdir(parents=True, exist_ok=True)
        remove_partial_checkpoints(out)  # left by a save that crashed; never a checkpoint
        if checkpoint is None:
            (out / RUN_CONFIG).write_text(json.dumps(current, indent=2, sort_keys=True))
        # on resume, metrics.jsonl is cut back to the checkpoint's step only once the checkpoint has loaded (train)
    state.wait_for_everyone()
    return checkpoint


def is_finished_run(out: Path) -> bool:
    """Whether ``out`` is a finished run by the one definition push and the final upload use
    (:func:`.outputs.finished_run`)."""
    from .outputs import NotAFinishedRun, finished_run

    try:
        finished_run(out)
    except NotAFinishedRun:
        return False
    return True


def truncate_log(path: Path, last_step: int) -> None:
    """Keep the records of steps ``<= last_step`` (and config events): a resumed run replays the rest."""
    if not path.exists():
        return
    kept = [line for line, record in read_log_lines(path)
            if record.get("step") is None or record["step"] <= last_step]
    path.write_text("".join(f"{line}\n" for line in kept))


# ------------------------------------------------------------------------------------------ accelerator and optimizer


def start_run(args: CommonArgs, recipe: str) -> tuple[Accelerator, Optional[Path]]:
    """Check the Hub first when ``--push_to_hub``, apply the output-folder contract, then build the Accelerator
    (JSONL tracker + ``report_to`` trackers, the recipe's mixed precision). Returns it and the checkpoint to resume
    (verified; :func:`train` loads it)."""
    # Create accelerate's PartialState the way Accelerator would: the tracker's main-process check needs it, and
    # ACCELERATE_USE_CPU (multi-process CPU runs) would otherwise be ignored.
    if args.push_to_hub:
        from .outputs import check_hub_access

        check_hub_access(args.hub_model_id, private=args.hub_private)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    checkpoint = prepare_output_dir(args, recipe, state)
    if not show_progress_bar(args, state):  # in a log, transformers' loading / saving bars are carriage-return noise
        import transformers

        transformers.utils.logging.disable_progress_bar()
    out = Path(args.output_dir)
    trackers: list = [JSONLTracker(args.run_name or recipe, out), *report_trackers(args.report_to)]
    # checkpoint naming, rotation and the non-pickle state files are .checkpoints' (accelerate's automatic naming
    # deletes old checkpoints before the new one is written)
    project = ProjectConfiguration(project_dir=str(out), logging_dir=str(out), automatic_checkpoint_naming=False)
    accelerator = Accelerator(mixed_precision=args.mixed_precision or None, log_with=trackers,
                              project_config=project)
    set_seed(args.seed)  # identical on every rank: identical initialisation
    return accelerator, checkpoint


def build_optimizer(model: torch.nn.Module, args: CommonArgs) -> torch.optim.Optimizer:
    """AdamW; with ``args.mup`` the muP groups of :func:`hf_structattn.mup.mup_param_groups`."""
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
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_eps)


def build_scheduler(optimizer: torch.optim.Optimizer, args: CommonArgs):
    """``transformers.get_scheduler``: one scheduler step per optimizer step (not per process or micro-step). Its
    linear warm-up starts at 0 (step 0 would be a full forward and backward with no update): here warm-up step ``s``
    (0-based) runs at ``(s + 1) / warmup_steps`` of the peak, so the first step updates and the last warm-up step
    reaches the peak; from ``warmup_steps`` on the schedule is transformers' own."""
    from transformers import get_scheduler

    specific = {"min_lr_rate": args.min_lr_ratio} if args.lr_schedule == "cosine_with_min_lr" else None
    scheduler = get_scheduler(args.lr_schedule, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.max_steps, scheduler_specific_kwargs=specific)
    warmup = args.warmup_steps
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if warmup and lambdas and all(rule(0) == 0 for rule in lambdas):
        def shifted(rule):
            def lr_lambda(step: int) -> float:
                return rule(step + 1) if step < warmup else rule(step)
            return lr_lambda

        scheduler.lr_lambdas = [shifted(rule) for rule in lambdas]
        for group, base, rule in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * rule(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return scheduler


# ------------------------------------------------------------------------------------------ training loop


@dataclass
class TrainResult:
    step: int
    interrupted: bool
    final_eval: dict
    train_seconds: float                    # wall time of the steps run here, evaluations included
    start_step: int = 0                     # the checkpoint's step when resumed: step - start_step steps ran here
    tokens_per_second: float = 0.0          # training tokens / wall seconds of the optimizer steps (no evaluation)
    tokens_per_cpu_second: float = 0.0      # the same per CPU second of the main thread (time.thread_time): a
    #                                          load-independent throughput on a shared machine with one intra-op thread


def rank_share(count: int, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """Indices ``rank, rank + world, ...`` of ``count`` items, padded (by repeating one) to the same length on every
    rank, and how many are real: under FSDP every rank must run the same number of forwards."""
    index = torch.arange(count)[rank::world]
    per_rank = -(-count // world)
    real = index.numel()
    if real < per_rank:
        index = torch.cat([index, torch.zeros(per_rank - real, dtype=torch.long)])
    return index, real


def _format_metrics(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


LONG_PHASE_S = 20.0  # a phase expected to take longer says so, with its estimate, before it starts


def duration(seconds: float) -> str:
    """``45 s``, ``3.5 min``, ``1.2 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def announce(accelerator, name: str, estimate_s: Optional[float]) -> None:
    """Print ``name (about <estimate>) ...`` before a phase whose estimate exceeds :data:`LONG_PHASE_S` (on the main
    process, flushed at once, so a log shows what the run is doing while it is silent)."""
    if estimate_s is not None and estimate_s > LONG_PHASE_S and accelerator.is_main_process:
        print(f"{name} (about {duration(estimate_s)}) ...", flush=True)


def show_progress_bar(args: CommonArgs, accelerator) -> bool:
    """A tqdm bar only on a terminal: in a log its carriage-return updates are one endless line; there the loop
    prints progress lines instead (``--progress_every_s``)."""
    import sys

    return not args.disable_tqdm and accelerator.is_local_main_process and sys.stderr.isatty()


def train(accelerator: Accelerator, args: CommonArgs, model, optimizer, *,
          micro_batch_fn: Callable[[int, int, int, int], object],
          loss_fn: Callable[[torch.nn.Module, object], torch.Tensor],
          eval_fn: Callable[[torch.nn.Module], dict],
          tokens_per_step: int, flops_per_token: float, recipe: str,
          resume_checkpoint: Optional[Path] = None, seconds_per_step: Optional[float] = None,
          seconds_per_eval: Optional[float] = None) -> TrainResult:
    """Run optimizer steps ``start..max_steps``. ``model``/``optimizer`` must already be ``accelerator.prepare``d.

    ``micro_batch_fn(step, micro, rank, world)`` returns this rank's share of micro-step ``micro`` of step ``step``;
    ``loss_fn(model, batch)`` the mean loss of that share; ``eval_fn(unwrapped_model)`` a dict of metrics that is
    identical on every rank (reduce inside it, on ``accelerator.device``). Logs ``train/loss``, ``train/lr``,
    ``tokens``, ``flops`` every ``log_every`` steps and ``eval/*`` every ``eval_every`` steps (and at step 0 and the
    end); every evaluation is printed.

    With ``resume_checkpoint`` (verified by :func:`start_run`) the checkpoint is loaded first; only once it has
    loaded are ``metrics.jsonl`` cut back to its step and the trackers started, so a checkpoint that fails to load
    (a one-line :class:`.checkpoints.CheckpointError`) leaves the run folder as it was.

    ``seconds_per_step`` / ``seconds_per_eval`` (the recipe's estimates, e.g. from a timed forward): the training and
    each evaluation are announced with their estimate when it exceeds :data:`LONG_PHASE_S` (an evaluation after the
    first by the time the previous one took).
    """
    from .outputs import public_configuration

    # not accelerator.prepare(scheduler): accelerate would step it once per process; nor register_for_checkpointing
    # (a pickle): the checkpoints store its state_dict as JSON
    scheduler = build_scheduler(optimizer, args)
    configuration = run_configuration(args, recipe)
    writer = CheckpointWriter(accelerator, args.output_dir, args.checkpoints_total_limit)
    start_step = 0
    if resume_checkpoint is not None:
        load_checkpoint(accelerator, resume_checkpoint, scheduler)  # one-line CheckpointError; nothing written yet
        start_step = json.loads((resume_checkpoint / CHECKPOINT_STATE).read_text())["step"]
        if accelerator.is_main_process:
            truncate_log(Path(args.output_dir) / "metrics.jsonl", start_step)
        accelerator.wait_for_everyone()
        accelerator.print(f"resumed from {resume_checkpoint} at step {start_step}")
    accelerator.init_trackers(args.run_name or recipe, config=public_configuration(args, recipe))
    unwrapped = accelerator.unwrap_model(model)
    world, rank = accelerator.num_processes, accelerator.process_index
    accum = args.gradient_accumulation_steps

    eval_time = {"wall": 0.0, "cpu": 0.0}
    eval_seconds = [seconds_per_eval]  # the estimate of the next evaluation: the last one's wall time once known

    def evaluate_now(step: int) -> dict:
        message = f"step {step}/{args.max_steps}: evaluating"
        if progress is not None and not progress.disable and eval_seconds[0] and eval_seconds[0] > LONG_PHASE_S:
            progress.write(f"{message} (about {duration(eval_seconds[0])}) ...")
        elif progress is None or progress.disable:
            announce(accelerator, message, eval_seconds[0])
        wall, cpu = time.perf_counter(), time.thread_time()
        was_training = unwrapped.training
        unwrapped.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(args.seed + 1_000_003)
            metrics = eval_fn(unwrapped)
        unwrapped.train(was_training)
        record = {f"eval/{k}": v for k, v in metrics.items()}
        record.update(tokens=step * tokens_per_step, flops=step * tokens_per_step * flops_per_token)
        if step > start_step:  # the main thread's CPU seconds of the training steps so far in this process
            record["train_cpu_s"] = time.thread_time() - cpu_started - eval_time["cpu"] - (time.thread_time() - cpu)
        accelerator.log(record, step=step)
        message = f"step {step}/{args.max_steps} eval: {_format_metrics(metrics)}"
        (progress.write(message) if progress is not None and not progress.disable else accelerator.print(message))
        eval_time["wall"] += time.perf_counter() - wall
        eval_time["cpu"] += time.thread_time() - cpu
        eval_seconds[0] = time.perf_counter() - wall
        return metrics

    def save_checkpoint(step: int) -> None:
        writer.save(step, configuration, scheduler)

    progress = None
    final_eval: dict = {}
    if start_step == 0 and args.eval_every:
        final_eval = evaluate_now(0)
    if seconds_per_step is not None:
        announce(accelerator, f"training steps {start_step + 1}-{args.max_steps}"
                 + (f", a progress line every {args.progress_every_s:g} s" if args.progress_every_s and
                    not show_progress_bar(args, accelerator) else ""),
                 seconds_per_step * (args.max_steps - start_step))
    progress = tqdm(total=args.max_steps, initial=start_step, desc=recipe,
                    disable=not show_progress_bar(args, accelerator))
    started, cpu_started = time.perf_counter(), time.thread_time()
    eval_time.update(wall=0.0, cpu=0.0)
    # without a bar (logs, `--disable_tqdm`), a line with the rate and an ETA now and then, so a slow run never
    # looks hung between evaluations
    progress_lines = progress.disable and args.progress_every_s > 0 and accelerator.is_local_main_process
    next_progress_line = started + args.progress_every_s
    step = start_step
    interrupted = False
    model.train()
    while step < args.max_steps:
        lr = scheduler.get_last_lr()[0]
        total = torch.zeros((), device=accelerator.device)
        for micro in range(accum):
            batch = micro_batch_fn(step, micro, rank, world)
            sync = contextlib.nullcontext() if micro == accum - 1 else accelerator.no_sync(model)
            with sync:
                loss = loss_fn(model, batch) / accum
                accelerator.backward(loss)
            total += loss.detach().float()
        grad_norm = None
        if args.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value = accelerator.reduce(total, reduction="mean").item()
        progress.update(1)
        progress.set_postfix(loss=f"{loss_value:.4f}")
        if progress_lines and time.perf_counter() >= next_progress_line and step < args.max_steps:
            print(progress_line(step, start_step, args.max_steps, loss_value, tokens_per_step,
                                time.perf_counter() - started), flush=True)
            next_progress_line = time.perf_counter() + args.progress_every_s
        if step % args.log_every == 0 or step == args.max_steps:
            record = {"train/loss": loss_value, "train/lr": lr,
                      "tokens": step * tokens_per_step, "flops": step * tokens_per_step * flops_per_token}
            if grad_norm is not None:
                record["train/grad_norm"] = float(grad_norm)
            accelerator.log(record, step=step)
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            final_eval = evaluate_now(step)
        stop = args.stop_after_steps is not None and args.stop_after_steps <= step < args.max_steps
        if (args.checkpoint_every and step % args.checkpoint_every == 0) or step == args.max_steps or stop:
            save_checkpoint(step)
        if stop:
            interrupted = True
            break
    seconds, cpu_seconds = time.perf_counter() - started, time.thread_time() - cpu_started
    step_seconds, step_cpu_seconds = seconds - eval_time["wall"], cpu_seconds - eval_time["cpu"]
    progress.close()
    if not final_eval or (not args.eval_every and not interrupted):
        final_eval = evaluate_now(step)
    tokens = (step - start_step) * tokens_per_step
    return TrainResult(step=step, interrupted=interrupted, final_eval=final_eval, train_seconds=seconds,
                       start_step=start_step, tokens_per_second=tokens / step_seconds if step_seconds > 0 else 0.0,
                       tokens_per_cpu_second=tokens / step_cpu_seconds if step_cpu_seconds > 0 else 0.0)


def progress_line(step: int, start_step: int, max_steps: int, loss: float, tokens_per_step: int,
                  elapsed_s: float) -> str:
    """``step 120/500: loss 3.2100, 2,410 tokens/s, ETA 2m38s`` (rate over the steps of this process, evaluations
    included, as a user waiting sees it)."""
    done = step - start_step
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    eta = (max_steps - step) / rate if rate > 0 else float("inf")
    eta_text = "?" if not math.isfinite(eta) else (f"{int(eta // 60)}m{int(eta % 60):02d}s" if eta >= 60
                                                    else f"{eta:.0f}s")
    return (f"step {step}/{max_steps}: loss {loss:.4f}, {rate * tokens_per_step:,.0f} tokens/s, ETA {eta_text}")


# ------------------------------------------------------------------------------------------ end of a run


def finish_run(accelerator: Accelerator, args: CommonArgs, model, result: TrainResult, summary: dict,
               save_outputs: Callable[[dict, dict], Optional[str]]) -> dict:
    """The shared ending of every recipe: an interrupted run only closes its trackers; a finished one gathers the
    full state dict on every rank (FSDP shards it), then rank 0 calls ``save_outputs(summary, state_dict)`` (model,
    card, plots; it may add to ``summary`` and returns a printable cost table or None), writes
    ``final_metrics.json``, uploads when ``--push_to_hub`` and prints the run summary."""
    summary = {"step": result.step, "steps_run": result.step - result.start_step, "resumed_at": result.start_step,
               "interrupted": result.interrupted, "train_seconds": result.train_seconds,
               "train_tokens_per_second": result.tokens_per_second,
               "train_tokens_per_cpu_second": result.tokens_per_cpu_second,
               **{f"eval_{k}": v for k, v in result.final_eval.items()}, **summary}
    parameter = next(accelerator.unwrap_model(model).parameters(), None)
    if parameter is not None:
        summary["weights_dtype"] = str(parameter.dtype).removeprefix("torch.")
    if "flops_per_token" in summary and "tokens_per_step" in summary:
        summary["training_flops"] = result.step * summary["tokens_per_step"] * summary["flops_per_token"]
    if result.interrupted:
        accelerator.print(f"stopped at step {result.step} (--stop_after_steps); continue with --resume_from latest")
        accelerator.end_training()
        return summary
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP: every rank takes part
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        from .outputs import NotAFinishedRun, describe_skipped, finished_run, push_to_hub, write_metrics_json

        cost_table = save_outputs(summary, state_dict)
        if args.final_weights_only:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
        summary["kept"] = kept_outputs(out)
        write_metrics_json(out, summary)
        apply_umask(out)  # safetensors writes its files 0600: every output gets the user's mode
        if args.push_to_hub:
            try:
                run = finished_run(out)  # the one definition of what an upload sends
            except NotAFinishedRun as error:
                raise RunFailure(f"--push_to_hub: not uploading {out}: {error}") from None
            for line in describe_skipped(run):
                print(line, flush=True)
            summary["hub_repo_id"] = push_to_hub(run, args.hub_model_id, private=args.hub_private)
        print_summary(summary, out, cost_table)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


# what a finished run's folder keeps beside the model, and why
KEPT_WHY = {"checkpoints/": "resumable checkpoints (weights, AdamW moments, schedule, RNG) for --resume_from; "
                            "--final_weights_only deletes them when a run finishes",
            "source/": "the dense source model built and pretrained here (a resumed run reloads it)",
            "base_tiny_chronos_t5/": "the tiny Chronos-T5 built here (a resumed run reloads it)"}


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def kept_outputs(out: Path) -> dict:
    """{entry: bytes} of a finished run's folder: the model's weights (``*.safetensors`` at the top), the rest of the
    published files together, and each folder of :data:`KEPT_WHY` that exists."""
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors") if p.is_file())
    folders = {name: _folder_bytes(out / name.rstrip("/")) for name in KEPT_WHY if (out / name.rstrip("/")).is_dir()}
    rest = _folder_bytes(out) - weights - sum(folders.values())
    return {"model weights (*.safetensors)": weights, "other files (card, config, code, tokenizer, metrics, plots)":
            rest, **folders}


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GB" if count >= 2**30 else f"{count / 2**20:.1f} MB"


def kept_lines(kept: dict, dtype: Optional[str] = None) -> list[str]:
    """The lines of the run summary that say what the output folder keeps and why."""
    lines = [f"kept in the output folder ({_size(sum(kept.values()))}):"]
    for name, count in kept.items():
        why = KEPT_WHY.get(name, f"the trained model, {dtype}: the dtype it was trained in" if dtype and
                           name.startswith("model weights") else "")
        lines.append(f"  {name}: {_size(count)}" + (f" -- {why}" if why else ""))
    return lines


def print_summary(summary: dict, out: Path, cost_table: Optional[str]) -> None:
    final = {k[len("eval_"):]: v for k, v in summary.items() if k.startswith("eval_")}
    resumed = (f" (resumed at step {summary['resumed_at']}, {summary['step']} in total)"
               if summary.get("resumed_at") else "")
    lines = ["", f"== run finished: {summary['steps_run']} steps in {summary['train_seconds']:.1f} s{resumed} "
                 f"({summary['train_tokens_per_second']:,.0f} training tokens/s)",
             f"final evaluation: {_format_metrics(final)}"]
    if "flops_per_token" in summary:
        lines.append(f"training FLOPs: {summary['flops_per_token']:,.0f} per token, "
                     f"{summary['training_flops']:.3g} in total")
    lines += [f"output folder: {out}", f"model card: {out / 'README.md'}", f"metrics: {out / 'final_metrics.json'}"]
    if "kept" in summary:
        lines += kept_lines(summary["kept"], summary.get("weights_dtype"))
    if "hub_repo_id" in summary:
        lines.append(f"uploaded to https://huggingface.co/{summary['hub_repo_id']}")
    if cost_table:
        lines += ["", cost_table]
    print("\n".join(lines), flush=True)
