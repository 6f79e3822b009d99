"""Train the R runs of one architecture (its learning rates x seeds) as ONE stacked model.

A tiny model (the ICL arms have 44k parameters and 16 tokens per prompt) leaves a GPU idle: every training step is a
few hundred to a few thousand kernel launches of microseconds each, so R separate runs cost R times the launches.
Here the runs' parameters are stacked along a new leading dim R and the model is called with
``torch.func.functional_call`` under ``torch.func.vmap``: one step launches one set of kernels, each R times wider,
for all runs. Everything a separate run does is kept per run:

* parameters and initialisation: each run's own (``initial_states``, e.g. one model per seed);
* data: each run's own batch (the batch tensors carry the run dim; runs that share a seed share a stream);
* learning rate: ``lrs[r] * lr_multipliers[param]`` (muP's per-matrix multipliers) times the step's schedule factor;
* gradient clipping: each run's global norm over its own parameters (``torch.nn.utils.clip_grad_norm_``'s formula);
* AdamW: ``torch.optim.AdamW``'s arithmetic (decoupled weight decay, bias corrections) over flat (R, P) buffers.

So a batched step equals R separate steps up to float rounding (``tests/test_batched_runs.py`` checks losses and
parameters in float64). Parameters that a separate run leaves without a gradient (unused weights) get a zero gradient
here: with ``weight_decay == 0`` AdamW leaves them unchanged in both; with weight decay they would decay here only.

The attention must be vmap-able: the ``eager`` implementation is (``StackedRuns`` sets it on the template), while the
fused MLR path is an ``autograd.Function`` without functorch support and CPU SDPA falls back to a per-run loop.

``compile_step=True`` compiles the whole step (forward, backward, clipping, AdamW) with ``torch.compile``, once per
batch shape; on a CPU it pays where the step is bound by per-operator dispatch, as the ICL arms' steps are (1.6-3.6x
less thread time, ``scripts/icl_rank_experiment.py time``); the learning-rate factor travels as a tensor so that a
schedule does not recompile it.

On CUDA, ``cuda_graphs=True`` records the whole step (forward, backward, clipping, AdamW) once per batch shape in a
CUDA graph and replays it, so a step costs one graph launch instead of hundreds of kernel launches from Python. The
first replay of each graph is checked against an eager step from the same state; on any difference beyond float32
rounding, or if capture fails, the runner falls back to eager steps (``graph_status`` says which happened).
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

Batch = object  # a pytree (tuple / dict) of tensors whose leading dim is the run dim R


class StackedRuns:
    """R runs of ``template``'s architecture, trained as one stacked model.

    ``template``: the module whose forward is called (its own parameters are not trained; its buffers are shared by
    every run). ``initial_states``: R mappings ``name -> tensor`` holding each run's initial trainable parameters
    (``model.state_dict()`` of R freshly built models works). ``lrs``: R peak learning rates.
    ``lr_multipliers`` / ``weight_decays``: per-parameter-name learning-rate multiplier (default 1) and decoupled
    weight decay (default ``weight_decay``), e.g. from :func:`hf_structattn.mup.mup_param_groups`.

    State (all on ``device``): ``flat`` (R, P) parameters, ``exp_avg`` / ``exp_avg_sq`` (R, P) AdamW moments,
    ``step_count`` () the number of optimizer steps, ``active`` (R,) 1.0 for runs still training and 0.0 for runs
    frozen by :meth:`freeze` (their parameters stop changing, as if the run had stopped).
    """

    def __init__(self, template: nn.Module, initial_states: Sequence[Mapping[str, torch.Tensor]],
                 lrs: Sequence[float], *, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: Optional[float] = 1.0,
                 lr_multipliers: Optional[Mapping[str, float]] = None,
                 weight_decays: Optional[Mapping[str, float]] = None,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None,
                 cuda_graphs: bool = False, compile_step: bool = False):
        if len(initial_states) != len(lrs):
            raise ValueError(f"initial_states: {len(initial_states)} states for {len(lrs)} learning rates")
        if not initial_states:
            raise ValueError("initial_states: no runs")
        if any(not lr > 0 for lr in lrs):
            raise ValueError(f"lrs must be positive, got {list(lrs)}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        self.template = template
        if hasattr(template, "set_attn_implementation"):
            template.set_attn_implementation("eager")  # vmap-able attention (module docstring)
        names = [name for name, param in template.named_parameters() if param.requires_grad]
        unknown = sorted(set(lr_multipliers or {}) - set(names)) + sorted(set(weight_decays or {}) - set(names))
        if unknown:
            raise ValueError(f"lr_multipliers/weight_decays: unknown parameters {unknown}")
        device = torch.device(device) if device is not None else next(template.parameters()).device
        dtype = dtype or next(template.parameters()).dtype
        template.to(device=device, dtype=dtype)
        self.runs, self.device, self.dtype = len(lrs), device, dtype
        self.layout: list[tuple[str, int, int, tuple[int, ...]]] = []  # (name, offset, numel, shape)
        offset = 0
        shapes = dict(template.named_parameters())
        for name in names:
            shape = tuple(shapes[name].shape)
            numel = math.prod(shape)
            self.layout.append((name, offset, numel, shape))
            offset += numel
        self.numel = offset
        rows = []
        for run, state in enumerate(initial_states):
            missing = [name for name in names if name not in state]
            if missing:
                raise ValueError(f"initial_states[{run}] lacks parameters {missing[:3]}")
            rows.append(torch.cat([state[name].detach().reshape(-1).to(device=device, dtype=dtype)
                                   for name in names]))
        self.flat = torch.stack(rows)
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.step_count = torch.zeros((), dtype=torch.float64, device=device)
        self.active = torch.ones(self.runs, dtype=dtype, device=device)
        multiplier = torch.cat([torch.full((numel,), float((lr_multipliers or {}).get(name, 1.0)), dtype=torch.float64)
                                for name, _, numel, _ in self.layout])
        decay = torch.cat([torch.full((numel,), float((weight_decays or {}).get(name, weight_decay)),
                                      dtype=torch.float64) for name, _, numel, _ in self.layout])
        self.lrs = torch.tensor([float(lr) for lr in lrs], dtype=torch.float64)
        # (R, P) peak learning rate of every entry; computed in float64 as a separate run's Python floats are
        self.peak_lr = (self.lrs[:, None] * multiplier[None, :]).to(device=device, dtype=dtype)
        self.weight_decay = decay.to(device=device, dtype=dtype)[None, :] if bool((decay != 0).any()) else None
        self.betas, self.eps, self.max_grad_norm = betas, eps, max_grad_norm
        self.cuda_graphs = bool(cuda_graphs) and device.type == "cuda"
        self._graphs: dict = {}
        self.compile_step = bool(compile_step) and not self.cuda_graphs
        self._compiled: dict = {}  # loss function -> its compiled step
        self.graph_status = "not captured yet" if self.cuda_graphs else "compiled" if self.compile_step else "eager"

    # ------------------------------------------------------------------------------------------------ parameters

    def parameters(self, flat: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """name -> (R, *shape) views of ``flat`` (default: the live parameters)."""
        flat = self.flat if flat is None else flat
        return {name: flat[:, offset:offset + numel].view(self.runs, *shape)
                for name, offset, numel, shape in self.layout}

    def run_state(self, run: int) -> dict[str, torch.Tensor]:
        """Run ``run``'s trainable parameters (copies, name -> shape), e.g. for ``model.load_state_dict(...,
        strict=False)``."""
        if not 0 <= run < self.runs:
            raise ValueError(f"run must be in [0, {self.runs}), got {run}")
        return {name: view[run].detach().clone() for name, view in self.parameters().items()}

    def run_model(self, run: int) -> nn.Module:
        """A copy of the template holding run ``run``'s parameters (for evaluation tools that take a module)."""
        model = copy.deepcopy(self.template)
        model.load_state_dict(self.run_state(run), strict=False)
        return model

    def freeze(self, runs: torch.Tensor) -> None:
        """Stop training the runs where ``runs`` (R,) is true: their learning rate becomes 0 from now on."""
        self.active.masked_fill_(runs.to(self.device, torch.bool), 0.0)

    # ------------------------------------------------------------------------------------------------ the step

    def _forward_fn(self, params: dict) -> Callable:
        return lambda **inputs: functional_call(self.template, params, (), inputs)

    def losses_and_grads(self, loss_fn: Callable, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-run losses (R,) and gradients (R, P) of ``loss_fn(forward, run_batch)`` (a scalar), where
        ``forward(**inputs)`` calls the template with the run's parameters and ``run_batch`` is ``batch`` without
        its run dim."""
        def one_run(params, run_batch):
            return loss_fn(self._forward_fn(params), run_batch)

        grads, losses = vmap(grad_and_value(one_run))(self.parameters(), batch)
        return losses.detach(), torch.cat([grads[name].reshape(self.runs, -1) for name, *_ in self.layout], 1)

    @torch.no_grad()
    def apply_gradients(self, grads: torch.Tensor, lr_factor: float | torch.Tensor) -> None:
        """One clipped AdamW step of every run with learning rate ``peak_lr * lr_factor`` (frozen runs: 0).
        ``grads`` (R, P) may be modified in place."""
        beta1, beta2 = self.betas
        self.step_count += 1
        if self.max_grad_norm is not None:
            # clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1, per run
            norms = torch.linalg.vector_norm(grads, dim=1, keepdim=True)
            grads.mul_((self.max_grad_norm / (norms + 1e-6)).clamp_(max=1.0))
        lr = self.peak_lr * (lr_factor * self.active[:, None])
        if self.weight_decay is not None:
            self.flat.mul_(1 - lr * self.weight_decay)
        self.exp_avg.lerp_(grads, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
        bias_correction1 = (1 - beta1 ** self.step_count).to(self.dtype)
        bias_correction2_sqrt = (1 - beta2 ** self.step_count).sqrt().to(self.dtype)
        denom = (self.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        self.flat.sub_(lr / bias_correction1 * self.exp_avg / denom)

    def _step(self, loss_fn: Callable, batch: Batch, lr_factor: float | torch.Tensor) -> torch.Tensor:
        losses, grads = self.losses_and_grads(loss_fn, batch)
        self.apply_gradients(grads, lr_factor)
        return losses

    def train_step(self, loss_fn: Callable, batch: Batch, lr_factor: float | torch.Tensor = 1.0) -> torch.Tensor:
        """One optimizer step of every run; returns the per-run losses (R,) before the step (no host sync)."""
        if self.cuda_graphs:
            return self._graphed_step(loss_fn, batch, lr_factor)
        if self.compile_step:
            if loss_fn not in self._compiled:
                self._compiled[loss_fn] = torch.compile(lambda batch, factor: self._step(loss_fn, batch, factor))
            factor = torch.as_tensor(lr_factor, dtype=torch.float64).to(self.device)
            return self._compiled[loss_fn](batch, factor)
        return self._step(loss_fn, batch, lr_factor)

    @torch.no_grad()
    def evaluate(self, fn: Callable, batch: Batch):
        """``fn(forward, run_batch)`` for every run under vmap (no gradients); outputs carry the run dim."""
        return vmap(lambda params, run_batch: fn(self._forward_fn(params), run_batch))(self.parameters(), batch)

    # ------------------------------------------------------------------------------------------------ CUDA graphs

    def _state_tensors(self) -> list[torch.Tensor]:
        return [self.flat, self.exp_avg, self.exp_avg_sq, self.step_count]

    def _graphed_step(self, loss_fn: Callable, batch: Batch, lr_factor) -> torch.Tensor:
        # one graph per batch shape; the loss function is assumed to be the same on every call
        leaves, spec = torch.utils._pytree.tree_flatten(batch)
        key = (spec, tuple((tuple(t.shape), t.dtype) for t in leaves))
        factor = (lr_factor.to(self.dtype) if torch.is_tensor(lr_factor)
                  else torch.empty((), dtype=self.dtype, device=self.device).fill_(float(lr_factor)))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(loss_fn, leaves, spec, factor)
            self._graphs[key] = entry
            if entry is None:
                return self.train_step(loss_fn, batch, lr_factor)  # capture failed: cuda_graphs is now False
            return entry["losses"].clone()
        graph, static_leaves, static_factor, losses = entry["graph"], entry["leaves"], entry["factor"], entry["losses"]
        for static, leaf in zip(static_leaves, leaves):
            static.copy_(leaf, non_blocking=True)
        static_factor.copy_(factor)  # a device-to-device copy: no host sync
        graph.replay()
        return losses.clone()

    def _capture(self, loss_fn, leaves, spec, factor) -> Optional[dict]:
        """Record one step in a CUDA graph and check its first replay against an eager step from the same state.
        Returns the graph's entry, or None after falling back to eager steps (``graph_status`` says why)."""
        start = [t.clone() for t in self._state_tensors()]
        static_leaves = [leaf.clone() for leaf in leaves]
        static_factor = factor.clone()
        static_batch = torch.utils._pytree.tree_unflatten(static_leaves, spec)

        def restore(state):
            for live, saved in zip(self._state_tensors(), state):
                live.copy_(saved)

        def step() -> torch.Tensor:
            return self._step(loss_fn, static_batch, static_factor)

        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up on a side stream (lazy inits), as torch.cuda.graphs' docs ask
                for _ in range(2):
                    restore(start)
                    step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            restore(start)
            expected_losses = step()  # the eager step the graph must reproduce
            expected = [t.clone() for t in self._state_tensors()]
            restore(start)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                losses = step()
            restore(start)
            graph.replay()
            torch.cuda.synchronize(self.device)
            same = all(torch.allclose(got, want, rtol=1e-4, atol=1e-6)
                       for got, want in zip(self._state_tensors() + [losses],
                                            expected + [expected_losses]))
            if not same:
                raise RuntimeError("the first graph replay differs from the eager step")
        except Exception as error:  # any capture problem: eager steps are always correct
            restore(start)
            self.cuda_graphs = False
            self.graph_status = f"eager (CUDA graph fell back: {type(error).__name__}: {str(error).splitlines()[0]})"
            return None
        self.graph_status = "cuda graphs"
        return {"graph": graph, "leaves": static_leaves, "factor": static_factor, "losses": losses}

    # ------------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {"flat": self.flat, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "step_count": self.step_count, "active": self.active,
                "layout": [(name, offset, numel, list(shape)) for name, offset, numel, shape in self.layout]}

    def load_state_dict(self, state: dict) -> None:
        layout = [(name, offset, numel, list(shape)) for name, offset, numel, shape in self.layout]
        if [list(entry) for entry in state["layout"]] != [list(entry) for entry in layout]:
            raise ValueError("load_state_dict: the stored parameter layout differs from this model's")
        for name in ("flat", "exp_avg", "exp_avg_sq", "step_count", "active"):
            getattr(self, name).copy_(state[name])
