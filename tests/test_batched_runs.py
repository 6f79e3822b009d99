"""The batched runner (hf_structattn/training/batched.py): R runs trained as one stacked model must equal R separate
runs (torch.optim.AdamW, clip_grad_norm_, the model's default attention) step for step, in float64."""

import sys
from pathlib import Path

import pytest
import torch

from hf_structattn.mup import mup_param_groups
from hf_structattn.training.batched import StackedRuns

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from icl_rank_experiment import build, loss_of, schedule, train_batch  # noqa: E402

D, LAYERS, STEPS = 4, 2, 3


def _separate_and_stacked(arm, lrs, seeds, *, max_grad_norm=1.0, groups=None):
    """R = len(lrs) * len(seeds) float64 models (a separate run seeds torch and builds its model), their torch
    optimizers, and one StackedRuns over copies of the same initial parameters."""
    runs = [(lr, seed) for seed in seeds for lr in lrs]
    models, optimizers = [], []
    for lr, seed in runs:
        torch.manual_seed(seed)
        model = build(D, arm, layers=LAYERS).double()
        models.append(model)
        param_groups = groups(model, lr) if groups else [{"params": list(model.parameters())}]
        optimizers.append(torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0))
    extra = {}
    if groups:  # the stacked runner takes the groups' multipliers and decays per parameter name
        names = {id(p): n for n, p in models[0].named_parameters()}
        reference = groups(models[0], 1.0)
        extra = dict(lr_multipliers={names[id(p)]: g["lr"] for g in reference for p in g["params"]},
                     weight_decays={names[id(p)]: g["weight_decay"] for g in reference for p in g["params"]})
    stack = StackedRuns(build(D, arm, layers=LAYERS).double(), [m.state_dict() for m in models],
                        [lr for lr, _ in runs], max_grad_norm=max_grad_norm, **extra)
    return runs, models, optimizers, stack


def _train_both(arm, lrs, seeds, **options):
    runs, models, optimizers, stack = _separate_and_stacked(arm, lrs, seeds, **options)
    max_grad_norm = options.get("max_grad_norm", 1.0)
    seed_list = sorted({seed for _, seed in runs})
    losses_separate, losses_stacked = [], []
    peaks = [[group["lr"] for group in optimizer.param_groups] for optimizer in optimizers]  # each group's peak LR
    for step in range(STEPS):
        prompts = {seed: train_batch(D, seed, step, STEPS) for seed in seed_list}
        xs = torch.stack([prompts[seed][0] for _, seed in runs]).double()
        ys = torch.stack([prompts[seed][1] for _, seed in runs]).double()
        factor = schedule(step, 200, D, 1.0)[0]  # a warm-up factor below 1 (2 warm-up steps of 200)
        losses_stacked.append(stack.train_step(loss_of, (xs, ys), factor))
        row = []
        for run, (model, optimizer) in enumerate(zip(models, optimizers)):
            for group, peak in zip(optimizer.param_groups, peaks[run]):
                group["lr"] = peak * factor
            loss = model(xs=xs[run], ys=ys[run]).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            row.append(loss.detach())
        losses_separate.append(torch.stack(row))
    return runs, models, stack, torch.stack(losses_separate), torch.stack(losses_stacked)


@pytest.mark.parametrize("arm", ["ii_dense1", "iii_btt8", "iv_mlr8"])
def test_stacked_runs_equal_separate_runs_in_float64(arm):
    # 2 LRs x 2 seeds, the ICL data streams and warm-up, a clipping threshold low enough to clip every step
    runs, models, stack, separate, stacked = _train_both(arm, [1e-3, 3e-2], [0, 1], max_grad_norm=0.05)
    torch.testing.assert_close(stacked, separate, rtol=1e-12, atol=1e-14)
    assert not torch.equal(separate[:, 0], separate[:, 2])  # the seeds saw different data and weights
    for run, model in enumerate(models):
        state = stack.run_state(run)
        for name, param in model.named_parameters():
            torch.testing.assert_close(state[name], param.detach(), rtol=1e-9, atol=1e-12,
                                       msg=f"{arm} run {run} {name}")
    moved = [(stack.run_state(0)[n] - stack.run_state(1)[n]).abs().max() for n in stack.run_state(0)]
    assert max(moved) > 1e-3  # the two LRs of seed 0 took different steps


def test_stacked_runs_take_mup_learning_rates_and_weight_decay_per_parameter():
    def groups(model, lr):
        found = mup_param_groups(model, lr=lr, base_width=8, weight_decay=0.1)
        for group in found:
            group.pop("names")
            group.pop("lr_multiplier")
        return found

    runs, models, stack, separate, stacked = _train_both("ii_dense1", [1e-3, 1e-2], [0], groups=groups)
    assert len({g["lr"] for g in groups(models[0], 1.0)}) > 1  # the multipliers differ between matrices
    torch.testing.assert_close(stacked, separate, rtol=1e-12, atol=1e-14)
    for run, model in enumerate(models):
        state = stack.run_state(run)
        for name, param in model.named_parameters():
            torch.testing.assert_close(state[name], param.detach(), rtol=1e-9, atol=1e-12, msg=name)


def test_a_frozen_run_stops_changing_while_the_others_train():
    runs, models, optimizers, stack = _separate_and_stacked("ii_dense1", [1e-2], [0, 1])
    prompts = [train_batch(D, seed, 0, 100) for seed in (0, 1)]
    batch = (torch.stack([x for x, _ in prompts]).double(), torch.stack([y for _, y in prompts]).double())
    stack.freeze(torch.tensor([True, False]))
    before = stack.flat.clone()
    stack.train_step(loss_of, batch, 1.0)
    assert torch.equal(stack.flat[0], before[0])
    assert (stack.flat[1] - before[1]).abs().max() > 1e-4


def test_bad_arguments_are_one_line_value_errors():
    model = build(D, "ii_dense1", layers=1)
    with pytest.raises(ValueError, match="2 states for 1 learning rates"):
        StackedRuns(model, [model.state_dict()] * 2, [1e-3])
    with pytest.raises(ValueError, match=r"lrs must be positive, got \[0.0\]"):
        StackedRuns(model, [model.state_dict()], [0.0])
    with pytest.raises(ValueError, match="unknown parameters \\['nope'\\]"):
        StackedRuns(model, [model.state_dict()], [1e-3], lr_multipliers={"nope": 2.0})
    stack = StackedRuns(model, [model.state_dict()], [1e-3])
    with pytest.raises(ValueError, match=r"run must be in \[0, 1\), got 3"):
        stack.run_state(3)
