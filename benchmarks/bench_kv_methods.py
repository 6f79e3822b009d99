"""Which KV-cache method for which workload: the MLR patch, a sink window, a plain window and int4 at equal bytes.

A user with a pretrained decoder who wants a smaller KV cache or a faster long-context decode step, and no training,
can patch it to MLR (``hf_structattn.patch``), keep a StreamingLLM-style window (attention sinks + the most recent
keys), or quantise the cache (transformers' ``QuantizedCache``). This measures all of them on the real-weights tier's
two models (``hf_structattn.real_weights``; float32, held-out text no calibration sees), one torch thread:

* ``smollm2``: SmolLM2-135M-Instruct, every layer patched, ranks 32|16|8|8;
* ``gemma3``: Gemma-3-270M, its three full-attention layers patched, ranks 128|64|32|32 (the same shares of its
  256-dim heads); its fifteen 512-token sliding layers stay stock in every row but ``int4``.

Methods (rows), each at the prompt length T of its column:

* ``stock``: the released model (SDPA);
* ``mlr``: ``hf_structattn.patch(model, mlr_ranks=..., mlr_max_length=2048)`` (blocks 1024, 512, 256; the paper's
  level rule), its hierarchical cache; ``mlr_nearest``: the same with ``mlr_level_rule="nearest"`` (level l for keys
  fewer than b_l positions away; the same cache and bytes);
* ``sink_window``: the first 4 keys + the most recent ones, in the patched layers, as many as MLR's K+V bytes hold
  there at T (StreamingLLM's cache; scores emulated by a mask over the full sequence, as its cache would give them
  without re-rotating positions); ``window``: the same bytes, no sinks;
* ``int4``: what transformers' ``QuantizedCache(backend="quanto", nbits=4)`` hands each query while decoding token
  by token (its defaults: asymmetric 4 bits per token in groups of 64 dims, the newest up to 128 tokens kept
  unquantised; emulated by :func:`residual_int4_attention`: each query sees the keys of its own 128-token chunk
  unquantised, as that cache holds them when it decodes the window from its first token), in every layer; for
  Gemma-3, which that cache refuses, as a quantised cache that keeps the sliding layers' windows would;
  ``int4_by_frequency``: the same, each key's dims grouped in the patch's dim order (RoPE pairs by frequency, as MLR's
  levels take them) before its groups of 64 are formed: whether ``mlr_int4``'s gain over int4 is that grouping;
* ``mlr_int4``: MLR's stored entries rounded the same way (each level's dims one group per token, at most 64; the
  values in groups of 64; the query's own 128-token chunk unquantised), emulated: the package's quantised cache
  (below) keeps no unquantised residual;
  ``mlr_nearest_int4`` the same for ``mlr_nearest``; ``sink_window_int4``: the sink window in int4 at the bytes of
  ``mlr_int4``;
* ``mlr_nearest_q8``, ``mlr_nearest_k8v4``, ``mlr_nearest_q4``: ``mlr_nearest`` on the package's quantised
  hierarchical cache (``MLRQuantizedCache(config=..., bits=..., key_bits=...)``: level-1 keys in 8, 8, 4 bits and
  values in 8, 4, 4 bits, per token in groups of at most 64 dims with a bf16 scale and minimum each, every token
  quantised, the newest too; the rings in bf16), measured through that cache: the windows scored by one prefill into
  it, decode timed on it.

Columns: K+V bytes / stock's at T (allocated by each cache in a bf16 model: 2 bytes an entry; int4 0.5 byte an entry
plus a bf16 scale and zero point per group, the up to 128 unquantised newest tokens not counted;
``flops.decoder_cache_report`` for MLR), perplexity / stock's and top-1
agreement with stock over the held-out windows (4 of 2,048 and 1 of 8,192 tokens by default), and decode ms per
token after a T-token prompt (the held-out text's first T tokens; thread clock, one thread, the timed variants
interleaved in one process: stock and the window on their DynamicCache (the window's keeps its sinks and most recent
keys), MLR on its own cache, ``int4`` on ``QuantizedCache(backend="quanto", nbits=4)``, which transformers refuses
for models with sliding-window layers such as Gemma-3; the emulated compositions have no cache to time).

Before measuring, each model checks the emulations with the rounding switched off against the models themselves
(:func:`check_emulation`). Rows land in ``kv_methods.jsonl`` as they finish and a rerun skips those done for the
same model, text, token count and versions (resumable); ``kv_methods.md`` beside it is rewritten after each row.
About 70 minutes on one core for both models at the defaults (measured beside another job).

    python benchmarks/bench_kv_methods.py                           # both models: outputs/kv_methods/kv_methods.*
    python benchmarks/bench_kv_methods.py --update-committed        # benchmarks/results/kv_methods.{jsonl,md}
    python benchmarks/bench_kv_methods.py --models smollm2 --lengths 2048
"""

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache, QuantizedCache
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_structattn
from hf_structattn.flops import decoder_cache_report
from hf_structattn.modeling.structattn_cache_quantized import MLRQuantizedCache, SlotCodecs
from hf_structattn.modeling.structattn_install import MLR_ATTENTION, mlr_geometry_of
from hf_structattn.modeling.structattn_reference import masked_softmax_attention, mlr_scores_reference
from hf_structattn.real_weights import RealWeightsUnavailable, load_model, model_folder, splits_digest, split_tokens

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import Clock, header_line  # noqa: E402
from bench_real_weights import window_scores  # noqa: E402
from bench_retrieval import fake_int4  # noqa: E402  (x (..., d) rounded to 4 bits per group of dims, de-quantised)

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": {"ranks": [32, 16, 8, 8], "full_layers_only": False},
          "gemma3": {"ranks": [128, 64, 32, 32], "full_layers_only": True}}
VARIANTS = ("stock", "mlr", "mlr_nearest", "sink_window", "window", "int4", "int4_by_frequency", "mlr_int4",
            "mlr_nearest_int4", "sink_window_int4", "mlr_nearest_q8", "mlr_nearest_k8v4", "mlr_nearest_q4")
# the quantised hierarchical cache: (bits of the level-1 keys, bits of the values)
QUANTISED = {"mlr_nearest_q8": (8, 8), "mlr_nearest_k8v4": (8, 4), "mlr_nearest_q4": (4, 4)}
TIMED = ("stock", "mlr", "mlr_nearest", "window", "int4", *QUANTISED)  # sink_window decodes over as many keys as window
EMULATED = ("int4_by_frequency", "mlr_int4", "mlr_nearest_int4", "sink_window_int4")  # no cache to time
SINKS, GROUP, RESIDUAL, MLR_MAX_LENGTH = 4, 64, 128, 2048
EMULATION = {}  # what the registered "kv_emulation" attention does (set per variant)


def int4_entry_bytes(group: int) -> float:
    """Bytes an int4 entry costs with a bf16 scale and zero point per group of ``group`` entries."""
    return 0.5 + 4 / group


def emulated_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA under this process's own causal (and the layer's sliding-window) mask; in ``EMULATION["layers"]`` with
    only the first ``SINKS`` keys (when ``"sinks"``) and the most recent ``EMULATION["reach"]`` (sinks included)
    visible, and with int4 keys/values as ``QuantizedCache`` holds them (``"int4"``: :func:`residual_int4_attention`).
    query (B, Hq, T, d), key and value (B, Hk, T, d); evaluation windows only (no cache, no padding: the mask
    transformers built for this implementation is not read)."""
    target = module.layer_idx in EMULATION["layers"]
    if target and EMULATION["int4"]:
        return residual_int4_attention(module, query, key, value, **kwargs)
    length = query.shape[2]
    allowed = visible(torch.arange(length)[:, None], torch.arange(length)[None, :], kwargs.get("sliding_window"),
                      EMULATION.get("reach") if target else None)
    return sdpa_attention_forward(module, query, key, value, allowed[None, None], **kwargs)


def visible(rows: torch.Tensor, columns: torch.Tensor, sliding_window=None, reach=None) -> torch.Tensor:
    """Which keys (columns) each query (rows) sees: causal, the layer's own sliding window, and the emulated
    window's sinks (``EMULATION["sinks"]``) and ``reach``."""
    distance = rows - columns
    allowed = distance >= 0
    if sliding_window:
        allowed = allowed & (distance < sliding_window)
    if reach:
        sinks = SINKS if EMULATION["sinks"] else 0
        allowed = allowed & ((distance < reach - sinks) | (columns < sinks))
    return allowed


def residual_int4_attention(module, query, key, value, scaling=None, sliding_window=None, **kwargs):
    """Attention with the keys and values a ``QuantizedCache`` would hand each query while decoding the window token
    by token: int4 (:func:`fake_int4`, per token, groups of ``GROUP`` dims; each MLR level's key dims their own
    groups) for every key older than the query's ``RESIDUAL``-token chunk, full precision inside it (the cache keeps up
    to ``RESIDUAL`` newest tokens unquantised and re-quantises them all when it overflows). For MLR layers the
    package's reference scores (``mlr_scores_reference``: level l's dims count when query and key share a level-l
    block). Materialised, ``RESIDUAL`` queries at a time. query (B, Hq, T, d), key and value (B, Hk, T, d); returns
    (B, T, Hq, d), None."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    geometry = mlr_geometry_of(module) if getattr(module, "layer_idx", None) in EMULATION.get("mlr_layers", ()) \
        else None
    if geometry is not None:
        order = geometry.dim_order_index(query.device)
        if order is not None:
            query, key = query.index_select(-1, order), key.index_select(-1, order)
        starts = [sum(geometry.ranks[:level]) for level in range(geometry.num_levels)]
        quantised_key = torch.cat([fake_int4(key[..., start:start + rank], min(GROUP, rank))
                                   for start, rank in zip(starts, geometry.ranks)], -1)
        scales = geometry.scales(scaling)
    else:
        order = EMULATION.get("key_order")
        if order is None:
            quantised_key = fake_int4(key, GROUP)
        else:
            quantised_key = fake_int4(key.index_select(-1, order), GROUP).index_select(-1, torch.argsort(order))
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    quantised_value = fake_int4(value, GROUP)
    outputs = []
    for first in range(0, query.shape[2], RESIDUAL):
        last = min(first + RESIDUAL, query.shape[2])
        keys = torch.cat([quantised_key[:, :, :first], key[:, :, first:last]], 2)
        values = torch.cat([quantised_value[:, :, :first], value[:, :, first:last]], 2)
        rows, columns = torch.arange(first, last)[:, None], torch.arange(last)[None, :]
        part = query[:, :, first:last]
        if geometry is None:
            scores = (part @ keys.transpose(-1, -2)) * scale
        else:  # the package's own level rule (reference scores), with these keys
            scores = mlr_scores_reference(part, keys, ranks=geometry.ranks, block_sizes=geometry.block_sizes,
                                          scales=scales, positions=rows.T, key_positions=columns,
                                          average_levels=geometry.average_levels, level_rule=geometry.level_rule)
        outputs.append(masked_softmax_attention(scores, values, visible(rows, columns, sliding_window,
                                                                        EMULATION.get("reach"))))
    return torch.cat(outputs, 2).transpose(1, 2).contiguous(), None


def mlr_int4_attention(module, query, key, value, attention_mask, **kwargs):
    """The patched layers' scores with their stored entries in int4 as :func:`residual_int4_attention` keeps them."""
    return residual_int4_attention(module, query, key, value, **kwargs)


def target_layers(model, spec: dict) -> list:
    types = getattr(model.config, "layer_types", None)
    if spec["full_layers_only"]:
        return [index for index, kind in enumerate(types) if kind == "full_attention"]
    return list(range(model.config.num_hidden_layers))


def patch(stock, spec: dict, level_rule: str = "blocks"):
    return hf_structattn.patch(stock, mlr_ranks=spec["ranks"], mlr_max_length=MLR_MAX_LENGTH,
                               layers=target_layers(stock, spec), mlr_level_rule=level_rule).eval()


def cache_bytes(patched, length: int) -> dict:
    """{variant: K+V bytes allocated at ``length`` tokens (bf16 layout)} and the windows' reaches (keys held)."""
    config = patched.config
    report = decoder_cache_report(config, length, dtype_bytes=2)
    head_dim = config.head_dim
    kv_heads = config.num_key_value_heads
    layers = list(config.mlr_layers) if config.mlr_layers is not None else list(range(config.num_hidden_layers))
    geometry = mlr_geometry_of(patched.model.layers[layers[0]].self_attn)
    mlr_keys = geometry.key_cache_elements(length)  # per (KV head, layer)
    stock = report["dense_kv_cache_bytes"]
    others = stock - len(layers) * kv_heads * 2 * length * head_dim * 2  # the layers no method changes
    reach = (mlr_keys + length * head_dim) // (2 * head_dim)  # keys + values a window holds in MLR's bytes
    mlr_int4_layer = (sum(rank * (length if level == 0 else min(size, length)) * int4_entry_bytes(min(GROUP, rank))
                          for level, (rank, size) in enumerate(zip(geometry.ranks, (length,) + tuple(
                              geometry.block_sizes))))
                      + length * head_dim * int4_entry_bytes(GROUP))  # per (KV head, layer)
    int4_reach = int(mlr_int4_layer // (2 * head_dim * int4_entry_bytes(GROUP)))
    window = others + len(layers) * kv_heads * 2 * reach * head_dim * 2
    int4 = stock * int4_entry_bytes(GROUP) / 2
    quantised = {}
    for variant, (key_bits, value_bits) in QUANTISED.items():  # the quantised cache's rows (bf16 scales), bf16 rings
        codecs = SlotCodecs.build(geometry, head_dim, key_bits, value_bits, GROUP, torch.bfloat16)
        quantised[variant] = others + len(layers) * kv_heads * (
            length * (codecs.keys.row_bytes + codecs.values.row_bytes)
            + (mlr_keys - length * geometry.ranks[0]) * 2)
    return {"bytes": {"stock": stock, "mlr": report["kv_cache_bytes"], "mlr_nearest": report["kv_cache_bytes"],
                      "sink_window": window, "window": window, "int4": int4, "int4_by_frequency": int4,
                      "mlr_int4": others + len(layers) * kv_heads * mlr_int4_layer,
                      "mlr_nearest_int4": others + len(layers) * kv_heads * mlr_int4_layer,
                      "sink_window_int4": others + len(layers) * kv_heads * 2 * int4_reach * head_dim
                      * int4_entry_bytes(GROUP), **quantised},
            "reach": {"sink_window": reach, "window": reach, "sink_window_int4": int4_reach}}


def quality(model, patched, variant: str, windows: torch.Tensor, layers: list, reach: dict) -> dict:
    """Scores of one variant (see :func:`window_scores`), with the emulation it needs registered; ``patched``: the
    patched model of the variant's level rule."""
    if variant in QUANTISED:
        key_bits, value_bits = QUANTISED[variant]
        return window_scores(patched, windows, new_cache=lambda: MLRQuantizedCache(
            config=patched.config, bits=value_bits, key_bits=key_bits))
    if variant.startswith("mlr"):
        if variant.endswith("int4"):
            EMULATION.update(mlr_layers=layers, int4=True, reach=None, sinks=False)
            AttentionInterface.register(MLR_ATTENTION, mlr_int4_attention)
        try:
            return window_scores(patched, windows)
        finally:
            AttentionInterface.register(MLR_ATTENTION, EMULATION["mlr"])
    every = variant.startswith("int4")
    order = mlr_geometry_of(patched.model.layers[layers[0]].self_attn).dim_order_index(windows.device) \
        if variant == "int4_by_frequency" else None
    EMULATION.update(layers=list(range(model.config.num_hidden_layers)) if every else layers, key_order=order,
                     int4=every or variant.endswith("int4"), reach=reach.get(variant),
                     sinks=variant.startswith("sink"), mlr_layers=())
    model.set_attn_implementation("kv_emulation" if variant != "stock" else "sdpa")
    try:
        return window_scores(model, windows)
    finally:
        model.set_attn_implementation("sdpa")


def crop_to_window(cache: DynamicCache, layers: list, reach: int) -> None:
    """Keep the first ``SINKS`` and the most recent ``reach - SINKS`` keys/values of ``layers`` (in place)."""
    for index in layers:
        layer = cache.layers[index]
        keep = lambda t: torch.cat([t[..., :SINKS, :], t[..., -(reach - SINKS):, :]], dim=-2)  # noqa: E731
        layer.keys, layer.values = keep(layer.keys), keep(layer.values)


@torch.no_grad()
def decode_times(model, patched, nearest, prompt: torch.Tensor, layers: list, reach: int, rounds: int,
                 steps: int) -> dict:
    """{variant: median thread-ms of one greedy decode step after ``prompt`` (1, T), or why it cannot run}; the
    variants interleaved, ``steps`` steps each per round; ``nearest``: the patch with the nearest-keys rule."""
    stock_cache = DynamicCache(config=model.config)
    # only the last position's logits: a view of the whole (T, vocab) logits would keep them (8.6 GB for Gemma-3 at 8k)
    first = model(prompt, cache=stock_cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    window_cache = copy.deepcopy(stock_cache)
    crop_to_window(window_cache, layers, reach)
    mlr, mlr_nearest = patched(prompt, use_cache=True, logits_to_keep=1), nearest(prompt, use_cache=True,
                                                                                  logits_to_keep=1)
    states = {"stock": [model, stock_cache, first], "mlr": [patched, mlr.cache, mlr.logits[:, -1]],
              "mlr_nearest": [nearest, mlr_nearest.cache, mlr_nearest.logits[:, -1]],
              "window": [model, window_cache, first]}
    for variant, (key_bits, value_bits) in QUANTISED.items():
        output = nearest(prompt, cache=MLRQuantizedCache(config=nearest.config, bits=value_bits, key_bits=key_bits),
                         use_cache=True, logits_to_keep=1)
        states[variant] = [nearest, output.cache, output.logits[:, -1]]
    try:
        int4_cache = QuantizedCache(backend="quanto", config=model.config, nbits=4)
        states["int4"] = [model, int4_cache, model(prompt, cache=int4_cache, use_cache=True,
                                                   logits_to_keep=1).logits[:, -1]]
    except (ValueError, ImportError) as error:  # sliding layers (Gemma-3), or no optimum-quanto
        states["int4"] = str(error).split(". ")[0].split(": ")[0]
    clock, times = Clock("thread"), {variant: [] for variant in states}
    position = {variant: prompt.shape[1] for variant in states}
    tokens = {variant: state[2].argmax(-1, keepdim=True) for variant, state in states.items()
              if not isinstance(state, str)}
    for _ in range(rounds):
        for variant, state in states.items():
            if isinstance(state, str):
                continue
            runner, cache = state[0], state[1]
            for _ in range(steps):
                positions = torch.tensor([[position[variant]]])
                started = clock()
                logits = runner(tokens[variant], cache=cache, position_ids=positions,
                                use_cache=True).logits[:, -1]
                times[variant].append((clock() - started) * 1000)
                tokens[variant], position[variant] = logits.argmax(-1, keepdim=True), position[variant] + 1
    return {variant: state if isinstance(state, str) else statistics.median(times[variant])
            for variant, state in states.items()}


def check_emulation(stock, patched, tokens: torch.Tensor, layers: list, length: int = 1100) -> float:
    """The largest per-token loss difference between the emulations with rounding switched off (and a window that
    reaches every key) and the models themselves (stock SDPA, the patched model's own MLR op) on the held-out
    text's first ``length`` tokens: past every MLR block edge and Gemma-3's 512-token window. The benchmark stops
    when it exceeds 1e-3 nats."""
    global fake_int4
    rounding, fake_int4 = fake_int4, (lambda x, group: x)
    try:
        window = tokens[None, :length]
        stock_scores = quality(stock, patched, "stock", window, layers, {})
        mlr_scores = quality(stock, patched, "mlr", window, layers, {})
        unbounded = {"sink_window": 10 * length}  # a window that reaches every key: the mask path alone
        gaps = [quality(stock, patched, "int4", window, layers, {})["losses"] - stock_scores["losses"],
                quality(stock, patched, "sink_window", window, layers, unbounded)["losses"] - stock_scores["losses"],
                quality(stock, patched, "mlr_int4", window, layers, {})["losses"] - mlr_scores["losses"]]
    finally:
        fake_int4 = rounding
    return max(float(gap.abs().max()) for gap in gaps)


def run_key(name: str, args) -> dict:
    """What a stored row must share with this run to be reused."""
    source = json.loads((model_folder(name, install=False) / "hf_structattn_source.json").read_text())
    return {"model_sha256": source["gguf_sha256"], "text_sha1": splits_digest(), "eval_tokens": args.eval_tokens,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


def covers_variants(record: dict) -> bool:
    """Whether a bytes or decode record has every variant of this version (an older one is measured again)."""
    if record["kind"] == "bytes":
        return set(VARIANTS) <= set(record["ratio"])
    return record["kind"] != "decode" or set(TIMED) <= set(record["ms"])


def measured(records: list) -> list:
    """The models with records, in ``MODELS`` order (the table shows every model measured, not only this run's)."""
    return [name for name in MODELS if any(r["model"] == name for r in records)]


def latest(rows: list, **match):
    """The last record of ``rows`` whose fields equal ``match``, or None."""
    return next((r for r in reversed(rows) if all(r.get(k) == v for k, v in match.items())), None)


def cell(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(records: list, names: list, lengths: list, header: str, command: str) -> str:
    parts = [f"# Which KV method for which workload (no training, equal bytes)\n\n{header}\n\nMade by `{command}`. "
             "K+V / stock: bytes each cache allocates at T in a bf16 model; ppl / stock and top-1 = stock over the "
             "held-out windows of T tokens; decode: median thread-ms of one greedy step after a T-token prompt "
             "(x stock's), one thread. \"emulated\": no cache implements the method; its scores are exact, its decode "
             "is not timed."]
    for name in names:
        rows, reasons = [r for r in records if r["model"] == name], {}
        if not rows:
            continue
        lines = ["| method | " + " | ".join(f"K+V / stock, T = {n:,}" for n in lengths) + " | "
                 + " | ".join(f"ppl / stock, T = {n:,} | top-1 = stock" for n in lengths) + " | "
                 + " | ".join(f"decode ms, T = {n:,}" for n in lengths) + " |",
                 "|---|" + "---:|" * (4 * len(lengths))]
        for variant in VARIANTS:
            cells = []
            for length in lengths:
                sizes = latest(rows, kind="bytes", length=length)
                cells.append(cell(sizes["ratio"].get(variant), 3) if sizes else "-")
            for length in lengths:
                found = latest(rows, kind="quality", length=length, variant=variant)
                cells += [cell(found and found["ppl_ratio"], 4), cell(found and found["top1"], 3)]
            for length in lengths:
                decode = latest(rows, kind="decode", length=length)
                timed = "window" if variant == "sink_window" else variant
                value = decode["ms"].get(timed) if decode else None
                if value is None:
                    cells.append("emulated" if decode and variant in EMULATED else "-")
                elif isinstance(value, str):
                    reasons.setdefault(value, len(reasons) + 1)
                    cells.append(f"not run ({reasons[value]})")
                else:
                    cells.append(f"{value:.1f} ({value / decode['ms']['stock']:.2f}x)")
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        title = {"smollm2": "SmolLM2-135M-Instruct (every layer; ranks 32|16|8|8)",
                 "gemma3": "Gemma-3-270M (the 3 full-attention layers; ranks 128|64|32|32; sliding layers stock)"}[name]
        notes = "".join(f"\n\n({number}) {reason}." for reason, number in reasons.items())
        parts.append(f"## {title}\n\n" + "\n".join(lines) + notes)
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=tuple(MODELS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--eval-tokens", type=int, default=8192,
                        help="held-out tokens scored per length: eval_tokens // T windows of T tokens")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=5, help="decode: interleaved rounds")
    parser.add_argument("--steps", type=int, default=4, help="decode: steps per variant per round")
    parser.add_argument("--work", default="outputs/kv_methods", help="folder of kv_methods.{jsonl,md} and scratch")
    parser.add_argument("--update-committed", action="store_true",
                        help="read and write benchmarks/results/kv_methods.{jsonl,md} (the table docs quote)")
    args = parser.parse_args(argv)
    for length in args.lengths:
        if length < 2 or args.eval_tokens // length < 1:
            parser.error(f"--lengths {length}: needs 2 <= T <= --eval-tokens ({args.eval_tokens})")
    torch.set_num_threads(1)
    folder = ROOT / "benchmarks/results" if args.update_committed else Path(args.work)
    scratch = Path(args.work)
    folder.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    results, table = folder / "kv_methods.jsonl", folder / "kv_methods.md"
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()] \
        if results.is_file() else []
    header = header_line(f"Python {platform.python_version()}, float32, real-weights tier, held-out text "
                         f"({args.eval_tokens:,} tokens per length), mlr_max_length={MLR_MAX_LENGTH}, no training")
    command = "python benchmarks/bench_kv_methods.py" + (" --update-committed" if args.update_committed else "")
    AttentionInterface.register("kv_emulation", emulated_attention)

    def add(record: dict) -> None:
        records.append(record)
        with open(results, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        table.write_text(report(records, measured(records), args.lengths, header, command))
        print(json.dumps({k: v for k, v in record.items() if k != "key"}), flush=True)

    for name in args.models:
        try:
            stock, tokenizer = load_model(name, torch.float32)
        except RealWeightsUnavailable as error:
            print(f"{name}: real weights unavailable: {error}", file=sys.stderr)
            continue
        spec, key = MODELS[name], run_key(name, args)
        patched, nearest = patch(stock, spec), patch(stock, spec, "nearest")
        EMULATION["mlr"] = ALL_ATTENTION_FUNCTIONS[MLR_ATTENTION]
        layers = target_layers(stock, spec)
        tokens = split_tokens(tokenizer, "heldout")

        gap = check_emulation(stock, patched, tokens, layers)
        if gap > 1e-3:
            sys.exit(f"{name}: the int4 emulation without rounding differs from the model by {gap:.2g} nats")
        print(f"{name}: emulation without rounding = the models' own losses within {gap:.1g} nats", flush=True)

        def done(kind: str, length: int, variant=None) -> bool:
            return any(r["model"] == name and r["kind"] == kind and r["length"] == length
                       and r.get("variant") == variant and r["key"] == key
                       and covers_variants(r) for r in records)

        for length in args.lengths:
            sizes = cache_bytes(patched, length)
            if not done("bytes", length):
                stock_bytes = sizes["bytes"]["stock"]
                add({"model": name, "kind": "bytes", "length": length, "key": key, "reach": sizes["reach"],
                     "bytes": sizes["bytes"],
                     "ratio": {v: b / stock_bytes for v, b in sizes["bytes"].items()}})
            count = args.eval_tokens // length
            if count * length > tokens.numel():
                sys.exit(f"the held-out split holds {tokens.numel():,} {name} tokens, fewer than "
                         f"{count} x {length}")
            windows = tokens[:count * length].view(count, length)
            reference_path = scratch / f"stock_{name}_{length}_{key['model_sha256'][:12]}_{args.eval_tokens}.pt"
            reference = torch.load(reference_path) if reference_path.is_file() else None
            for variant in args.variants:
                if done("quality", length, variant) and not (variant == "stock" and reference is None):
                    continue
                scores = quality(stock, nearest if "nearest" in variant else patched, variant, windows, layers,
                                 sizes["reach"])
                if variant == "stock":
                    reference = scores
                    torch.save(scores, reference_path)
                elif reference is None:
                    reference = quality(stock, patched, "stock", windows, layers, sizes["reach"])
                    torch.save(reference, reference_path)
                if done("quality", length, variant):
                    continue
                gap = scores["losses"] - reference["losses"]
                add({"model": name, "kind": "quality", "length": length, "variant": variant, "key": key,
                     "windows": count, "mean_loss": float(scores["losses"].mean()),
                     "ppl_ratio": math.exp(float(gap.mean())),
                     "ppl_ratio_by_window": [math.exp(float(g)) for g in gap.mean(1)],
                     "top1": float((scores["argmax"] == reference["argmax"]).double().mean())})
            if not done("decode", length):
                ms = decode_times(stock, patched, nearest, tokens[None, :length], layers, sizes["reach"]["window"],
                                  args.rounds, args.steps)
                add({"model": name, "kind": "decode", "length": length, "key": key, "ms": ms,
                     "rounds": args.rounds, "steps": args.steps})
    table.write_text(report(records, measured(records), args.lengths, header, command))
    print(f"written: {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
