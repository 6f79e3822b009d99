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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from transformers import T5Config

from ..flops import encoder_decoder_flops
from .args import ConfigError, arg, model_args_dataclass, parse_recipe_args, run_main
from .loop import CommonArgs, build_optimizer, finish_run, start_run, train

TINY_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               feed_forward_proj="relu", dropout_rate=0.1, initializer_factor=0.05)
TINY_CHRONOS = dict(tokenizer_class="MeanScaleUniformBins", tokenizer_kwargs=dict(low_limit=-15.0, high_limit=15.0),
                    n_tokens=64, n_special_tokens=2, pad_token_id=0, eos_token_id=1, use_eos_token=True,
                    model_type="seq2seq", context_length=64, prediction_length=16, num_samples=8, temperature=1.0,
                    top_k=50, top_p=1.0)


ChronosModelArgs = model_args_dataclass(
    "ChronosModelArgs", T5Config, TINY_T5, {},
    extra=[("chronos_config", dict, {}, "overrides of the tiny model's chronos_config, e.g. '{context_length: 512, "
                                        "prediction_length: 32, n_tokens: 1024}'")],
    exclude=("vocab_size", "pad_token_id", "eos_token_id", "use_cache", "is_encoder_decoder", "is_decoder",
             "classifier_dropout", "decoder_start_token_id"))
ChronosModelArgs._argument_group_name = ("model (T5Config fields of the tiny Chronos-T5 built when no --checkpoint "
                                         "is given; also under 'model:' in a config file)")
PATCH_INITS = ("split", "svd")


@dataclass
class ChronosArgs(CommonArgs):
    PATH_FIELDS = ("checkpoint",)  # published as a folder name only (public_configuration)

    output_dir: str = arg("the run's folder; a loadable checkpoint with model card when done",
                          default="outputs/chronos")
    checkpoint: Optional[str] = arg("local Chronos-T5 folder to patch (none: build a tiny one from the model "
                                    "fields)", default=None)
    attention: str = arg("mlr (patched) or dense (stock T5 attention, not patched: the baseline)", default="mlr")
    targets: list[str] = arg("attention roles to patch: encoder_self, decoder_self, decoder_cross",
                             default_factory=lambda: ["encoder_self", "decoder_self"])
    init: str = arg("level split of pretrained q/k: split (first dims) or svd (strongest directions global)",
                    default="split")
    mlr_ranks: Optional[list[int]] = arg("per-level ranks summing to d_kv (none: d_kv split in two levels)",
                                         default=None)
    mlr_block_sizes: Optional[list[int]] = arg("block sizes of levels 2..L (none: dyadic from the context "
                                               "length)", default=None)
    mlr_scaling: Optional[str] = arg("standard or mup (none: the patch default)", default=None)
    mlr_average_levels: Optional[bool] = arg("divide each logit by its number of shared levels (none: patch "
                                             "default)", default=None)
    synthetic_series: int = arg("KernelSynth-style GP training series", default=128)
    synthetic_eval_series: int = arg("held-out GP series for evaluation", default=16)
    series_length: Optional[int] = arg("GP training series length (none: 2 x (context + horizon))", default=None)
    eval_context_length: Optional[int] = arg("history kept for held-out windows (none: the model's context)",
                                             default=None)
    real_eval_windows: int = arg("held-out consecutive horizons at the end of each real series", default=1)
    real_datasets: list[str] = arg("statsmodels series: sunspots, co2, nile, elnino, macrodata",
                                   default_factory=lambda: ["sunspots", "co2", "nile", "elnino", "macrodata"])
    quantile_levels: list[float] = arg("quantile levels of the WQL metric",
                                       default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    eval_num_samples: int = arg("forecast samples per series in evaluation", default=20)
    learning_rate: float = arg("peak learning rate of AdamW", default=1e-3)
    per_device_batch_size: int = arg("windows per process per micro-step", default=16)

    def __post_init__(self):
        super().__post_init__()
        from .timeseries import REAL_DATASETS

        if self.attention not in ("mlr", "dense"):
            raise ConfigError(f"--attention {self.attention!r}: the Chronos recipe trains mlr (patched) or dense")
        if self.init not in PATCH_INITS:
            raise ConfigError(f"--init {self.init!r} is not one of {', '.join(PATCH_INITS)}")
        roles = ("encoder_self", "decoder_self", "decoder_cross")
        if not self.targets or any(t not in roles for t in self.targets):
            raise ConfigError(f"--targets {','.join(self.targets)!r}: name some of {', '.join(roles)}")
        unknown = [name for name in self.real_datasets if name not in REAL_DATASETS]
        if unknown:
            raise ConfigError(f"--real_datasets: unknown {', '.join(unknown)}; expected some of "
                              f"{', '.join(REAL_DATASETS)}")
        if not all(0 < q < 1 for q in self.quantile_levels) or not self.quantile_levels:
            raise ConfigError(f"--quantile_levels must lie in (0, 1), got {self.quantile_levels}")
        for name in ("synthetic_series", "synthetic_eval_series", "real_eval_windows", "eval_num_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint is not None and not (Path(self.checkpoint) / "config.json").is_file():
            raise ConfigError(f"--checkpoint {self.checkpoint}: not a model folder (no config.json)")

    def check_model(self) -> None:
        """Model fields only shape the built tiny model; the MLR ranks must fit its (or the checkpoint's) d_kv."""
        from ..modeling.structattn_config_rules import default_block_sizes, validate_mlr_geometry

        defaults = {f.name: getattr(ChronosModelArgs(), f.name) for f in dataclasses.fields(ChronosModelArgs)}
        if self.checkpoint is not None:
            changed = sorted(k for k, v in self.model.items() if v != defaults[k])
            if changed:
                raise ConfigError(f"model fields {', '.join(changed)} only shape the tiny model built without "
                                  f"--checkpoint; {self.checkpoint} brings its own configuration")
            import json

            stored = json.loads((Path(self.checkpoint) / "config.json").read_text())
            d_kv, context = stored["d_kv"], stored.get("chronos_config", {}).get("context_length", 512)
        else:
            chronos_config = dict(TINY_CHRONOS, **self.model["chronos_config"])
            T5Config(**{k: v for k, v in self.model.items() if k != "chronos_config"})
            d_kv, context = self.model["d_kv"], chronos_config["context_length"]
        if self.attention == "mlr":
            ranks = self.mlr_ranks or default_ranks(d_kv)
            try:
                blocks = self.mlr_block_sizes or default_block_sizes(context, len(ranks))
                validate_mlr_geometry(ranks, blocks, d_kv, "mlr_ranks", "mlr_block_sizes")
            except ValueError as error:
                raise ConfigError(f"--mlr_ranks/--mlr_block_sizes for d_kv={d_kv}, context {context}: "
                                  f"{str(error).splitlines()[0]}") from None


def _no_attention_dropout_in_mlr_layers(model) -> float:
    """Set the attention-weight dropout of ``model``'s MLR attention modules to 0 when they run the fused op (which
    cannot drop weights and would warn at every run); returns the configured rate that was turned off (0.0: none)."""
    from ..modeling.structattn_attention import mlr_geometry_of

    if model.config._attn_implementation == "eager":
        return 0.0
    rates = set()
    for module in model.modules():
        if mlr_geometry_of(module) is not None and isinstance(getattr(module, "dropout", None), float) and \
                module.dropout > 0:
            rates.add(module.dropout)
            module.dropout = 0.0
    return max(rates, default=0.0)


def build_tiny_chronos(path: str | Path, overrides: Optional[dict] = None, seed: int = 0) -> Path:
    """Save a randomly initialised tiny Chronos-T5 (hf_integration.md §5) to ``path``; returns it."""
    from transformers import T5Config, T5ForConditionalGeneration

    overrides = dict(overrides or {})
    chronos_config = dict(TINY_CHRONOS)
    chronos_config.update(overrides.pop("chronos_config", {}) or {})
    fields = dict(TINY_T5)
    fields.update(overrides)
    fields.pop("vocab_size", None)
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
    args = parse_recipe_args(ChronosArgs, ChronosModelArgs, argv, prog="finetune_chronos.py")
    try:
        from chronos import ChronosPipeline
    except ImportError as error:  # pragma: no cover
        raise ImportError("finetune_chronos needs chronos-forecasting: pip install 'hf-structattn[chronos]'") from error
    from .. import patch as structattn_patch
    from ..patching import patch_report
    from . import timeseries
    from .data import step_generator
    from .metrics import load_metric

    accelerator, checkpoint = start_run(args, "finetune_chronos")
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
    dropped = _no_attention_dropout_in_mlr_layers(model)
    if dropped:
        accelerator.print(f"attention dropout: {dropped} in the config, off in the {args.attention} layers (their "
                          f"fused kernels do not drop attention weights); every other dropout unchanged")
    set_eval_config = dict(num_samples=args.eval_num_samples)
    optimizer = build_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
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
        batch = tokenize(pipe, torch.from_numpy(windows[first:first + args.per_device_batch_size]), context_length)
        return {k: v.to(accelerator.device) for k, v in batch.items()}

    def loss_fn(model_, batch):
        return model_(**batch).loss

    def eval_fn(unwrapped) -> dict:
        loss = float(unwrapped(**{k: v.to(accelerator.device) for k, v in eval_tokens.items()}).loss)
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
                   recipe="finetune_chronos", resume_checkpoint=checkpoint)
    summary = {f"patch_{k}": v for k, v in moved.items() if isinstance(v, (int, float))}
    summary.update(flops_per_token=flops_per_token, flops_per_window=flops_per_window,
                   tokens_per_step=tokens_per_step,
                   context_length=context_length, prediction_length=prediction_length, attention=args.attention)
    flops_line = (f"Training FLOPs per window of {encoder_len} encoder + {decoder_len} decoder tokens "
                  f"(`hf_structattn.flops.encoder_decoder_flops`): {flops_per_window:,.0f}")

    def save_outputs(summary: dict, state_dict: dict) -> str:
        from .outputs import write_model_card, write_plots

        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(out, state_dict=state_dict)
        write_plots(out, loss_key="train/loss", eval_key="eval/loss")
        path = args.hub_model_id or "path/to/this/folder"
        base = f"`{Path(args.checkpoint).name}`" if args.checkpoint else "tiny, built locally"
        write_model_card(
            out, args, recipe="finetune_chronos", title=f"Chronos-T5 with {args.attention} attention (hf_structattn)",
            summary=(f"A Chronos-T5 ({base})"
                     + (" with its stock dense T5 attention (the baseline)" if args.attention == "dense" else
                        f" whose {', '.join(args.targets)} attention was converted by `hf_structattn.patch` "
                        f"(init `{args.init}`, ranks {fields['mlr_ranks']})")
                     + f", fine-tuned {result.step} steps with `recipes/finetune_chronos.py`. Context "
                       f"{context_length}, horizon {prediction_length}."),
            config=unwrapped.config.to_dict(), data=task.description, pipeline_tag="time-series-forecasting",
            dataset_type="time-series",
            eval_results=[("time-series-forecasting", "wql", "WQL on held-out series", summary.get("eval_wql")),
                          ("time-series-forecasting", "mase", "MASE on held-out series", summary.get("eval_mase"))],
            metrics={k: v for k, v in summary.items() if k.startswith(("eval_", "patch_")) or
                     k in ("step", "train_seconds")},
            usage=f"""import torch
from chronos import ChronosPipeline

pipe = ChronosPipeline.from_pretrained("{path}", trust_remote_code=True)  # hf_structattn need not be installed
quantiles, mean = pipe.predict_quantiles([torch.randn(100).cumsum(0)], prediction_length={prediction_length},
                                         quantile_levels=[0.1, 0.5, 0.9])""",
            cost_markdown=flops_line, tags=("chronos", "time-series-forecasting"))
        return flops_line

    return finish_run(accelerator, args, model, result, summary, save_outputs)


if __name__ == "__main__":
    run_main(main, "finetune_chronos.py")
