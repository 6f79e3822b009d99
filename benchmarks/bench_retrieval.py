"""Long-range retrieval at equal K+V bytes: a pass key placed in real text, asked for at the end.

A sliding window cannot retrieve what lies before it, by construction; MLR keeps every key at its coarse width. This
measures whether that matters on a real pretrained decoder patched without training: SmolLM2-135M-Instruct (the
real-weights tier, ``hf_structattn.real_weights``; float32), in its chat template. A trial is one prompt: a haystack
(``--haystack``: ``pydoc``, the held-out split's real text from a random offset; ``repeat``, the classic pass-key
filler of Mohtashami & Jaggi 2023, "The grass is green. The sky is blue. ..." repeated) with the sentence "The pass key is NNNNN. Remember it: NNNNN." inserted at a depth of
the text, then "What is the pass key? Answer with the number only." as the user's question; the assistant turn
starts "The pass key is" and the key is teacher-forced (SmolLM2's tokenizer gives a space token, then one token per
digit). A trial is **retrieved** when the model's argmax at every digit is the key's digit (the space is given:
the stock model sometimes opens with a quote). With ``--facts N`` a prompt holds N pass keys, each "of" its own
holder ("The pass key of the red door is NNNNN. ..."), the asked one at the depth and the others at random depths,
and the question and the answer's opening name the holder: retrieval by association, not by the one number in
sight. Prompt lengths are ``--length`` minus a random 0-255 tokens, so the answer falls at
a random place in its block (the patched model's first tokens of a block see even their nearest keys through the
coarse dims only).

Variants, all without training, each reading the same prompts:

* ``stock``: SmolLM2 as released (de-quantised GGUF, SDPA);
* ``mlr``: the default patch, ``hf_structattn.patch(model, mlr_ranks=[32, 16, 8, 8], mlr_max_length=2048)``;
* ``window``: 4 attention sinks + the most recent keys, as many as MLR's K+V bytes hold at the prompt's length
  (StreamingLLM's cache, emulated by a mask over the full prompt: the same scores its cache would give);
* ``int4``: keys and values rounded to 4 bits (asymmetric, one scale and zero per 32 dims of a token; emulated:
  quantised and de-quantised before SDPA; transformers' QuantizedCache keeps its newest 128 tokens unquantised);
* ``mlr_nearest``: the same patch with ``mlr_level_rule="nearest"``: level l's dims for the keys fewer than ``b_l``
  positions away instead of the query's own level-l block (the same cache bytes);
* ``mlr_nearest_k8v4``: ``mlr_nearest`` reading its prompt through the package's quantised hierarchical cache,
  ``MLRQuantizedCache(config=..., bits=4, key_bits=8)`` (level-1 keys in 8 bits, values in 4, every token rounded;
  0.37 of stock's K+V bytes at 2k).

Per variant and length: retrieved trials / trials with a 95 % Wilson interval, overall, for needles the window cannot
see (older than its reach) and by depth. Trials are appended to ``--results`` (JSON lines) as they finish; a rerun
skips those done (resumable). One torch thread.

    python benchmarks/bench_retrieval.py                       # outputs/retrieval/retrieval.{jsonl,md}
    python benchmarks/bench_retrieval.py --update-committed    # benchmarks/results/retrieval.{jsonl,md}
    python benchmarks/bench_retrieval.py --update-committed --haystack pydoc   # adds the real-text rows
    python benchmarks/bench_retrieval.py --update-committed --facts 4          # adds the four-fact rows
"""

import argparse
import json
import math
import os
import platform
import random
import sys
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_structattn
from hf_structattn.flops import decoder_cache_report
from hf_structattn.modeling.structattn_cache_quantized import MLRQuantizedCache
from hf_structattn.real_weights import split_tokens

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_real_weights import load_stock_or_exit  # noqa: E402
from bench_generation import header_line  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
VARIANTS = ("stock", "mlr", "window", "int4", "mlr_nearest", "mlr_nearest_k8v4")
RANKS = [32, 16, 8, 8]
SINKS = 4
# what the facts of a multi-fact prompt are about (``--facts N``: N pass keys, one per holder, one of them asked for)
HOLDERS = ("the red door", "the blue box", "the green car", "the old clock", "the tall tower", "the small boat",
           "the iron gate", "the glass jar")
WINDOW = {}  # the registered window function's reach (tokens), set per prompt


def window_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA over the first ``SINKS`` keys and the ``WINDOW["keys"] - SINKS`` most recent ones (causal)."""
    length = query.shape[2]
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    allowed = (distance >= 0) & ((distance < WINDOW["keys"] - SINKS) | (torch.arange(length)[None, :] < SINKS))
    return sdpa_attention_forward(module, query, key, value, allowed[None, None], **kwargs)


def fake_int4(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x (..., d) rounded to 16 levels per group of ``group`` dims (asymmetric min/max), returned de-quantised."""
    grouped = x.unflatten(-1, (-1, group))
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15
    return ((grouped - low) / scale).round().clamp(0, 15).mul(scale).add(low).flatten(-2)


def int4_attention(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, fake_int4(key), fake_int4(value), attention_mask, **kwargs)


def wilson(hits: int, total: int) -> str:
    """'hits/total (rate, 95 % interval)'."""
    if total == 0:
        return "-"
    z, rate = 1.96, hits / total
    centre = (rate + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(rate * (1 - rate) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return f"{hits}/{total} ({rate:.2f}, {max(0.0, centre - half):.2f}-{min(1.0, centre + half):.2f})"


def build_trial(tokenizer, text: torch.Tensor, length: int, depth: float, rng: random.Random, facts: int = 1
                ) -> dict:
    """Token ids of one prompt (chat template, the needle at ``depth`` of the text) and where its answer is. With
    ``facts`` > 1 the prompt holds that many pass keys, each of its own holder (``HOLDERS``), the asked one at
    ``depth`` and the others at random depths, and the question names the holder."""
    keys = [f"{rng.randrange(10000, 100000)}" for _ in range(facts)]
    key = keys[0]
    holders = rng.sample(HOLDERS, facts) if facts > 1 else [None]
    of = (lambda holder: f" of {holder}" if holder else "")  # noqa: E731
    needles = [tokenizer(f" The pass key{of(holder)} is {value}. Remember it: {value}. ",
                         add_special_tokens=False).input_ids for holder, value in zip(holders, keys)]
    needle = needles[0]
    head, tail = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], add_generation_prompt=True,
                                               tokenize=False).split("\x00")
    head_ids = tokenizer(head, add_special_tokens=False).input_ids
    question = tokenizer(f"\n\nWhat is the pass key{of(holders[0])}? Answer with the number only." + tail
                         + f"The pass key{of(holders[0])} is", add_special_tokens=False).input_ids
    answer = tokenizer(f" {key}", add_special_tokens=False).input_ids
    filler = length - rng.randrange(0, 256) - len(head_ids) - sum(map(len, needles)) - len(question) - len(answer)
    start = rng.randrange(0, text.numel() - filler)
    body = text[start:start + filler].tolist()
    cut = int(depth * filler)
    # the other facts at random depths, inserted from the back so that earlier cuts keep their places
    others = sorted(((rng.randrange(0, filler + 1), other) for other in needles[1:]), reverse=True)
    for place, other in others:
        body = body[:place] + other + body[place:]
        if place <= cut:
            cut += len(other)
    ids = head_ids + body[:cut] + needle + body[cut:] + question + answer
    # the digits are scored; a separate space token before them is given (the model may open with a quote instead)
    digits = len(answer) - (1 if not tokenizer.decode(answer[:1]).strip() else 0)
    return {"ids": ids, "answer_start": len(ids) - digits, "needle_at": len(head_ids) + cut,
            "needle_end": len(head_ids) + cut + len(needle), "key": key}


@torch.no_grad()
def retrieved(model, trial: dict, cache=None) -> bool:
    ids = torch.tensor([trial["ids"]])
    start = trial["answer_start"]
    logits = model(ids[:, :-1], cache=cache, use_cache=cache is not None).logits[0, start - 1:]
    return bool((logits.argmax(-1) == ids[0, start:]).all())


def equal_bytes_window(config, length: int) -> int:
    """Keys (sinks included) a sink + window cache holds in MLR's K+V bytes at ``length`` tokens."""
    return int(decoder_cache_report(config, length)["kv_cache_ratio"] * length)


def report(records: list, lengths: list, depths: list) -> str:
    lines = ["| haystack | facts | variant | prompt | retrieved (95 % interval) | needle older than the window's reach | "
             + " | ".join(f"depth {depth:.0%}" for depth in depths) + " |",
             "|---|---:|---|---|---|---|" + "---|" * len(depths)]
    counts = sorted({r.get("facts", 1) for r in records})
    for haystack, facts, variant, length in [(h, f, v, n) for h in ("repeat", "pydoc") for f in counts
                                             for v in VARIANTS for n in lengths]:
        chosen = [r for r in records if (r["haystack"], r.get("facts", 1), r["variant"], r["length"])
                  == (haystack, facts, variant, length)]
        if not chosen:
            continue
        beyond = [r for r in chosen if r["beyond_window"]]
        cells = [wilson(sum(r["retrieved"] for r in chosen), len(chosen)),
                 wilson(sum(r["retrieved"] for r in beyond), len(beyond))]
        for depth in depths:
            at = [r for r in chosen if r["depth"] == depth]
            cells.append(f"{sum(r['retrieved'] for r in at)}/{len(at)}")
        lines.append(f"| {haystack} | {facts} | {variant} | {length:,} - 0..255 | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.05, 0.25, 0.5, 0.75, 0.95])
    parser.add_argument("--trials", type=int, default=6, help="prompts per length and depth")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--haystack", default="repeat", choices=("repeat", "pydoc"))
    parser.add_argument("--facts", type=int, default=1, choices=range(1, len(HOLDERS) + 1),
                        help="pass keys per prompt, each of its own holder; one is asked for")
    parser.add_argument("--work", default="outputs/retrieval", help="folder of retrieval.jsonl and retrieval.md")
    parser.add_argument("--update-committed", action="store_true",
                        help="read and write benchmarks/results/retrieval.{jsonl,md} (the table docs quote)")
    args = parser.parse_args(argv)
    bad = [depth for depth in args.depths if not 0 <= depth <= 1]
    if bad:
        parser.error(f"--depths must lie in [0, 1], got {bad[0]}")
    torch.set_num_threads(1)
    stock, tokenizer = load_stock_or_exit()
    folder = ROOT / "benchmarks/results" if args.update_committed else Path(args.work)
    folder.mkdir(parents=True, exist_ok=True)
    results = folder / "retrieval.jsonl"
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()] \
        if results.is_file() else []
    done = {(r["haystack"], r.get("facts", 1), r["variant"], r["length"], r["depth"], r["trial"]) for r in records}
    header = header_line(f"Python {platform.python_version()}, float32, SmolLM2-135M-Instruct (real-weights tier), "
                         f"held-out text, no training")
    print(header, flush=True)
    if args.haystack == "pydoc":
        text = split_tokens(tokenizer, "heldout")
    else:
        text = torch.tensor(tokenizer(FILLER * (max(args.lengths) // 8), add_special_tokens=False).input_ids)
    patched = hf_structattn.patch(stock, mlr_ranks=RANKS, mlr_max_length=2048).eval()
    nearest = hf_structattn.patch(stock, mlr_ranks=RANKS, mlr_max_length=2048, mlr_level_rule="nearest").eval()
    AttentionInterface.register("sdpa_sink_window", window_attention)
    AttentionInterface.register("sdpa_int4", int4_attention)
    trials = {}
    for length in args.lengths:
        for depth in args.depths:
            for trial in range(args.trials):
                seed = f"{args.haystack}-{length}-{depth}-{trial}" + (f"-{args.facts}" if args.facts > 1 else "")
                trials[(length, depth, trial)] = build_trial(tokenizer, text, length, depth, random.Random(seed),
                                                             args.facts)
    for variant in args.variants:
        model = {"mlr": patched, "mlr_nearest": nearest, "mlr_nearest_k8v4": nearest}.get(variant, stock)
        if variant in ("stock", "window", "int4"):
            stock.set_attn_implementation({"stock": "sdpa", "window": "sdpa_sink_window", "int4": "sdpa_int4"}[variant])
        for (length, depth, trial), prompt in trials.items():
            if (args.haystack, args.facts, variant, length, depth, trial) in done:
                continue
            reach = equal_bytes_window(patched.config, len(prompt["ids"]))
            WINDOW["keys"] = reach
            # the query that predicts the first digit sees the needle's last token only inside the window's reach
            beyond = (prompt["answer_start"] - 1) - (prompt["needle_end"] - 1) >= reach - SINKS
            record = {"haystack": args.haystack, "facts": args.facts, "variant": variant, "length": length,
                      "depth": depth, "trial": trial,
                      "tokens": len(prompt["ids"]), "needle_at": prompt["needle_at"], "window_keys": reach,
                      "beyond_window": bool(beyond), "answer_phase": (prompt["answer_start"] - 1) % 256,
                      "retrieved": retrieved(model, prompt, MLRQuantizedCache(config=nearest.config, bits=4,
                                                                              key_bits=8)
                                             if variant == "mlr_nearest_k8v4" else None)}
            with open(results, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            records.append(record)
            print(f"{variant} T={record['tokens']} depth {depth:.0%} trial {trial}: "
                  f"{'retrieved' if record['retrieved'] else 'missed'}", flush=True)
    # every measured length and depth, not only this run's
    table = report(records, sorted({r["length"] for r in records}), sorted({r["depth"] for r in records}))
    (folder / "retrieval.md").write_text(
        f"# Pass-key retrieval at equal K+V bytes\n\n{header}\n\nMade by `python benchmarks/bench_retrieval.py"
        f"{' --update-committed' if args.update_committed else ''}` ({args.trials} prompts per length and depth).\n\n"
        f"{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
