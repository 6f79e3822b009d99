"""Patch a local transformers decoder to MLR attention and fine-tune it -- ``recipes/finetune_patched.py``.

1. The source: ``--model_path`` (a local checkpoint with its tokenizer), or by default a tiny Llama built here and
   trained dense for ``--pretrain_steps`` on the same corpus (saved to ``OUT/source``: the "pretrained" model).
2. ``hf_structattn.patch`` converts it (``--mlr_ranks``, ``--mlr_block_sizes`` or ``--mlr_max_length``,
   ``--layers``, ``--sliding_window_layers``); the drift before fine-tuning is measured on validation windows
   (``drift_report``: logit differences, top-1 agreement) and as the validation-loss gap to the source.
3. Fine-tuning with accelerate (AdamW, linear warm-up then cosine) on the embedded corpus (the Python standard
   library's sources) or ``--text_files``; the loss gap to the source after it. (The default tiny source is
   itself undertrained, so fine-tuning also continues its training and the gap usually turns negative; for a
   converged checkpoint the gap measures how much of the drift was recovered.)
4. ``OUT/model``: the patched, fine-tuned model saved with its code (loads with ``trust_remote_code=True``), the
   tokenizer and ``metrics.json``; a greedy sample generated through the model's cache.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import set_seed

from . import data

TINY_LLAMA = dict(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=256, eos_token_id=256,
                  pad_token_id=256)


@dataclass
class PatchedFinetuneArgs:
    """Arguments of recipes/finetune_patched.py (``--name value``; lists as ``--mlr_ranks 16 8 8``)."""

    output_dir: str = field(default="outputs/finetune_patched", metadata={"help": "output folder"})
    model_path: Optional[str] = field(default=None, metadata={
        "help": "a local decoder checkpoint (with its tokenizer); default: build and pretrain a tiny Llama"})
    pretrain_steps: int = field(default=300, metadata={"help": "dense pretraining steps of the built tiny Llama"})
    mlr_ranks: list[int] = field(default_factory=lambda: [8, 8, 16], metadata={"help": "MLR level ranks"})
    mlr_block_sizes: Optional[list[int]] = field(default_factory=lambda: [64, 16], metadata={
        "help": "nested blocks b_2..b_L (none: from --mlr_max_length)"})
    mlr_max_length: Optional[int] = field(default=None, metadata={
        "help": "training length for dyadic blocks (default: seq_len when no block sizes are given)"})
    layers: Optional[list[int]] = field(default=None, metadata={"help": "layers to convert (default: all)"})
    sliding_window_layers: str = field(default="refuse", metadata={"help": "refuse | replace"})
    text_files: Optional[list[str]] = field(default=None, metadata={"help": "local text files instead of stdlib"})
    max_train_bytes: int = field(default=4_000_000, metadata={"help": "bytes of training text read"})
    seq_len: int = field(default=256, metadata={"help": "tokens per training window"})
    max_steps: int = field(default=150, metadata={"help": "fine-tuning steps"})
    per_device_batch_size: int = field(default=8, metadata={"help": "windows per step and process"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate (pretraining too)"})
    warmup_steps: int = field(default=20, metadata={"help": "linear warm-up steps"})
    eval_windows: int = field(default=32, metadata={"help": "validation windows of seq_len tokens"})
    sample_new_tokens: int = field(default=64, metadata={"help": "tokens generated after fine-tuning"})
    seed: int = field(default=0, metadata={"help": "initialisation and data order"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "clear a non-empty --output_dir first"})


def _check(args: PatchedFinetuneArgs) -> None:
    for name in ("pretrain_steps", "max_steps", "warmup_steps"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    for name in ("seq_len", "per_device_batch_size", "eval_windows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.learning_rate > 0:
        raise ValueError(f"--learning_rate must be > 0, got {args.learning_rate}")


def load_tokens(args: PatchedFinetuneArgs, tokenizer) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train, validation) token ids of the corpus; byte tokens, re-encoded with ``tokenizer`` when it is not the
    byte tokenizer (a checkpoint's own)."""
    common = dict(validation_percent=5.0, max_train_bytes=args.max_train_bytes, max_validation_bytes=500_000)
    corpus = (data.load_text_files_corpus(args.text_files, **common) if args.text_files
              else data.load_stdlib_corpus(**common))
    if tokenizer is None:
        return corpus.train, corpus.validation, corpus.description

    def encode(tokens: torch.Tensor) -> torch.Tensor:
        text = bytes(tokens[tokens < 256].tolist()).decode("utf-8", errors="replace")
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)

    return encode(corpus.train), encode(corpus.validation), corpus.description


@torch.no_grad()
def validation_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    was_training = model.training
    model.eval()
    losses = [float(model(windows[i:i + batch_size], labels=windows[i:i + batch_size], use_cache=False).loss)
              for i in range(0, windows.shape[0], batch_size)]
    model.train(was_training)
    return sum(losses) / len(losses)


def fit(accelerator: Accelerator, model, tokens: torch.Tensor, args: PatchedFinetuneArgs, steps: int,
        stream: int) -> list[float]:
    """``steps`` AdamW steps (linear warm-up, cosine to 10%) on random windows of ``tokens``; returns the losses."""
    if steps == 0:
        return []
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    losses = []
    for step in range(steps):
        warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
        progress = step / max(1, steps - 1)
        for group in optimizer.param_groups:
            group["lr"] = args.learning_rate * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        batch = data.lm_micro_batch(tokens, args.seq_len, step, 0, accelerator.process_index,
                                    accelerator.num_processes, args.per_device_batch_size, 1,
                                    args.seed * 7 + stream)
        loss = model(batch, labels=batch, use_cache=False).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
        if step % 50 == 0 or step == steps - 1:
            accelerator.print(f"  step {step + 1}/{steps} loss {losses[-1]:.4f}")
    return losses


def source_model(args: PatchedFinetuneArgs, accelerator: Accelerator, out: Path):
    """(source model, tokenizer, train tokens, validation tokens, corpus description)."""
    from ..tokenization import build_byte_tokenizer

    if args.model_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_path)
        except (OSError, ValueError):
            tokenizer = None
        train, validation, description = load_tokens(args, tokenizer)
        if tokenizer is None:
            if model.config.vocab_size < 257:
                raise ValueError(f"{args.model_path} has no tokenizer and vocab_size={model.config.vocab_size} < "
                                 f"257: cannot use the byte tokens of the corpus")
            tokenizer = build_byte_tokenizer()
            # what the model can attend to, not a tokenizer default
            tokenizer.model_max_length = model.config.max_position_embeddings
        return model, tokenizer, train, validation, description
    tokenizer = build_byte_tokenizer()
    tokenizer.model_max_length = TINY_LLAMA["max_position_embeddings"]
    train, validation, description = load_tokens(args, None)
    set_seed(args.seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    accelerator.print(f"pretraining a tiny Llama (dense) for {args.pretrain_steps} steps")
    fit(accelerator, model, train, args, args.pretrain_steps, stream=0)
    model = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        model.save_pretrained(out / "source")
        tokenizer.save_pretrained(out / "source")
    return model.eval(), tokenizer, train, validation, description


def main(argv=None) -> dict:
    parser = transformers.HfArgumentParser(PatchedFinetuneArgs)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    _check(args)
    import hf_structattn
    from ..decoder_patching import drift_report
    from ..flops import decoder_cache_report

    out = Path(args.output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not args.overwrite_output_dir or not out.is_dir():
            raise ValueError(f"--output_dir {out} exists and is not an empty folder; pass --overwrite_output_dir to "
                             f"clear it (a run never continues or mixes with another run)")
    accelerator = Accelerator()
    if args.overwrite_output_dir and out.is_dir() and accelerator.is_main_process:
        shutil.rmtree(out)
    accelerator.wait_for_everyone()
    started = time.perf_counter()
    model, tokenizer, train, validation, description = source_model(args, accelerator, out)
    windows = data.eval_windows(validation, args.seq_len, args.eval_windows)
    blocks = args.mlr_block_sizes
    max_length = args.mlr_max_length if blocks is not None or args.mlr_max_length else args.seq_len
    patched = hf_structattn.patch(model, mlr_ranks=args.mlr_ranks, mlr_block_sizes=blocks,
                                  mlr_max_length=None if blocks is not None else max_length, layers=args.layers,
                                  sliding_window_layers=args.sliding_window_layers)
    drift = drift_report(model.eval(), patched.eval(), windows[:8])
    loss_source = validation_loss(model, windows, args.per_device_batch_size)
    loss_before = validation_loss(patched, windows, args.per_device_batch_size)
    accelerator.print(f"source loss {loss_source:.4f}; patched before fine-tuning {loss_before:.4f} "
                      f"(logit_rel {drift['logit_rel']:.3f}, top-1 agreement {drift['top1_agreement']:.3f})")
    set_seed(args.seed)
    fit(accelerator, patched, train, args, args.max_steps, stream=1)
    patched = accelerator.unwrap_model(patched).eval()
    loss_after = validation_loss(patched, windows, args.per_device_batch_size)
    accelerator.print(f"patched after fine-tuning {loss_after:.4f}; validation-loss gap to the source: "
                      f"{loss_before - loss_source:+.4f} before, {loss_after - loss_source:+.4f} after")

    prompt = tokenizer("def ", return_tensors="pt", add_special_tokens=False).input_ids
    sample = patched.generate(prompt, max_new_tokens=args.sample_new_tokens, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
    context = sample.shape[1]
    metrics = {"corpus": description, "source": args.model_path or "tiny Llama pretrained here",
               "loss_source": loss_source, "loss_patched_before": loss_before, "loss_patched_after": loss_after,
               "loss_gap_before": loss_before - loss_source, "loss_gap_after": loss_after - loss_source,
               "drift": drift,
               "cache": decoder_cache_report(patched.config, context, dtype_bytes=next(patched.parameters()).dtype),
               "sample": tokenizer.decode(sample[0]), "seconds": time.perf_counter() - started,
               "args": asdict(args)}
    if accelerator.is_main_process:
        patched.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
        (out / "model" / "metrics.json").write_text(json.dumps(metrics, indent=2))
        accelerator.print(f"saved {out / 'model'} (loads with trust_remote_code=True); sample:\n{metrics['sample']}")
    accelerator.wait_for_everyone()
    return metrics


__all__ = ["PatchedFinetuneArgs", "main"]
