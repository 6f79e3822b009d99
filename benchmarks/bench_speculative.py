"""Prompt-lookup decoding with the main job's trained models: tokens/s with and without speculation for
the dense and the MLR model, and how many drafted tokens were accepted.

The prompt is a code-editing request on code from the embedded corpus (the standard library's own sources, the data
the models were trained on): a function's source, then a marker, then the first line of the same source again, so
that the continuation repeats much of the prompt (what prompt lookup exploits; 2-3x on real editing tasks).

Models: ``OUT/clm_dense_stdlib`` and ``OUT/clm_mlr_stdlib`` of ``bash scripts/run.sh`` (OUT=outputs by default),
loaded with this package's classes. For each model, ``model.generate`` greedy with and without
``prompt_lookup_num_tokens``; rounds interleave the four variants (the order flips every round); one thread, CPU
time of the thread (``time.thread_time``); tokens/s as the median over rounds with its min-max, and the speed-up of
prompt lookup taken within each round (greedy and prompt lookup of a model ran side by side), its median [min-max].
The speculative tokens are checked to equal the greedy ones. Accepted / drafted counts come from a forward hook that sees each forward's input length: a forward
after the first feeds the last accepted token plus the draft, so drafted = input length - 1 and accepted = tokens
the forward advanced the sequence by, minus one.

    python benchmarks/bench_speculative.py [--runs outputs] [--new_tokens 100] [--draft 6] [--rounds 5]
"""

import argparse
import inspect
import os
import statistics
import sys
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import header_line  # noqa: E402


def editing_prompt(length: int = 100) -> str:
    """The first ``length`` characters of ``textwrap.dedent``'s source (a file of the training corpus), a marker,
    and its first line again: the model is asked to write the code out once more."""
    source = inspect.getsource(textwrap.dedent)[:length]
    return source + "\n# again:\n" + source.splitlines()[0] + "\n"


class ForwardCounter:
    """Counts a model's forwards and the draft tokens speculative decoding fed to them."""

    def __init__(self, model):
        self.lengths = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(ids.shape[1])

    def reset(self):
        self.lengths = []


def speculation_counts(lengths: list, prompt: int, new_tokens: int) -> tuple[int, int]:
    """(drafted, accepted) over one generate call from the input lengths of its forwards: the first forward reads
    the prompt plus a draft, every later one the last token plus a draft; each forward emits its accepted drafts and
    one token of its own."""
    drafted = (lengths[0] - prompt) + sum(length - 1 for length in lengths[1:])
    accepted = new_tokens - len(lengths)
    return drafted, accepted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=os.environ.get("OUT", "outputs"),
                        help="folder holding clm_dense_stdlib and clm_mlr_stdlib (bash scripts/run.sh)")
    parser.add_argument("--new_tokens", type=int, default=100)
    parser.add_argument("--draft", type=int, default=6, help="prompt_lookup_num_tokens")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    for name, value in (("--new_tokens", args.new_tokens), ("--draft", args.draft), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    paths = {kind: os.path.join(args.runs, f"clm_{kind}_stdlib") for kind in ("dense", "mlr")}
    missing = [path for path in paths.values() if not os.path.isfile(os.path.join(path, "config.json"))]
    if missing:
        parser.error(f"no trained model in {', '.join(missing)}: run `bash scripts/run.sh` first (or pass --runs)")

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    import hf_structattn  # noqa: F401  (registers the classes)
    from hf_structattn import StructAttnGPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(paths["mlr"])
    prompt_text = editing_prompt()
    ids = tokenizer(prompt_text, return_tensors="pt").input_ids
    models = {kind: StructAttnGPT2LMHeadModel.from_pretrained(path).eval() for kind, path in paths.items()}
    limit = min(model.config.n_positions for model in models.values())
    if ids.shape[1] + args.new_tokens > limit:
        parser.error(f"a {ids.shape[1]}-token prompt + --new_tokens {args.new_tokens} is beyond n_positions={limit}")
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id, attention_mask=torch.ones_like(ids))
    variants = [(kind, draft) for kind in models for draft in (None, args.draft)]
    counters = {kind: ForwardCounter(model) for kind, model in models.items()}
    times = {variant: [] for variant in variants}
    outputs, counts = {}, {}
    with torch.no_grad():
        for kind, model in models.items():  # warm-up, untimed
            model.generate(ids, **common)
        for round_index in range(args.rounds):
            for kind, draft in (variants if round_index % 2 == 0 else variants[::-1]):  # order flips every round
                extra = {} if draft is None else {"prompt_lookup_num_tokens": draft}
                counters[kind].reset()
                start = time.thread_time()
                out = models[kind].generate(ids, **common, **extra)
                times[(kind, draft)].append(time.thread_time() - start)
                outputs[(kind, draft)] = out
                if draft is not None:
                    counts[kind] = speculation_counts(counters[kind].lengths, ids.shape[1], args.new_tokens)
    for kind in models:
        if not torch.equal(outputs[(kind, None)], outputs[(kind, args.draft)]):
            raise SystemExit(f"{kind}: prompt-lookup tokens differ from greedy decoding")

    print(header_line(f"float32, batch 1, greedy, {ids.shape[1]}-token prompt, {args.new_tokens} new tokens, "
                      f"prompt_lookup_num_tokens={args.draft}, {args.rounds} interleaved rounds, thread clock"))
    print()
    print("| model | decoding | tokens/CPU-s (median [min-max]) | speed-up (median [min-max] over rounds) | drafted "
          "| accepted | acceptance |")
    print("|---|---|---:|---:|---:|---:|---:|")
    speedups = {}
    for kind in models:
        # the speed-up is taken within each round (greedy and prompt lookup ran side by side), then its median
        speedups[kind] = [greedy / lookup for greedy, lookup in zip(times[(kind, None)], times[(kind, args.draft)])]
        for draft in (None, args.draft):
            spans = times[(kind, draft)]
            rates = [args.new_tokens / span for span in spans]
            median = args.new_tokens / statistics.median(spans)
            if draft is None:
                extra = "| greedy | {:,.0f} [{:,.0f}-{:,.0f}] | 1.00x | - | - | - |".format(median, min(rates), max(rates))
            else:
                drafted, accepted = counts[kind]
                ratios = speedups[kind]
                extra = "| prompt lookup | {:,.0f} [{:,.0f}-{:,.0f}] | {:.2f}x [{:.2f}-{:.2f}] | {} | {} | {:.0%} |".format(
                    median, min(rates), max(rates), statistics.median(ratios), min(ratios), max(ratios), drafted,
                    accepted, accepted / drafted if drafted else 0.0)
            print(f"| {kind} {extra}")
    print()
    relative = [mlr / dense for mlr, dense in zip(speedups["mlr"], speedups["dense"])]
    print(f"MLR's speed-up / dense's, per round: median {statistics.median(relative):.2f} "
          f"[{min(relative):.2f}-{max(relative):.2f}]")
    print()
    print(f"prompt: {prompt_text!r}")
    print(f"MLR continuation: {tokenizer.decode(outputs[('mlr', None)][0, ids.shape[1]:])!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
