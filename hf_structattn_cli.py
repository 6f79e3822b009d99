"""``hf-structattn`` command line.

    hf-structattn patch SRC_DIR OUT_DIR --attention mlr --mlr-ranks 32,16,8,8 --mlr-block-sizes 256,128,64 [--init svd]

    hf-structattn push OUTPUT_DIR --repo-id USER/NAME [--dry-run | --to-folder DIR]

``patch`` converts a T5, Chronos-T5, Chronos-Bolt or transformers decoder checkpoint (Llama, Qwen, Mistral, Gemma,
Phi-3, GPT-2, ...: ``--layers``, ``--sliding-window-layers``) on disk (see ``hf_structattn.patch``), prints how far the
outputs moved on synthetic inputs, and saves the result. The arguments are checked against SRC_DIR/config.json
before any weight is loaded (the checks ``hf_structattn.patch`` makes). The save is atomic: everything is written
into a hidden folder next to OUT_DIR that is renamed to OUT_DIR at the end, so a failure leaves no OUT_DIR. Bad
arguments or an unusable SRC_DIR / OUT_DIR exit with code 2 and write nothing; a failure while writing exits with
code 1. ``push`` uploads a finished output folder to the Hub, or rehearses that offline (``hf_structattn.hub``).

This module is the console script's entry point (argument parsing only). It lives outside the ``hf_structattn``
package: importing any module of the package first runs the package's ``__init__``, which imports torch and
transformers and registers the Auto classes (seconds). Here only argparse is imported until a command runs, so
``--help`` and malformed arguments answer at once. The commands themselves are in ``hf_structattn.cli``.
"""

import argparse
import sys


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


DEFAULT_TARGETS = "encoder_self,decoder_self"
# --help text is plain text (argparse prints it as is): no reST markup from the docstrings
DESCRIPTION = ("hf-structattn: convert Hugging Face checkpoints to structured (MLR) attention, and publish "
               "finished runs. Run 'hf-structattn patch --help' or 'hf-structattn push --help' for the options.")
PATCH_DESCRIPTION = (
    "Convert the T5, Chronos-T5, Chronos-Bolt or transformers decoder checkpoint (Llama, Qwen, Mistral, Gemma, "
    "Phi-3, GPT-2, ...) in SRC_DIR to MLR attention, print how far its outputs moved on synthetic inputs, and save "
    "the result with its code in OUT_DIR (atomically: OUT_DIR appears complete or not at all). Exit status 2: bad "
    "arguments or an unusable SRC_DIR / OUT_DIR, nothing written; 1: writing OUT_DIR failed.")
PATCH_EPILOG = ("example: hf-structattn patch t5-small t5-small-mlr --mlr-ranks 32,16,8,8 --mlr-block-sizes "
                "256,128,64 --init svd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-structattn", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    patch = commands.add_parser("patch", help="convert a T5 / Chronos-T5 / Chronos-Bolt / transformers decoder "
                                              "checkpoint to MLR attention", description=PATCH_DESCRIPTION,
                                epilog=PATCH_EPILOG)
    patch.add_argument("src_dir", help="the checkpoint folder to convert (config.json + weights); a Hub model is "
                                       "downloaded first: hf download ORG/NAME --local-dir DIR")
    patch.add_argument("out_dir", help="created atomically; must not exist or be an empty directory")
    patch.add_argument("--attention", default="mlr", help="structured attention to install (mlr)")
    patch.add_argument("--mlr-ranks", type=_int_list,
                       help="per-level ranks summing to the head dim (T5: d_kv), e.g. 32,16,8,8")
    blocks = patch.add_mutually_exclusive_group()
    blocks.add_argument("--mlr-block-sizes", type=_int_list,
                        help="block sizes of levels 2..L in tokens (Chronos-Bolt: patches), e.g. 256,128,64. "
                             "Decoders: this or --mlr-max-length is required (never derived from the model's "
                             "maximum length). T5: default dyadic from --mlr-max-length (512 when not given); "
                             "Chronos: default dyadic from the context length")
    blocks.add_argument("--mlr-block-steps", type=_int_list,
                        help="Chronos only: block sizes of levels 2..L in time steps (Bolt: multiples of the patch "
                             "stride), e.g. 1024,256,64")
    patch.add_argument("--mlr-max-length", type=int,
                       help="the training length in tokens that dyadic blocks derive from (b_l = length / 2^(l-1))")
    patch.add_argument("--targets", default=None,
                       help=f"T5-family only: comma-separated roles among encoder_self, decoder_self (default "
                            f"{DEFAULT_TARGETS})")
    patch.add_argument("--init", choices=("split", "svd"), default="split",
                       help="level split of pretrained q/k (decoders: split only)")
    patch.add_argument("--layers", type=_int_list, help="decoders only: layers to convert, e.g. 0,1,2 (default all)")
    patch.add_argument("--sliding-window-layers", choices=("refuse", "replace"),
                       help="decoders only: refuse (default) or replace sliding-window layers by global MLR layers")
    # no argparse choices: hf_structattn.patch names the field and the closest value in one line
    patch.add_argument("--level-order",
                       help="decoders only: which RoPE pairs form which level, whole pairs per level: frequency "
                            "(default: unrotated dims, then the pairs from the lowest frequency up), index (the "
                            "pairs in the model's dim order), contribution (pairs ranked by q/k norms on "
                            "--calibration-text)")
    patch.add_argument("--level-rule",
                       help="decoders only: which levels a token pair shares: blocks (default: the paper's blocks "
                            "aligned to position 0) or nearest (level l for keys fewer than b_l positions away; "
                            "the same cache bytes, for pretrained weights patched without training)")
    patch.add_argument("--calibration-text", metavar="FILE",
                       help="decoders, --level-order contribution only: a UTF-8 text file, tokenized with SRC_DIR's "
                            "tokenizer, whose first --calibration-tokens tokens the stock model runs on")
    patch.add_argument("--calibration-tokens", type=int, default=4096,
                       help="tokens of --calibration-text used, in windows of up to 2048 (default 4096)")
    patch.add_argument("--allow-identity", action="store_true",
                       help="accept a patch that changes nothing (one level, or blocks covering the whole context)")
    add_push_parser(commands)
    return parser


# ---- hf-structattn push (kept apart from the patch command above) ----
PUSH_DESCRIPTION = (
    "Upload a finished output folder (a recipe run, or a checkpoint written by 'hf-structattn patch') to the Hub, "
    "exactly what a recipe's --push_to_hub uploads: the bytes it read once from the folder (no link followed) and "
    "checked, in one commit. A folder is refused unless it is a finished run: config.json and every JSON file parse, "
    "the safetensors weights are complete and match it, a recipe run wrote final_metrics.json, every auto_map names "
    "a module in the folder, every .py compiles and is the package's payload, it is no staging folder of a killed "
    "write. Left out and listed: checkpoints/, run_config.json, sources, pickles (by content, whatever their name or "
    "compression), staging folders, symlinks. Checks the token and creates the repository first. --dry-run prints "
    "the files it would upload and uses no network; --to-folder DIR writes them into DIR instead, a local rehearsal "
    "of the repository. Exit status 2: bad arguments, an unusable folder or Hub access refused, nothing uploaded; 1: "
    "the upload failed.")
PUSH_EPILOG = "example: hf-structattn push outputs/clm_mlr_stdlib --repo-id someone/gpt2-mlr-stdlib --dry-run"


def add_push_parser(commands) -> None:
    push = commands.add_parser("push", help="upload a finished output folder to the Hub (or rehearse it offline)",
                               description=PUSH_DESCRIPTION, epilog=PUSH_EPILOG)
    push.add_argument("output_dir", help="the finished run or checkpoint folder (config.json + weights)")
    push.add_argument("--repo-id", help="Hub repository USER/NAME or ORG/NAME (created if missing); required except "
                                        "with --to-folder")
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--commit-message", default="Upload model trained with hf_structattn")
    rehearse = push.add_mutually_exclusive_group()
    rehearse.add_argument("--dry-run", action="store_true",
                          help="print the files that would be uploaded (with sizes) and exit; no network")
    rehearse.add_argument("--to-folder", metavar="DIR",
                          help="copy the files that would be uploaded into DIR (absent or empty) instead; no network")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # argparse exits with code 2 on malformed arguments
    from hf_structattn.cli import CliError, patch_command, push_command  # torch, transformers: once a command runs

    try:
        return push_command(args) if args.command == "push" else patch_command(args)
    except CliError as error:
        print(f"hf-structattn: error: {error}", file=sys.stderr)
        return error.code


if __name__ == "__main__":
    sys.exit(main())
