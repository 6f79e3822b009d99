"""Causal LM pre-training of ``StructAttnGPT2LMHeadModel`` (any attention variant) -- ``recipes/train_clm.py``."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .args import parse_recipe_args
from .loop import CommonArgs, build_optimizer, finish_run, make_accelerator, train

DEFAULT_MODEL = dict(vocab_size=257, n_positions=256, n_embd=128, n_layer=4, n_head=2, attention="mlr",
                     mlr_ranks=[32, 8, 6, 4, 4, 4, 4, 2], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=256, eos_token_id=256, pad_token_id=256)


@dataclass
class CLMArgs(CommonArgs):
    output_dir: str = "outputs/clm"
    text_files: Optional[list[str]] = None     # local text files (datasets' text loader) instead of the stdlib
    dataset_name: Optional[str] = None         # a datasets Hub name (online users only)
    dataset_config: Optional[str] = None
    text_column: str = "text"
    validation_percent: float = 5.0
    max_train_bytes: Optional[int] = 8_000_000
    max_validation_bytes: Optional[int] = 1_000_000
    seq_len: Optional[int] = None               # default: n_positions
    eval_windows: int = 64                      # validation windows of seq_len tokens per evaluation
    sample_prompt: str = "def "
    sample_new_tokens: int = 160                # generated with the hierarchical key cache after training
    model: dict = field(default_factory=lambda: dict(DEFAULT_MODEL))


def model_config_fields() -> set[str]:
    from ..modeling.configuration_structattn_gpt2 import StructAttnGPT2Config

    return {f.name for f in dataclasses.fields(StructAttnGPT2Config)}


def load_corpus(args: CLMArgs):
    from . import data

    common = dict(validation_percent=args.validation_percent, max_train_bytes=args.max_train_bytes,
                  max_validation_bytes=args.max_validation_bytes)
    if args.dataset_name:
        return data.load_hub_corpus(args.dataset_name, args.dataset_config, args.text_column, **common)
    if args.text_files:
        return data.load_text_files_corpus(args.text_files, **common)
    return data.load_stdlib_corpus(**common)


def build_model(args: CLMArgs):
    from .. import StructAttnGPT2Config, StructAttnGPT2LMHeadModel

    fields = dict(args.model)
    if args.mup:
        from ..mup import mup_config_overrides

        fields.update(mup_config_overrides())
    config = StructAttnGPT2Config(**fields)
    model = StructAttnGPT2LMHeadModel(config)
    if args.mup:
        from ..mup import mup_init_

        mup_init_(model)
    return model


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window summed NLL (nats) of tokens 1..T-1 and the number of byte tokens among them."""
    nll, nbytes = [], []
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start:start + batch_size]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        targets = ids[:, 1:]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        nll.append(losses.sum(dim=1).double())
        nbytes.append((targets < 256).sum(dim=1))
    return torch.cat(nll), torch.cat(nbytes)


@torch.no_grad()
def generate_with_key_cache(model, tokenizer, prompt: str, max_new_tokens: int, seed: int = 0) -> dict:
    """Top-k sample (k=20, temperature 0.8, seeded) through the model's hierarchical key cache; returns text and measured cache bytes, next to
    the bytes a dense cache (every key at full head dim) would hold for the same tokens."""
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    cache = model.transformer.new_cache() if hasattr(model, "transformer") else None
    started = time.perf_counter()
    torch.manual_seed(seed)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=20, temperature=0.8,
                         cache=cache, pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - started
    config = model.config
    cached_tokens = cache.get_seq_length()
    itemsize = next(model.parameters()).element_size()
    head_dim = config.n_embd // config.n_head
    dense = out.shape[0] * config.n_layer * config.n_head * cached_tokens * head_dim * itemsize
    measured = cache.key_cache_bytes()
    return {"text": tokenizer.decode(out[0], skip_special_tokens=False), "cached_tokens": cached_tokens,
            "key_cache_bytes": measured, "dense_key_cache_bytes": dense, "key_cache_ratio": measured / dense,
            "generation_seconds": seconds}


def loading_snippet(path_hint: str, prompt: str = "def ") -> str:
    return f"""from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{path_hint}"  # this folder, or its Hub id
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)  # hf_structattn need not be installed
ids = tokenizer({prompt!r}, return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=100, do_sample=False)[0]))"""


def main(argv=None) -> dict:
    args = parse_recipe_args(CLMArgs, argv, model_config_fields())
    run_name = args.run_name or "train_clm"
    accelerator = make_accelerator(args, run_name)
    from ..flops import attention_cost_report, flops_per_token
    from ..tokenization import build_byte_tokenizer
    from .metrics import load_metric

    corpus = load_corpus(args)
    model = build_model(args)
    config = model.config
    seq_len = args.seq_len or config.n_positions
    if seq_len > config.n_positions:
        raise ValueError(f"seq_len={seq_len} exceeds n_positions={config.n_positions}")
    accelerator.print(f"data: {corpus.description}: {corpus.train.numel():,} train / "
                      f"{corpus.validation.numel():,} validation tokens")
    optimizer = build_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers(run_name, config={k: v for k, v in dataclasses.asdict(args).items()})

    from .data import eval_windows, lm_micro_batch

    windows = eval_windows(corpus.validation, seq_len, args.eval_windows)
    metric = load_metric("bits_per_byte")
    world, rank = accelerator.num_processes, accelerator.process_index

    def micro_batch_fn(step, micro, rank_, world_):
        return lm_micro_batch(corpus.train, seq_len, step, micro, rank_, world_, args.per_device_batch_size,
                              args.gradient_accumulation_steps, args.seed)

    def loss_fn(model_, ids):
        return model_(input_ids=ids, labels=ids, use_cache=False).loss

    def eval_fn(unwrapped) -> dict:
        index = torch.arange(windows.shape[0])[rank::world]
        nll = torch.zeros(windows.shape[0], dtype=torch.float64)
        nbytes = torch.zeros(windows.shape[0], dtype=torch.long)
        if index.numel():
            nll[index], nbytes[index] = window_nll(unwrapped, windows[index], args.per_device_batch_size)
        nll, nbytes = accelerator.reduce(nll, "sum"), accelerator.reduce(nbytes, "sum")
        result = metric.compute(nll_sum=nll.tolist(), num_bytes=nbytes.tolist())
        tokens = windows.shape[0] * (seq_len - 1)
        return {"loss": float(nll.sum()) / tokens, "bits_per_byte": result["bits_per_byte"]}

    tokens_per_step = args.per_device_batch_size * world * args.gradient_accumulation_steps * seq_len
    train_flops_per_token = flops_per_token(config, seq_len, training=True)
    result = train(accelerator, args, model, optimizer, micro_batch_fn=micro_batch_fn, loss_fn=loss_fn,
                   eval_fn=eval_fn, tokens_per_step=tokens_per_step, flops_per_token=train_flops_per_token,
                   desc="train_clm")
    summary = {"step": result.step, "interrupted": result.interrupted, "train_seconds": result.train_seconds,
               **{f"eval_{k}": v for k, v in result.final_eval.items()}}
    if result.interrupted:
        accelerator.end_training()
        return summary

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        tokenizer = build_byte_tokenizer()
        unwrapped.save_pretrained(out)
        tokenizer.save_pretrained(out)
        cost = attention_cost_report(config, dtype_bytes=4, context_len=seq_len)
        summary.update(flops_per_token=train_flops_per_token, tokens_per_step=tokens_per_step,
                       total_train_flops=result.step * tokens_per_step * train_flops_per_token,
                       key_cache_ratio_formula=cost.key_cache_ratio, score_flops_ratio=cost.score_ratio)
        sections = {}
        if args.sample_new_tokens > 0:
            with torch.random.fork_rng(devices=[]):
                sample = generate_with_key_cache(unwrapped, tokenizer, args.sample_prompt, args.sample_new_tokens,
                                                 seed=args.seed)
            summary.update({f"sample_{k}": v for k, v in sample.items() if k != "text"})
            sections["Sample (top-k 20, temperature 0.8, hierarchical key cache)"] = (
                f"Key cache held {sample['key_cache_bytes']:,} bytes for {sample['cached_tokens']} tokens vs "
                f"{sample['dense_key_cache_bytes']:,} bytes for a dense cache ({sample['key_cache_ratio']:.3f}x).\n\n"
                "```python\n" + sample["text"].replace("```", "'''") + "\n```")
            summary["sample_text"] = sample["text"]
        from .outputs import write_metrics_json, write_model_card, write_plots

        write_metrics_json(out, summary)
        write_plots(out, loss_key="train/loss", eval_key="eval/loss")
        variant = config.attention if not config.attention_layers else "+".join(config.attention_layers)
        write_model_card(
            out, title=f"StructAttn GPT-2 ({variant}) causal LM",
            summary=(f"A {config.n_layer}-layer, width-{config.n_embd} GPT-2-style byte-level language model with "
                     f"`{variant}` attention (Kuang et al., ICML 2025, *Customizing the Inductive Biases of Softmax "
                     f"Attention using Structured Matrices*), trained for {result.step} steps "
                     f"({result.step * tokens_per_step:,} tokens) with `recipes/train_clm.py` of hf_structattn."),
            config=config.to_dict(), data=corpus.description,
            metrics={k: v for k, v in summary.items() if k.startswith("eval_") or k in ("step", "train_seconds")},
            usage=loading_snippet(args.hub_model_id or str(out), args.sample_prompt),
            cost_markdown=cost.to_markdown(), flops_per_token=train_flops_per_token, extra_sections=sections,
            recipe_args=dataclasses.asdict(args))
    return finish_run(accelerator, args, out, summary)


if __name__ == "__main__":
    main()
