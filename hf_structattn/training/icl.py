"""In-context linear regression (paper §4, Garg et al. 2022) -- ``recipes/train_icl.py``.

A prompt is ``x_1, y_1, ..., x_N, y_N`` with ``x ~ N(0, I/d)``, ``w ~ N(0, I)``, ``y = <x, w>`` and ``N = 2d`` by
default; the model predicts every ``y_i`` from the tokens before it and is trained on the MSE over all positions.
Optional curriculum (as in the authors' code): the active dimension and the number of points grow every
``curriculum_interval`` steps; coordinates beyond the active dimension are zero, and x is scaled by the *active*
dimension. Evaluation uses a fixed set of fresh prompts at the full dimension and length, drawn from a random stream
that training never uses (the authors' code evaluated on the current training batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..modeling.configuration_structattn_gpt2 import StructAttnGPT2Config
from .args import ConfigError, arg, model_args_dataclass, parse_recipe_args, run_main
from .clm import GPT2_FIELD_HELP, gpt2_config_fields
from .data import step_generator
from .loop import CommonArgs, build_optimizer, finish_run, rank_share, start_run, train

TRAIN_STREAM, EVAL_STREAM = 2, 3

DEFAULT_MODEL = dict(n_embd=64, n_layer=3, n_head=4, vocab_size=1, attention="bilinear_mlr",
                     bilinear_mlr_ranks=[8, 4, 2, 2], qk_layernorm=True, qk_norm="rms", resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                     n_positions=None)

ICLModelArgs = model_args_dataclass("ICLModelArgs", StructAttnGPT2Config, DEFAULT_MODEL,
                                    dict(GPT2_FIELD_HELP, n_positions="maximum prompt length in tokens (none: "
                                                                      "2 x n_points)",
                                         icl_input_dim="set from n_dims by the recipe"))


@dataclass
class ICLArgs(CommonArgs):
    output_dir: str = arg("the run's folder; a loadable checkpoint with model card when done",
                          default="outputs/icl")
    n_dims: int = arg("dimension d of x and w", default=8)
    n_points: Optional[int] = arg("(x, y) pairs per prompt (none: 2 x n_dims)", default=None)
    curriculum: bool = arg("grow the active dimension and the number of points during training", default=False)
    curriculum_dims_start: int = arg("active dimension at step 0", default=4)
    curriculum_points_start: int = arg("points at step 0", default=8)
    curriculum_dims_increment: int = arg("active-dimension increase per curriculum update", default=1)
    curriculum_points_increment: int = arg("points increase per curriculum update", default=2)
    curriculum_interval: int = arg("steps between curriculum updates", default=100)
    eval_prompts: int = arg("fixed fresh evaluation prompts (full dimension and length)", default=256)
    learning_rate: float = arg("peak learning rate of AdamW", default=1e-3)
    per_device_batch_size: int = arg("prompts per process per micro-step", default=32)

    def __post_init__(self):
        super().__post_init__()
        for name in ("n_dims", "curriculum_dims_start", "curriculum_points_start", "curriculum_interval",
                     "eval_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("curriculum_dims_increment", "curriculum_points_increment"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.n_points is not None and self.n_points < 1:
            raise ConfigError(f"--n_points must be >= 1 or none, got {self.n_points}")

    def check_model(self) -> None:
        build_model(self, meta=True)


def curriculum_state(args: ICLArgs, step: int) -> tuple[int, int]:
    """(active dims, points) at optimizer step ``step``."""
    n_points = args.n_points or 2 * args.n_dims
    if not args.curriculum:
        return args.n_dims, n_points
    updates = step // max(1, args.curriculum_interval)
    dims = min(args.n_dims, args.curriculum_dims_start + updates * args.curriculum_dims_increment)
    points = min(n_points, args.curriculum_points_start + updates * args.curriculum_points_increment)
    return max(1, dims), max(1, points)


def sample_prompts(generator: torch.Generator, batch: int, n_points: int, n_dims: int,
                   active_dims: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xs (B, N, d) ~ N(0, I/active) on the first ``active`` coordinates (zero beyond), w (B, d) ~ N(0, I),
    ys = xs @ w. Returns (xs, ys, w)."""
    active = n_dims if active_dims is None else active_dims
    xs = torch.randn(batch, n_points, n_dims, generator=generator, dtype=torch.float32) / math.sqrt(active)
    w = torch.randn(batch, n_dims, generator=generator, dtype=torch.float32)
    if active < n_dims:
        xs[..., active:] = 0.0
        w[:, active:] = 0.0
    ys = torch.einsum("bnd,bd->bn", xs, w)
    return xs, ys, w


def train_batch(args: ICLArgs, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole global batch of a step (all ranks, all micro-steps): a pure function of (seed, step)."""
    dims, points = curriculum_state(args, step)
    size = args.per_device_batch_size * world * args.gradient_accumulation_steps
    return sample_prompts(step_generator(args.seed, TRAIN_STREAM, step), size, points, args.n_dims, dims)


def eval_set(args: ICLArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed fresh evaluation prompts at the full dimension and length (a stream training never draws from)."""
    return sample_prompts(step_generator(args.seed, EVAL_STREAM, 0), args.eval_prompts,
                          args.n_points or 2 * args.n_dims, args.n_dims)


def build_model(args: ICLArgs, meta: bool = False):
    """The ICL model of ``args`` (``meta``: only build and validate its config)."""
    from .. import StructAttnGPT2ForInContextRegression

    fields = gpt2_config_fields(args.model)
    n_points = args.n_points or 2 * args.n_dims
    fields["icl_input_dim"] = args.n_dims
    if fields.get("n_positions") is None:
        fields["n_positions"] = 2 * n_points
    if fields["n_positions"] < 2 * n_points:
        raise ConfigError(f"--n_positions {fields['n_positions']} < 2 x n_points = {2 * n_points}")
    if meta:
        return StructAttnGPT2Config(**fields)
    if args.mup:
        from ..mup import mup_config_overrides

        fields.update(mup_config_overrides())
    model = StructAttnGPT2ForInContextRegression(StructAttnGPT2Config(**fields))
    if args.mup:
        from ..mup import mup_init_

        mup_init_(model)
    return model


def loading_snippet(path: str) -> str:
    return f"""import torch
from transformers import AutoModel

path = "{path}"  # this folder, or its Hub id
model = AutoModel.from_pretrained(path, trust_remote_code=True).eval()  # StructAttnGPT2ForInContextRegression
d = model.config.icl_input_dim
xs = torch.randn(1, 2 * d, d) / d ** 0.5; w = torch.randn(d); ys = xs @ w
print(model(xs=xs, ys=ys).predictions[0, -1].item(), ys[0, -1].item())"""


def main(argv=None) -> dict:
    args = parse_recipe_args(ICLArgs, ICLModelArgs, argv, prog="train_icl.py")
    accelerator, checkpoint = start_run(args, "train_icl")
    from ..flops import attention_cost_report, flops_per_token
    from .metrics import load_metric

    model = build_model(args)
    config = model.config
    optimizer = build_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    world, rank = accelerator.num_processes, accelerator.process_index
    device = accelerator.device
    eval_xs, eval_ys, _ = eval_set(args)
    metric = load_metric("icl_mse")
    n_points = args.n_points or 2 * args.n_dims

    def micro_batch_fn(step, micro, rank_, world_):
        xs, ys, _ = train_batch(args, step, world_)
        first = (micro * world_ + rank_) * args.per_device_batch_size
        rows = slice(first, first + args.per_device_batch_size)
        return xs[rows].to(device), ys[rows].to(device)

    def loss_fn(model_, batch):
        xs, ys = batch
        return model_(xs=xs, ys=ys).loss

    def eval_fn(unwrapped) -> dict:
        # each rank predicts every world-th prompt; the sum over ranks is reduced on accelerator.device
        predictions = torch.zeros(eval_ys.shape, device=device)
        index, real = rank_share(eval_ys.shape[0], rank, world)
        for start in range(0, index.numel(), args.per_device_batch_size):
            chunk = index[start:start + args.per_device_batch_size]
            output = unwrapped(xs=eval_xs[chunk].to(device), ys=eval_ys[chunk].to(device)).predictions.float()
            keep = max(0, min(chunk.numel(), real - start))
            predictions[chunk[:keep].to(device)] = output[:keep]
        predictions = accelerator.reduce(predictions, "sum").cpu()
        result = metric.compute(predictions=predictions.tolist(), references=eval_ys.tolist(),
                                input_dim=args.n_dims)
        return {"loss": result["mse"], "mse": result["mse"], "mse_last": result["mse_last"],
                "normalized_mse_last": result["normalized_mse_last"],
                "baseline_zero_mse": float((eval_ys ** 2).mean())}

    size = args.per_device_batch_size * world * args.gradient_accumulation_steps
    tokens_per_step = size * 2 * n_points
    train_flops_per_token = flops_per_token(config, 2 * n_points, training=True)
    result = train(accelerator, args, model, optimizer, micro_batch_fn=micro_batch_fn, loss_fn=loss_fn,
                   eval_fn=eval_fn, tokens_per_step=tokens_per_step, flops_per_token=train_flops_per_token,
                   recipe="train_icl", resume_checkpoint=checkpoint)
    cost = attention_cost_report(config, causal=True, dtype_bytes=4, context_len=2 * n_points)

    def save_outputs(summary: dict, state_dict: dict) -> str:
        from .outputs import write_model_card, write_plots

        out = Path(args.output_dir)
        unwrapped = accelerator.unwrap_model(model)
        # the payload registers only the LM classes; map AutoModel of *this* checkpoint to the ICL head so that
        # save_pretrained copies the code and AutoModel.from_pretrained(..., trust_remote_code=True) returns it
        type(unwrapped).register_for_auto_class("AutoModel")
        unwrapped.save_pretrained(out, state_dict=state_dict)
        write_plots(out, loss_key="train/loss", eval_key="eval/loss")
        variant = "+".join(config.layer_attention(i) for i in range(config.n_layer)) \
            if len(set(config.layer_types)) > 1 else config.attention
        write_model_card(
            out, args, recipe="train_icl", title=f"StructAttn GPT-2 ({variant}) for in-context linear regression",
            summary=(f"In-context linear regression in d = {args.n_dims} with N = {n_points} points per prompt "
                     f"(Kuang et al., ICML 2025, §4): {config.n_layer} layers, width {config.n_embd}, "
                     f"{config.n_head} heads, `{variant}` attention, trained {result.step} steps with "
                     f"`recipes/train_icl.py` of hf_structattn. Evaluation: {args.eval_prompts} fresh prompts "
                     "never seen in training; `mse_last` is the error at the last position."),
            config=config.to_dict(), pipeline_tag="feature-extraction", dataset_type="synthetic",
            data=(f"Synthetic in-context linear regression: x ~ N(0, I/{args.n_dims}), w ~ N(0, I), y = <x, w>, "
                  f"noiseless; curriculum {'on' if args.curriculum else 'off'}."),
            eval_results=[("regression", "mse", "MSE on fresh prompts", summary.get("eval_mse"))],
            metrics={k: v for k, v in summary.items() if k.startswith("eval_") or k in ("step", "train_seconds")},
            usage=loading_snippet(args.hub_model_id or "path/to/this/folder"), cost_markdown=cost.to_markdown(),
            flops_per_token=train_flops_per_token, tags=("in-context-learning",))
        return cost.to_markdown()

    return finish_run(accelerator, args, model, result, dict(flops_per_token=train_flops_per_token,
                                                      tokens_per_step=tokens_per_step), save_outputs)


if __name__ == "__main__":
    run_main(main, "train_icl.py")
