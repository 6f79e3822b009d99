"""One arm of a learning-rate x seed sweep trained as one stacked model, for the LM and Chronos experiments
(``scripts/lm_experiment.py``, ``scripts/chronos_experiment.py``; the ICL experiment has its own runner with a
curriculum and early stopping).

An arm is one model configuration; its runs are (lr, seed) pairs, trained together by
:class:`~stacked_runs.StackedRuns` (each run: its own initialisation, data stream and learning
rate). Layout under the arm's ``root``::

    <root>/<arm>_lr<lr>_s<seed>/progress.jsonl   one JSON line per evaluation (step, metrics, cumulative FLOPs, wall,
                                                 thread time: :meth:`StackedArm.log_evaluation`)
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
import copy
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from stacked_runs import StackedRuns


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
                 dtype: torch.dtype = torch.float32, compile_step: bool = False):
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
                                 dtype=dtype, cuda_graphs=False, compile_step=compile_step)
        self.run_seed = torch.tensor([self.seeds.index(seed) for _, seed in self.runs], device=self.device)
        self.step, self.wall_before, self.started = 0, 0.0, time.perf_counter()
        # this thread's CPU seconds (time.thread_time) of the stack, all of them and the evaluations' share, carried
        # across resumes by the checkpoint; None when resumed from a checkpoint written before they were kept
        self.thread_before, self.eval_thread, self.thread_started = 0.0, 0.0, time.thread_time()
        self.checkpoint = self.stack_folder(self.root, spec.name, [lr for lr, _ in self.runs], self.seeds) / \
            "checkpoint.pt"
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        if self.checkpoint.exists():
            state = torch.load(self.checkpoint, map_location=self.device, weights_only=True)
            if state["config"] != self.config:
                raise ValueError(f"{self.checkpoint} was written by another configuration: {state['config']} vs "
                                 f"{self.config}")
            self.stack.load_state_dict(state["stack"])
            self.step, self.wall_before = state["step"], state["wall"]
            self.thread_before, self.eval_thread = state.get("thread"), state.get("eval_thread")
            for folder in self.folders():
                lines = [line for line in (folder / "progress.jsonl").read_text().splitlines()
                         if line and json.loads(line)["step"] <= self.step]
                (folder / "progress.jsonl").write_text("".join(f"{line}\n" for line in lines))
        else:
            for folder in self.folders():
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "progress.jsonl").write_text("")
            self.log_evaluation()

    @staticmethod
    def stack_folder(root: Path, name: str, lrs: Sequence[float], seeds: Sequence[int]) -> Path:
        """The folder of the checkpoint of arm ``name``'s stack of ``lrs`` x ``seeds`` under ``root``."""
        seeds_text = "-".join(str(seed) for seed in sorted({int(seed) for seed in seeds}))
        lrs_text = "-".join(f"{lr:g}" for lr in sorted({float(lr) for lr in lrs}))
        return Path(root) / f"{name}_lr{lrs_text}_s{seeds_text}.stack"

    @staticmethod
    def checkpoint_step(root: Path, name: str, lrs: Sequence[float], seeds: Sequence[int]) -> Optional[int]:
        """The step of that stack's checkpoint (from its ``checkpoint.json``), None when it has none."""
        marker = StackedArm.stack_folder(root, name, lrs, seeds) / "checkpoint.json"
        return json.loads(marker.read_text())["step"] if marker.exists() else None

    def folders(self) -> list[Path]:
        return [self.root / run_name(self.spec.name, lr, seed) for lr, seed in self.runs]

    @property
    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    @property
    def thread(self) -> Optional[float]:
        """CPU seconds of this thread spent on the stack so far (training, evaluations, compiles; earlier
        invocations included), None when an earlier invocation did not keep them."""
        return None if self.thread_before is None else self.thread_before + time.thread_time() - self.thread_started

    @property
    def finished(self) -> bool:
        return self.step >= self.steps

    def log_evaluation(self) -> None:
        """Evaluate every run and append one record to its ``progress.jsonl``: step, the spec's metrics, cumulative
        training FLOPs, ``wall`` (seconds of wall since the stack started, resumes included), ``thread`` (this
        thread's CPU seconds, :attr:`thread`) and ``eval_thread`` (the part of ``thread`` spent in evaluations, this
        one included); the last two are null after a resume from a checkpoint that lacked them."""
        begin = time.thread_time()
        metrics = {name: values.tolist() for name, values in self.spec.evaluate(self.stack).items()}
        if self.eval_thread is not None:
            self.eval_thread += time.thread_time() - begin
        wall, thread = self.wall, self.thread
        for run, folder in enumerate(self.folders()):
            record = {"step": self.step, **{name: values[run] for name, values in metrics.items()},
                      "flops": self.step * self.spec.flops_per_step, "wall": wall, "thread": thread,
                      "eval_thread": None if thread is None else self.eval_thread}
            with (folder / "progress.jsonl").open("a") as log:
                log.write(json.dumps(record) + "\n")

    def advance(self, until: Optional[int] = None) -> None:
        """Train to the next evaluation, checkpoint, chunk end or step ``until`` (the chunk's batches moved to the
        device at once)."""
        end = min(self.steps, (self.step // self.eval_every + 1) * self.eval_every,
                  (self.step // self.checkpoint_every + 1) * self.checkpoint_every, self.step + self.chunk,
                  self.steps if until is None or until <= self.step else until)
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
        torch.save({"config": self.config, "stack": self.stack.state_dict(), "step": self.step, "wall": self.wall,
                    "thread": self.thread, "eval_thread": self.eval_thread}, temporary)
        os.replace(temporary, self.checkpoint)
        marker = self.checkpoint.with_name("checkpoint.json.tmp")  # the step, readable without loading the state
        marker.write_text(json.dumps({"step": self.step, "wall": self.wall}))
        os.replace(marker, self.checkpoint.with_name("checkpoint.json"))

    def run_until(self, budget_s: Optional[float] = None, until: Optional[int] = None) -> bool:
        """Train until finished (True), until step ``until`` or until ``budget_s`` seconds of this process have
        passed (False, with a checkpoint a rerun resumes from)."""
        while not self.finished:
            if until is not None and self.step >= until:
                if self.checkpoint_step(self.root, self.spec.name, [lr for lr, _ in self.runs], self.seeds) != \
                        self.step:
                    self.save_checkpoint()
                return False
            self.advance(until)
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
        self.checkpoint.with_name("checkpoint.json").unlink(missing_ok=True)
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


def pack_shards(units: Sequence[dict], limit_flops: float, key: str = "flops") -> list[list[dict]]:
    """Units (dicts with ``flops``, or the cost named by ``key``) in order into the fewest shards of at most
    ``limit_flops`` each, as even as a sequential split allows; a unit over the limit is split (:func:`split_unit`)
    until its parts fit, and a single run over the limit is an error (the design must shrink)."""
    fitting, pending = [], list(units)
    while pending:
        unit = pending.pop(0)
        if unit[key] > limit_flops:
            try:
                pending[:0] = split_unit(unit)
            except ValueError as error:
                raise ValueError(f"{error} of at most {limit_flops:.3g} FLOPs") from None
        else:
            fitting.append(unit)
    units = fitting
    total = sum(unit[key] for unit in units)
    count = max(1, math.ceil(total / limit_flops)) if units else 0
    while units:
        target, shards, current = total / count, [], []
        for unit in units:
            if current and (sum(u[key] for u in current) + unit[key] > limit_flops
                            or (sum(u[key] for u in current) >= target and len(shards) < count - 1)):
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


def diverged(run: dict, metric: str) -> bool:
    """A run *diverged* (the LM and Chronos rules) when its final ``metric`` is not finite (NaN or infinite) or is
    above its first evaluation's, the untrained model's at step 0 (``run["evals"][0]``, when the record has it)."""
    final = run["final"][metric]
    if final is None or not math.isfinite(final):
        return True
    evals = run.get("evals") or []
    start = evals[0].get(metric) if evals and evals[0].get("step") == 0 else None
    return start is not None and math.isfinite(start) and final > start


def run_score(run: dict, metric: str) -> float:
    """A run's score under the LM and Chronos rules: its final ``metric``, or ``math.inf`` (worse than any run that
    did not diverge) when it :func:`diverged`. So a diverged run is never an arm's best LR unless all of them
    diverged, and an arm whose scored run diverged is the higher in that seed's comparison (by any margin) against
    one whose run did not; two diverged runs are no lower than each other (:func:`lower_in_every_seed`)."""
    return math.inf if diverged(run, metric) else float(run["final"][metric])


def lower_in_every_seed(best: dict, first: str, second: str, width: int, seeds: Sequence[int],
                        margin: float) -> bool:
    """The designs' comparison: ``first`` is *lower* than ``second`` at ``width`` when its score is lower by at
    least ``margin`` in every seed (``best[arm, width, seed]``, the rule's score, :func:`run_score`: ``inf`` for a
    diverged run, so a diverged ``second`` against a finite ``first`` counts as lower, and two diverged runs do not)."""
    def gap(seed):
        a, b = best[first, width, seed], best[second, width, seed]
        return -math.inf if a == math.inf else (math.inf if b == math.inf else b - a)

    return all(gap(seed) >= margin for seed in seeds)


def majority(count: int, widths: Sequence[int]) -> bool:
    """More than half of ``widths``: the designs' NO needs a baseline lower at a majority of the widths (2 of 3;
    the one width of a CPU design)."""
    return 2 * count > len(widths)


# ---------------------------------------------------------------------------------------------------- CPU designs
#
# A CPU design's unit is ONE run (stacking runs saves little on a CPU); its shards are sized in CPU-minutes of one
# thread at the rates its committed CPU pilot measured (results/<design>/pilot.json). Short runs pack into shards of
# at most CPU_SHARD_MINUTES; a longer run is cut into consecutive *segments* of equal steps, one shard each, the later
# continuing the earlier's checkpoint in the working folder (--out, on the same machine). Every shard command writes a
# small record, results/<design>/shards/<id>.json (the steps each run reached, thread and wall seconds), committed:
# it is what says that a segment whose run has not finished is done.

CPU_SHARD_MINUTES = 120.0  # at most about two CPU-hours of one thread, at the pilot's measured rates
CPU_SHARD_BUDGET_S = 9_000.0  # a CPU shard's default --budget-s (wall): a shard stopped by it resumes when rerun


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_rates(results: Path, assumed: dict) -> tuple[dict, str]:
    """Rate key -> {"step_s", "eval_s", "setup_s"} (thread seconds of one thread: a training step, an evaluation, a
    shard process's setup) from the CPU pilot summary committed as ``results/pilot.json``, else ``assumed``; and
    where they came from."""
    pilot = Path(results) / "pilot.json"
    if pilot.exists():
        summary = json.loads(pilot.read_text())
        if summary.get("design") == "cpu" and not summary.get("tiny"):
            rates = dict(assumed)
            rates.update({key: {name: arm[name] for name in ("step_s", "eval_s", "setup_s")}
                          for key, arm in summary["arms"].items() if arm["measured"]})
            left = sorted(key for key in assumed if key not in rates or not summary["arms"].get(key, {}).get(
                "measured"))
            return rates, (f"measured by the CPU pilot ({summary['machine']}, one thread)" +
                           (f"; assumed for {', '.join(left)}" if left else ""))
    return dict(assumed), "assumed (no CPU pilot committed yet)"


def evaluations_between(steps: int, eval_every: int, start: int, until: int) -> int:
    """The evaluations a :class:`StackedArm` of ``steps`` steps makes while it trains from ``start`` to ``until``
    (the one at step 0 when ``start`` is 0, then every ``eval_every`` steps and at the end)."""
    return (start == 0) + sum(1 for step in range(start + 1, until + 1) if step % eval_every == 0 or step == steps)


def run_minutes(unit: dict, rates: dict, start: int = 0, until: Optional[int] = None) -> float:
    """CPU minutes of steps ``start``..``until`` of a run unit ({"steps", "eval_every", "rate"}): its steps, its
    evaluations in that range and one process setup, at ``rates[unit["rate"]]``."""
    rate = rates[unit["rate"]]
    until = unit["steps"] if until is None else until
    evals = evaluations_between(unit["steps"], unit["eval_every"], start, until)
    return ((until - start) * rate["step_s"] + evals * rate["eval_s"] + rate["setup_s"]) / 60


def cpu_shards(stages: Sequence[tuple[str, Sequence[dict]]], rates: dict,
               limit: float = CPU_SHARD_MINUTES) -> dict[str, list[dict]]:
    """Shard id -> segments of a CPU design. ``stages``: (id prefix, run units) in order; a unit is a dict with
    ``name`` (unique), ``arm``, ``lr`` (None until the design's rule picks it), ``seed``, ``steps``, ``eval_every``,
    ``rate`` (a key of ``rates``). Within a stage, consecutive runs of at most ``limit`` minutes pack into shards
    (:func:`pack_shards`); a longer run becomes ceil(minutes / limit) or more segments of equal steps, one shard each.
    A segment is the unit with ``start``, ``until``, ``part``, ``parts``, ``minutes``, ``shard`` and ``after`` (the
    shard of its previous segment, None for the first) added."""
    out: dict[str, list[dict]] = {}
    for prefix, units in stages:
        shards, pending = [], []

        def flush():
            if pending:
                whole = [dict(unit, start=0, until=unit["steps"], part=1, parts=1, minutes=run_minutes(unit, rates))
                         for unit in pending]
                shards.extend(pack_shards(whole, limit, key="minutes"))
                pending.clear()

        for unit in units:
            minutes = run_minutes(unit, rates)
            if minutes <= limit:
                pending.append(unit)
                continue
            flush()
            parts = math.ceil(minutes / limit)
            while True:  # each segment pays its own setup: add a segment until all fit
                bounds = [round(unit["steps"] * part / parts) for part in range(parts + 1)]
                segments = [dict(unit, start=a, until=b, part=part, parts=parts,
                                 minutes=run_minutes(unit, rates, a, b))
                            for part, (a, b) in enumerate(zip(bounds, bounds[1:]), start=1)]
                if all(segment["minutes"] <= limit for segment in segments):
                    break
                parts += 1
            shards.extend([segment] for segment in segments)
        flush()
        for index, members in enumerate(shards, start=1):
            out[f"{prefix}{index}"] = members
    where = {}
    for sid, members in out.items():
        for segment in members:
            segment["shard"] = sid
            segment["after"] = where.get((segment["name"], segment["part"] - 1))
            where[segment["name"], segment["part"]] = sid
    return out


def segment_run(segment: dict) -> Optional[str]:
    """The results name of a segment's run, None while its learning rate is not known."""
    return None if segment["lr"] is None else run_name(segment["arm"], segment["lr"], segment["seed"])


def read_shard_records(results: Path) -> dict[str, dict]:
    """Shard id -> its committed record (``results/shards/<id>.json``)."""
    folder = Path(results) / "shards"
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))} if folder.exists() \
        else {}


def segment_done(segment: dict, names: set, records: dict) -> bool:
    """A segment is done when its run has its results file, or when its shard's record says the run reached the
    segment's last step."""
    run = segment_run(segment)
    if run is None:
        return False
    if run in names:
        return True
    reached = records.get(segment["shard"], {}).get("reached", {})
    return reached.get(run, 0) >= segment["until"]


def runnable_shards(shards: dict, names: set, records: dict) -> list[str]:
    """Ids of the shards not done whose runs' learning rates are known and whose earlier segments are done."""
    done = {sid: all(segment_done(s, names, records) for s in members) for sid, members in shards.items()}
    return [sid for sid, members in shards.items() if not done[sid] and
            all(segment_run(s) is not None and (s["after"] is None or done[s["after"]]) for s in members)]


def cpu_shard_lines(shards: dict, rates_source: str, names: set, records: dict, command: str,
                    limit: float = CPU_SHARD_MINUTES) -> list[str]:
    """Markdown lines: per shard its runs (steps), the shard it continues, done, estimated CPU minutes and, once it
    ran, the thread minutes its record measured; ``command`` has ``{id}``."""
    lines = [f"One process, one thread per shard; rates {rates_source}; a shard is at most {limit:g} CPU-minutes at "
             "those rates (a run longer than that is cut into segments, each continuing the previous one's "
             "checkpoint).", "",
             "| shard | runs (steps) | after | done | CPU minutes (est.) | thread minutes (measured) | command |",
             "|---|---|---|---|---|---|---|"]
    for sid, members in shards.items():
        runs = ", ".join(f"{s['name']}" + (f" lr {s['lr']:g}" if s["lr"] is not None and " lr " not in s["name"]
                                            else "") + (f" steps {s['start']:,}-{s['until']:,}" if s["parts"] > 1
                                                        else f" ({s['steps']:,})") for s in members)
        after = ", ".join(sorted({s["after"] for s in members if s["after"]})) or "-"
        done = sum(segment_done(s, names, records) for s in members)
        record = records.get(sid)
        measured = "-" if record is None else f"{record['thread_s'] / 60:.0f}"
        lines.append(f"| {sid} | {runs} | {after} | {done}/{len(members)} | "
                     f"{sum(s['minutes'] for s in members):.0f} | {measured} | `{command.format(id=sid)}` |")
    total = sum(s["minutes"] for members in shards.values() for s in members)
    lines += ["", f"{len(shards)} shards, {total / 60:.1f} CPU-hours at these rates."]
    return lines


def cpu_progress(table: dict, names: set, records: dict, command: str) -> str:
    """Shards done, CPU-hours their records measured, shards left and the commands that can start now."""
    done = [sid for sid, members in table.items() if all(segment_done(s, names, records) for s in members)]
    spent = sum(record["thread_s"] for record in records.values()) / 3600
    ready = runnable_shards(table, names, records)
    left = [sid for sid in table if sid not in done]
    text = (f"shards done: {len(done)} of {len(table)} ({spent:.1f} CPU-hours measured); left: "
            f"{', '.join(left) or 'none'}")
    if ready:
        text += "\nready to start (one process per core): " + "; ".join(command.format(id=sid) for sid in ready[:2])
    return text


class CarriedState:
    """An unfinished run's state carried between machines in the committed results folder: a session's checkout
    holds no ignored files, so a shard that stops with a run unfinished (a segment's end, a budget) copies the run's
    ``folders`` under the working folder (its checkpoint's stack folder, its progress) to ``<results>/carried/``
    (about 60 MB for an LM run at D = 256, a few hundred KB for an ICL stack), the next shard of the run restores them
    when the working folder has no checkpoint, and the run's end removes them (its results file takes their place).
    ``scripts/run_shards.sh`` commits the results folder after every shard."""

    def __init__(self, folders: Sequence[Path], results: Path):
        self.pairs = [(Path(folder), Path(results) / "carried" / Path(folder).name) for folder in folders]

    def restore(self) -> None:
        """Copy the carried folders in, unless the working folder already holds a checkpoint of its own."""
        if any((folder / "checkpoint.pt").exists() for folder, _ in self.pairs) or \
                not any(carried.exists() for _, carried in self.pairs):
            return
        for folder, carried in self.pairs:
            if carried.exists():
                shutil.copytree(carried, folder, dirs_exist_ok=True)

    def keep(self) -> None:
        for folder, carried in self.pairs:
            if carried.exists():
                shutil.rmtree(carried)
            if folder.exists():
                shutil.copytree(folder, carried, ignore=shutil.ignore_patterns("*.tmp"))

    def drop(self) -> None:
        for _, carried in self.pairs:
            if carried.exists():
                shutil.rmtree(carried)


def run_cpu_shard(shard_id: str, shards: dict, spec_of: Callable[[dict], ArmSpec], work: Path, results: Path,
                  budget_s: Optional[float], compile_step: bool = False, checkpoints: int = 10,
                  dtype: torch.dtype = torch.float32, chunk: int = 50) -> bool:
    """Train a CPU shard's segments in order (one thread; one run a segment, resumable): each from its run's
    checkpoint in ``work`` (a segment that continues a run refuses to start before the previous segment has
    reached its first step) to its last step, writing the run's results file when the run ends. ``spec_of(segment)``
    builds the run's :class:`ArmSpec`; ``checkpoints`` per run (and one at every segment end); ``dtype`` and
    ``chunk`` as :class:`StackedArm`'s (float64 is for tests). Writes the shard's
    record (:func:`read_shard_records`), carries an unfinished run's state in ``results`` (:class:`CarriedState`)
    and returns True when every segment is done, False when ``budget_s``
    (wall seconds) stopped it first (a rerun resumes)."""
    if shard_id not in shards:
        raise SystemExit(f"shard: unknown id {shard_id!r}; the shards now are {', '.join(shards)}")
    records_path = Path(results) / "shards" / f"{shard_id}.json"
    record = json.loads(records_path.read_text()) if records_path.exists() else {
        "shard": shard_id, "machine": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "step_mode": "compiled" if compile_step else "eager", "invocations": 0, "thread_s": 0.0, "wall_s": 0.0,
        "reached": {}, "done": False}
    thread, wall = time.thread_time(), time.perf_counter()
    names = {path.stem for path in Path(results).glob("*_lr*_s*.json")}
    finished, trained = True, False
    for segment in shards[shard_id]:
        run = segment_run(segment)
        if run is None:
            raise SystemExit(f"shard {shard_id}: {segment['name']} runs at a learning rate the design's grid picks; "
                             "its grid (and edge) runs must finish first (`report` says what is left)")
        if run in names:
            continue
        carried = CarriedState([Path(work) / run, StackedArm.stack_folder(Path(work), segment["arm"], [segment["lr"]],
                                                                           [segment["seed"]])], results)
        carried.restore()
        at = StackedArm.checkpoint_step(work, segment["arm"], [segment["lr"]], [segment["seed"]])
        if segment["start"] > 0 and (at or 0) < segment["start"]:
            raise SystemExit(f"shard {shard_id}: {run} continues from step {segment['start']:,}, but its checkpoint "
                             f"in {work} is at step {at or 0:,}: run shard {segment['after']} first (same --out)")
        if at is not None and at >= segment["until"]:
            record["reached"][run] = max(at, record["reached"].get(run, 0))
            continue
        spec = spec_of(segment)
        left = None if budget_s is None else budget_s - (time.perf_counter() - wall)
        arm = StackedArm(spec, [segment["lr"]], [segment["seed"]], segment["steps"], segment["eval_every"], work,
                         "cpu", checkpoint_every=max(1, segment["steps"] // checkpoints), chunk=chunk, dtype=dtype,
                         compile_step=compile_step)
        # a budget spent by earlier segments of this command stops it before the next; the first always trains (at
        # least up to its first checkpoint, evaluation or chunk end)
        complete = arm.run_until(left if left is None or left > 0 or not trained else 0.0, until=segment["until"]) \
            if left is None or left > 0 or not trained else False
        trained = True
        if complete:
            arm.finish(results=results)
            carried.drop()
        else:
            carried.keep()
        record["reached"][run] = arm.step
        print(f"shard {shard_id}: {run} at step {arm.step:,} of {segment['steps']:,} "
              f"(segment {segment['part']}/{segment['parts']}, to step {segment['until']:,})", flush=True)
        if arm.step < segment["until"]:
            finished = False
            print(f"stopped by --budget-s; rerun the command to resume", flush=True)
            break
    record.update(invocations=record["invocations"] + 1, done=finished,
                  thread_s=round(record["thread_s"] + time.thread_time() - thread, 1),
                  wall_s=round(record["wall_s"] + time.perf_counter() - wall, 1))
    records_path.parent.mkdir(parents=True, exist_ok=True)
    temporary = records_path.with_name(records_path.name + ".tmp")
    temporary.write_text(json.dumps(record, indent=1))
    os.replace(temporary, records_path)
    return finished


def one_thread() -> None:
    """A CPU design's process: one intra-op thread, and torch.compile's code generation in this thread too (no pool
    of compile workers on the other core), so that its thread clock counts all of its work."""
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1


def cpu_pilot_markdown(summary: dict) -> str:
    """The markdown table of a CPU pilot's summary (:func:`cpu_pilot`)."""
    def rate(value):
        return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"

    lines = [f"### CPU pilot ({summary['machine']}, one thread, torch {summary['torch']})", "",
             f"{summary['steps_timed']} timed steps per arm after two warm-up steps; thread clock (wall in brackets); "
             f"wall {summary['wall_s']:.0f} s in all.", "",
             f"| arm | step | s a step | {summary.get('units', 'units')} a second | evaluation s | first step s | "
             "setup s |", "|---|---|---|---|---|---|---|"]
    for key, arm in summary["arms"].items():
        mode = "compiled" if arm["compiled"] else "eager"
        if not arm["measured"]:
            lines.append(f"| {key} | {mode} | not measured (budget): assumed {arm['step_s']:.3f} | - | - | - | - |")
            continue
        lines.append(f"| {key} | {mode} | {arm['step_s']:.3f} ({arm['step_wall_s']:.3f}) | {rate(arm['units_per_s'])} "
                     f"| {arm['eval_s']:.1f} ({arm['eval_wall_s']:.1f}) | {arm['first_step_s']:.1f} "
                     f"({arm['first_step_wall_s']:.1f}) | {arm['setup_s']:.0f} |")
    return "\n".join(lines)


def cpu_pilot(arms: Sequence[tuple[str, Callable[[], ArmSpec], bool, float]], setup_s: float, out: Path,
              results: Optional[Path], budget_s: float, started: float, assumed: dict, steps: int = 5,
              summary: Optional[dict] = None) -> dict:
    """A CPU design's pilot: for each arm (rate key, spec builder, compiled?, units (tokens or windows) per step), in
    order while ``budget_s`` wall seconds since ``started`` last, one run of seed 0 at lr 1e-3 built as the shards
    build it (:class:`StackedRuns`, one run): its build, its first step (the compile, when compiled), one more
    warm-up step, ``steps`` timed steps on its own batches and one evaluation, on the thread clock (wall beside it).
    Its rates ({"step_s", "eval_s", "setup_s"}: ``setup_s`` = ``setup_s`` (the caller's data loading) + build +
    the first step's excess over a step) size the shards (:func:`cpu_rates`); an arm the budget leaves out keeps its
    ``assumed`` rate and is marked so. Writes ``pilot.json`` and ``pilot.md`` to ``out`` and, with ``results``,
    ``results/pilot.json`` (committed)."""
    if results is not None and not (summary or {}).get("tiny") and read_shard_records(results):
        raise SystemExit(f"pilot: {results} has shard records; the committed pilot.json fixed their layout (a new "
                         "pilot would re-cut the shards under runs in progress): write the pilot elsewhere "
                         "(--results) or remove the records first")
    summary = dict(summary or {})
    summary.update(design="cpu", machine=cpu_model(), threads=torch.get_num_threads(), torch=torch.__version__,
                   steps_timed=steps, budget_s=budget_s, data_setup_s=round(setup_s, 1), arms={})
    for key, build_spec, compiled, units in arms:
        if time.perf_counter() - started > budget_s:
            summary["arms"][key] = {**assumed[key], "measured": False, "compiled": compiled}
            continue
        thread = time.thread_time()
        spec = build_spec()
        torch.manual_seed(0)
        model = spec.build(0)
        multipliers = spec.lr_multipliers(model) if spec.lr_multipliers else None
        stack = StackedRuns(model, [model.state_dict()], [1e-3], lr_multipliers=multipliers, compile_step=compiled)
        build_s = time.thread_time() - thread

        def batch_of(step):
            return tuple(field[None] for field in spec.batch(0, step))

        timings, losses = [], []
        for step in range(steps + 2):
            batch = batch_of(step)
            thread, wall = time.thread_time(), time.perf_counter()
            losses.append(float(stack.train_step(spec.loss, batch, 1.0)[0]))
            timings.append((time.thread_time() - thread, time.perf_counter() - wall))
        thread, wall = time.thread_time(), time.perf_counter()
        metrics = {name: float(value[0]) for name, value in spec.evaluate(stack).items()}
        eval_s, eval_wall_s = time.thread_time() - thread, time.perf_counter() - wall
        step_s = sum(t for t, _ in timings[2:]) / steps
        step_wall_s = sum(w for _, w in timings[2:]) / steps
        summary["arms"][key] = {
            "measured": True, "compiled": compiled, "step_s": round(step_s, 4), "step_wall_s": round(step_wall_s, 4),
            "units_per_s": round(units / step_s, 1), "eval_s": round(eval_s, 4), "eval_wall_s": round(eval_wall_s, 4),
            "first_step_s": round(timings[0][0], 2), "first_step_wall_s": round(timings[0][1], 2),
            "setup_s": round(setup_s + build_s + max(0.0, timings[0][0] - step_s), 1), "losses": losses,
            "evaluation": metrics, "flops_per_step": spec.flops_per_step,
            "flops_per_s": round(spec.flops_per_step / step_s, 1)}
        print(f"pilot {key}: {step_s:.3f} s a step ({units / step_s:,.1f} a second), evaluation {eval_s:.1f} s, "
              f"first step {timings[0][0]:.1f} s (thread)", flush=True)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    lines = cpu_pilot_markdown(summary).splitlines()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pilot.json").write_text(json.dumps(summary, indent=1))
    (out / "pilot.md").write_text("\n".join(lines) + "\n")
    if results is not None and not summary.get("tiny"):
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / "pilot.json").write_text(json.dumps(summary, indent=1))
        (Path(results) / "pilot.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return summary


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


def step_timing(specs: Sequence[ArmSpec], repeats: int = 5, warmup: int = 1, runs: int = 1) -> list[dict]:
    """Thread time (``time.thread_time``: this thread's CPU seconds, so other processes on the cores do not count) of
    one training step of each spec's stack of ``runs`` runs, eager against compiled
    (``StackedRuns(compile_step=True)``): both built from the same initial state, ``warmup`` steps each first (the
    compiled stack's first step is the compile, timed apart in wall and thread seconds), then ``repeats`` steps of
    each, interleaved step by step in one process, on the batch of the spec's step 0. Returns per spec
    {"arm", "runs", "eager_ms", "compiled_ms", "eager_wall_ms", "compiled_wall_ms", "compile_s",
    "compile_thread_s", "saving"} (``saving`` = 1 - compiled / eager thread time)."""
    rows = []
    for spec in specs:
        torch.manual_seed(0)
        template = spec.build(0)
        multipliers = spec.lr_multipliers(template) if spec.lr_multipliers else None
        states = [template.state_dict()] * runs
        stacks = {mode: StackedRuns(copy.deepcopy(template), states, [1e-3] * runs, lr_multipliers=multipliers,
                                    compile_step=mode == "compiled") for mode in ("eager", "compiled")}
        batch = tuple(field[None].expand(runs, *field.shape).contiguous() for field in spec.batch(0, 0))
        wall, thread = time.perf_counter(), time.thread_time()
        stacks["compiled"].train_step(spec.loss, batch, 1.0)
        compile_s, compile_thread_s = time.perf_counter() - wall, time.thread_time() - thread
        for mode in ("eager", "compiled"):
            for _ in range(warmup if mode == "eager" else warmup - 1):
                stacks[mode].train_step(spec.loss, batch, 1.0)
        totals = {(mode, clock): 0.0 for mode in stacks for clock in ("thread", "wall")}
        for _ in range(repeats):
            for mode, stack in stacks.items():
                wall, thread = time.perf_counter(), time.thread_time()
                stack.train_step(spec.loss, batch, 1.0)
                totals[mode, "thread"] += time.thread_time() - thread
                totals[mode, "wall"] += time.perf_counter() - wall
        row = {"arm": spec.name, "runs": runs, "repeats": repeats, "compile_s": round(compile_s, 1),
               "compile_thread_s": round(compile_thread_s, 1)}
        for mode in stacks:
            row[f"{mode}_ms"] = round(1000 * totals[mode, "thread"] / repeats, 1)
            row[f"{mode}_wall_ms"] = round(1000 * totals[mode, "wall"] / repeats, 1)
        row["saving"] = round(1 - row["compiled_ms"] / row["eager_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def merge_timing(path: Path, rows: list[dict], fields: dict) -> None:
    """Write ``rows`` into the timing record ``path``, replacing earlier rows of the same arms."""
    record = json.loads(path.read_text()) if path.exists() else {"rows": []}
    kept = [row for row in record["rows"] if row["arm"] not in {r["arm"] for r in rows}]
    record.update(machine=cpu_model(), torch=torch.__version__, threads=torch.get_num_threads(), **fields,
                  rows=kept + [dict(row, machine=cpu_model()) for row in rows])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


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


def design_arguments(argv, description: str, design_out: str, pilot_out: str, results: str = "results",
                     designs: Optional[dict] = None) -> argparse.Namespace:
    """The command line of a design script (``plan [--shards]``, ``shard ID``, ``run``, ``report``, ``pilot``,
    ``time``), checked: a positive budget, a cpu / cuda[:index] device that exists for ``shard``, ``run`` and
    ``pilot``, a new or empty folder for a pilot, an id for ``shard``. ``designs``: name -> (results, work folder,
    pilot folder) of the script's registered designs (``--design``, the first the default); ``--design cpu`` runs
    on one CPU thread (:func:`one_thread`), its shards with ``--budget-s`` :data:`CPU_SHARD_BUDGET_S` unless given
    and its pilot with 1,100 s. Turns TF32 matmuls on for CUDA (the throughput the GPU designs' estimates assume)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("command", choices=["plan", "shard", "run", "report", "pilot", "time"])
    parser.add_argument("shard_id", nargs="?", help="shard: its id (plan --shards lists them)")
    parser.add_argument("--design", choices=list(designs or {"gpu": None}), default=next(iter(designs or {"gpu": 0})),
                        help="the registered design (default: the first)")
    parser.add_argument("--shards", action="store_true", help="plan: the shards, their FLOPs and minutes")
    parser.add_argument("--results", help=f"the committed results files (default {results}, or the design's)")
    parser.add_argument("--out", help=f"working folder: progress, checkpoints (default {design_out}; pilot "
                                      f"{pilot_out}; or the design's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<index>")
    parser.add_argument("--budget-s", dest="budget_s", type=float, help="wall seconds (pilot default 170)")
    parser.add_argument("--tiny", action="store_true", help="pilot: the CPU rehearsal")
    parser.add_argument("--eager", action="store_true", help="CPU design: do not compile the training step")
    parser.add_argument("--arms", nargs="*", help="time: only these arms / variants")
    args = parser.parse_args(argv)
    if designs:
        results, design_out, pilot_out = designs[args.design]
    cpu = args.design == "cpu"
    args.results = args.results or results
    args.out = args.out or (pilot_out if args.command == "pilot" else design_out)
    if args.command == "pilot" and args.budget_s is None:
        args.budget_s = 1_100.0 if cpu else 170.0
    if args.command == "shard" and cpu and args.budget_s is None:
        args.budget_s = CPU_SHARD_BUDGET_S
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda[:index], got {args.device!r}")
    if cpu and args.device != "cpu":
        parser.error("--design cpu runs on the CPU (--device cpu)")
    if args.command == "shard" and not args.shard_id:
        parser.error("shard needs an id (plan --shards lists them)")
    if args.device.startswith("cuda") and args.command in ("run", "shard", "pilot") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    if args.command == "pilot" and Path(args.out).exists() and any(Path(args.out).iterdir()):
        parser.error(f"--out {args.out} is not empty: a pilot starts from scratch in a new folder")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    if cpu:
        one_thread()
    return args
