"""What patching a real pretrained decoder costs and how much a CPU recovers: SmolLM2-135M-Instruct at a 2,048-token
context, one table.

For each rank setting (``--ranks``; blocks dyadic from 2,048; the default ``level_order``):

* **key cache**: the formula ``(T r_1 + sum_{l>=2} b_l r_l) / (T d)`` at T = 2,048
  (``flops.decoder_cache_report``) and the key bytes the cache holds after a 2,048-token prefill
  (``structattn_prepare.key_cache_bytes``), both against the stock model's;
* **before training**: perplexity / stock and top-1 agreement with stock on the held-out split of the real-weights
  tier (``hf_structattn.real_weights``: CPython's pydoc topics; text no calibration or fine-tuning sees);
* **recovery**: ``recipes/finetune_patched.py`` (``hf_structattn.training.decoder_ft``), run in this process with
  ``--objective distill`` (KL from the stock model: it aims the patched model at the stock model rather than at the
  text; the curve's KL shows how close it gets) on the fine-tune split, 2,048-token windows, batch 1,
  AdamW at ``--learning_rate``; its evaluations (KL to stock and top-1 on 4 held-out windows) against the training
  steps' CPU minutes form the recovery curve (``--recovery_ranks``: the settings that get one; a 2,048-token step costs
  about 30 CPU-seconds here); cosine decay to zero after 3 warm-up steps (in a prototype at a constant 2e-5 the held-out
  ratio rose again between evaluations: the rate has to come down for the gain to stay); after it, the same perplexity / stock and top-1 as before training;
* **decode**: ms per generated token at a 2,048-token prompt, batch 1, stock and patched interleaved step by step,
  thread clock: eager (``generate``'s default cache) and static cache + ``torch.compile``;
* **chat**: the instruct model's greedy answer (its chat template) to a question on a 1,600-token held-out document:
  stock, patched before training, patched after recovery.

Everything goes to the output folder ``--work`` (default ``outputs/real_checkpoint``): each part's result is appended
to ``real_checkpoint.jsonl`` there as it finishes and reused by a rerun (the recipe runs resume from their
checkpoints), so the command can be stopped and continued; the table goes to stdout and ``real_checkpoint.md``
there. ``--update-committed`` reads and writes the committed ``benchmarks/results/real_checkpoint.{jsonl,md}``
instead (the guide's table): a run of a few settings never replaces it by accident. Before each phase a line names
it with an estimate (from one timed forward of 2,048 tokens), and before each recovery run the same run's command
from a shell is printed (docs/patching.md gives it). One torch thread; CPU minutes are the main thread's CPU time
(the thread clock).

    python benchmarks/bench_real_checkpoint.py        # about 1.5 CPU-hours on one core of a 2-core Xeon VM
    python benchmarks/bench_real_checkpoint.py --ranks 32,16,8,8 --parts drift decode
    python benchmarks/bench_real_checkpoint.py --update-committed   # the full run that replaces the guide's table
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import hf_structattn
from hf_structattn.flops import decoder_cache_report
from hf_structattn.real_weights import RealWeightsUnavailable, load_smollm2, smollm2_folder, token_windows, write_split
from hf_structattn.training.loop import duration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decoder_patching import compiled_decode, speed  # noqa: E402
from bench_generation import header_line  # noqa: E402
from bench_real_weights import rank_list, window_scores  # noqa: E402

DEFAULT_RANKS = ["32,16,8,8", "24,24,8,8", "16,16,16,16"]
COMMITTED_RESULTS, COMMITTED_TABLE = "benchmarks/results/real_checkpoint.jsonl", "benchmarks/results/real_checkpoint.md"
PARTS = ("drift", "recovery", "decode", "chat")
CONTEXT = 2048
# the chat prompt: a held-out document, then a question on it, so that the answer reads across every block boundary
# (a short prompt lies inside one 256-token block, where the patched model is exact)
CHAT_DOCUMENT, CHAT_DOCUMENT_TOKENS = "try", 1600
CHAT_QUESTION = ('Which statement does the text above describe, and what does its "except" clause do? '
                 'Answer in two sentences.')


def patched_model(stock, ranks):
    return hf_structattn.patch(stock, mlr_ranks=ranks, mlr_max_length=CONTEXT).eval()


def quality(model, windows, stock_scores) -> dict:
    """Perplexity / stock and top-1 agreement with stock on ``windows`` (N, T)."""
    scores = window_scores(model, windows)
    return {"perplexity_ratio": math.exp(float(scores["losses"].mean() - stock_scores["losses"].mean())),
            "top1_agreement": float((scores["argmax"] == stock_scores["argmax"]).double().mean())}


def chat_prompt(tokenizer, texts: Path) -> str:
    """The first ``CHAT_DOCUMENT_TOKENS`` tokens of the held-out topic ``CHAT_DOCUMENT``, then ``CHAT_QUESTION``."""
    document = (texts / "heldout" / f"{CHAT_DOCUMENT}.txt").read_text()
    ids = tokenizer(document, add_special_tokens=False).input_ids[:CHAT_DOCUMENT_TOKENS]
    return f"{tokenizer.decode(ids)}\n\n{CHAT_QUESTION}"


@torch.no_grad()
def chat_answer(model, tokenizer, prompt: str, new_tokens: int = 60) -> str:
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(output[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


LAUNCH = "accelerate launch --quiet --config_file configs/accelerate_one_process.yaml recipes/finetune_patched.py"


def recovery_command(args, ranks, folder, texts, model_path) -> list:
    """The recipe's arguments of one recovery run, the text files as the shell globs of the folders ``write-split``
    fills (``texts/finetune``, ``texts/heldout``): the command docs/patching.md gives, which this bench prints before
    the run (tests/test_docs_consistency.py holds the two equal)."""
    return ["--model_path", str(model_path), "--output_dir", str(folder),
            "--text_files", f"{texts}/finetune/*.txt", "--eval_text_files", f"{texts}/heldout/*.txt",
            "--max_train_bytes", "none", "--max_validation_bytes", "none",
            "--mlr_ranks", *map(str, ranks), "--mlr_max_length", str(CONTEXT), "--seq_len", str(CONTEXT),
            "--eval_windows", "4", "--per_device_batch_size", "1", "--objective", "distill",
            "--learning_rate", f"{args.learning_rate:g}", "--lr_schedule", "cosine",
            "--warmup_steps", "3", "--max_steps", str(args.recovery_steps), "--eval_every", str(args.eval_every),
            "--checkpoint_every", str(args.eval_every), "--sample_new_tokens", "0", "--report_to", "none",
            "--seed", "0"]


def recovery_argv(args, ranks, folder: Path, texts: Path, model_path: Path) -> list:
    """:func:`recovery_command` with its globs expanded, as the shell would."""
    argv = []
    for word in recovery_command(args, ranks, folder, texts, model_path):
        argv += sorted(glob.glob(word)) if "*" in word else [word]
    return argv


def shell_command(words: list) -> str:
    """The recipe's command line from a shell (one line)."""
    return f"{LAUNCH} {' '.join(words)}"


def recovery(args, ranks, texts: Path, model_path: Path) -> dict:
    """Run (or resume) the recipe on ``texts``/finetune (evaluating on ``texts``/heldout); its curve from
    metrics.jsonl; the saved model's folder."""
    from hf_structattn.training.decoder_ft import main as finetune

    folder = Path(args.work) / ("recovery_" + "_".join(map(str, ranks)))
    argv = recovery_argv(args, ranks, folder, texts, model_path)
    if not (folder / "final_metrics.json").is_file():
        print(f"recovery {','.join(map(str, ranks))}: the same run from a shell (after python -m "
              f"hf_structattn.real_weights write-split finetune|heldout {texts}/finetune|heldout):\n"
              f"{shell_command(recovery_command(args, ranks, folder, texts, model_path))}", flush=True)
        resume = ["--resume_from", "latest"] if any(folder.glob("checkpoints/checkpoint_*")) else []
        finetune(argv + resume)
    evals = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
             if line.strip() and "eval/loss" in line]
    curve = [{"step": e["step"], "cpu_minutes": e.get("train_cpu_s", 0.0) / 60, "kl_to_stock": e["eval/kl_to_source"],
              "top1": e["eval/top1_source"], "loss": e["eval/loss"]} for e in evals]
    return {"folder": str(folder), "curve": curve, "cpu_minutes": curve[-1]["cpu_minutes"],
            "steps": curve[-1]["step"]}


def read_results(path: Path, key: dict) -> dict:
    found = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("key") == key:
                    found[(row["part"], row["ranks"])] = row
    return found


def table(settings, found: dict, stock_ppl: float) -> str:
    lines = ["| ranks | keys / stock: formula (allocated) | K+V / stock | ppl / stock, no training | top-1, no training "
             "| recovery: CPU-min (steps) | ppl / stock after | top-1 after | decode ms/token eager: stock / MLR | "
             "static + compile: stock / MLR |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| stock | 1.000 | 1.000 | 1.000 (ppl {stock_ppl:.2f}) | 1.000 | - | - | - | | |"]
    for name in settings:
        drift, rec, dec = (found.get((part, name), {}) for part in ("drift", "recovery", "decode"))
        cell = lambda row, field, fmt: format(row[field], fmt) if field in row else "-"  # noqa: E731
        keys = f"{cell(drift, 'key_cache_ratio', '.3f')} ({cell(dec, 'allocated_key_ratio', '.3f')})"
        eager = f"{cell(dec, 'eager_stock_ms', '.1f')} / {cell(dec, 'eager_mlr_ms', '.1f')}"
        compiled = f"{cell(dec, 'compiled_stock_ms', '.1f')} / {cell(dec, 'compiled_mlr_ms', '.1f')}"
        recovered = f"{rec['cpu_minutes']:.0f} ({rec['steps']})" if rec else "-"
        lines.append(f"| {name.replace(',', chr(92) + '|')} | {keys} | {cell(drift, 'kv_cache_ratio', '.3f')} | "
                     f"{cell(drift, 'perplexity_ratio', '.4f')} | {cell(drift, 'top1_agreement', '.3f')} | "
                     f"{recovered} | {cell(rec, 'perplexity_ratio', '.4f')} | {cell(rec, 'top1_agreement', '.3f')} | "
                     f"{eager} | {compiled} |")
    curves = [(name, found[("recovery", name)]["curve"]) for name in settings if ("recovery", name) in found]
    if curves:
        lines += ["", "Recovery curves (evaluations on 4 held-out windows: KL to stock, nats per token; top-1 "
                      "agreement with stock):", "", "| ranks | step | CPU-min | KL to stock | top-1 |",
                  "|---|---:|---:|---:|---:|"]
        for name, curve in curves:
            lines += [f"| {name.replace(',', chr(92) + '|')} | {p['step']} | {p['cpu_minutes']:.1f} | "
                      f"{p['kl_to_stock']:.4f} | {p['top1']:.3f} |" for p in curve]
    chats = [(name, found[("chat", name)]) for name in settings if ("chat", name) in found]
    if chats:
        lines += ["", f"Chat (greedy, up to 60 tokens): the first {CHAT_DOCUMENT_TOKENS:,} tokens of the held-out topic "
                      f"\"{CHAT_DOCUMENT}\", then \"{CHAT_QUESTION}\"", "",
                  f"* stock: {chats[0][1]['stock']!r}"]
        for name, row in chats:
            lines.append(f"* {name.replace(',', '|')}, no training: {row['before']!r}")
            if row.get("after") is not None:
                lines.append(f"* {name.replace(',', '|')}, after recovery: {row['after']!r}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=rank_list, nargs="+", default=[rank_list(r) for r in DEFAULT_RANKS])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of 2,048 tokens (16 exist)")
    parser.add_argument("--recovery_ranks", type=rank_list, nargs="*", default=[rank_list(r) for r in DEFAULT_RANKS[:2]],
                        help="the settings that get a recovery run (the others: drift, decode, chat)")
    parser.add_argument("--recovery_steps", type=int, default=30, help="optimizer steps of one 2,048-token window")
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--decode_steps", type=int, default=12)
    parser.add_argument("--work", default="outputs/real_checkpoint",
                        help="the output folder: recovery runs, text files, results (JSON lines) and the table")
    parser.add_argument("--update-committed", action="store_true",
                        help=f"read and write the committed results ({COMMITTED_RESULTS}, {COMMITTED_TABLE}) instead "
                             f"of the output folder's: a full run that replaces the guide's table")
    return parser


def output_paths(args) -> tuple:
    """(results, table): the output folder's unless ``--update-committed`` (a run of a few settings never replaces
    the committed table)."""
    if args.update_committed:
        return Path(COMMITTED_RESULTS), Path(COMMITTED_TABLE)
    return Path(args.work) / "real_checkpoint.jsonl", Path(args.work) / "real_checkpoint.md"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        smollm2_folder()
    except RealWeightsUnavailable as error:
        print(f"real weights unavailable: {error}", file=sys.stderr)
        return 1
    stock, tokenizer = load_smollm2(torch.float32)
    stock.eval()
    for ranks in args.ranks:  # every setting checked before the first forward
        try:
            hf_structattn.decoder_patching.plan_decoder_patch(stock, mlr_ranks=ranks, mlr_max_length=CONTEXT)
        except ValueError as error:
            parser.error(f"--ranks {','.join(map(str, ranks))}: {error}")
    texts = Path(args.work) / "text"
    for split in ("finetune", "heldout"):
        write_split(split, texts / split)
    windows = token_windows(tokenizer, "heldout", CONTEXT, args.windows)
    prompt = chat_prompt(tokenizer, texts)
    key = {"windows": args.windows, "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "recovery_steps": args.recovery_steps,
           "learning_rate": args.learning_rate, "lr_schedule": "cosine", "warmup": "(step + 1) / 3"}
    results, table_path = output_paths(args)
    results.parent.mkdir(parents=True, exist_ok=True)
    found = read_results(results, key)

    def keep(part: str, name: str, row: dict) -> None:
        row = {"key": key, "part": part, "ranks": name, **row}
        with open(results, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        found[(part, name)] = row
        print(f"{part} {name}: {json.dumps({k: v for k, v in row.items() if k not in ('key', 'curve')})}", flush=True)

    header = header_line(f"Python {platform.python_version()}, float32, SmolLM2-135M-Instruct (de-quantised GGUF), "
                         f"{args.windows} held-out windows of {CONTEXT} tokens, mlr_max_length={CONTEXT}")
    print(header, flush=True)
    started = time.perf_counter()

    def say(what: str, estimate_s: float) -> None:  # before each phase: what it is and about how long it takes
        print(f"[bench +{time.perf_counter() - started:.0f} s] {what} (about {duration(estimate_s)}) ...", flush=True)

    timed = time.perf_counter()
    first = window_scores(stock, windows[:1])  # one forward of 2,048 tokens: what every estimate below counts in
    forward_s = time.perf_counter() - timed
    say(f"the stock model on {args.windows - 1} more held-out windows ({forward_s:.1f} s per forward of {CONTEXT} "
        f"tokens)", (args.windows - 1) * forward_s)
    rest = window_scores(stock, windows[1:])
    stock_scores = {k: torch.cat([first[k], rest[k]]) for k in first}
    stock_ppl = math.exp(float(stock_scores["losses"].mean()))
    settings = [",".join(map(str, ranks)) for ranks in args.ranks]
    patched = {name: patched_model(stock, ranks) for ranks, name in zip(args.ranks, settings)}
    for ranks, name in zip(args.ranks, settings):  # the cheap parts of every setting first
        if "drift" in args.parts and ("drift", name) not in found:
            say(f"drift {name}: {args.windows} windows", args.windows * forward_s)
            report = decoder_cache_report(patched[name].config, CONTEXT)
            keep("drift", name, {"key_cache_ratio": report["key_cache_ratio"], "kv_cache_ratio":
                                 report["kv_cache_ratio"], **quality(patched[name], windows, stock_scores)})
        if "decode" in args.parts and ("decode", name) not in found:
            models = {"stock": stock, "MLR": patched[name]}
            say(f"decode {name}: eager and static cache + torch.compile after a {CONTEXT}-token prompt, stock and "
                f"MLR (compilation included)", 8 * forward_s + 4 * args.decode_steps * forward_s / 20 + 120)
            eager = speed(models, CONTEXT, args.decode_steps, 1)
            compiled = compiled_decode(models, CONTEXT, args.decode_steps)
            keep("decode", name, {"eager_stock_ms": eager["stock"][1], "eager_mlr_ms": eager["MLR"][1],
                                  "eager_ratio": eager["MLR"][3], "allocated_key_ratio": eager["MLR"][2] /
                                  eager["stock"][2], "compiled_stock_ms": compiled["stock"],
                                  "compiled_mlr_ms": compiled["MLR"]})
    for ranks, name in zip(args.ranks, settings):
        if "recovery" in args.parts and ranks in args.recovery_ranks and ("recovery", name) not in found:
            evaluations = args.recovery_steps // args.eval_every + 1 if args.eval_every else 2
            say(f"recovery {name}: {args.recovery_steps} distillation steps of one window, {evaluations} evaluations "
                f"of 4 windows", (20 + 4 * args.recovery_steps + 8 * evaluations) * forward_s)
            run = recovery(args, ranks, texts, smollm2_folder())
            recovered = transformers.AutoModelForCausalLM.from_pretrained(run["folder"], trust_remote_code=True)
            keep("recovery", name, {**run, **quality(recovered.eval(), windows, stock_scores)})
        if "chat" in args.parts and ("chat", name) not in found:
            say(f"chat {name}: greedy answers of up to 60 tokens to a {CHAT_DOCUMENT_TOKENS:,}-token prompt",
                3 * 2 * forward_s)
            after = None
            if ("recovery", name) in found:
                recovered = transformers.AutoModelForCausalLM.from_pretrained(found[("recovery", name)]["folder"],
                                                                              trust_remote_code=True).eval()
                after = chat_answer(recovered, tokenizer, prompt)
            keep("chat", name, {"stock": chat_answer(stock, tokenizer, prompt),
                                "before": chat_answer(patched[name], tokenizer, prompt), "after": after})
    text = f"{header}\n\n{table(settings, found, stock_ppl)}\n"
    table_path.write_text(text)
    print(text)
    print(f"table: {table_path}; results: {results}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
