"""One arm of a learning-rate x seed sweep trained as one stacked model, for the LM and Chronos experiments
(``scripts/lm_experiment.py``, ``scripts/chronos_experiment.py``; the ICL experiment has its own runner with a
curriculum and early stopping).

An arm is one model configuration; its runs are (lr, seed) pairs, trained together by
:class:`~hf_structattn.training.batched.StackedRuns` (each run: its own initialisation, data stream and learning
rate). Layout under the arm's ``root``::

    <root>/<arm>_lr<lr>_s<seed>/progress.jsonl   one JSON line per evaluation (step, metrics, cumulative FLOPs, wall)
    <root>/<arm>_lr<lr>_s<seed>/result.json      written when the arm finishes
    <root>/<arm>_lr<lrs>_s<seeds>.stack/checkpoint.pt   every ``checkpoint_every`` steps; a rerun resumes from it

The schedule is linear warm-up then cosine decay to ``min_lr_ratio`` of the peak (``transformers``'
``cosine_with_min_lr`` shape), the same factor for every run of the arm.

Shards (shared by the three design scripts): a design's units (one stacked arm each) pack into shards of at most
:data:`SHARD_MINUTES` on one H100 (:func:`pack_shards`, :func:`shard_rate`); :func:`run_unit` trains a unit unless
each of its runs has its committed record ``results/<...>/<run>.json`` (:func:`write_run_json`,
:func:`read_run_jsons`); :func:`edge_extensions` is the rules' pre-registered grid extension.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .batched import StackedRuns


def cosine_factor(step: int, steps: int, warmup: int, min_lr_ratio: float) -> float:
    """Learning-rate factor at optimizer step ``step`` (0-based): ``(step + 1) / warmup`` during the warm-up, then
    a cosine from 1 to ``min_lr_ratio`` at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class ArmSpec:
    """What a stacked arm needs from its experiment.

    ``build(seed)``: the run's freshly initialised model (float32, CPU). ``batch(seed, step)``: that run's training
    batch of the step, a tuple of CPU tensors (runs of one seed share it). ``loss(forward, batch)``: a scalar loss,
    ``forward(**inputs)`` calling the model with the run's parameters. ``evaluate(stack)``: metrics name -> (R,)
    tensor for every run at the current parameters. ``lr_multipliers(model)``: optional per-parameter LR
    multipliers (muP). ``flops_per_step``: training FLOPs of one run's step (for the logs and the reports)."""

    name: str
    build: Callable[[int], nn.Module]
    batch: Callable[[int, int], tuple]
    loss: Callable
    evaluate: Callable[[StackedRuns], dict]
    flops_per_step: float
    lr_multipliers: Optional[Callable[[nn.Module], dict]] = None
    config: dict = field(default_factory=dict)


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}_lr{lr:g}_s{seed}"


class StackedArm:
    """The (lr, seed) runs of one :class:`ArmSpec`, stacked, for ``steps`` steps (module docstring)."""

    def __init__(self, spec: ArmSpec, lrs: Sequence[float], seeds: Sequence[int], steps: int, eval_every: int,
                 root: Path, device: str = "cpu", warmup: Optional[int] = None, min_lr_ratio: float = 0.1,
                 max_grad_norm: float = 1.0, checkpoint_every: int = 1000, chunk: int = 50,
                 dtype: torch.dtype = torch.float32):
        for name, value in (("steps", steps), ("eval_every", eval_every), ("checkpoint_every", checkpoint_every),
                            ("chunk", chunk)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.spec, self.steps, self.eval_every, self.root = spec, steps, eval_every, Path(root)
        self.warmup = max(1, steps // 20) if warmup is None else warmup
        self.min_lr_ratio, self.checkpoint_every, self.chunk = min_lr_ratio, checkpoint_every, chunk
        self.runs = [(float(lr), int(seed)) for seed in seeds for lr in lrs]
        self.seeds = sorted({seed for _, seed in self.runs})
        self.device = torch.device(device)
        self.config = {"arm": spec.name, "lrs": [float(lr) for lr in lrs], "seeds": [int(s) for s in seeds],
                       "steps": steps, "eval_every": eval_every, "warmup": self.warmup, "min_lr_ratio": min_lr_ratio,
                       "max_grad_norm": max_grad_norm, "dtype": str(dtype), **spec.config}
        models = {}
        for seed in self.seeds:
            torch.manual_seed(seed)
            models[seed] = spec.build(seed).to(dtype)
        template = models[self.seeds[0]]
        self.params = sum(p.numel() for p in template.parameters())
        multipliers = spec.lr_multipliers(template) if spec.lr_multipliers else None
        self.stack = StackedRuns(template, [models[seed].state_dict() for _, seed in self.runs],
                                 [lr for lr, _ in self.runs], betas=(0.9, 0.95), weight_decay=0.0,
                                 max_grad_norm=max_grad_norm, lr_multipliers=multipliers, device=self.device,
                                 dtype=dtype, cuda_graphs=False)
        self.run_seed = torch.tensor([self.seeds.index(seed) for _, seed in self.runs], device=self.device)
        self.step, self.wall_before, self.started = 0, 0.0, time.perf_counter()
        seeds_text = "-".join(str(seed) for seed in self.seeds)
        lrs_text = "-".join(f"{lr:g}" for lr in sorted({lr for lr, _ in self.runs}))
        self.checkpoint = self.root / f"{spec.name}_lr{lrs_text}_s{seeds_text}.stack" / "checkpoint.pt"
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        if self.checkpoint.exists():
            state = torch.load(self.checkpoint, map_location=self.device, weights_only=True)
            if state["config"] != self.config:
                raise ValueError(f"{self.checkpoint} was written by another configuration: {state['config']} vs "
                                 f"{self.config}")
            self.stack.load_state_dict(state["stack"])
            self.step, self.wall_before = state["step"], state["wall"]
            for folder in self.folders():
                lines = [line for line in (folder / "progress.jsonl").read_text().splitlines()
                         if line and json.loads(line)["step"] <= self.step]
                (folder / "progress.jsonl").write_text("".join(f"{line}\n" for line in lines))
        else:
            for folder in self.folders():
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "progress.jsonl").write_text("")
            self.log_evaluation()

    def folders(self) -> list[Path]:
        return [self.root / run_name(self.spec.name, lr, seed) for lr, seed in self.runs]

    @property
    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    @property
    def finished(self) -> bool:
        return self.step >= self.steps

    def log_evaluation(self) -> None:
        metrics = {name: values.tolist() for name, values in self.spec.evaluate(self.stack).items()}
        wall = self.wall
        for run, folder in enumerate(self.folders()):
            record = {"step": self.step, **{name: values[run] for name, values in metrics.items()},
                      "flops": self.step * self.spec.flops_per_step, "wall": wall}
            with (folder / "progress.jsonl").open("a") as log:
                log.write(json.dumps(record) + "\n")

    def advance(self) -> None:
        """Train to the next evaluation, checkpoint or chunk end (the chunk's batches moved to the device at once)."""
        end = min(self.steps, (self.step // self.eval_every + 1) * self.eval_every,
                  (self.step // self.checkpoint_every + 1) * self.checkpoint_every, self.step + self.chunk)
        steps = range(self.step, end)
        per_step = [[self.spec.batch(seed, step) for seed in self.seeds] for step in steps]
        fields = len(per_step[0][0])
        # (K, seeds, ...) per field, moved once; a step's run batch is an index_select by seed on the device
        stacked = [torch.stack([torch.stack([batch[i] for batch in seeds]) for seeds in per_step]).to(self.device)
                   for i in range(fields)]
        for index, step in enumerate(steps):
            batch = tuple(field[index].index_select(0, self.run_seed) for field in stacked)
            self.stack.train_step(self.spec.loss, batch, cosine_factor(step, self.steps, self.warmup,
                                                                       self.min_lr_ratio))
        self.step = end
        if self.step % self.eval_every == 0 or self.finished:
            self.log_evaluation()
        if self.step % self.checkpoint_every == 0 and not self.finished:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        temporary = self.checkpoint.with_name("checkpoint.tmp")
        torch.save({"config": self.config, "stack": self.stack.state_dict(), "step": self.step, "wall": self.wall},
                   temporary)
        os.replace(temporary, self.checkpoint)

    def run_until(self, budget_s: Optional[float] = None) -> bool:
        """Train until finished (True) or until ``budget_s`` seconds of this process have passed (False, with a
        checkpoint a rerun resumes from)."""
        while not self.finished:
            self.advance()
            if budget_s is not None and self.wall - self.wall_before > budget_s and not self.finished:
                self.save_checkpoint()
                return False
        return True

    def finish(self, extra: Optional[dict] = None, results: Optional[Path] = None) -> list[dict]:
        """Write every run's ``result.json`` (and, with ``results``, its small committed copy
        ``results/<run>.json``, :func:`write_run_json`) and remove the checkpoint."""
        out = []
        for run, folder in enumerate(self.folders()):
            lr, seed = self.runs[run]
            evals = [json.loads(line) for line in (folder / "progress.jsonl").read_text().splitlines() if line]
            result = {**self.config, "lr": lr, "seed": seed, "final": evals[-1], "params": self.params,
                      "flops_per_step": self.spec.flops_per_step, "wall_s": self.wall,
                      "batched_with": len(self.runs), **(extra or {})}
            temporary = folder / "result.json.tmp"
            temporary.write_text(json.dumps(result, indent=1))
            os.replace(temporary, folder / "result.json")
            if results is not None:
                write_run_json(Path(results) / f"{run_name(self.spec.name, lr, seed)}.json", result, evals)
            out.append(result)
        self.checkpoint.unlink(missing_ok=True)
        return out


# ------------------------------------------------------------------------ shards, committed results, grid extension


def write_run_json(path: Path, result: dict, evals: list[dict]) -> None:
    """A finished run's committed record (a few KB): its result and every evaluation, floats to 6 digits."""
    def short(value):
        return float(f"{value:.6g}") if isinstance(value, float) else value

    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps({**result, "evals": [{k: short(v) for k, v in e.items()} for e in evals]}))
    os.replace(temporary, path)


def read_run_jsons(folder: Path) -> list[dict]:
    """Every committed run record (:func:`write_run_json`) under ``folder``, with ``arm`` parsed from its name."""
    runs = []
    for path in sorted(Path(folder).glob("*_lr*_s*.json")):
        record = json.loads(path.read_text())
        record["name"] = path.stem
        record["arm"] = path.stem.rsplit("_lr", 1)[0]
        runs.append(record)
    return runs


def run_table(runs: Sequence[dict], best: dict, arms: Sequence[str], widths: Sequence[int], seeds: Sequence[int],
              metric: str, label: str) -> list[str]:
    """The markdown table a design's ``report`` prints: per arm, width and seed, every finished run's final
    ``metric`` by learning rate and the rule's score (``best[arm, width, seed]``)."""
    lines = [f"| {label} | D | seed | runs (lr: {metric}) | score |", "|---|---|---|---|---|"]
    for arm in arms:
        for width in widths:
            for seed in seeds:
                mine = sorted((r for r in runs if r["arm"] == f"{arm}_D{width}" and r["seed"] == seed),
                              key=lambda r: r["lr"])
                if mine:
                    cells = ", ".join(f"{r['lr']:g}: {r['final'][metric]:.4f}" for r in mine)
                    score = best.get((arm, width, seed))
                    lines.append(f"| {arm} | {width} | {seed} | {cells} | {'-' if score is None else f'{score:.4f}'} |")
    return lines


def edge_extensions(best_lrs, grid: Sequence[float]) -> list[float]:
    """The pre-registered grid extension of the LM, Chronos and ICL rules: when a best learning rate (one per seed,
    picked on the planned ``grid``) is the grid's smallest, one more LR below it is run; when it is the largest, one
    more above; each the grid's own step beyond the edge (``edge^2 / neighbour``, 2 significant digits). At most one
    LR per direction; the extended runs are not extended again."""
    grid = sorted(float(lr) for lr in grid)
    if len(grid) < 2:
        raise ValueError(f"grid needs at least 2 learning rates, got {grid}")
    picks = {float(lr) for lr in best_lrs}
    out = []
    if grid[0] in picks:
        out.append(float(f"{grid[0] ** 2 / grid[1]:.2g}"))
    if grid[-1] in picks:
        out.append(float(f"{grid[-1] ** 2 / grid[-2]:.2g}"))
    return out


def split_unit(unit: dict) -> list[dict]:
    """A shard unit (dict with ``name``, ``seeds``, ``lrs`` (a list, or None for one LR chosen later), ``runs``,
    ``flops``) split in two or more: by seed first, then by learning rate. An error when it is one run."""
    seeds, lrs = unit["seeds"], unit["lrs"]
    if len(seeds) > 1:
        return [dict(unit, seeds=[seed], runs=unit["runs"] // len(seeds), flops=unit["flops"] / len(seeds),
                     name=f"{unit['name']} s{seed}") for seed in seeds]
    if lrs is not None and len(lrs) > 1:
        return [dict(unit, lrs=[lr], runs=unit["runs"] // len(lrs), flops=unit["flops"] / len(lrs),
                     name=f"{unit['name']} lr {lr:g}") for lr in lrs]
    raise ValueError(f"unit {unit['name']} is one run of {unit['flops']:.3g} FLOPs: it cannot fit a shard")


def pack_shards(units: Sequence[dict], limit_flops: float) -> list[list[dict]]:
    """Units (dicts with ``flops``) in order into the fewest shards of at most ``limit_flops`` each, as even as a
    sequential split allows; a unit over the limit is split (:func:`split_unit`) until its parts fit, and a single
    run over the limit is an error (the design must shrink)."""
    fitting, pending = [], list(units)
    while pending:
        unit = pending.pop(0)
        if unit["flops"] > limit_flops:
            try:
                pending[:0] = split_unit(unit)
            except ValueError as error:
                raise ValueError(f"{error} of at most {limit_flops:.3g} FLOPs") from None
        else:
            fitting.append(unit)
    units = fitting
    total = sum(unit["flops"] for unit in units)
    count = max(1, math.ceil(total / limit_flops)) if units else 0
    while units:
        target, shards, current = total / count, [], []
        for unit in units:
            if current and (sum(u["flops"] for u in current) + unit["flops"] > limit_flops
                            or (sum(u["flops"] for u in current) >= target and len(shards) < count - 1)):
                shards.append(current)
                current = []
            current.append(unit)
        shards.append(current)
        if len(shards) <= count:
            return shards
        count += 1
    return []


SHARD_MINUTES = 8.0  # a shard's wall-time limit on one H100 (a lent GPU gives 10 minutes a command)


def shard_rate(results: Path, assumed: float) -> tuple[float, str]:
    """The H100 FLOP rate shards are sized with: the mean rate ``results/pilot.json`` measured (a GPU pilot's
    summary, committed there), else ``assumed``; and where it came from."""
    pilot = Path(results) / "pilot.json"
    if pilot.exists():
        summary = json.loads(pilot.read_text())
        if not summary.get("tiny") and str(summary.get("device", "")).lower().find("cpu") != 0:
            rates = [arm["flops_per_s"] for arm in summary["arms"].values()]
            return sum(rates) / len(rates), f"measured by the pilot ({summary['device']})"
    return assumed, "assumed (no GPU pilot yet)"


def run_unit(spec: ArmSpec, lrs: Sequence[float], seeds: Sequence[int], steps: int, eval_every: int, work: Path,
             results: Path, device: str, budget_s: Optional[float]) -> bool:
    """One shard unit: ``spec``'s (lr, seed) runs stacked, unless every one has its results file
    (``results/<run>.json``); resumable from ``work``. True when every run has its results file."""
    todo = [lr for lr in lrs if not all((Path(results) / f"{run_name(spec.name, lr, s)}.json").exists()
                                        for s in seeds)]
    if not todo:
        return True
    arm = StackedArm(spec, todo, seeds, steps, eval_every, work, device)
    if not arm.run_until(budget_s):
        return False
    arm.finish(results=results)
    return True


def shard_table(results: Path, shards: dict, done, assumed_rate: float, command: str) -> list[str]:
    """Markdown lines: per shard its units, runs done / planned, FLOPs and estimated H100 minutes at the rate a
    committed GPU pilot in ``results`` measured (else ``assumed_rate``). ``shards``: id -> units (dicts with name,
    runs, flops); ``done(unit, runs)`` -> runs of the unit with a results file among ``runs`` (the results files);
    ``command``: the shard command with ``{id}``."""
    rate, source = shard_rate(results, assumed_rate)
    runs = read_run_jsons(results)
    lines = [f"H100 rate {rate:.3g} FLOP/s, {source}; a shard is at most {SHARD_MINUTES:g} min at that rate.", "",
             "| shard | units | runs done | training FLOPs | H100 minutes (est.) | command |",
             "|---|---|---|---|---|---|"]
    for sid, units in shards.items():
        flops = sum(unit["flops"] for unit in units)
        lines.append(f"| {sid} | {', '.join(unit['name'] for unit in units)} | "
                     f"{sum(done(unit, runs) for unit in units)}/{sum(unit['runs'] for unit in units)} | {flops:.3g} | "
                     f"{flops / rate / 60:.1f} | `{command.format(id=sid)}` |")
    return lines


def probe_arm(spec: ArmSpec, lrs: Sequence[float], device: str = "cpu", steps: int = 2) -> dict:
    """Train ``spec``'s runs (seed 0, ``lrs`` stacked) for ``steps`` steps without writing anything: the wall time of
    the last step and, on CUDA, the peak memory. An out-of-memory error is reported, not raised (a pilot checks
    that the design's largest arms fit before the design runs). Returns {"ms_per_step", "peak_gib", "error"}."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        torch.manual_seed(0)
        model = spec.build(0)
        multipliers = spec.lr_multipliers(model) if spec.lr_multipliers else None
        stack = StackedRuns(model, [model.state_dict()] * len(lrs), list(lrs), lr_multipliers=multipliers,
                            device=device)
        seconds = 0.0
        for step in range(steps):
            batch = tuple(field[None].expand(len(lrs), *field.shape).to(device) for field in spec.batch(0, step))
            begin = time.perf_counter()
            losses = stack.train_step(spec.loss, batch, 1.0)
            losses.sum().item()  # wait for the device
            seconds = time.perf_counter() - begin
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
        return {"ms_per_step": round(1000 * seconds, 2), "peak_gib": peak, "error": None}
    except torch.cuda.OutOfMemoryError as error:
        return {"ms_per_step": None, "peak_gib": None, "error": f"out of memory: {str(error).splitlines()[0]}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ the design scripts' shared CLI


def finish_pilot(summary: dict, names: Sequence[str], spec_of: Callable[[str], ArmSpec], lrs: Sequence[float],
                 device: str, started: float, budget_s: float, design_flops: float, out: Path,
                 markdown: Callable[[dict], str], results: Optional[Path] = None) -> dict:
    """The end of a design pilot: probe the widest arm of every name in ``names`` (``spec_of(name)``) while the
    budget lasts, project the design's time from the FLOP rate the trained arms measured, write ``pilot.json`` and
    ``pilot.md`` (``markdown(summary)``) to ``out`` and print the latter. ``summary["arms"]`` holds the trained
    arms (each with ``flops_per_s``); ``summary["probe"]["width"]`` is set by the caller."""
    for name in names:  # the widest arms: do they fit, and how fast is their step?
        if time.perf_counter() - started > budget_s:
            summary["probe"]["arms"][name] = {"ms_per_step": None, "peak_gib": None, "error": "not run: budget"}
            continue
        summary["probe"]["arms"][name] = probe_arm(spec_of(name), lrs, device)
    rate = sum(arm["flops_per_s"] for arm in summary["arms"].values()) / len(summary["arms"])
    summary.update(wall_s=round(time.perf_counter() - started, 2), design_flops=design_flops,
                   projected_design_h=round(design_flops / rate / 3600, 2))
    (out / "pilot.json").write_text(json.dumps(summary, indent=1))
    (out / "pilot.md").write_text(markdown(summary))
    print((out / "pilot.md").read_text(), flush=True)
    keep_pilot(summary, device, results)
    return summary


def keep_pilot(summary: dict, device: str, results: Optional[Path]) -> None:
    """A GPU pilot's summary is also written to ``results/pilot.json`` (committed): ``plan --shards`` sizes the
    shards by the rate it measured (:func:`shard_rate`). CPU runs and rehearsals are not kept."""
    if results is not None and device.startswith("cuda") and not summary.get("tiny"):
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / "pilot.json").write_text(json.dumps(summary, indent=1))


def device_name(device: str) -> str:
    """The device a pilot ran on, for its report: the CUDA device's name, or the CPU and its thread count."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (torch {torch.__version__})"
    return f"cpu, {torch.get_num_threads()} thread(s) (torch {torch.__version__})"


def probe_markdown(summary: dict, label: str) -> list:
    """A pilot summary's widest-arm probe table (``summary["probe"]``, from :func:`probe_arm`) and the projected
    design time, as markdown lines; ``label`` names the first column (arm, variant)."""
    lines = ["", f"Widest arms (D = {summary['probe']['width']}, 3 LRs stacked, 2 steps):", "",
             f"| {label} | ms/step | peak memory (GiB) | error |", "|---|---|---|---|"]
    for name, probe in summary["probe"]["arms"].items():
        ms = "-" if probe["ms_per_step"] is None else f"{probe['ms_per_step']:.1f}"
        peak = "-" if probe["peak_gib"] is None else f"{probe['peak_gib']:.1f}"
        lines.append(f"| {name} | {ms} | {peak} | {probe['error'] or '-'} |")
    lines += ["", f"Projected full design on this device ({summary['design_flops']:.3g} FLOPs at the mean measured "
                  f"FLOP rate): {summary['projected_design_h']:.1f} h.", ""]
    return lines


def design_arguments(argv, description: str, design_out: str, pilot_out: str,
                     results: str = "results") -> argparse.Namespace:
    """The command line of a design script (``plan [--shards]``, ``shard ID``, ``run``, ``report``, ``pilot``),
    checked: a positive budget, a cpu / cuda[:index] device that exists for ``shard``, ``run`` and ``pilot``, a new or
    empty folder for a pilot, an id for ``shard``. Turns TF32 matmuls on for CUDA (the throughput the designs'
    estimates assume)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("command", choices=["plan", "shard", "run", "report", "pilot"])
    parser.add_argument("shard_id", nargs="?", help="shard: its id (plan --shards lists them)")
    parser.add_argument("--shards", action="store_true", help="plan: the shards, their FLOPs and minutes")
    parser.add_argument("--results", default=results, help=f"the committed results files (default {results})")
    parser.add_argument("--out", help=f"working folder: progress, checkpoints (default {design_out}; pilot "
                                      f"{pilot_out})")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<index>")
    parser.add_argument("--budget-s", dest="budget_s", type=float, help="wall seconds (pilot default 170)")
    parser.add_argument("--tiny", action="store_true", help="pilot: the CPU rehearsal")
    args = parser.parse_args(argv)
    args.out = args.out or (pilot_out if args.command == "pilot" else design_out)
    if args.command == "pilot" and args.budget_s is None:
        args.budget_s = 170.0
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda[:index], got {args.device!r}")
    if args.command == "shard" and not args.shard_id:
        parser.error("shard needs an id (plan --shards lists them)")
    if args.device.startswith("cuda") and args.command in ("run", "shard", "pilot") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    if args.command == "pilot" and Path(args.out).exists() and any(Path(args.out).iterdir()):
        parser.error(f"--out {args.out} is not empty: a pilot starts from scratch in a new folder")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    return args
