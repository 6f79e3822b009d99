"""Init logit scale of MLR attention by pair distance for the LM settings (docs/models.md).

    python scripts/logit_scale_report.py

Model: the paper's LM MLR layer (D = 512, 8 heads of 64, ranks 32|8|6|4|4|4|4|2, T = 1024, q/k LayerNorm), fresh
init, attention inputs N(0, I). Prints the std of the logits of pairs sharing only the global level (distant) and
all 8 levels (nearest) for each scaling option.
"""

import torch

from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel
from hf_structattn.diagnostics import mlr_logit_std_by_depth

OPTIONS = [("standard", True, "uniform 1/sqrt(64), averaged over shared levels (the LM runs in docs/results.md §2)"),
           ("standard", False, "uniform 1/sqrt(64), summed"),
           ("mup", True, "1/r_l per level, averaged (the authors' LM runs)"),
           ("mup", False, "1/r_l per level, summed")]


def main():
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


if __name__ == "__main__":
    main()
