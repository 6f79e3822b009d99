"""Tiny models and the isolated interpreter that several test files share (benchmarks/patch_drift.py uses the
patching ones too): the package's T5 family, stock T5 / Chronos models to patch, and ``run_isolated``, where a saved
checkpoint is reloaded by an interpreter that cannot import hf_structattn. The GPT-2 family's ``tiny_lm`` is in
conftest.py; what the tests that drive a cache layer share is in cache_helpers.py."""

import os
import subprocess
import sys
import textwrap

import torch
import transformers

from hf_structattn import StructAttnT5Config, StructAttnT5ForConditionalGeneration

# ------------------------------------------------------------------ the package's T5 family

T5_BASE = dict(vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
               dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
T5_MLR = dict(encoder_attention="mlr", decoder_attention="mlr", mlr_ranks=[4, 2, 2], mlr_max_length=16)  # blocks 8|4


def left_padded(ids: torch.Tensor, pads, length: int):
    """Rows of ``ids`` left-padded to ``length`` with generate's mask and positions (cumsum - 1)."""
    batch = torch.zeros(len(pads), length, dtype=torch.long)
    mask = torch.zeros(len(pads), length, dtype=torch.long)
    for row, pad in enumerate(pads):
        batch[row, pad:] = ids[row, :length - pad]
        mask[row, pad:] = 1
    return batch, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def tiny_structattn_t5(seed=0, **fields):
    torch.manual_seed(seed)
    model = StructAttnT5ForConditionalGeneration(StructAttnT5Config(**{**T5_BASE, **fields})).eval()
    with torch.no_grad():  # asymmetric weights so that head / level mix-ups cannot cancel out
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


# ------------------------------------------------------------------ stock models to patch

STOCK_T5_FIELDS = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
                       feed_forward_proj="relu", dropout_rate=0.0, initializer_factor=0.5, pad_token_id=0,
                       eos_token_id=1, decoder_start_token_id=0)
PATCH_MLR = dict(mlr_ranks=[4, 2, 2], mlr_block_sizes=[8, 4])  # ``hf_structattn.patch`` keywords


def tiny_stock_t5(seed=0, **overrides):
    torch.manual_seed(seed)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(**{**STOCK_T5_FIELDS, **overrides})).eval()


def tiny_chronos_t5(path):
    """A Chronos-T5 pipeline of a tiny random T5, saved to and loaded from ``path`` (needs chronos-forecasting)."""
    from chronos import ChronosPipeline

    chronos_config = dict(tokenizer_class="MeanScaleUniformBins",
                          tokenizer_kwargs=dict(low_limit=-15.0, high_limit=15.0), n_tokens=64, n_special_tokens=2,
                          pad_token_id=0, eos_token_id=1, use_eos_token=True,
                          model_type="seq2seq", context_length=64, prediction_length=8, num_samples=4,
                          temperature=1.0, top_k=50, top_p=1.0)
    # num_decoder_layers == num_layers: transformers' own T5 generate() cannot size its cache otherwise
    tiny_stock_t5(chronos_config=chronos_config, num_decoder_layers=2).save_pretrained(path)
    return ChronosPipeline.from_pretrained(path, device_map="cpu", dtype=torch.float32)


def tiny_bolt(path):
    """A Chronos-Bolt pipeline of a tiny random model, saved to and loaded from ``path`` (needs chronos-forecasting)."""
    from chronos.chronos_bolt import ChronosBoltModelForForecasting, ChronosBoltPipeline

    config = transformers.T5Config(**{**STOCK_T5_FIELDS, "vocab_size": 2}, chronos_pipeline_class="ChronosBoltPipeline",
                                   chronos_config=dict(context_length=64, prediction_length=8, input_patch_size=4,
                                                       input_patch_stride=4, quantiles=[0.1, 0.5, 0.9],
                                                       use_reg_token=True))
    config.architectures = ["ChronosBoltModelForForecasting"]
    torch.manual_seed(0)
    ChronosBoltModelForForecasting(config).save_pretrained(path)
    return ChronosBoltPipeline.from_pretrained(path, device_map="cpu", dtype=torch.float32)


def chronos_contexts():
    t = torch.arange(60, dtype=torch.float32)
    return [10 + 4 * torch.sin(t / 3), 5 + 0.1 * t[:37] + torch.cos(t[:37])]  # different lengths: left padding


def train_copy_task(model, steps=300):
    """Teach a tiny T5 to reverse 24-token sequences (enough structure for attention to matter)."""
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = torch.randint(2, 64, (8, 24))
        loss = model(input_ids=ids, labels=ids.flip(1)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


# ------------------------------------------------------------------ remote code

BLOCK_IMPORT = textwrap.dedent("""
    import importlib.abc, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_structattn" or name.startswith("hf_structattn."):
                raise ImportError("hf_structattn is deliberately not importable here")
    sys.meta_path.insert(0, _Block())
    try:
        import hf_structattn  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hf_structattn was importable")
""")


def run_isolated(script: str, workdir) -> str:
    """Run ``script`` in a fresh interpreter that cannot import hf_structattn; returns stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(workdir / "modules"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-c", BLOCK_IMPORT + textwrap.dedent(script)], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
