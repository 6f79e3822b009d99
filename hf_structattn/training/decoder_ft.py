"""Patch a local transformers decoder to MLR attention and fine-tune it -- ``recipes/finetune_patched.py``.

1. The source: ``--model_path`` (a local checkpoint with its tokenizer), or by default a tiny Llama built from the
   ``model`` fields and trained dense for ``--pretrain_steps`` on the same corpus (saved to ``OUTPUT/source``: the
   "pretrained" model; a resumed run loads it from there).
2. ``hf_structattn.patch`` converts it (``--mlr_ranks``, ``--mlr_block_sizes`` or ``--mlr_max_length``,
   ``--layers``, ``--sliding_window_layers``, ``--level_order`` with patch's default; ``contribution`` is calibrated
   on the first ``--calibration_windows`` training windows); the drift before fine-tuning is measured on validation
   windows (``drift_report``: logit differences, top-1 agreement) and as the validation-loss gap to the source.
3. Fine-tuning on the shared recipe loop (:mod:`.loop`: AdamW, ``transformers.get_scheduler``, checkpoints and exact
   resume, trackers) on the embedded corpus (the Python standard library's sources) or ``--text_files``; the loss gap
   to the source after it. ``--objective distill`` (the default) trains the patched model towards the source's
   next-token distributions (KL(source || patched) per token, the source kept in memory as the teacher): it recovers
   what the patch moved and nothing else, where ``lm`` (next-token loss) also adapts the model to the corpus, so its
   gap to the source mixes recovery with domain adaptation. Evaluations report the validation loss and, with
   ``distill``, the KL to the source and the top-1 agreement with it; ``--eval_text_files`` evaluates on text of
   its own (held out from the training files) instead of a split of the corpus. (The default tiny source is itself undertrained, so fine-tuning also continues its
   training and the gap usually turns negative; for a converged checkpoint the gap measures how much of the drift
   was recovered.)
4. ``OUTPUT``: the patched, fine-tuned model saved with its code (loads with ``trust_remote_code=True``), the
   tokenizer, the model card, plots and ``final_metrics.json``; a greedy sample generated through the model's cache.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import transformers

from ..command_io import apply_umask
from ..modeling.structattn_decoder_spec import DEFAULT_LEVEL_ORDER, check_level_order
from .args import ConfigError, arg, model_args_dataclass, parse_recipe_args, run_main
from .loop import (CommonArgs, announce, build_optimizer, build_scheduler, finish_run, rank_share, start_run,
                   train)

RECIPE = "finetune_patched"
OBJECTIVES = ("distill", "lm")
BYTE_VOCAB, BYTE_EOS = 257, 256  # hf_structattn.tokenization's byte tokenizer: 256 bytes + <|endoftext|>
TINY_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096)
SLIDING_WINDOW_CHOICES = ("refuse", "replace")

PatchedModelArgs = model_args_dataclass(
    "PatchedModelArgs", transformers.LlamaConfig, TINY_LLAMA,
    dict(hidden_size="width of the tiny Llama", intermediate_size="MLP hidden width",
         num_hidden_layers="transformer blocks", num_attention_heads="query heads (head dim = hidden_size / heads "
                                                                     "unless head_dim is set)",
         num_key_value_heads="key/value heads (grouped-query attention when fewer than the query heads)",
         max_position_embeddings="longest sequence the tiny model's RoPE is built for",
         hidden_act="MLP activation (transformers ACT2FN name)", initializer_range="std of the normal weight init",
         rms_norm_eps="RMSNorm epsilon", attention_bias="bias in the q/k/v/o projections",
         attention_dropout="dropout of the attention probabilities", mlp_bias="bias in the MLP projections",
         head_dim="attention head dim (none: hidden_size / num_attention_heads)",
         tie_word_embeddings="tie the LM head to the token embedding"),
    exclude=("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "use_cache", "pretraining_tp",
             "rope_parameters"))
PatchedModelArgs._argument_group_name = ("model (LlamaConfig fields of the tiny Llama built when no --model_path is "
                                         "given; also under 'model:' in a config file)")


@dataclass
class PatchedFinetuneArgs(CommonArgs):
    """Arguments of recipes/finetune_patched.py (``--name value`` or a ``--config`` file)."""

    PATH_FIELDS = ("model_path", "text_files")  # published as file names only (public_configuration)

    output_dir: str = arg("the run's folder; a loadable checkpoint with model card when done",
                          default="outputs/finetune_patched")
    model_path: Optional[str] = arg("a local decoder checkpoint folder with its tokenizer (Llama, Qwen, Mistral, "
                                    "Gemma, Phi-3, GPT-2, ...); none: build and pretrain a tiny Llama here",
                                    default=None)
    pretrain_steps: int = arg("dense pretraining steps of the tiny Llama built without --model_path (same "
                              "optimizer and schedule settings as the fine-tuning)", default=300)
    mlr_ranks: list[int] = arg("MLR level ranks r_1..r_L, summing to the head dim (whole RoPE pairs per level)",
                               default_factory=lambda: [8, 8, 16])
    mlr_block_sizes: Optional[list[int]] = arg("nested block sizes b_2..b_L in tokens (none: dyadic from "
                                               "--mlr_max_length)", default=None)
    mlr_max_length: Optional[int] = arg("training length the dyadic blocks derive from, b_l = length / 2^(l-1) "
                                        "(none: --seq_len); give this or --mlr_block_sizes", default=None)
    layers: Optional[list[int]] = arg("indices of the layers to convert (none: all)", default=None)
    sliding_window_layers: str = arg("what to do with sliding-window layers: refuse or replace (by global MLR "
                                     "layers)", default="refuse")
    level_order: str = arg("which RoPE pairs form which level (hf_structattn.patch's level_order, same default): "
                           "frequency (unrotated dims, then the pairs from the lowest frequency up), index (the "
                           "pairs in the model's dim order) or contribution (pairs ranked by q/k norms on "
                           "--calibration_windows training windows)", default=DEFAULT_LEVEL_ORDER)
    calibration_windows: int = arg("training windows of seq_len tokens (the first ones) that level_order "
                                   "contribution measures the pairs on", default=4)
    text_files: Optional[list[str]] = arg("local UTF-8 text files (datasets' text loader, one document per file) "
                                          "instead of the standard library", default=None)
    eval_text_files: Optional[list[str]] = arg("local UTF-8 text files to evaluate on, all of them (none: the "
                                               "validation split of the training corpus)", default=None)
    objective: str = arg("distill: KL from the source model's next-token distributions (recovers what the patch "
                         "moved); lm: next-token loss on the corpus (also adapts to it)", default="distill")
    validation_percent: float = arg("percent of documents held out (split by sha1 of their name)", default=5.0)
    max_train_bytes: Optional[int] = arg("cap on training bytes (none: all)", default=4_000_000)
    max_validation_bytes: Optional[int] = arg("cap on validation bytes (none: all)", default=500_000)
    seq_len: int = arg("tokens per training and validation window", default=256)
    eval_windows: int = arg("validation windows of seq_len tokens per evaluation", default=32)
    sample_prompt: str = arg("prompt of the greedy sample generated after fine-tuning", default="def ")
    sample_new_tokens: int = arg("tokens generated greedily through the model's cache after fine-tuning (0: none)",
                                 default=64)
    max_steps: int = arg("fine-tuning optimizer steps", default=150)
    warmup_steps: int = arg("linear warm-up steps of the schedule", default=20)
    per_device_batch_size: int = arg("windows per process per micro-step", default=8)

    def __post_init__(self):
        super().__post_init__()
        if self.pretrain_steps < 0:
            raise ConfigError(f"--pretrain_steps must be >= 0, got {self.pretrain_steps}")
        for name in ("seq_len", "eval_windows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_train_bytes", "max_validation_bytes", "mlr_max_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1 or none, got {getattr(self, name)}")
        if self.sample_new_tokens < 0:
            raise ConfigError(f"--sample_new_tokens must be >= 0, got {self.sample_new_tokens}")
        if not 0 < self.validation_percent < 100:
            raise ConfigError(f"--validation_percent must be in (0, 100), got {self.validation_percent}")
        try:
            check_level_order(self.level_order)
        except ValueError as error:
            raise ConfigError(f"--{error}") from None
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.calibration_windows < 1:
            raise ConfigError(f"--calibration_windows must be >= 1, got {self.calibration_windows}")
        if self.sliding_window_layers not in SLIDING_WINDOW_CHOICES:
            raise ConfigError(f"--sliding_window_layers {self.sliding_window_layers!r} is not one of "
                              f"{', '.join(SLIDING_WINDOW_CHOICES)}")
        if self.mlr_block_sizes is not None and self.mlr_max_length is not None:
            raise ConfigError(f"--mlr_block_sizes {self.mlr_block_sizes} and --mlr_max_length {self.mlr_max_length}:"
                              " give one of them (the block sizes, or the length they derive from)")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise ConfigError(f"--model_path {self.model_path}: not a model folder (no config.json)")
        from .data import check_text_files

        check_text_files(self.text_files)
        check_text_files(self.eval_text_files, "--eval_text_files")

    def patch_fields(self) -> dict:
        """Keywords of ``hf_structattn.patch`` for this run (``calibration_ids`` for ``level_order="contribution"``
        are added by :func:`calibration_fields` once the training tokens exist)."""
        blocks = self.mlr_block_sizes
        return dict(mlr_ranks=list(self.mlr_ranks), mlr_block_sizes=blocks,
                    mlr_max_length=None if blocks is not None else (self.mlr_max_length or self.seq_len),
                    layers=self.layers, sliding_window_layers=self.sliding_window_layers,
                    level_order=self.level_order)

    def source_config(self):
        """The source model's config: the checkpoint's, or the tiny Llama's from the model fields."""
        if self.model_path is not None:
            try:
                return transformers.AutoConfig.from_pretrained(self.model_path)
            except Exception as error:  # OSError, ValueError, strict-config validation errors
                cause = error.__cause__ or error
                raise ConfigError(f"--model_path {self.model_path}: cannot read its config "
                                  f"({' '.join(str(cause).split())})") from None
        try:
            return transformers.LlamaConfig(**tiny_llama_fields(self.model))
        except Exception as error:  # ValueError, or huggingface_hub's StrictDataclassClassValidationError around it
            cause = error.__cause__ or error
            raise ConfigError(f"model: {' '.join(str(cause).split())}") from None

    def check_model(self) -> None:
        """Model fields shape only the tiny Llama; the patch (ranks, blocks, layers) is checked on the source's
        architecture built on the meta device (no weights are read or allocated)."""
        defaults = {f.name: getattr(PatchedModelArgs(), f.name) for f in dataclasses.fields(PatchedModelArgs)}
        if self.model_path is not None:
            changed = sorted(k for k, v in self.model.items() if v != defaults[k])
            if changed:
                raise ConfigError(f"model fields {', '.join(changed)} only shape the tiny Llama built without "
                                  f"--model_path; {self.model_path} brings its own configuration")
        config = self.source_config()
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if limit is not None and self.seq_len > limit:
            raise ConfigError(f"--seq_len {self.seq_len} exceeds the source's max_position_embeddings={limit}")
        dry_run_patch(config, self.patch_fields())


def tiny_llama_fields(model: dict) -> dict:
    """LlamaConfig keywords of the tiny source: the model fields plus the byte tokenizer's vocabulary and ids."""
    return dict(model, vocab_size=BYTE_VOCAB, bos_token_id=BYTE_EOS, eos_token_id=BYTE_EOS, pad_token_id=BYTE_EOS)


def dry_run_patch(config, fields: dict) -> None:
    """``hf_structattn.patch`` on the source architecture built on the meta device, so that every patch error
    (ranks vs head dim, RoPE pairs, blocks, layers, sliding windows, unsupported architecture) is reported before any
    work starts. The rotary embeddings are rebuilt on the CPU (the patcher reads the rotation pairs off them)."""
    import hf_structattn

    from ..decoder_patching import is_decoder_architecture

    architectures = getattr(config, "architectures", None)
    if architectures and not is_decoder_architecture(architectures):
        raise ConfigError(f"--model_path: architectures {architectures} is not a transformers decoder "
                          "(*ForCausalLM / *LMHeadModel)")
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        for name, module in list(model.named_modules()):
            if type(module).__name__.endswith("RotaryEmbedding"):
                parent_name, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(parent_name), attribute, type(module)(config=module.config))
    except Exception:  # an architecture that cannot be built this way: patch() checks it when the run loads it
        return
    from ..decoder_patching import weightless_check_fields

    try:
        hf_structattn.patch(model, attention="mlr", **weightless_check_fields(fields))
    except ValueError as error:
        raise ConfigError(f"patch: {' '.join(str(error).split())}") from None
    except (NotImplementedError, RuntimeError):  # meta tensors the patcher cannot handle: checked at load time
        return


def calibration_fields(args: PatchedFinetuneArgs, train_tokens: torch.Tensor) -> dict:
    """``{"calibration_ids": (calibration_windows, seq_len)}``, the first training windows, for
    ``level_order="contribution"``; {} for the other orders."""
    if args.level_order != "contribution":
        return {}
    count = min(args.calibration_windows, train_tokens.numel() // args.seq_len)
    if count < 1:
        raise ConfigError(f"--level_order contribution: the training text holds {train_tokens.numel()} tokens, not "
                          f"one window of --seq_len {args.seq_len}")
    return {"calibration_ids": train_tokens[:count * args.seq_len].view(count, args.seq_len)}


# ------------------------------------------------------------------------------------------ data and model


def load_corpus(args: PatchedFinetuneArgs):
    """The training corpus; with ``--eval_text_files`` its validation is every one of those files instead."""
    from . import data

    common = dict(validation_percent=args.validation_percent, max_train_bytes=args.max_train_bytes,
                  max_validation_bytes=args.max_validation_bytes)
    corpus = (data.load_text_files_corpus(args.text_files, **common) if args.text_files
              else data.load_stdlib_corpus(**common))
    if args.eval_text_files:
        texts = [Path(file).read_text(encoding="utf-8") for file in sorted(args.eval_text_files)]
        validation, count = data.encode_documents(texts, args.max_validation_bytes)
        corpus = dataclasses.replace(corpus, validation=validation, validation_documents=count,
                                     description=f"{corpus.description}; evaluated on {len(texts)} text file(s) of "
                                                 "its own")
    return corpus


def encode_corpus(corpus, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token ids: the byte tokens as they are, or re-encoded with a checkpoint's own tokenizer."""
    if tokenizer is None:
        return corpus.train, corpus.validation

    def encode(tokens: torch.Tensor) -> torch.Tensor:
        text = bytes(tokens[tokens < 256].tolist()).decode("utf-8", errors="replace")
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)

    return encode(corpus.train), encode(corpus.validation)


def distillation_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(target || model) of next-token distributions: logits and target (B, T, V), in at
    least float32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_q = logits.to(dtype).flatten(0, 1).log_softmax(-1)
    log_p = target.to(dtype).flatten(0, 1).log_softmax(-1)
    return torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


@torch.no_grad()
def window_scores(model, teacher, windows: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(3, count) float64 per window: mean next-token loss, and with a ``teacher`` the mean KL(teacher || model) and
    the fraction of positions whose argmax is the teacher's (0 without one)."""
    rows = []
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start:start + batch_size]
        logits = model(ids, use_cache=False).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(dim=1)
        kl = top1 = torch.zeros_like(loss)
        if teacher is not None:
            target = teacher(ids, use_cache=False).logits[:, :-1].float()
            kl = (target.log_softmax(-1).exp() * (target.log_softmax(-1) - logits.log_softmax(-1))).sum(-1).mean(1)
            top1 = (target.argmax(-1) == logits.argmax(-1)).float().mean(dim=1)
        rows.append(torch.stack([loss, kl, top1]).double())
    return torch.cat(rows, dim=1)


def validation_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    was_training = model.training
    model.eval()
    loss = float(window_scores(model, None, windows, batch_size)[0].mean())
    model.train(was_training)
    return loss


def pretrain_tiny_llama(accelerator, args: PatchedFinetuneArgs, train_tokens: torch.Tensor):
    """The default source: a tiny Llama trained dense for ``pretrain_steps`` (deterministic for the seed)."""
    from accelerate.utils import set_seed

    from .data import lm_micro_batch

    set_seed(args.seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_llama_fields(args.model)))
    if args.pretrain_steps == 0:
        return model
    accelerator.print(f"pretraining a tiny Llama (dense) for {args.pretrain_steps} steps")
    schedule = SimpleNamespace(lr_schedule=args.lr_schedule, min_lr_ratio=args.min_lr_ratio,
                               max_steps=args.pretrain_steps, warmup_steps=min(args.warmup_steps, args.pretrain_steps))
    optimizer = build_optimizer(model, args)
    scheduler = build_scheduler(optimizer, schedule)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    prepared.train()
    world, rank, accum = accelerator.num_processes, accelerator.process_index, args.gradient_accumulation_steps
    for step in range(args.pretrain_steps):
        for micro in range(accum):
            ids = lm_micro_batch(train_tokens, args.seq_len, step, micro, rank, world, args.per_device_batch_size,
                                 accum, args.seed * 7).to(accelerator.device)
            accelerator.backward(prepared(ids, labels=ids, use_cache=False).loss / accum)
        if args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(prepared.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    model = accelerator.unwrap_model(prepared)
    accelerator.free_memory()  # the source and its optimizer are not part of the fine-tuning checkpoints
    return model


def source_model(accelerator, args: PatchedFinetuneArgs, corpus):
    """(source model, tokenizer, train tokens, validation tokens). A built tiny source is saved to
    ``OUTPUT/source`` (atomically) and reloaded from there by a resumed run."""
    from ..tokenization import build_byte_tokenizer

    if args.model_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_path)
        except (OSError, ValueError):
            tokenizer = None
        train_tokens, validation_tokens = encode_corpus(corpus, tokenizer)
        if tokenizer is None:
            if model.config.vocab_size < BYTE_VOCAB:
                raise ConfigError(f"--model_path {args.model_path} has no tokenizer and vocab_size="
                                  f"{model.config.vocab_size} < {BYTE_VOCAB}: cannot use the byte tokens of the corpus")
            tokenizer = build_byte_tokenizer()
            # what the model can attend to, not a tokenizer default
            tokenizer.model_max_length = model.config.max_position_embeddings
        return model, tokenizer, train_tokens, validation_tokens
    tokenizer = build_byte_tokenizer()
    tokenizer.model_max_length = args.model["max_position_embeddings"]
    saved = Path(args.output_dir) / "source"
    if (saved / "config.json").is_file():
        model = transformers.LlamaForCausalLM.from_pretrained(saved)
    else:
        model = pretrain_tiny_llama(accelerator, args, corpus.train)
        if accelerator.is_main_process:
            staging = saved.with_name(f".source.partial-{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            apply_umask(staging)
            os.rename(staging, saved)
        accelerator.wait_for_everyone()
    return model, tokenizer, corpus.train, corpus.validation


def patched_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token of a patched decoder: ``3 x (2 N + 2 H sum_layers (score + PV MACs) / T)``, with N the
    matmul weights outside the embedding and LM head and the causal per-head attention MACs of each layer (MLR layers
    from their ranks and blocks, the others dense at full head dim)."""
    from ..decoder_patching import head_dim_of
    from ..flops import pv_macs, score_macs
    from ..modeling.structattn_decoder import decoder_geometry, mlr_layer_indices

    config = model.config
    head = model.get_output_embeddings()
    params = sum(module.weight.numel() for module in model.modules()
                 if isinstance(module, torch.nn.Linear) and module is not head)
    head_dim = head_dim_of(config)
    mlr = decoder_geometry(config)
    mlr_layers = set(mlr_layer_indices(config))
    macs = 0
    for layer in range(config.num_hidden_layers):
        geometry = (dict(variant="mlr", ranks=list(mlr.ranks), block_sizes=list(mlr.block_sizes))
                    if layer in mlr_layers else dict(variant="dense", head_dim=head_dim))
        variant = geometry.pop("variant")
        macs += score_macs(variant, seq_len, causal=True, **geometry) + pv_macs(variant, seq_len, causal=True,
                                                                                 **geometry)
    return 3 * (2 * params + 2 * config.num_attention_heads * macs / seq_len)


def cache_summary(config, mlr_max_length: Optional[int], sample_tokens: int, dtype, summary: dict) -> str:
    """The key-cache saving of a patched decoder for its card and run summary, by the formula the guide's table uses
    (``flops.decoder_cache_report``): at the model's context length (``mlr_max_length``, the length its blocks were
    derived from, else the config's ``max_position_embeddings``), which is the saving the model is for, and at the
    greedy sample's length, labelled as such (a sample shorter than the finest block keeps every level: no saving
    there). Adds ``cache`` / ``cache_*`` (context length, ``cache_context_tokens``) and ``sample_cache_*`` to
    ``summary``; returns the markdown line."""
    from ..flops import decoder_cache_report
    from ..modeling.structattn_decoder import decoder_geometry

    length = mlr_max_length or getattr(config, "max_position_embeddings", None) or sample_tokens
    cache = decoder_cache_report(config, length, dtype_bytes=dtype)
    sample = decoder_cache_report(config, sample_tokens, dtype_bytes=dtype)
    summary["cache"] = cache
    summary["cache_context_tokens"] = length
    summary.update({f"cache_{k}": v for k, v in cache.items()})
    summary["sample_cache_tokens"] = sample_tokens
    summary.update({f"sample_cache_{k}": v for k, v in sample.items()})
    finest = min(decoder_geometry(config).block_sizes, default=length)
    inside = (f": it lies inside one block of the finest level ({finest} tokens), where every level is kept"
              if sample_tokens <= finest else "")
    return (f"Cache of one sequence at the model's context length, {length:,} tokens "
            f"(`hf_structattn.flops.decoder_cache_report`): keys {cache['key_cache_bytes']:,} bytes vs "
            f"{cache['dense_key_cache_bytes']:,} with full keys ({cache['key_cache_ratio']:.3f}x); keys + values "
            f"{cache['kv_cache_ratio']:.3f}x. At the {sample_tokens}-token greedy sample's length: keys "
            f"{sample['key_cache_ratio']:.3f}x, keys + values {sample['kv_cache_ratio']:.3f}x{inside}.")


def loading_snippet(path_hint: str, prompt: str) -> str:
    # the tokenizer too: AutoTokenizer reads config.json, whose auto_map names the checkpoint's code, and without the
    # flag asks "Do you wish to run the custom code?" where hf_structattn is not installed
    return f"""from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{path_hint}"  # this folder, or its Hub id
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)  # hf_structattn need not be installed
ids = tokenizer({prompt!r}, return_tensors="pt", add_special_tokens=False).input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0]))"""


def saved_card_warning(folder) -> str:
    """The WARNING paragraph that a patched decoder's ``save_pretrained`` put into ``folder/README.md`` (the payload's
    ``structattn_decoder.MODEL_CARD``: the checkpoint is not the stock model, and the stock class by name loads it
    dense). The recipe's own card starts with it too, so the warning has one text, written in one place."""
    from ..modeling.structattn_decoder import CARD_WARNING

    card = Path(folder) / "README.md"
    text = card.read_text(encoding="utf-8") if card.is_file() else ""
    paragraph = next((part.strip() for part in text.split("\n\n") if CARD_WARNING in part), None)
    if paragraph is None:
        raise ValueError(f"{card} holds no {CARD_WARNING!r} paragraph: save the patched model with save_pretrained "
                         f"before writing the recipe's card")
    return paragraph


# ------------------------------------------------------------------------------------------ the recipe


def main(argv=None) -> dict:
    args = parse_recipe_args(PatchedFinetuneArgs, PatchedModelArgs, argv, prog="finetune_patched.py")
    corpus = load_corpus(args)  # read (and its files checked) before the output folder is touched
    accelerator, checkpoint = start_run(args, RECIPE)
    import hf_structattn

    from ..decoder_patching import drift_report
    from .data import eval_windows, lm_micro_batch

    source, tokenizer, train_tokens, validation_tokens = source_model(accelerator, args, corpus)
    windows = eval_windows(validation_tokens, args.seq_len, args.eval_windows,
                           "--eval_text_files" if args.eval_text_files else
                           "--eval_text_files FILES held out from training, or a larger --validation_percent / "
                           "--max_validation_bytes of the --text_files split")
    try:
        patched = hf_structattn.patch(source, attention="mlr", **args.patch_fields(),
                                      **calibration_fields(args, train_tokens))
    except ValueError as error:  # not caught by the dry run (e.g. an architecture the meta device cannot build)
        raise ConfigError(f"patch: {' '.join(str(error).split())}") from None
    source.eval().requires_grad_(False)
    # the estimates of the long phases: one forward of a window, timed here (every phase below is forwards of it)
    timed = time.perf_counter()
    window_scores(source, None, windows[:1], 1)
    forward_s = time.perf_counter() - timed
    distill = args.objective == "distill"
    count = 2 * min(8, windows.shape[0]) + windows.shape[0] * (3 if distill else 2)
    announce(accelerator, f"drift and validation losses before fine-tuning: {count} forwards of {args.seq_len} "
                          f"tokens at {forward_s:.1f} s each", count * forward_s)
    drift = drift_report(source, patched.eval(), windows[:8])
    loss_source = validation_loss(source, windows, args.per_device_batch_size)
    before = window_scores(patched.eval(), source if args.objective == "distill" else None, windows,
                           args.per_device_batch_size).mean(dim=1).tolist()
    loss_before = before[0]
    distill_before = dict(kl_to_source_before=before[1], top1_source_before=before[2]) \
        if args.objective == "distill" else {}
    accelerator.print(f"source loss {loss_source:.4f}; patched before fine-tuning {loss_before:.4f} "
                      f"(logit_rel {drift['logit_rel']:.3f}, top-1 agreement {drift['top1_agreement']:.3f})")
    teacher = source.to(accelerator.device) if args.objective == "distill" else None
    del source
    accelerator.print(f"data: {corpus.description}: {train_tokens.numel():,} train / "
                      f"{validation_tokens.numel():,} validation tokens")
    optimizer = build_optimizer(patched, args)
    model, optimizer = accelerator.prepare(patched.train(), optimizer)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device

    def micro_batch_fn(step, micro, rank_, world_):
        return lm_micro_batch(train_tokens, args.seq_len, step, micro, rank_, world_, args.per_device_batch_size,
                              args.gradient_accumulation_steps, args.seed * 7 + 1).to(device)

    def loss_fn(model_, ids):
        if teacher is None:
            return model_(ids, labels=ids, use_cache=False).loss
        logits = model_(ids, use_cache=False).logits
        with torch.no_grad():
            target = teacher(ids, use_cache=False).logits
        return distillation_loss(logits, target)

    def eval_fn(unwrapped) -> dict:
        index, real = rank_share(windows.shape[0], rank, world)
        sums = torch.zeros(3, windows.shape[0], dtype=torch.float64, device=device)  # loss, KL, top-1 agreement
        mine = window_scores(unwrapped, teacher, windows[index].to(device), args.per_device_batch_size)
        sums[:, index[:real].to(device)] = mine[:, :real]
        loss, kl, top1 = accelerator.reduce(sums, "sum").mean(dim=1).tolist()
        return {"loss": loss} if teacher is None else {"loss": loss, "kl_to_source": kl, "top1_source": top1}

    tokens_per_step = args.per_device_batch_size * world * args.gradient_accumulation_steps * args.seq_len
    flops_per_token = patched_flops_per_token(accelerator.unwrap_model(model), args.seq_len)
    # a training step: forward and backward (about 3 forwards) of each window, and the teacher's forward
    windows_per_step = args.per_device_batch_size * args.gradient_accumulation_steps
    result = train(accelerator, args, model, optimizer, micro_batch_fn=micro_batch_fn, loss_fn=loss_fn,
                   eval_fn=eval_fn, tokens_per_step=tokens_per_step, flops_per_token=flops_per_token, recipe=RECIPE,
                   resume_checkpoint=checkpoint,
                   seconds_per_step=forward_s * windows_per_step * (4 if distill else 3),
                   seconds_per_eval=forward_s * windows.shape[0] * (2 if distill else 1) / world)
    loss_after = result.final_eval["loss"]
    accelerator.print(f"validation-loss gap to the source: {loss_before - loss_source:+.4f} before fine-tuning, "
                      f"{loss_after - loss_source:+.4f} after")
    summary = dict(source=Path(args.model_path).name if args.model_path else "tiny Llama pretrained here",
                   corpus=corpus.description, loss_source=loss_source, loss_patched_before=loss_before,
                   loss_patched_after=loss_after, loss_gap_before=loss_before - loss_source,
                   loss_gap_after=loss_after - loss_source, drift=drift, objective=args.objective, **distill_before,
                   **{f"drift_{k}": v for k, v in drift.items()}, flops_per_token=flops_per_token,
                   tokens_per_step=tokens_per_step)

    def save_outputs(summary: dict, state_dict: dict) -> str:
        from accelerate.utils import DistributedType

        from .outputs import write_model_card, write_plots

        out = Path(args.output_dir)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(out, state_dict=state_dict)
        tokenizer.save_pretrained(out)
        if accelerator.distributed_type == DistributedType.FSDP:  # a sharded model cannot generate on one rank
            unwrapped = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        unwrapped.eval()
        sections = {}
        context = len(tokenizer(args.sample_prompt, add_special_tokens=False).input_ids) + args.sample_new_tokens
        if args.sample_new_tokens > 0:
            prompt = tokenizer(args.sample_prompt, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                sample = unwrapped.generate(prompt.to(unwrapped.device), max_new_tokens=args.sample_new_tokens,
                                            do_sample=False, pad_token_id=tokenizer.pad_token_id)
            summary["sample"] = tokenizer.decode(sample[0])
            context = sample.shape[1]
            sections["Sample (greedy, through the model's cache)"] = (
                "```python\n" + summary["sample"].replace("```", "'''") + "\n```")
        cost = cache_summary(unwrapped.config, args.patch_fields()["mlr_max_length"], context,
                             next(unwrapped.parameters()).dtype, summary)
        sections["Drift of the patch before fine-tuning"] = (
            f"On {min(8, windows.shape[0])} validation windows of {args.seq_len} tokens: max |delta logit| "
            f"{drift['logit_max_abs']:.4g}, relative logit change {drift['logit_rel']:.4g}, top-1 agreement "
            f"{drift['top1_agreement']:.3f}. Validation loss: source {loss_source:.4f}, patched "
            f"{loss_before:.4f} before and {loss_after:.4f} after fine-tuning.")
        write_plots(out, loss_key="train/loss", eval_key="eval/loss")
        config = unwrapped.config
        notice = saved_card_warning(out)  # read before write_model_card replaces the card save_pretrained wrote
        write_model_card(
            out, args, recipe=RECIPE, title=f"{type(unwrapped).__name__}: MLR attention patched into a decoder",
            summary=(f"`{summary['source']}` ({config.model_type}) converted to multi-level low-rank attention "
                     f"(Kuang et al., ICML 2025) by `hf_structattn.patch` (ranks {config.mlr_ranks}, blocks "
                     f"{config.mlr_block_sizes}, layers {'all' if config.mlr_layers is None else config.mlr_layers}, "
                     f"level order {config.mlr_patch['level_order']})"
                     f" and fine-tuned {result.step} steps ({result.step * tokens_per_step:,} tokens) with "
                     f"`recipes/finetune_patched.py` of hf_structattn."),
            config=config.to_dict(), data=corpus.description, pipeline_tag="text-generation",
            eval_results=[("text-generation", "loss", "validation loss (nats/token)", loss_after)],
            metrics={k: v for k, v in summary.items() if k.startswith(("eval_", "loss_")) or
                     k in ("step", "train_seconds")},
            usage=loading_snippet(args.hub_model_id or "path/to/this/folder", args.sample_prompt),
            cost_markdown=cost, flops_per_token=flops_per_token, extra_sections=sections, notice=notice)
        return cost

    return finish_run(accelerator, args, model, result, summary, save_outputs)


__all__ = ["PatchedFinetuneArgs", "PatchedModelArgs", "calibration_fields", "loading_snippet", "main",
           "saved_card_warning"]

if __name__ == "__main__":
    run_main(main, "finetune_patched.py")
