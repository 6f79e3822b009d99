"""Fine-tune a Chronos-T5 with structured attention -- ``recipes/finetune_chronos.py``.

1. Load a local Chronos-T5 checkpoint directory (``--checkpoint``), or build a tiny Chronos-T5 from a config
   (``--model`` fields override the T5 config; nothing is ever downloaded).
2. ``hf_structattn.patch`` it (``attention``, ``targets``, ``init`` = split | svd, ``mlr_ranks``,
   ``mlr_block_sizes``) and record how far the patch moved its outputs (``hf_structattn.patch_report``);
   ``attention: dense`` keeps the stock T5 attention (the baseline of the reproduction's experiment 3).
3. Fine-tune on KernelSynth-style GP series + statsmodels' real series (teacher-forced cross-entropy on Chronos
   tokens), evaluate MASE (median forecast) and WQL (quantiles) with the project's ``evaluate`` metrics.
4. Save the patched model (with its payload code) so that ``ChronosPipeline.from_pretrained(dir,
   trust_remote_code=True)`` loads it.

``chronos`` is imported lazily: the rest of the package does not need it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..flops import encoder_decoder_flops
from .args import parse_recipe_args
from .loop import CommonArgs, build_optimizer, finish_run, make_accelerator, train

TINY_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               feed_forward_proj="relu", dropout_rate=0.1, initializer_factor=0.05)
TINY_CHRONOS = dict(tokenizer_class="MeanScaleUniformBins", tokenizer_kwargs=dict(low_limit=-15.0, high_limit=15.0),
                    n_tokens=64, n_special_tokens=2, pad_token_id=0, eos_token_id=1, use_eos_token=True,
                    model_type="seq2seq", context_length=64, prediction_length=16, num_samples=8, temperature=1.0,
                    top_k=50, top_p=1.0)


@dataclass
class ChronosArgs(CommonArgs):
    output_dir: str = "outputs/chronos"
    checkpoint: Optional[str] = None        # local Chronos-T5 folder; None: build a tiny one (TINY_T5 + model)
    attention: str = "mlr"                  # mlr (patched) | dense (stock T5 attention, not patched)
    targets: list[str] = field(default_factory=lambda: ["encoder_self", "decoder_self"])
    init: str = "split"                    # split | svd
    mlr_ranks: Optional[list[int]] = None   # default: an even split of d_kv in two levels
    mlr_block_sizes: Optional[list[int]] = None
    mlr_scaling: Optional[str] = None
    mlr_average_levels: Optional[bool] = None
    synthetic_series: int = 128
    synthetic_eval_series: int = 16
    series_length: Optional[int] = None     # synthetic training series length; default 2 x (context + horizon)
    eval_context_length: Optional[int] = None  # history kept for held-out windows; default the model's context
    real_eval_windows: int = 1              # held-out consecutive horizons at the end of each real series
    real_datasets: list[str] = field(default_factory=lambda: ["sunspots", "co2", "nile", "elnino", "macrodata"])
    quantile_levels: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    eval_num_samples: int = 20
    learning_rate: float = 1e-3
    per_device_batch_size: int = 16
    model: dict = field(default_factory=dict)


def build_tiny_chronos(path: str | Path, overrides: Optional[dict] = None, seed: int = 0) -> Path:
    """Save a randomly initialised tiny Chronos-T5 (hf_integration.md §5) to ``path``; returns it."""
    from transformers import T5Config, T5ForConditionalGeneration

    overrides = dict(overrides or {})
    chronos_config = dict(TINY_CHRONOS)
    chronos_config.update(overrides.pop("chronos_config", {}) or {})
    fields = dict(TINY_T5)
    fields.update(overrides)
    config = T5Config(vocab_size=chronos_config["n_tokens"], pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                      chronos_config=chronos_config, **fields)
    torch.manual_seed(seed)
    T5ForConditionalGeneration(config).save_pretrained(path)
    return Path(path)


def default_ranks(d_kv: int) -> list[int]:
    return [d_kv - d_kv // 2, d_kv // 2] if d_kv >= 2 else [d_kv]


def tokenize(pipe, windows: torch.Tensor, context_length: int) -> dict:
    """Chronos tokens of (B, context_length + prediction_length) windows: input_ids/attention_mask/labels."""
    context, future = windows[:, :context_length], windows[:, context_length:]
    input_ids, attention_mask, scale = pipe.tokenizer.context_input_transform(context)
    labels, labels_mask = pipe.tokenizer.label_input_transform(future, scale)
    labels = labels.clone()
    labels[labels_mask == 0] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def main(argv=None) -> dict:
    args = parse_recipe_args(ChronosArgs, argv, model_fields=set(TINY_T5) | {"chronos_config", "vocab_size"})
    try:
        from chronos import ChronosPipeline
    except ImportError as error:  # pragma: no cover
        raise ImportError("finetune_chronos needs chronos-forecasting: pip install 'hf-structattn[chronos]'") from error
    from .. import patch as structattn_patch
    from ..patching import patch_report
    from . import timeseries
    from .data import step_generator
    from .metrics import load_metric

    run_name = args.run_name or "finetune_chronos"
    accelerator = make_accelerator(args, run_name)
    out = Path(args.output_dir)
    source = args.checkpoint
    if source is None:
        source = out / "base_tiny_chronos_t5"
        if accelerator.is_main_process and not (source / "config.json").exists():
            build_tiny_chronos(source, args.model, seed=args.seed)
        accelerator.wait_for_everyone()
    original = ChronosPipeline.from_pretrained(str(source), device_map="cpu", dtype=torch.float32)
    chronos_config = original.model.config
    context_length, prediction_length = chronos_config.context_length, chronos_config.prediction_length
    t5_config = original.model.model.config
    fields = {"mlr_ranks": args.mlr_ranks or default_ranks(t5_config.d_kv)}
    for name in ("mlr_block_sizes", "mlr_scaling", "mlr_average_levels"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if not args.mlr_block_sizes:
        fields.setdefault("mlr_max_length", context_length)
    task = timeseries.build_task(context_length, prediction_length, args.synthetic_series,
                                 args.synthetic_eval_series, args.real_datasets, args.seed,
                                 series_length=args.series_length, eval_context_length=args.eval_context_length,
                                 real_eval_windows=args.real_eval_windows)
    if args.attention == "dense":
        pipe, moved = original, {}
    else:
        pipe = structattn_patch(original, attention=args.attention, targets=tuple(args.targets), init=args.init,
                                **fields)
        probe = torch.tensor(np.stack([c[-context_length:] for c in task.eval_contexts
                                       if c.size >= context_length][:4]))
        with torch.random.fork_rng(devices=[]):
            moved = patch_report(original, pipe, {"context": probe, "prediction_length": prediction_length})
    del original
    model = pipe.model.model
    set_eval_config = dict(num_samples=args.eval_num_samples)
    optimizer = build_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers(run_name, config=dataclasses.asdict(args))
    world = accelerator.num_processes
    mase, wql = load_metric("mase"), load_metric("wql")
    window = context_length + prediction_length
    eval_windows = torch.tensor(np.stack([np.concatenate([c[-context_length:], t]) for c, t in
                                          zip(task.eval_contexts, task.eval_targets) if c.size >= context_length]))
    eval_tokens = tokenize(pipe, eval_windows, context_length)
    encoder_len, decoder_len = eval_tokens["input_ids"].shape[1], eval_tokens["labels"].shape[1]

    def micro_batch_fn(step, micro, rank, world_):
        size = args.per_device_batch_size * world_ * args.gradient_accumulation_steps
        rng = np.random.default_rng(int(step_generator(args.seed, 4, step).initial_seed()))
        windows = timeseries.sample_windows(task.train_pool, size, window, rng)
        first = (micro * world_ + rank) * args.per_device_batch_size
        return tokenize(pipe, torch.from_numpy(windows[first:first + args.per_device_batch_size]), context_length)

    def loss_fn(model_, batch):
        return model_(**batch).loss

    def eval_fn(unwrapped) -> dict:
        loss = float(unwrapped(**eval_tokens).loss)
        contexts = [torch.from_numpy(c) for c in task.eval_contexts]
        quantiles, _ = pipe.predict_quantiles(contexts, prediction_length=prediction_length,
                                              quantile_levels=args.quantile_levels, **set_eval_config)
        median = quantiles[..., args.quantile_levels.index(0.5)] if 0.5 in args.quantile_levels else \
            quantiles.median(dim=-1).values
        m = mase.compute(predictions=median.tolist(), references=[t.tolist() for t in task.eval_targets],
                         contexts=[c.tolist() for c in task.eval_contexts])
        w = wql.compute(predictions=quantiles.tolist(), references=[t.tolist() for t in task.eval_targets],
                        quantile_levels=args.quantile_levels)
        return {"loss": loss, "mase": m["mase"], "wql": w["wql"]}

    # Exact matmul + attention count of the (possibly MLR) encoder-decoder; "tokens" are encoder + decoder tokens.
    flops_per_window = encoder_decoder_flops(accelerator.unwrap_model(model).config, encoder_len, decoder_len)
    tokens_per_step = args.per_device_batch_size * world * args.gradient_accumulation_steps * (encoder_len +
                                                                                                decoder_len)
    flops_per_token = flops_per_window / (encoder_len + decoder_len)
    result = train(accelerator, args, model, optimizer, micro_batch_fn=micro_batch_fn, loss_fn=loss_fn,
                   eval_fn=eval_fn, tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                   desc="finetune_chronos")
    summary = {"step": result.step, "interrupted": result.interrupted, "train_seconds": result.train_seconds,
               **{f"eval_{k}": v for k, v in result.final_eval.items()},
               **{f"patch_{k}": v for k, v in moved.items() if isinstance(v, (int, float))}}
    if result.interrupted:
        accelerator.end_training()
        return summary
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(out)
        from .outputs import write_metrics_json, write_model_card, write_plots

        summary.update(flops_per_token=flops_per_token, flops_per_window=flops_per_window,
                       tokens_per_step=tokens_per_step, training_flops=result.step * tokens_per_step * flops_per_token,
                       context_length=context_length, prediction_length=prediction_length,
                       attention=args.attention)
        write_metrics_json(out, summary)
        write_plots(out, loss_key="train/loss", eval_key="eval/loss")
        path = args.hub_model_id or str(out)
        write_model_card(
            out, title=f"Chronos-T5 with {args.attention} attention (hf_structattn)",
            summary=(f"A Chronos-T5 ({'`' + str(args.checkpoint) + '`' if args.checkpoint else 'tiny, built locally'})"
                     + (" with its stock dense T5 attention (the baseline)" if args.attention == "dense" else
                        f" whose {', '.join(args.targets)} attention was converted by `hf_structattn.patch` "
                        f"(init `{args.init}`, ranks {fields['mlr_ranks']})")
                     + f", fine-tuned {result.step} steps with `recipes/finetune_chronos.py`. Context "
                       f"{context_length}, horizon {prediction_length}."),
            config=unwrapped.config.to_dict(), data=task.description,
            metrics={k: v for k, v in summary.items() if k.startswith(("eval_", "patch_")) or
                     k in ("step", "train_seconds")},
            usage=f"""import torch
from chronos import ChronosPipeline

pipe = ChronosPipeline.from_pretrained("{path}", trust_remote_code=True)  # hf_structattn need not be installed
quantiles, mean = pipe.predict_quantiles([torch.randn(100).cumsum(0)], prediction_length={prediction_length},
                                         quantile_levels=[0.1, 0.5, 0.9])""",
            cost_markdown=(f"Training FLOPs per window of {encoder_len} encoder + {decoder_len} decoder tokens "
                           f"(`hf_structattn.flops.encoder_decoder_flops`): {flops_per_window:,.0f}"),
            tags=("hf_structattn", "structured-attention", "chronos",
                                                          "time-series-forecasting"),
            recipe_args=dataclasses.asdict(args))
    return finish_run(accelerator, args, out, summary)


if __name__ == "__main__":
    main()
