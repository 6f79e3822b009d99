"""Init logit scale of MLR attention by pair distance, against dense attention.

    python scripts/logit_scale_report.py               # the paper's LM MLR layer, each scaling option (docs/models.md)
    python scripts/logit_scale_report.py --main-job    # the README main job's two models (configs/clm_mlr_stdlib.yaml)

Default: the paper's LM MLR layer (D = 512, 8 heads of 64, ranks 32|8|6|4|4|4|4|2, T = 1024, q/k LayerNorm), fresh
init, attention inputs N(0, I). Prints the std of the logits of pairs sharing only the global level (distant) and
all 8 levels (nearest) for each scaling option.

``--main-job``: the dense and MLR models ``scripts/run.sh`` trains (the config file's model, seed 0, fresh init):
the std of the logits on attention inputs N(0, I) by shared depth for MLR (``mlr_logit_std_by_depth``) and for
dense (every pair alike, the same inputs and q/k LayerNorm), and the RMS of each layer's row-centred logits on a
window of real bytes (the start of the standard library's argparse.py; ``hf_structattn.mup.attention_logit_rms``).
"""

import argparse
from pathlib import Path

import torch
import yaml

from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
from hf_structattn.diagnostics import mlr_logit_std_by_depth
from hf_structattn.mup import attention_logit_rms

OPTIONS = [("standard", True, "uniform 1/sqrt(64), averaged over shared levels (the LM runs in docs/results.md §2)"),
           ("standard", False, "uniform 1/sqrt(64), summed"),
           ("mup", True, "1/r_l per level, averaged (the authors' LM runs)"),
           ("mup", False, "1/r_l per level, summed")]
MAIN_JOB = Path(__file__).resolve().parents[1] / "configs" / "clm_mlr_stdlib.yaml"


def scaling_options() -> None:
    torch.manual_seed(0)
    print("| mlr_scaling | mlr_average_levels | meaning | std, distant pairs (1 level) | std, nearest pairs (8 levels) "
          "| nearest / distant |")
    print("|---|---|---|---|---|---|")
    for scaling, average, meaning in OPTIONS:
        config = StructAttnGPT2Config(vocab_size=96, n_positions=1024, n_embd=512, n_head=8, n_layer=1,
                                      attention="mlr", mlr_ranks=[32, 8, 6, 4, 4, 4, 4, 2], mlr_scaling=scaling,
                                      mlr_average_levels=average, qk_layernorm=True)
        stds = mlr_logit_std_by_depth(StructAttnGPT2LMHeadModel(config))
        print(f"| {scaling} | {average} | {meaning} | {stds[0]:.3f} | {stds[-1]:.3f} | {stds[-1] / stds[0]:.2f} |")


def dense_logit_std(model, num_tokens: int = 256, seed: int = 0) -> float:
    """Std of dense layers' pre-softmax logits on attention inputs N(0, I) (the inputs ``mlr_logit_std_by_depth``
    draws), pooled over layers, heads and pairs."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, model.config.n_embd, generator=generator)
    values = []
    for block in model.transformer.h:
        attention = block.attn
        query, key, _ = attention.c_attn(hidden[None]).split(attention.embed_dim, -1)
        query, key = attention._split_heads(query)[0], attention._split_heads(key)[0]
        if attention.config.qk_layernorm:
            query, key = attention.q_norm(query), attention.k_norm(key)
        values.append((query @ key.transpose(-1, -2) * attention.scaling).flatten())
    return float(torch.cat(values).std())


def main_job() -> None:
    fields = yaml.safe_load(MAIN_JOB.read_text())["model"]
    text = Path(argparse.__file__).read_bytes()[:fields["n_positions"]]  # a standard-library source
    ids = torch.tensor(list(text))[None]
    models = {}
    for attention in ("dense", "mlr"):
        torch.manual_seed(0)
        models[attention] = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**{**fields, "attention": attention}))
    with torch.no_grad():
        depth = mlr_logit_std_by_depth(models["mlr"])
        dense = dense_logit_std(models["dense"])
        rms = {name: attention_logit_rms(model, input_ids=ids) for name, model in models.items()}
    print(f"main job (configs/clm_mlr_stdlib.yaml: D = {fields['n_embd']}, {fields['n_head']} heads, "
          f"{fields['n_layer']} layers, MLR ranks {fields['mlr_ranks']}, level averaging, q/k LayerNorm), seed 0, init")
    print("| logits | dense | MLR | MLR / dense |")
    print("|---|---|---|---|")
    print(f"| std on N(0, I) inputs, distant pairs (1 shared level) | {dense:.3f} | {depth[0]:.3f} | "
          f"{depth[0] / dense:.2f} |")
    print(f"| std on N(0, I) inputs, nearest pairs ({len(depth)} shared levels) | {dense:.3f} | {depth[-1]:.3f} | "
          f"{depth[-1] / dense:.2f} |")
    for layer in range(len(rms["dense"])):
        print(f"| row-centred RMS on {ids.shape[1]} real bytes, layer {layer + 1} | {rms['dense'][layer]:.3f} | "
              f"{rms['mlr'][layer]:.3f} | {rms['mlr'][layer] / rms['dense'][layer]:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main-job", action="store_true", help="the README main job's dense and MLR models")
    main_job() if parser.parse_args().main_job else scaling_options()
