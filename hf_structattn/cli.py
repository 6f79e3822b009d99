"""``hf-structattn`` command line.

    hf-structattn patch SRC_DIR OUT_DIR --attention mlr --mlr-ranks 32,16,8,8 --mlr-block-sizes 256,128,64 [--init svd]

converts a T5, Chronos-T5 or Chronos-Bolt checkpoint on disk (see ``hf_structattn.patch``), prints how far the
outputs moved on synthetic inputs, and saves the result. Bad arguments exit with code 2 and write nothing.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

# files of a checkpoint directory that the converted model rewrites itself
_REWRITTEN = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
              "pytorch_model.bin"}


class CliError(Exception):
    """A user error: reported on stderr with exit code 2."""


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _checkpoint_kind(src: Path) -> tuple[str, dict]:
    config_path = src / "config.json"
    if not config_path.is_file():
        raise CliError(f"{src}: no config.json (not a Hugging Face checkpoint directory)")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type == "structattn_t5":
        raise CliError(f"{src}: already a structured-attention checkpoint (model_type 'structattn_t5'); patch the "
                       f"original T5 checkpoint")
    if model_type != "t5":
        raise CliError(f"{src}: model_type={model_type!r}; hf-structattn patch converts T5 checkpoints (T5, "
                       f"Chronos-T5, Chronos-Bolt) only")
    if "ChronosBoltModelForForecasting" in (config.get("architectures") or []):
        return "chronos_bolt", config
    if "chronos_config" in config:
        return "chronos_t5", config
    return "t5", config


def _synthetic_context(batch: int = 4, length: int = 96) -> torch.Tensor:
    """Seasonal series with trend and noise, (batch, length); deterministic."""
    generator = torch.Generator().manual_seed(0)
    t = torch.arange(length, dtype=torch.float32)
    rows = [10 + 0.05 * (i + 1) * t + 3 * torch.sin(2 * torch.pi * t / (12 + 4 * i))
            + 0.3 * torch.randn(length, generator=generator) for i in range(batch)]
    return torch.stack(rows)


def _patch_command(args) -> int:
    import hf_structattn

    src, out = Path(args.src_dir), Path(args.out_dir)
    if not src.is_dir():
        raise CliError(f"SRC_DIR {src} is not a directory")
    if out.exists() and any(out.iterdir()):
        raise CliError(f"OUT_DIR {out} exists and is not empty")
    kind, _ = _checkpoint_kind(src)
    fields = {}
    if args.mlr_ranks is not None:
        fields["mlr_ranks"] = args.mlr_ranks
    if args.mlr_block_sizes is not None:
        fields["mlr_block_sizes"] = args.mlr_block_sizes
    if args.mlr_max_length is not None:
        fields["mlr_max_length"] = args.mlr_max_length
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())

    if kind == "t5":
        from transformers import T5ForConditionalGeneration

        original = T5ForConditionalGeneration.from_pretrained(src).eval()
        generator = torch.Generator().manual_seed(0)
        vocab = original.config.vocab_size
        inputs = dict(input_ids=torch.randint(0, vocab, (2, 64), generator=generator),
                      decoder_input_ids=torch.randint(0, vocab, (2, 16), generator=generator))
    elif kind == "chronos_t5":
        from chronos import ChronosPipeline

        original = ChronosPipeline.from_pretrained(src, device_map="cpu", dtype=torch.float32)
        original.model.model.eval()
        inputs = {"context": _synthetic_context(), "prediction_length": original.model.config.prediction_length}
    else:
        from chronos.chronos_bolt import ChronosBoltPipeline

        original = ChronosBoltPipeline.from_pretrained(src, device_map="cpu", dtype=torch.float32)
        original.model.eval()
        inputs = {"context": _synthetic_context(),
                  "prediction_length": original.model.chronos_config.prediction_length}
    try:
        patched = hf_structattn.patch(original, attention=args.attention, targets=targets, init=args.init, **fields)
    except ValueError as error:
        raise CliError(str(error)) from None
    report = hf_structattn.patch_report(original, patched, inputs)
    print(f"patched {kind} checkpoint {src} with attention={args.attention} init={args.init} targets={targets}")
    print("drift before fine-tuning (synthetic inputs):")
    print(hf_structattn.patching.format_report(report))

    out.mkdir(parents=True, exist_ok=True)
    if kind == "t5":
        patched.save_pretrained(out)
    elif kind == "chronos_t5":
        patched.model.model.save_pretrained(out)
    else:
        patched.model.save_pretrained(out)
    for item in src.iterdir():  # tokenizer and other side files travel along
        if item.is_file() and item.name not in _REWRITTEN and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)
    how = ("hf_structattn.load_patched_chronos_bolt(OUT_DIR)" if kind == "chronos_bolt" else
           "ChronosPipeline.from_pretrained(OUT_DIR, trust_remote_code=True)" if kind == "chronos_t5" else
           "AutoModelForSeq2SeqLM.from_pretrained(OUT_DIR, trust_remote_code=True)")
    print(f"saved to {out}; load with {how}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-structattn", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    patch = commands.add_parser("patch", help="convert a T5 / Chronos-T5 / Chronos-Bolt checkpoint to MLR attention")
    patch.add_argument("src_dir")
    patch.add_argument("out_dir")
    patch.add_argument("--attention", default="mlr", help="structured attention to install (mlr)")
    patch.add_argument("--mlr-ranks", type=_int_list, help="per-level ranks summing to d_kv, e.g. 32,16,8,8")
    patch.add_argument("--mlr-block-sizes", type=_int_list,
                       help="block sizes of levels 2..L, e.g. 256,128,64 (default: dyadic from --mlr-max-length)")
    patch.add_argument("--mlr-max-length", type=int, help="training length for the default dyadic blocks")
    patch.add_argument("--targets", default="encoder_self,decoder_self",
                       help="comma-separated roles among encoder_self, decoder_self")
    patch.add_argument("--init", choices=("split", "svd"), default="split", help="level split of pretrained q/k")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # argparse exits with code 2 on malformed arguments
    try:
        return _patch_command(args)
    except CliError as error:
        print(f"hf-structattn: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
