"""The ``hf-structattn`` commands. Argument parsing and the console script's ``main`` are in the top-level module
``hf_structattn_cli`` (outside this package, so that ``--help`` answers without importing torch; ``python -m
hf_structattn_cli`` runs it), which imports this module once a command runs.
"""

import json
import re
import shutil
from pathlib import Path

import torch

from .command_io import CliError, check_out_dir, save_atomically  # noqa: F401  (CliError: hf_structattn_cli's)

# files the converted model writes itself, and the source's model card (it describes the unconverted model); weight
# files of the source (single, sharded, other formats) never travel either
T5_TARGETS = ("encoder_self", "decoder_self")  # hf_structattn.patch's default roles (hf_structattn_cli's --targets)
_NOT_COPIED = {"config.json", "generation_config.json", "README.md"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".index.json")
_SOURCE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
_PATCHED_MODEL_TYPES = ("structattn_t5", "structattn_chronos_bolt")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _check_source_dir(src: Path) -> None:
    if src.is_dir():
        return
    if not src.exists() and _HUB_ID.fullmatch(str(src)):
        raise CliError(f"SRC_DIR {src} is not a directory; if it is a Hugging Face Hub model id, download it first "
                       f"(hf download {src} --local-dir DIR) and pass DIR")
    raise CliError(f"SRC_DIR {src} is not a directory")


def _read_config(src: Path) -> dict:
    config_path = src / "config.json"
    if not config_path.is_file():
        raise CliError(f"{src}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CliError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise CliError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def _check_weights(src: Path) -> None:
    if not any((src / name).is_file() for name in _SOURCE_WEIGHTS):
        raise CliError(f"{src}: no weights ({', '.join(_SOURCE_WEIGHTS)})")


def _checkpoint_kind(src: Path, config: dict) -> str:
    """"t5", "chronos_t5", "chronos_bolt" or "decoder" from SRC_DIR/config.json; CliError for anything else."""
    model_type = config.get("model_type")
    if model_type in _PATCHED_MODEL_TYPES:
        raise CliError(f"{src}: already a structured-attention checkpoint (model_type {model_type!r}); patch the "
                       f"original checkpoint")
    if model_type != "t5":
        from .decoder_patching import MODEL_TYPE_PREFIX, is_decoder_architecture

        if str(model_type).startswith(MODEL_TYPE_PREFIX):
            raise CliError(f"{src}: already an MLR decoder checkpoint (model_type {model_type!r}); patch the "
                           f"original checkpoint")
        if is_decoder_architecture(config.get("architectures") or []):
            return "decoder"
        raise CliError(f"{src}: model_type={model_type!r}; hf-structattn patch converts T5 checkpoints (T5, "
                       f"Chronos-T5, Chronos-Bolt) and transformers decoders (*ForCausalLM, *LMHeadModel) only")
    architectures = config.get("architectures") or []
    pipeline_class = config.get("chronos_pipeline_class")
    if pipeline_class not in (None, "ChronosPipeline", "ChronosBoltPipeline"):  # e.g. Chronos-2: no T5 attention
        raise CliError(f"{src}: chronos_pipeline_class={pipeline_class!r}; hf-structattn patch converts Chronos-T5 "
                       f"(ChronosPipeline) and Chronos-Bolt (ChronosBoltPipeline) only")
    if "ChronosBoltModelForForecasting" in architectures or pipeline_class == "ChronosBoltPipeline":
        return "chronos_bolt"
    if "chronos_config" in config:
        return "chronos_t5"
    return "t5"


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES)


def _synthetic_context(batch: int = 4, length: int = 96) -> torch.Tensor:
    """Seasonal series with trend and noise, (batch, length); deterministic. Chronos drift is measured on the
    model's full context: a shorter one would leave the levels with long blocks inactive."""
    generator = torch.Generator().manual_seed(0)
    t = torch.arange(length, dtype=torch.float32)
    rows = [10 + 0.05 * (i + 1) * t + 3 * torch.sin(2 * torch.pi * t / (12 + 4 * i))
            + 0.3 * torch.randn(length, generator=generator) for i in range(batch)]
    return torch.stack(rows)


def _load(kind: str, src: Path):
    """(original model or pipeline, inputs for ``patch_report`` / ``drift_report``)."""
    if kind == "decoder":
        from transformers import AutoModelForCausalLM

        original = AutoModelForCausalLM.from_pretrained(src).eval()
        generator = torch.Generator().manual_seed(0)
        return original, torch.randint(0, original.config.vocab_size, (2, 64), generator=generator)
    if kind == "t5":
        from transformers import T5ForConditionalGeneration

        original = T5ForConditionalGeneration.from_pretrained(src).eval()
        generator = torch.Generator().manual_seed(0)
        vocab = original.config.vocab_size
        return original, dict(input_ids=torch.randint(0, vocab, (2, 64), generator=generator),
                              decoder_input_ids=torch.randint(0, vocab, (2, 16), generator=generator))
    if kind == "chronos_t5":
        from chronos import ChronosPipeline

        original = ChronosPipeline.from_pretrained(src, device_map="cpu", dtype=torch.float32)
        original.model.model.eval()
        chronos = original.model.config
        return original, {"context": _synthetic_context(length=chronos.context_length),
                          "prediction_length": chronos.prediction_length}
    from chronos.chronos_bolt import ChronosBoltPipeline

    original = ChronosBoltPipeline.from_pretrained(src, device_map="cpu", dtype=torch.float32)
    original.model.eval()
    chronos = original.model.chronos_config
    return original, {"context": _synthetic_context(length=chronos.context_length),
                      "prediction_length": chronos.prediction_length}


def _check_arguments(kind: str, src: Path, config: dict, args, targets, fields: dict) -> None:
    """The checks ``hf_structattn.patch`` makes, run on SRC_DIR/config.json before any weight is read (the same
    functions ``patch`` calls): a decoder is built on the meta device from its config, a T5-family model is checked
    on its ``T5Config`` and, for Chronos, its Chronos config."""
    from transformers import AutoConfig, AutoModelForCausalLM, T5Config

    from .patching import check_decoder_patch, check_t5_patch

    try:
        if kind == "decoder":
            model_config = AutoConfig.from_pretrained(src)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(model_config)
        else:
            model_config = T5Config.from_pretrained(src)
            chronos = None
            if kind == "chronos_t5":
                from chronos import ChronosConfig

                chronos = ChronosConfig(**config["chronos_config"])
            elif kind == "chronos_bolt":
                from chronos.chronos_bolt import ChronosBoltConfig

                chronos = ChronosBoltConfig(**config["chronos_config"])
    except Exception as error:  # strict-config validation, a malformed chronos_config, ...: all about SRC_DIR
        raise CliError(f"{src}: cannot load the config of a {kind} checkpoint: {_one_line(error)}") from None
    try:
        if kind == "decoder":
            from .decoder_patching import weightless_check_fields

            check_decoder_patch(model, args.attention, args.init, **weightless_check_fields(fields))
        else:
            check_t5_patch(model_config, kind, args.attention, targets, args.init, chronos=chronos,
                           allow_identity=args.allow_identity, **fields)
    except ValueError as error:
        raise CliError(str(error)) from None


CALIBRATION_WINDOW = 2048  # tokens per forward of --calibration-text (fewer for a model with a shorter context)


def _calibration_ids(src: Path, args):
    """(windows, tokens) ids of ``--calibration-text`` for ``--level-order contribution``, tokenized with SRC_DIR's
    tokenizer; None without the option. CliError when one of the two options comes without the other, or when the
    file or the tokenizer cannot be read."""
    if args.level_order is not None:
        from .decoder_patching import check_level_order

        try:
            check_level_order(args.level_order)
        except ValueError as error:
            raise CliError(str(error)) from None
    if (args.level_order == "contribution") != (args.calibration_text is not None):
        if args.calibration_text is None:
            raise CliError("--level-order contribution ranks the RoPE pairs by their q/k norms on calibration text: "
                           "give --calibration-text FILE (UTF-8 text)")
        raise CliError(f"--calibration-text is used by --level-order contribution only (got --level-order "
                       f"{args.level_order or 'default'})")
    if args.calibration_text is None:
        return None
    if args.calibration_tokens < 1:
        raise CliError(f"--calibration-tokens {args.calibration_tokens} must be >= 1")
    try:
        text = Path(args.calibration_text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"--calibration-text {args.calibration_text}: {_one_line(error)}") from None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception as error:  # OSError, ValueError from a missing or broken tokenizer
        raise CliError(f"--calibration-text needs SRC_DIR's tokenizer: {src}: {_one_line(error)}") from None
    ids = tokenizer(text, add_special_tokens=False).input_ids[:args.calibration_tokens]
    if not ids:
        raise CliError(f"--calibration-text {args.calibration_text} holds no token")
    config = _read_config(src)
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    window = min(CALIBRATION_WINDOW, limit or CALIBRATION_WINDOW, len(ids))
    count = len(ids) // window
    return torch.tensor(ids[:count * window], dtype=torch.long).view(count, window)


def patch_command(args) -> int:
    import hf_structattn

    src, out = Path(args.src_dir), Path(args.out_dir)
    _check_source_dir(src)
    check_out_dir(out)
    config = _read_config(src)
    kind = _checkpoint_kind(src, config)
    fields = {}
    for name in ("mlr_ranks", "mlr_block_sizes", "mlr_max_length", "mlr_block_steps", "layers",
                 "sliding_window_layers"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if kind == "decoder":
        if args.targets is not None:
            raise CliError(f"--targets {args.targets}: targets name T5 attention roles; a decoder has only "
                           "self-attention (choose layers with --layers)")
        targets = ()
        if args.level_order is not None:
            fields["level_order"] = args.level_order
        if args.level_rule is not None:
            fields["mlr_level_rule"] = args.level_rule
        calibration_ids = _calibration_ids(src, args)
        if calibration_ids is not None:
            fields["calibration_ids"] = calibration_ids
    else:
        decoder_only = [option for option, value in (("--layers", args.layers),
                                                     ("--sliding-window-layers", args.sliding_window_layers),
                                                     ("--level-order", args.level_order),
                                                     ("--level-rule", args.level_rule),
                                                     ("--calibration-text", args.calibration_text))
                        if value is not None]
        if decoder_only:
            raise CliError(f"{decoder_only[0]} applies to transformers decoders only; {src} is a {kind} checkpoint "
                           "(choose the attention roles with --targets)")
        targets = T5_TARGETS if args.targets is None else \
            tuple(t.strip() for t in args.targets.split(",") if t.strip())
    _check_arguments(kind, src, config, args, targets, fields)
    _check_weights(src)

    try:
        original, inputs = _load(kind, src)
    except Exception as error:  # OSError, strict-config validation, Chronos' asserts, ...: all about SRC_DIR
        raise CliError(f"{src}: cannot load as a {kind} checkpoint: {_one_line(error)}") from None
    try:
        patched = hf_structattn.patch(original, attention=args.attention, targets=targets, init=args.init,
                                      allow_identity=args.allow_identity, **fields)
    except ValueError as error:
        raise CliError(str(error)) from None
    if kind == "decoder":
        from .decoder_patching import drift_report

        report = drift_report(original, patched, inputs)
    else:
        report = hf_structattn.patch_report(original, patched, inputs)
    if kind == "decoder":
        config = patched.config
        layers = "all" if config.mlr_layers is None else config.mlr_layers
        print(f"patched decoder checkpoint {src} ({type(original).__name__}) with attention={args.attention} "
              f"mlr_ranks={config.mlr_ranks} mlr_block_sizes={config.mlr_block_sizes} layers={layers} "
              f"sliding_window_layers={config.mlr_patch['sliding_window_layers']} "
              f"level_order={config.mlr_patch['level_order']} level_rule={config.mlr_level_rule}")
    else:
        print(f"patched {kind} checkpoint {src} with attention={args.attention} init={args.init} targets={targets}")
    print("drift before fine-tuning (synthetic inputs):")
    print(hf_structattn.patching.format_report(report))

    model = patched if kind in ("t5", "decoder") else patched.model.model if kind == "chronos_t5" else patched.model

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        for item in src.iterdir():  # tokenizer, license and other side files travel along; old weights never do
            if (item.is_file() and item.name not in _NOT_COPIED and not _is_weight_file(item.name)
                    and not (folder / item.name).exists()):
                shutil.copy2(item, folder / item.name)

    try:
        save_atomically(out, write)
    except Exception as error:  # OSError, safetensors' own error type, ...: the staging folder is already gone
        raise CliError(f"writing OUT_DIR {out} failed, nothing was left behind: {_one_line(error)}", code=1) from None
    how = ("BaseChronosPipeline.from_pretrained(OUT_DIR, trust_remote_code=True)" if kind == "chronos_bolt" else
           "ChronosPipeline.from_pretrained(OUT_DIR, trust_remote_code=True)" if kind == "chronos_t5" else
           "AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True)" if kind == "decoder" else
           "AutoModelForSeq2SeqLM.from_pretrained(OUT_DIR, trust_remote_code=True)")
    print(f"saved to {out}; load with {how} (or without the flag after `import hf_structattn`)")
    return 0


# ---- hf-structattn push (kept apart from the patch command above) ----
def push_command(args) -> int:
    """``hf-structattn push``: upload a finished output folder (:func:`hf_structattn.hub.push_output_dir`), or with
    ``--dry-run`` list what would be uploaded, or with ``--to-folder`` copy it into a local folder; each lists what
    it skips. No network but the upload itself; every failure is one :class:`CliError` line."""
    from .hub import PushError, check_repo_id, copy_to_folder, describe, finished, push_output_dir

    try:
        if args.to_folder:
            run = copy_to_folder(finished(args.output_dir), args.to_folder)
            print(f"copied {len(run.files)} files from {args.output_dir} to {args.to_folder} (what the Hub "
                  f"repository would hold; nothing uploaded)")
            print("\n".join(describe(run)))
            return 0
        repo_id = check_repo_id(args.repo_id)
        if args.dry_run:
            run = finished(args.output_dir)
            print(f"dry run: would upload {len(run.files)} files from {args.output_dir} to "
                  f"https://huggingface.co/{repo_id}{' (private)' if args.private else ''}; nothing uploaded")
            print("\n".join(describe(run)))
            return 0
        run = push_output_dir(args.output_dir, repo_id, private=args.private, commit_message=args.commit_message)
    except PushError as error:
        raise CliError(str(error), code=error.code) from None
    print(f"uploaded {len(run.files)} files from {args.output_dir} to https://huggingface.co/{repo_id}")
    print("\n".join(describe(run)))
    return 0
