"""Causal LM pre-training of ``StructAttnGPT2LMHeadModel`` (any attention variant) -- ``recipes/train_clm.py``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..modeling.configuration_structattn_gpt2 import StructAttnGPT2Config
from .args import ConfigError, arg, model_args_dataclass, parse_recipe_args, run_main
from .loop import CommonArgs, build_optimizer, finish_run, rank_share, start_run, train

DEFAULT_MODEL = dict(vocab_size=257, n_positions=256, n_embd=128, n_layer=4, n_head=2, attention="mlr",
                     mlr_ranks=[32, 8, 6, 4, 4, 4, 4, 2], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=256, eos_token_id=256, pad_token_id=256)

# --help text of the GPT-2 fields that StructAttnGPT2Config's docstring does not describe
GPT2_FIELD_HELP = dict(
    vocab_size="vocabulary size (257 = bytes + <|endoftext|> for the byte tokenizer)",
    n_positions="maximum sequence length; MLR block sizes default to n_positions / 2^(l-1)",
    n_embd="model width", n_layer="number of transformer blocks", n_head="attention heads (head dim = n_embd / n_head)",
    n_inner="MLP hidden width (none: 4 x n_embd)", activation_function="MLP activation (transformers ACT2FN name)",
    resid_pdrop="dropout after attention and MLP", embd_pdrop="dropout of the embeddings",
    layer_norm_epsilon="LayerNorm epsilon", initializer_range="std of the normal weight init",
    scale_attn_weights="scale dense attention scores by 1/sqrt(head dim)", use_cache="return a cache from forward",
    bos_token_id="beginning-of-sequence token id", eos_token_id="end-of-sequence token id",
    pad_token_id="padding token id", tie_word_embeddings="tie the LM head to the token embedding",
    mlr_scaling="standard, mup, or per-level floats like 0.2,0.3")

CLMModelArgs = model_args_dataclass("CLMModelArgs", StructAttnGPT2Config, DEFAULT_MODEL, GPT2_FIELD_HELP)


def gpt2_config_fields(model: dict) -> dict:
    """The model dict as StructAttnGPT2Config keywords (``mlr_scaling`` "0.2,0.3" -> floats)."""
    fields = dict(model)
    scaling = fields.get("mlr_scaling")
    if isinstance(scaling, str) and scaling not in ("standard", "mup"):
        try:
            values = [float(v) for v in scaling.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"mlr_scaling={scaling!r} is not standard, mup or per-level floats") from None
        fields["mlr_scaling"] = values if len(values) > 1 else values[0]
    return fields


@dataclass
class CLMArgs(CommonArgs):
    PATH_FIELDS = ("text_files",)  # published as file names only (public_configuration)

    output_dir: str = arg("the run's folder; a loadable checkpoint with model card when done",
                            default="outputs/clm")
    text_files: Optional[list[str]] = arg("local text files (datasets' text loader, one document per file) "
                                            "instead of the standard library", default=None)
    dataset_name: Optional[str] = arg("a datasets Hub dataset (needs the network; never used by default)",
                                        default=None)
    dataset_config: Optional[str] = arg("its configuration name", default=None)
    text_column: str = arg("its text column", default="text")
    validation_percent: float = arg("percent of documents held out (split by sha1 of their name)", default=5.0)
    max_train_bytes: Optional[int] = arg("cap on training bytes (none: all)", default=8_000_000)
    max_validation_bytes: Optional[int] = arg("cap on validation bytes (none: all)", default=1_000_000)
    seq_len: Optional[int] = arg("training window length (none: n_positions)", default=None)
    eval_windows: int = arg("validation windows of seq_len tokens per evaluation", default=64)
    sample_prompt: str = arg("prompt of the sample generated after training", default="def ")
    sample_new_tokens: int = arg("tokens sampled after training with the hierarchical key cache (0: none)",
                                   default=160)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.validation_percent < 100:
            raise ConfigError(f"--validation_percent must be in (0, 100), got {self.validation_percent}")
        for name in ("max_train_bytes", "max_validation_bytes", "seq_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1 or none, got {getattr(self, name)}")
        if self.eval_windows < 1:
            raise ConfigError(f"--eval_windows must be >= 1, got {self.eval_windows}")
        if self.sample_new_tokens < 0:
            raise ConfigError(f"--sample_new_tokens must be >= 0, got {self.sample_new_tokens}")
        from .data import check_text_files

        check_text_files(self.text_files)  # exists, not empty, UTF-8

    def check_model(self) -> None:
        config = StructAttnGPT2Config(**gpt2_config_fields(self.model))
        if self.seq_len is not None and self.seq_len > config.n_positions:
            raise ConfigError(f"--seq_len {self.seq_len} exceeds n_positions={config.n_positions}")
        prompt_tokens = len(self.sample_prompt.encode("utf-8"))  # byte tokenizer: one token per UTF-8 byte
        if self.sample_new_tokens and prompt_tokens + self.sample_new_tokens > config.n_positions:
            raise ConfigError(f"--sample_new_tokens {self.sample_new_tokens} + the {prompt_tokens}-token "
                              f"--sample_prompt exceeds n_positions={config.n_positions}")


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

    fields = gpt2_config_fields(args.model)
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
    from ..modeling.structattn_prepare import key_cache_bytes

    model.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    started = time.perf_counter()
    torch.manual_seed(seed)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=20, temperature=0.8,
                         pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
    seconds = time.perf_counter() - started
    cache, out = out.cache, out.sequences
    config = model.config
    cached_tokens = int(cache.get_seq_length())
    itemsize = next(model.parameters()).element_size()
    head_dim = config.n_embd // config.n_head
    dense = out.shape[0] * config.n_layer * config.n_head * cached_tokens * head_dim * itemsize
    measured = key_cache_bytes(cache)
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
    args = parse_recipe_args(CLMArgs, CLMModelArgs, argv, prog="train_clm.py")
    accelerator, checkpoint = start_run(args, "train_clm")
    from ..flops import attention_cost_report, flops_per_token
    from ..tokenization import build_byte_tokenizer
    from .data import eval_windows, lm_micro_batch
    from .metrics import load_metric

    corpus = load_corpus(args)
    model = build_model(args)
    config = model.config
    seq_len = args.seq_len or config.n_positions
    accelerator.print(f"data: {corpus.description}: {corpus.train.numel():,} train / "
                      f"{corpus.validation.numel():,} validation tokens")
    optimizer = build_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)

    windows = eval_windows(corpus.validation, seq_len, args.eval_windows)
    metric = load_metric("bits_per_byte")
    world, rank = accelerator.num_processes, accelerator.process_index
    device = accelerator.device

    def micro_batch_fn(step, micro, rank_, world_):
        return lm_micro_batch(corpus.train, seq_len, step, micro, rank_, world_, args.per_device_batch_size,
                              args.gradient_accumulation_steps, args.seed).to(device)

    def loss_fn(model_, ids):
        return model_(input_ids=ids, labels=ids, use_cache=False).loss

    def eval_fn(unwrapped) -> dict:
        # each rank scores every world-th window; the sums are reduced on accelerator.device
        index, real = rank_share(windows.shape[0], rank, world)
        nll = torch.zeros(windows.shape[0], dtype=torch.float64, device=device)
        nbytes = torch.zeros(windows.shape[0], dtype=torch.long, device=device)
        mine_nll, mine_bytes = window_nll(unwrapped, windows[index].to(device), args.per_device_batch_size)
        mine = index[:real].to(device)
        nll[mine], nbytes[mine] = mine_nll[:real], mine_bytes[:real]
        nll, nbytes = accelerator.reduce(nll, "sum").cpu(), accelerator.reduce(nbytes, "sum").cpu()
        result = metric.compute(nll_sum=nll.tolist(), num_bytes=nbytes.tolist())
        tokens = windows.shape[0] * (seq_len - 1)
        return {"loss": float(nll.sum()) / tokens, "bits_per_byte": result["bits_per_byte"]}

    tokens_per_step = args.per_device_batch_size * world * args.gradient_accumulation_steps * seq_len
    train_flops_per_token = flops_per_token(config, seq_len, training=True)
    result = train(accelerator, args, model, optimizer, micro_batch_fn=micro_batch_fn, loss_fn=loss_fn,
                   eval_fn=eval_fn, tokens_per_step=tokens_per_step, flops_per_token=train_flops_per_token,
                   recipe="train_clm", resume_checkpoint=checkpoint)
    cost = attention_cost_report(config, dtype_bytes=4, context_len=seq_len)
    summary = dict(flops_per_token=train_flops_per_token, tokens_per_step=tokens_per_step,
                   key_cache_ratio_formula=cost.key_cache_ratio, score_flops_ratio=cost.score_ratio)

    def save_outputs(summary: dict, state_dict: dict) -> str:
        from accelerate.utils import DistributedType

        from .outputs import write_model_card, write_plots

        out = Path(args.output_dir)
        unwrapped = accelerator.unwrap_model(model)
        tokenizer = build_byte_tokenizer()
        tokenizer.model_max_length = config.n_positions  # what the model can attend to, not a tokenizer default
        unwrapped.save_pretrained(out, state_dict=state_dict)
        tokenizer.save_pretrained(out)
        if accelerator.distributed_type == DistributedType.FSDP:  # a sharded model cannot generate on one rank
            unwrapped = type(unwrapped).from_pretrained(out)
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
        write_plots(out, loss_key="train/loss", eval_key="eval/loss")
        variant = "+".join(config.layer_attention(i) for i in range(config.n_layer)) \
            if len(set(config.layer_types)) > 1 else config.attention
        write_model_card(
            out, args, recipe="train_clm", title=f"StructAttn GPT-2 ({variant}) causal LM",
            summary=(f"A {config.n_layer}-layer, width-{config.n_embd} GPT-2-style byte-level language model with "
                     f"`{variant}` attention (Kuang et al., ICML 2025, *Customizing the Inductive Biases of Softmax "
                     f"Attention using Structured Matrices*), trained for {result.step} steps "
                     f"({result.step * tokens_per_step:,} tokens) with `recipes/train_clm.py` of hf_structattn."),
            config=config.to_dict(), data=corpus.description, pipeline_tag="text-generation",
            datasets=[args.dataset_name] if args.dataset_name else None,
            eval_results=[("text-generation", "bits_per_byte", "validation bits per byte",
                           summary.get("eval_bits_per_byte"))],
            metrics={k: v for k, v in summary.items() if k.startswith("eval_") or k in ("step", "train_seconds")},
            usage=loading_snippet(args.hub_model_id or "path/to/this/folder", args.sample_prompt),
            cost_markdown=cost.to_markdown(), flops_per_token=train_flops_per_token, extra_sections=sections)
        return cost.to_markdown()

    return finish_run(accelerator, args, model, result, summary, save_outputs)


if __name__ == "__main__":
    run_main(main, "train_clm.py")
