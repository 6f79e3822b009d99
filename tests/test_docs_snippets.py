"""Every Python snippet in README.md, docs/*.md and recipes/README.md runs as written.

A document's ```python blocks run in order in one fresh interpreter (a later block may use what an earlier block of
the same document defined, as a reader would), in an empty temporary folder, offline, with the checkout importable.
A snippet that needs a model builds a tiny one locally; nothing is downloaded. README.md and docs/models.md show what
their commented prints print; docs/patching.md's table of cache bytes is what its snippet prints. No snippet prints a
Python warning (a library's notice is filtered where the snippet causes it, with the reason beside the filter).

docs/patching.md's real-checkpoint guide (the bash blocks after a ``<!-- tests/test_docs_snippets.py runs this block``
comment) runs as written, except for the listed edits: the download becomes a tiny local model of the same head dim,
and the fine-tuning a few short steps."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
WARNING = re.compile(r"\b\w*Warning: ")  # how Python prints a warning: "file.py:12: FutureWarning: ..."
PRINTED = re.compile(r"^[ \t]*print\(.*?\)[ \t]+#[ \t]*(\S.*?)[ \t]*$", re.M)  # print(...)  # what it prints


def python_blocks(path: Path) -> list:
    return BLOCK.findall(path.read_text())


WITH_SNIPPETS = [path for path in DOCUMENTS if python_blocks(path)]


def test_the_documents_with_snippets_are_found():
    assert ROOT / "README.md" in WITH_SNIPPETS


@pytest.mark.parametrize("path", WITH_SNIPPETS, ids=lambda path: str(path.relative_to(ROOT)))
def test_python_snippets_run_as_written(path, tmp_path):
    blocks = python_blocks(path)
    program = "\n".join(f"# --- block {index + 1} of {path.name}\n{block}" for index, block in enumerate(blocks))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"{path.name}: {result.stderr[-3000:]}"
    warned = [line for line in result.stderr.splitlines() if WARNING.search(line)]
    assert not warned, f"{path.name}'s snippets print warnings:\n" + "\n".join(warned)
    if path.name == "README.md":  # the README shows what it prints: each commented print's output appears as written
        for expected in PRINTED.findall(program):
            assert expected in result.stdout, (expected, result.stdout[-2000:])
    if path.name == "models.md":  # so does models.md (its Trainer and export snippets)
        for expected in PRINTED.findall(program):
            assert expected in result.stdout, (expected, result.stdout[-2000:])
    if path.name == "patching.md":  # the table of cache bytes on real checkpoints' shapes is what its snippet prints
        document = path.read_text().replace("\\|", "|")
        rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
        assert len(rows) == 6, result.stdout[-2000:]
        for row in rows:
            assert row in document, f"{path.name} prints a table row it does not show: {row}"


# ---------------------------------------------------------------- the real-checkpoint guide (docs/patching.md)
GUIDE_MARKER = "<!-- tests/test_docs_snippets.py runs this block"
GUIDE_BLOCK = re.compile(re.escape(GUIDE_MARKER) + r".*?-->\n```bash\n(.*?)^```", re.M | re.S)

# the tiny local stand-ins for the downloads: same head dim (64) as the real checkpoints, random weights
MAKE_TINY = '''
import sys
import torch
import transformers

kind, out = sys.argv[1:]
torch.manual_seed(0)
if kind == "qwen2":  # stands in for Qwen/Qwen2.5-0.5B (head dim 64, GQA)
    from hf_structattn.tokenization import build_byte_tokenizer

    config = transformers.Qwen2Config(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                                      bos_token_id=256, eos_token_id=256, pad_token_id=256)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)
else:  # stands in for amazon/chronos-t5-small (head dim 64, context 512)
    chronos_config = dict(tokenizer_class="MeanScaleUniformBins", tokenizer_kwargs=dict(low_limit=-15.0,
                          high_limit=15.0), n_tokens=64, n_special_tokens=2, pad_token_id=0, eos_token_id=1,
                          use_eos_token=True, model_type="seq2seq", context_length=512, prediction_length=8,
                          num_samples=4, temperature=1.0, top_k=50, top_p=1.0)
    config = transformers.T5Config(vocab_size=64, d_model=64, d_kv=64, d_ff=64, num_layers=1, num_decoder_layers=1,
                                   num_heads=1, feed_forward_proj="relu", dropout_rate=0.0, pad_token_id=0,
                                   eos_token_id=1, decoder_start_token_id=0, chronos_config=chronos_config,
                                   architectures=["T5ForConditionalGeneration"])
    transformers.T5ForConditionalGeneration(config).save_pretrained(out)
'''
FAST_CLM = "--max_steps 2 --eval_every 0 --eval_windows 2 --per_device_batch_size 2 --sample_new_tokens 8"
FAST_CHRONOS = ("--max_steps 2 --eval_every 0 --synthetic_series 8 --synthetic_eval_series 2 --real_datasets nile "
                "--eval_num_samples 2 --per_device_batch_size 4 --real_eval_windows 2")
GUIDES = {  # what each guide block downloads, and the only edits the test makes (each must match exactly once)
    "qwen2": {"hf download Qwen/Qwen2.5-0.5B --local-dir qwen2.5-0.5b": "python make_tiny.py qwen2 qwen2.5-0.5b",
              "--seq_len 2048": "--seq_len 64", "--max_steps 1000": FAST_CLM},
    "chronos": {"hf download amazon/chronos-t5-small --local-dir chronos-t5-small":
                "python make_tiny.py chronos chronos-t5-small", "--max_steps 1000": FAST_CHRONOS},
}


def guide_blocks() -> list:
    return GUIDE_BLOCK.findall((ROOT / "docs" / "patching.md").read_text())


def test_the_guide_blocks_are_found():
    blocks = guide_blocks()
    assert len(blocks) == len(GUIDES) and "Qwen/Qwen2.5-0.5B" in blocks[0] and "chronos-t5-small" in blocks[1]


@pytest.mark.parametrize("index, kind", list(enumerate(GUIDES)))
def test_real_checkpoint_guide_runs_on_a_tiny_local_model(index, kind, tmp_path):
    if kind == "chronos":
        pytest.importorskip("chronos")
    script = guide_blocks()[index]
    for old, new in GUIDES[kind].items():
        assert script.count(old) == 1, (old, script)
        script = script.replace(old, new)
    (tmp_path / "make_tiny.py").write_text(MAKE_TINY)
    (tmp_path / "my_corpus.txt").write_text((ROOT / "hf_structattn" / "decoder_patching.py").read_text() * 2)
    for name in ("configs", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{kind}: {result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    if kind == "qwen2":
        assert "drift before fine-tuning" in result.stdout and "'logit_rel'" in result.stdout
        assert "dry run: would upload" in result.stdout and "model.safetensors" in result.stdout
        config = (tmp_path / "qwen2.5-0.5b-mlr-ft" / "config.json").read_text()
        assert '"mlr_qwen2"' in config and "[\n    1024,\n    512,\n    256\n  ]" in config
    else:
        assert "torch.Size([1, 4, 8])" in result.stdout  # one series, 4 samples, 8 steps
        assert (tmp_path / "chronos-t5-small-mlr-ft" / "config.json").is_file()
