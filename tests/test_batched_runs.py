"""The batched runner (scripts/stacked_runs.py): R runs trained as one stacked model must equal R separate
runs (torch.optim.AdamW, clip_grad_norm_, the model's default attention) step for step, in float64."""

import sys
from pathlib import Path

import pytest
import torch

from hf_structattn.mup import mup_param_groups

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from stacked_runs import StackedRuns  # noqa: E402
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


@pytest.mark.slow
def test_the_compiled_step_equals_the_eager_step_in_float64():
    # torch.compile of the whole step (forward, backward, clipping, AdamW), the LR factor a tensor; 2 runs, a warm-up
    # schedule and a frozen run. ~1 min: the compile
    torch.manual_seed(0)
    template = build(D, "i_dense12_half", layers=1).double()
    states = [template.state_dict(), build(D, "i_dense12_half", layers=1).double().state_dict()]
    eager = StackedRuns(build(D, "i_dense12_half", layers=1).double(), states, [1e-3, 3e-2], max_grad_norm=0.05)
    compiled = StackedRuns(build(D, "i_dense12_half", layers=1).double(), states, [1e-3, 3e-2], max_grad_norm=0.05,
                           compile_step=True)
    assert compiled.graph_status == "compiled"
    for step, factor in enumerate((0.25, 0.5, 1.0, 1.0)):
        xs, ys = train_batch(D, 0, step, 200)
        batch = (torch.stack([xs, xs]).double(), torch.stack([ys, ys]).double())
        if step == 2:
            for stack in (eager, compiled):
                stack.freeze(torch.tensor([True, False]))
        torch.testing.assert_close(compiled.train_step(loss_of, batch, factor), eager.train_step(loss_of, batch, factor),
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(compiled.flat, eager.flat, rtol=1e-10, atol=1e-13)
    assert (eager.flat[1] - torch.cat([v.reshape(-1) for v in states[1].values()])).abs().max() > 1e-4


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


# ------------------------------------------------------------------ the LM and Chronos designs' arms (StackedArm)


ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which StackedRuns shares
ROUNDING_GRADIENT = 1e-13  # float64: a gradient this small is rounding noise of O(1) terms, not a signal


def _assert_same_run(state, model, gradient_max, peak_lrs, steps, label):
    """A stacked run's parameters equal its separate twin's, in float64.

    A parameter whose gradient is analytically zero (a key bias under softmax's shift invariance, for one) gets a
    gradient of pure rounding noise, ~1e-18, whose sign depends on the CPU's kernels; Adam divides it by its own
    scale (plus eps), so such a parameter's value is that noise times lr / eps and no rtol can compare it. For those
    (largest gradient over the run below ROUNDING_GRADIENT) both sides must stay within Adam's bound for such
    gradients, steps * lr * max|g| / eps, of the initial value; every other parameter matches at rtol 1e-9."""
    for name, param in model.named_parameters():
        if gradient_max[name] < ROUNDING_GRADIENT:
            bound = steps * peak_lrs[name] * gradient_max[name] / ADAM_EPS + 1e-15
            start = model.initial_state[name]
            for side, value in (("stacked", state[name]), ("separate", param.detach())):
                drift = float((value - start).abs().max())
                assert drift <= bound, f"{label} {name}: the {side} run moved {drift:.3g} on a rounding-level " \
                                       f"gradient (bound {bound:.3g})"
            continue
        torch.testing.assert_close(state[name], param.detach(), rtol=1e-9, atol=1e-12, msg=f"{label} {name}")


def _separate_like_the_arm(spec, lrs, seeds, steps, warmup, frozen_after):
    """The runs of a StackedArm trained one by one: torch's AdamW (muP multipliers as per-parameter LRs), clipping at
    1, the arm's warm-up + cosine factor, each run's own seed, data stream and peak LR; run ``k`` of
    ``frozen_after`` stops after that many steps (as a frozen run of the stack does). Each model carries
    ``initial_state``, ``gradient_max`` (name -> largest |gradient| over its steps) and ``peak_lrs`` (name -> LR)."""
    from sweep import cosine_factor

    models = []
    for index, (lr, seed) in enumerate((lr, seed) for seed in seeds for lr in lrs):
        torch.manual_seed(seed)
        model = spec.build(seed).double()
        multipliers = spec.lr_multipliers(model) if spec.lr_multipliers else {}
        groups = [{"params": [p], "lr": lr * multipliers.get(n, 1.0), "peak": lr * multipliers.get(n, 1.0)}
                  for n, p in model.named_parameters()]
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        model.initial_state = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.gradient_max = {n: 0.0 for n, _ in model.named_parameters()}
        model.peak_lrs = {n: lr * multipliers.get(n, 1.0) for n, _ in model.named_parameters()}
        for step in range(frozen_after.get(index, steps)):
            for group in optimizer.param_groups:
                group["lr"] = group["peak"] * cosine_factor(step, steps, warmup, 0.1)
            loss = spec.loss(model, spec.batch(seed, step))
            optimizer.zero_grad()
            loss.backward()
            for name, param in model.named_parameters():
                if param.grad is not None:
                    model.gradient_max[name] = max(model.gradient_max[name], float(param.grad.abs().max()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        models.append(model)
    return models


def _stacked_equals_separate(spec, lrs, seeds, tmp_path, steps=3, frozen_after=None):
    from sweep import StackedArm

    frozen_after = frozen_after or {}
    arm = StackedArm(spec, lrs, seeds, steps, steps, tmp_path, warmup=2, chunk=1, dtype=torch.float64)
    while not arm.finished:
        arm.advance()  # one step a call (chunk 1)
        stop = torch.tensor([frozen_after.get(run) == arm.step for run in range(arm.stack.runs)])
        if stop.any():
            arm.stack.freeze(stop)
    models = _separate_like_the_arm(spec, lrs, seeds, steps, 2, frozen_after)
    for run, model in enumerate(models):
        _assert_same_run(arm.stack.run_state(run), model, model.gradient_max, model.peak_lrs, steps,
                         f"{spec.name} run {run}")
    return arm, models


def _lm_spec(variant):
    import lm_experiment as lm
    from sweep import ArmSpec

    size = dict(seq_len=32, layers=3, head_dim=16)

    def batch(seed, step):  # random bytes: this checks the stacking, not the corpus
        return (torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(100 * seed + step)),)

    return ArmSpec(name=f"{variant}_D32", build=lambda seed: lm.build_model(variant, 32, **size), batch=batch,
                   loss=lm.lm_loss, evaluate=lambda stack: {}, flops_per_step=1.0, lr_multipliers=lm.mup_multipliers)


@pytest.mark.parametrize("variant", ["dense", "swa", "gswa", "mlr"])
def test_the_lm_arms_stacked_equal_separate_runs_in_float64(variant, tmp_path):
    # 2 LRs x 2 seeds with muP's per-matrix LR multipliers, warm-up + cosine, clipping; run 1 frozen after 2 steps
    arm, models = _stacked_equals_separate(_lm_spec(variant), [1e-2, 3e-2], [0, 1], tmp_path, frozen_after={1: 2})
    differ = [(arm.stack.run_state(0)[n] - arm.stack.run_state(2)[n]).abs().max() for n in arm.stack.run_state(0)]
    assert max(differ) > 1e-3  # the two seeds are different runs
    once = _separate_like_the_arm(_lm_spec(variant), [3e-2], [0], 3, 2, {})[0]  # run 1 had it not been frozen
    assert any((p - q).abs().max() > 1e-4 for p, q in zip(once.parameters(), models[1].parameters()))


@pytest.mark.parametrize("arm_name", ["dense", "mlr", "mlr_flat"])
def test_the_chronos_arms_stacked_equal_separate_runs_in_float64(arm_name, tmp_path):
    # the design's T5 arms at tiny size (2 heads of 16, context 64): 3 LRs of one seed (the task is per seed), the
    # Chronos tokenizer's real batches, run 0 frozen after 1 step
    import chronos_experiment as ce

    spec = ce.arm_spec(arm_name, 32, 0, tiny=True, batch=2)
    arm, models = _stacked_equals_separate(spec, [1e-3, 1e-2, 3e-2], [0], tmp_path, frozen_after={0: 1})
    moved = [(arm.stack.run_state(1)[n] - arm.stack.run_state(2)[n]).abs().max() for n in arm.stack.run_state(1)]
    assert max(moved) > 1e-4  # per-run learning rates: the runs differ


def test_an_eager_stacked_step_memoises_no_functorch_wrapped_tensor_in_the_mlr_geometry():
    # a tensor made inside grad is wrapped; kept in the (shared) geometry memo it outlived its transform, and a later
    # compiled step of another stack of the same geometry read it as an input without storage
    import lm_experiment as lm
    from hf_structattn.modeling.structattn_attention import mlr_geometry_of

    torch.manual_seed(0)
    model = lm.build_model("mlr", 32, seq_len=64, layers=1, head_dim=16)
    geometry = mlr_geometry_of(model.transformer.h[0].attn)
    geometry.tensors.entries.clear()
    stack = StackedRuns(model, [model.state_dict()], [1e-3], lr_multipliers=lm.mup_multipliers(model))
    ids = torch.randint(0, 257, (1, 2, 64), generator=torch.Generator().manual_seed(0))
    stack.train_step(lm.lm_loss, (ids,), 1.0)
    stack.evaluate(lm.window_nll_sum, (ids,))
    assert geometry.tensors.entries  # the evaluation (no grad) memoised its scale vector
    assert not any(torch._C._functorch.is_functorch_wrapped_tensor(value) for value in geometry.tensors.entries.values()
                   if isinstance(value, torch.Tensor))


@pytest.mark.slow
def test_a_compiled_mlr_step_after_an_eager_one_of_the_same_geometry_equals_eager():
    # the interleaving of the eager / compiled timing (training/sweep.step_timing): ~1-2 min, the compile
    import copy

    import lm_experiment as lm

    torch.manual_seed(0)
    model = lm.build_model("mlr", 32, seq_len=64, layers=1, head_dim=16).double()
    states, multipliers = [model.state_dict()], lm.mup_multipliers(model)
    eager = StackedRuns(copy.deepcopy(model), states, [1e-3], lr_multipliers=multipliers)
    compiled = StackedRuns(copy.deepcopy(model), states, [1e-3], lr_multipliers=multipliers, compile_step=True)
    for step in range(3):
        ids = torch.randint(0, 257, (1, 2, 64), generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(compiled.train_step(lm.lm_loss, (ids,), 1.0), eager.train_step(lm.lm_loss, (ids,),
                                                                                                  1.0))
    torch.testing.assert_close(compiled.flat, eager.flat, rtol=1e-10, atol=1e-13)
