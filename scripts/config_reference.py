"""Write docs/config_reference.md: every field of the package's configs, generated from the code.

    python scripts/config_reference.py            # rewrite docs/config_reference.md
    python scripts/config_reference.py --check    # exit 1 (and say what differs) when the file is not what the code gives

Where each column comes from:

* **name, type, default**: the dataclass fields of ``StructAttnGPT2Config`` and ``StructAttnT5Config`` (transformers'
  configs are ``@strict`` dataclasses), so a field added, removed or given a new default changes the page;
* **meaning**: the class docstring's "Structured-attention fields:" section; for a field the class shares with
  transformers' GPT-2 or T5 config, the ``Args:`` entry of ``transformers.GPT2Config`` / ``transformers.T5Config``;
  a field described in neither place stops this script with its name (describe it in the class docstring);
* **read by** (which variants or roles use the field) and everything about the patched decoders' ``MLR<Arch>Config``
  fields (plain attributes that ``patch`` sets, not dataclass fields): the tables below, the one place they live.

``tests/test_docs_consistency.py`` fails when the page differs from this script's output, when a config field is
missing from it, or when the patcher sets or the payload reads an ``mlr_*`` field of a patched decoder that the
table below does not describe.
"""

import argparse
import dataclasses
import difflib
import re
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "config_reference.md"

GPT2_VARIANTS = "dense, mlr, bilinear_mlr, bilinear_btt, swa"
# which layers of the GPT-2 family read a structured-attention field (the architecture fields: every layer)
GPT2_READ_BY = {
    "attention": "every layer (the variant of every layer `layer_types` does not name)",
    "layer_types": "every layer",
    "mlr_ranks": "mlr", "mlr_block_sizes": "mlr", "mlr_scaling": "mlr", "mlr_average_levels": "mlr",
    "qk_layernorm": f"every variant ({GPT2_VARIANTS})",
    "qk_norm": "every variant, when `qk_layernorm` is true",
    "dense_scaling": "dense, swa",
    "scale_attn_weights": "dense, swa; mlr with `mlr_scaling=\"standard\"` (false: multiplier 1)",
    "attn_pdrop": "dense, swa, bilinear_mlr, bilinear_btt (must be 0 when a layer is mlr)",
    "bilinear_mlr_ranks": "bilinear_mlr",
    "bilinear_scaling": "bilinear_mlr, bilinear_btt", "bilinear_scale_constant": "bilinear_mlr, bilinear_btt",
    "bilinear_weight_rms_clamp": "bilinear_mlr, bilinear_btt",
    "btt_rank": "bilinear_btt", "btt_factors": "bilinear_btt",
    "sliding_window": "swa",
    "icl_input_dim": "`StructAttnGPT2ForInContextRegression` (any variant)",
}
T5_READ_BY = {
    "encoder_attention": "encoder self-attention", "decoder_attention": "decoder self-attention",
    "cross_attention": "decoder-to-encoder cross-attention",
    "mlr_ranks": "every mlr role", "mlr_block_sizes": "every mlr role",
    "mlr_max_length": "every mlr role, when `mlr_block_sizes` is not given", "mlr_scaling": "every mlr role",
    "mlr_average_levels": "every mlr role",
    "bilinear_mlr_ranks": "every bilinear_mlr role", "bilinear_scaling": "every bilinear_mlr / bilinear_btt role",
    "btt_rank": "every bilinear_btt role", "btt_factors": "every bilinear_btt role",
    "structattn_patch": "nothing at run time: provenance (a patched Chronos-Bolt's reload re-applies the spec)",
}
ARCHITECTURE_READ_BY = {"gpt2": "every layer (GPT-2's own field)", "t5": "every role (T5's own field)"}
# where transformers' docstring misdescribes a field (GPT2Config says "scale embeddings by dividing by
# sqrt(d_model)"; GPT-2 divides the attention logits by sqrt(head dim))
MEANING_OVERRIDES = {
    ("gpt2", "scale_attn_weights"): "scale the attention logits: dense and SWA layers by `dense_scaling` "
                                    "(1/sqrt(r) by default), MLR layers with `mlr_scaling=\"standard\"` by "
                                    "1/sqrt(r) on every level; false: multiplier 1, as in GPT-2",
}

# MLR<Arch>Config (a patched Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-2, ...): the architecture's config plus these
# attributes. (name, type, default, read by, meaning)
PATCHED_DECODER_FIELDS = [
    ("mlr_ranks", "list[int]", "required", "the MLR layers",
     "level ranks r_1..r_L summing to the head dim; for RoPE models every level boundary inside the rotated dims "
     "is even, so each level holds whole rotation pairs (`patch(mlr_ranks=...)`)"),
    ("mlr_block_sizes", "list[int]", "from `mlr_max_length`", "the MLR layers",
     "nested block sizes b_2..b_L of the finer levels, in tokens; `patch` takes them or derives them from "
     "`mlr_max_length` (b_l = max_length / 2^(l-1)); the config keeps the sizes, not the length"),
    ("mlr_layers", "list[int] or None", "None", "the model (which layers install MLR)",
     "indices of the MLR layers; None: every layer. The others run the architecture's attention unchanged "
     "(`patch(layers=...)`)"),
    ("mlr_dim_order", "list[int] or None", "None", "the MLR layers (q and k at run time)",
     "the head-dim order in which the level slices are taken (None: identity), chosen by `patch(level_order=...)` "
     "so that every level holds whole RoPE pairs; the weights are never re-based"),
    ("mlr_level_scales", "list[float] or None", "None", "the MLR layers",
     "per-level logit multipliers; None: the attention module's own scaling on every level, so "
     "`mlr_ranks=[head_dim]` is the stock model (`patch(mlr_level_scales=...)`)"),
    ("mlr_level_rule", "str", "`\"blocks\"` (also when absent)", "the MLR layers",
     "which levels a (query, key) pair shares: `\"blocks\"`, the paper's blocks aligned to position 0, or "
     "`\"nearest\"`, level l for keys fewer than b_l positions away (a window per finer level, the same cache "
     "bytes; the rule for pretrained weights patched without training, docs/patching.md) "
     "(`patch(mlr_level_rule=...)`)"),
    ("mlr_patch", "dict", "written by `patch`", "nothing at run time: provenance",
     "how the checkpoint was patched: `source`, `source_model_type`, `init`, `sliding_window_layers`, "
     "`replaced_sliding_layers`, `level_order` (and `calibration_tokens` for `level_order=\"contribution\"`)"),
    ("mlr_notice", "str", "written by `patch`", "people reading config.json",
     "the one-line warning that a stock class loads this checkpoint as a DENSE model, and how to load it instead"),
    ("mlr_level_order", "str", "DEFAULT_LEVEL_ORDER", "a stock model loaded with `attn_implementation=\"mlr\"`",
     "the level-order rule (`\"frequency\"` or `\"index\"`; `\"contribution\"` is refused there, it needs "
     "calibration text) by which such a model finds `mlr_dim_order` from its rotary embedding on first use; "
     "`patch` takes `level_order=` instead and records it in `mlr_patch`"),
]


def config_classes():
    import transformers

    from hf_structattn import StructAttnGPT2Config, StructAttnT5Config

    return [(StructAttnGPT2Config, transformers.GPT2Config, "gpt2", GPT2_READ_BY),
            (StructAttnT5Config, transformers.T5Config, "t5", T5_READ_BY)]


def docstring_fields(doc: str, section: str) -> dict:
    """{name: text} of the ``name[, name]: text`` entries of a docstring's ``section:`` block (continuation lines
    indented deeper; ``a, b: text`` gives both names the text)."""
    lines = (doc or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == section), None)
    if start is None:
        return {}
    out, names, indent = {}, None, None
    for line in lines[start + 1:]:
        if not line.strip():
            if names is not None:
                break
            continue
        width = len(line) - len(line.lstrip())
        entry = re.match(r"\s*([\w, ]+?):\s+(.*)$", line)
        if indent is None:
            indent = width
        if width < indent:
            break
        if width == indent and entry:
            names = [name.strip() for name in entry.group(1).split(",")]
            for name in names:
                out[name] = entry.group(2).strip()
        elif names is not None:
            for name in names:
                out[name] += " " + line.strip()
    return out


def transformers_args(doc: str) -> dict:
    """{name: text} of the ``Args:`` entries of a transformers config docstring (``name (`type`, ...):`` then the
    text on the lines below, indented deeper)."""
    out, name, indent = {}, None, None
    for line in (doc or "").split("Args:", 1)[-1].splitlines():
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        entry = re.match(r"\s*(\w+) \(.*\):\s*$", line)
        if entry and (indent is None or width == indent):
            indent, name = width, entry.group(1)
            out[name] = ""
        elif name is not None and width > indent:
            out[name] = (out[name] + " " + line.strip()).strip()
        elif indent is not None and width <= indent:
            name = None
    return out


def type_name(annotation) -> str:
    """``Optional[list[int]]`` -> ``list[int] or None``; ``Union[float, int]`` -> ``float or int``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(annotation)
        names = [type_name(arg) for arg in args if arg is not type(None)]
        return " or ".join(names + (["None"] if type(None) in args else []))
    if origin is not None:
        inner = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{origin.__name__}[{inner}]"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "required"


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def own_fields(config_class) -> list:
    """The dataclass fields of ``config_class`` that transformers' ``PreTrainedConfig`` does not define."""
    import transformers

    common = {field.name for field in dataclasses.fields(transformers.PreTrainedConfig)}
    return [field for field in dataclasses.fields(config_class) if field.name not in common]


def rows(config_class, architecture_class, family: str, read_by: dict) -> tuple:
    """(structured-attention rows, architecture rows) of a config class: [name, type, default, read by, meaning]."""
    ours = docstring_fields(config_class.__doc__, "Structured-attention fields:")
    theirs = transformers_args(architecture_class.__doc__)
    architecture = {field.name for field in dataclasses.fields(architecture_class)}
    structured, shared = [], []
    for field in own_fields(config_class):
        meaning = ours.get(field.name) or MEANING_OVERRIDES.get((family, field.name)) or theirs.get(field.name)
        if not meaning:
            raise SystemExit(f"{config_class.__name__}.{field.name} has no meaning: describe it in the class docstring's "
                             f"'Structured-attention fields:' section")
        if field.name in read_by:
            reader = read_by[field.name]
        elif field.name in architecture:
            reader = ARCHITECTURE_READ_BY[family]
        else:
            raise SystemExit(f"{config_class.__name__}.{field.name}: say which variants read it in "
                             f"scripts/config_reference.py ({family.upper()}_READ_BY)")
        row = [f"`{field.name}`", type_name(field.type), f"`{default_text(field)}`", reader, meaning]
        (shared if field.name in architecture and field.name not in ours else structured).append(row)
    return structured, shared


def table(rows_: list) -> list:
    lines = ["| field | type | default | read by | meaning |", "|---|---|---|---|---|"]
    return lines + ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows_]


def render() -> str:
    import transformers

    common = sorted(field.name for field in dataclasses.fields(transformers.PreTrainedConfig))
    out = ["# Config reference", "",
           "<!-- generated by scripts/config_reference.py from the config classes; edit the code (or that script's "
           "tables), then run it -->", "",
           "Every field of the package's configs: its type and default as the code declares them, what it means, and "
           "which attention variants (or, for T5, roles) read it. Generated by `python scripts/config_reference.py` "
           f"from the config classes (transformers {transformers.__version__}); "
           "`tests/test_docs_consistency.py` fails when this page and the code disagree. A keyword that is not a "
           "field is refused with the field it resembles (docs/contracts.md). How the variants work: "
           "[models.md](models.md).", ""]
    titles = {"gpt2": ("StructAttnGPT2Config", "`model_type` `structattn_gpt2`: the GPT-2 family "
                       "(`StructAttnGPT2Model`, `StructAttnGPT2LMHeadModel`, `StructAttnGPT2ForInContextRegression`). "
                       "Variants: " + GPT2_VARIANTS + ", one per layer."),
              "t5": ("StructAttnT5Config", "`model_type` `structattn_t5`: the T5 family (`StructAttnT5Model`, "
                     "`StructAttnT5ForConditionalGeneration`, `StructAttnT5EncoderModel`; a patched T5 or "
                     "Chronos-T5). Roles: encoder self-attention, decoder self-attention, cross-attention.")}
    for config_class, architecture_class, family, read_by in config_classes():
        structured, shared = rows(config_class, architecture_class, family, read_by)
        name, intro = titles[family]
        out += [f"## {name}", "", intro, "", "**Structured attention** (meanings from the class docstring):", ""]
        out += table(structured)
        out += ["", f"**{architecture_class.__name__.replace('Config', '')} architecture** (the same fields as "
                f"`transformers.{architecture_class.__name__}`; meanings from its docstring):", ""]
        out += table(shared) + [""]
    out += ["## Patched decoders: `MLR<Arch>Config`", "",
            "`hf_structattn.patch` on a transformers decoder (Llama, Qwen2/3, Mistral, Gemma/Gemma-3, Phi-3, GPT-2, "
            "GPT-NeoX, ...) returns a model whose config is the architecture's own (`LlamaConfig`, ...: every field "
            "kept) with `model_type` `mlr_<type>`, `architectures` `[\"MLR<Arch>ForCausalLM\"]`, an `auto_map`, and "
            "these attributes (a stock checkpoint loaded with `attn_implementation=\"mlr\"` reads the first ones "
            "too: [patching.md](patching.md)):", ""]
    from hf_structattn.modeling.structattn_decoder_spec import DEFAULT_LEVEL_ORDER

    defaults = {"DEFAULT_LEVEL_ORDER": f"`{DEFAULT_LEVEL_ORDER!r}`", "None": "`None`"}
    out += table([[f"`{name}`", kind, defaults.get(default, default), reader, meaning]
                  for name, kind, default, reader, meaning in PATCHED_DECODER_FIELDS])
    out += ["", "## Fields every config has", "",
            "transformers' `PreTrainedConfig` fields, read as for any transformers model: "
            + ", ".join(f"`{name}`" for name in common) + ".", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when they differ")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                       str(OUTPUT.relative_to(ROOT)), "the code"))
            print(f"\n{OUTPUT.relative_to(ROOT)} is out of date: run python scripts/config_reference.py")
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
