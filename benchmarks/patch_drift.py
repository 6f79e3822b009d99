"""How far ``hf_structattn.patch`` moves tiny T5 / Chronos-T5 / Chronos-Bolt models before any fine-tuning, for
both level splits (the table in docs/patching.md).

    python benchmarks/patch_drift.py

Models are those of ``tests/model_helpers.py`` (d_model 32, 4 heads of d_kv 8, MLR ranks 4|2|2, blocks 8|4
tokens; Bolt: the same blocks given as 32|16 time steps in patches of 4): a T5 (2 encoder + 3 decoder layers)
trained 300 AdamW steps to reverse 24-token sequences, and randomly initialised Chronos-T5 / Chronos-Bolt,
evaluated on two contexts of 60 and 37 steps. Deterministic (fixed seeds, CPU); one thread.
"""

import platform
import sys
import tempfile
from pathlib import Path

import torch
import transformers

import hf_structattn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from model_helpers import PATCH_MLR, train_copy_task, chronos_contexts, tiny_bolt, tiny_chronos_t5, tiny_stock_t5  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}")
    trained = train_copy_task(tiny_stock_t5(initializer_factor=1.0))
    torch.manual_seed(5)
    ids = torch.randint(2, 64, (8, 24))
    t5_inputs = dict(input_ids=ids, decoder_input_ids=trained._shift_right(ids.flip(1)))
    series = {"context": chronos_contexts(), "prediction_length": 8}
    with tempfile.TemporaryDirectory() as folder:
        chronos_t5 = tiny_chronos_t5(Path(folder) / "chronos_t5")
        bolt = tiny_bolt(Path(folder) / "bolt")
    rows = []
    for init in ("split", "svd"):
        report = hf_structattn.patch_report(trained, hf_structattn.patch(trained, init=init, **PATCH_MLR), t5_inputs)
        rows += [("T5 trained", name, init, report[name]) for name in ("logit_rel", "logit_max_abs", "top1_agreement")]
        report = hf_structattn.patch_report(chronos_t5, hf_structattn.patch(chronos_t5, init=init, **PATCH_MLR), series)
        rows += [("Chronos-T5 tiny", name, init, report[name]) for name in ("logit_rel", "forecast_rel")]
        patched = hf_structattn.patch(bolt, init=init, mlr_ranks=PATCH_MLR["mlr_ranks"], mlr_block_steps=[32, 16])
        rows.append(("Chronos-Bolt tiny", "forecast_rel", init, hf_structattn.patch_report(bolt, patched, series)[
            "forecast_rel"]))
    print("| model | metric | init | value |\n|---|---|---|---|")
    for model, metric, init, value in rows:
        print(f"| {model} | {metric} | {init} | {value:.3g} |")


if __name__ == "__main__":
    main()
