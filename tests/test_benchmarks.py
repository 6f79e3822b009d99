"""The measurement tooling at toy sizes: the allocated-cache-bytes helper, bench_cache_memory, bench_memory (and the
fused op's forward pieces it motivated), bench_generation's decode cells, bench_speculative, bench_real_weights'
scores, table and resume (its model is the real-weights tier's), bench_real_checkpoint's recovery run and table, and
scripts/compare_runs.py."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel, mlr_attention, mlr_attention_reference
from hf_structattn.cache_memory import allocated_cache_bytes
from hf_structattn.flops import attention_cost_report
from hf_structattn.modeling import structattn_mlr_fused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_cache_memory  # noqa: E402
import bench_decoder_patching  # noqa: E402
import bench_decode_ab  # noqa: E402
import bench_generation  # noqa: E402
import bench_memory  # noqa: E402
import bench_real_checkpoint  # noqa: E402
import bench_real_weights  # noqa: E402
import bench_speculative  # noqa: E402
import compare_runs  # noqa: E402

SHAPE = dict(vocab_size=61, n_positions=64, n_embd=32, n_head=2, n_layer=2, bos_token_id=0, eos_token_id=1,
             pad_token_id=1)


def _generate(model, ids, **kwargs):
    output = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                            **kwargs)
    return bench_cache_memory.returned_cache(output)


# ------------------------------------------------------------------------------------ allocated_cache_bytes


@torch.no_grad()
def test_allocated_cache_bytes_of_stock_dynamic_cache_is_keys_plus_values():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE)).eval()
    cache = _generate(model, torch.randint(2, 60, (2, 9)))
    held = int(cache.get_seq_length())
    # stock transformers concatenates: exactly batch x heads x tokens x head dim per tensor, keys and values
    assert allocated_cache_bytes(cache) == 2 * SHAPE["n_layer"] * 2 * SHAPE["n_head"] * held * 16 * 4


@torch.no_grad()
def test_allocated_cache_bytes_of_static_cache_counts_every_slot_and_the_counters():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE)).eval()
    cache = _generate(model, torch.randint(2, 60, (2, 9)), cache_implementation="static", max_cache_len=40)
    slots = cache.layers[0].max_cache_len
    assert slots >= 40 > cache.get_seq_length()
    per_layer = 2 * 2 * SHAPE["n_head"] * slots * 16 * 4 + 8  # keys, values and the int64 length counter
    assert allocated_cache_bytes(cache) == SHAPE["n_layer"] * per_layer


def test_allocated_cache_bytes_counts_a_shared_storage_once_at_its_full_size():
    cache = transformers.DynamicCache()
    storage = torch.zeros(1, 2, 10, 48)  # 3840 bytes; the layer views only part of it
    layer = transformers.cache_utils.DynamicLayer()
    layer.keys, layer.values = storage[..., :16], storage[..., 16:40]
    layer.extra = {"positions": [storage[0, 0, :, 0]]}  # tensors inside containers are found too
    cache.layers = [layer]
    assert allocated_cache_bytes(cache) == storage.untyped_storage().nbytes() == 3840


@torch.no_grad()
def test_allocated_cache_bytes_of_encoder_decoder_cache_with_and_without_cross_attention():
    config = transformers.T5Config(vocab_size=61, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, d_kv=16, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    cache = _generate(model, torch.randint(2, 60, (2, 9)))
    cross = 2 * 2 * 2 * 2 * 9 * 16 * 4  # layers x (k, v) x batch x heads x encoder tokens x d_kv x float32
    assert allocated_cache_bytes(cache) - allocated_cache_bytes(cache, cross_attention=False) == cross


def test_allocated_cache_bytes_rejects_what_is_not_a_cache():
    with pytest.raises(TypeError, match="cache=dict"):
        allocated_cache_bytes({"keys": torch.zeros(3)})


@torch.no_grad()
def test_mlr_cache_allocation_is_measured_beside_the_formula():
    """The MLR cache generate returns: allocated bytes are at least the formula's bytes in use."""
    torch.manual_seed(0)
    config = StructAttnGPT2Config(**SHAPE, attention="mlr", mlr_ranks=[8, 4, 2, 2])
    model = StructAttnGPT2LMHeadModel(config).eval()
    cache = _generate(model, torch.randint(2, 60, (1, 20)))
    formula = attention_cost_report(config, dtype_bytes=4, context_len=int(cache.get_seq_length())).kv_cache_bytes
    assert allocated_cache_bytes(cache) >= formula > 0


# ----------------------------------------------------------------------------------------- bench_cache_memory


def test_bench_cache_memory_table(tmp_path, capsys):
    output = tmp_path / "cache.md"
    bench_cache_memory.main(["--prompts", "8", "40", "--new_tokens", "2", "--output", str(output)])
    text = output.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| MLR GPT-2") or line.startswith("| patched")]
    assert len(rows) == 4
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        prompt, held = int(cells[2]), int(cells[3])
        assert held == prompt + 1  # prompt + new tokens - 1 fed back
        stock = int(cells[6].replace(",", ""))
        heads, layers = (4, 2) if row.startswith("| MLR") else (2, 2)  # Llama: 2 KV heads
        assert stock == layers * 2 * heads * held * 64 * 4  # stock transformers allocates exactly what it holds
        mlr, formula = int(cells[4].replace(",", "")), int(cells[5].replace(",", ""))
        assert cells[-3] == f"**{mlr / stock:.2f}x**" and cells[-1] == f"{mlr / formula:.2f}x"


def test_bench_cache_memory_rejects_bad_prompts():
    with pytest.raises(SystemExit):
        bench_cache_memory.main(["--prompts", "0"])


# ------------------------------------------------------------------------------------------------ bench_memory


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_bench_memory_peak_includes_the_output_and_training_includes_the_gradients(layout):
    length, heads = 256, 2
    output_bytes = heads * length * 64 * 4
    prefill, _ = bench_memory.measure("SDPA", length, heads, layout, training=False)
    step, _ = bench_memory.measure("SDPA", length, heads, layout, training=True)
    assert prefill >= output_bytes
    assert step >= prefill + 3 * output_bytes  # dq, dk, dv (or the packed projection's gradient)


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_fused_mlr_prefill_peak_memory_stays_near_sdpa(layout):
    """Regression (issue 24): each coarse group's scaled query copy and kernel output used to be live together
    in one piece, ~1x the output on top of it (1.94x SDPA's peak at T = 4096); in pieces it is ~1.25x."""
    mlr, _ = bench_memory.measure("MLR fused", 4096, 8, layout, training=False)
    sdpa, _ = bench_memory.measure("SDPA", 4096, 8, layout, training=False)
    assert mlr <= 1.35 * sdpa


def test_bench_memory_script_prints_both_tables(tmp_path):
    output = tmp_path / "memory.md"
    bench_memory.main(["--lengths", "256", "--heads", "2", "--layouts", "bthd", "--breakdown", "--output",
                       str(output)])
    text = output.read_text()
    assert "prefill (forward, no grad)" in text and "training step (forward + backward)" in text
    assert "| bthd | MLR fused |" in text and "allocating op" in text
    with pytest.raises(SystemExit):
        bench_memory.main(["--lengths", "100"])


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("fraction", [2, 4, 16, 64], ids=lambda f: f"1/{f}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_fused_forward_in_pieces_is_exact(monkeypatch, float64_default, layout, fraction, causal):
    """Pieces cut the batch, heads, parents and rows (all four at 1/64); output and gradients still equal the
    naive reference in float64."""
    monkeypatch.setattr(structattn_mlr_fused, "MIN_PIECE_ELEMENTS", 1)
    monkeypatch.setattr(structattn_mlr_fused, "PIECE_FRACTION", fraction)
    batch, heads, length, ranks, blocks = 2, 2, 32, [4, 2, 2], [16, 8]
    generator = torch.Generator().manual_seed(fraction)
    if layout == "bthd":
        packed = torch.randn(batch, length, 3 * heads * 8, generator=generator, requires_grad=True)
        leaves = [packed]
        q, k, v = (t.view(batch, length, heads, 8).transpose(1, 2) for t in packed.split(heads * 8, -1))
    else:
        leaves = [torch.randn(batch, heads, length, 8, generator=generator, requires_grad=True) for _ in range(3)]
        q, k, v = leaves
    grad = torch.randn(batch, heads, length, 8, generator=generator)
    fused = mlr_attention(q, k, v, ranks=ranks, block_sizes=blocks, causal=causal, implementation="fused")
    fused_grads = torch.autograd.grad(fused, leaves, grad)
    reference = mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=blocks, causal=causal)
    reference_grads = torch.autograd.grad(reference, leaves, grad)
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-12)
    for mine, theirs in zip(fused_grads, reference_grads):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)


# -------------------------------------------------------------------------------------------- bench_generation


def test_decode_cell_times_every_variant_interleaved_and_tables_follow():
    models = bench_generation.gpt2_models(n_layer=1, n_embd=64, n_head=1)
    variants = bench_generation.decode_variants(list(models), ["eager", "static", "compiled"])
    assert [label for label, _, _ in variants] == ["MLR", "dense", "MLR static", "dense static", "MLR compiled",
                                                   "dense compiled"]
    clock = bench_generation.Clock("thread")
    times = bench_generation.decode_cell(models, variants, batch=2, prompt=12, steps=2, warmup=2, clock=clock,
                                         compiled={}, compile_backend="eager")
    assert set(times) == {label for label, _, _ in variants}
    assert all(len(clock_times) == len(wall) == 2 for clock_times, wall in times.values())
    rows = bench_generation.cell_rows(2, 12, variants, times)
    assert len(rows) == 6 and rows[0].startswith("| GPT-2 | 2 | 12 | MLR |")
    summary = bench_generation.summary_table([(2, 12, times)], ["eager", "static", "compiled"])
    assert summary[0].count("MLR / dense") == 3 and summary[2].startswith("| 2 | 12 |")


@torch.no_grad()
def test_prefilled_cache_holds_the_prompt_and_a_static_one_has_room():
    models = bench_generation.gpt2_models(n_layer=1, n_embd=64, n_head=1)
    ids = torch.randint(2, 200, (1, 10))
    for model in models.values():
        assert bench_generation.prefilled_cache(model, ids).get_seq_length() == 10
        static = bench_generation.prefilled_cache(model, ids, static_len=20)
        assert static.get_seq_length() == 10
        # a decode step at the next position writes into the static cache's free slots
        model(ids[:, :1], cache=static, use_cache=True, position_ids=torch.full((1, 1), 10))
        assert static.get_seq_length() == 11


@torch.no_grad()
def test_prefilled_cache_is_sized_as_generate_sizes_it_for_the_cells_tokens():
    """The timed steps of a cell run on a dynamic MLR cache reserved for them, as ``generate(max_new_tokens=N)``
    reserves it: 29 decode steps after the prompt write into the storage the prefill allocated."""
    model = bench_generation.gpt2_models(n_layer=1, n_embd=64, n_head=1)["MLR"]
    ids = torch.randint(2, 200, (1, 10))
    cache = bench_generation.prefilled_cache(model, ids, new_tokens=30)
    assert cache.get_seq_length() == 10
    layer = cache.layers[0]
    storage = layer.keys_storage().data_ptr()
    for position in range(10, 39):
        model(ids[:, :1], cache=cache, use_cache=True, position_ids=torch.full((1, 1), position))
    assert cache.get_seq_length() == 39 and layer.keys_storage().data_ptr() == storage


def test_bench_decode_ab_runs_two_payload_versions_side_by_side(tmp_path):
    """Against HEAD the old payload is this one: the two MLR models (same weights) give the same logits, each reads
    its own cache layers, and every variant is timed. Run as the script (a subprocess), as it is used."""
    output = tmp_path / "ab.json"
    completed = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_decode_ab.py"), "--against",
                                "HEAD", "--prompt", "16", "--steps", "2", "--warmup", "1", "--json", str(output)],
                               capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "new / old" in completed.stdout
    result = json.loads(output.read_text())
    assert set(result["medians"]) == {"dense", "old", "new"} and all(v > 0 for v in result["medians"].values())
    assert result["logit difference"] < 1e-4
    modules = result["layer modules"]
    assert len(modules["old"]) == len(modules["new"]) == 6
    assert all(m.startswith("payload_at_HEAD.") for m in modules["old"])
    assert all(m.startswith("hf_structattn.modeling.") for m in modules["new"])
    assert result["pending consumed"]


def test_bench_decode_ab_main_job_model_has_the_main_jobs_config():
    """``--model main-job`` builds the README main job's model (configs/clm_mlr_stdlib.yaml), for both payloads."""
    import yaml

    with open(os.path.join(ROOT, "configs", "clm_mlr_stdlib.yaml")) as handle:
        expected = yaml.safe_load(handle)["model"]
    shape = bench_decode_ab.model_shape("main-job")
    assert shape["mlr_ranks"] == expected["mlr_ranks"] and shape["n_layer"] == expected["n_layer"]
    assert "attention" not in shape and bench_decode_ab.model_shape("gpt2-6x512") == {}
    with pytest.raises(SystemExit):
        bench_decode_ab.parse_args(["--against", "HEAD", "--model", "main-job", "--prompt", "250", "--steps", "10"])


def test_bench_trace_calls_counts_the_first_and_a_later_layer_and_the_whole_forward(capsys):
    """The trace of eager decode steps: counts for every model, consistent with their definitions; the forward's
    whole plan is made before its first layer, so the first MLR layer runs what a later one runs and re-enters no
    payload file; a patched 8-layer Llama's whole forward runs at most 1.15x stock Llama's Python calls."""
    import bench_trace_calls

    results = bench_trace_calls.main([])
    stock = results["stock Llama (DynamicCache, SDPA)"]
    for result in results.values():
        for counts in result.values():
            assert 0 <= counts["package files"] <= counts["package runs"] <= counts["package calls"] <= \
                counts["calls"] and counts["re-entries"] < max(counts["package runs"], 1)
    patched = results["patched Llama, 8 layers (MLR 8|4|2|2)"]
    for name in ("GPT-2 MLR (main job's model)", "patched Llama, 8 layers (MLR 8|4|2|2)"):
        first, later = results[name]["first layer"], results[name]["later layer"]
        assert first["package calls"] - later["package calls"] <= 5 and first["re-entries"] == 0, (name, first, later)
    assert patched["later layer"]["calls"] > stock["later layer"]["calls"]  # the MLR write and read
    assert patched["forward"]["calls"] <= 1.15 * stock["forward"]["calls"], (patched, stock)
    assert "| stock Llama (DynamicCache, SDPA) |" in capsys.readouterr().out


def test_bench_checkpoint_code_lists_what_each_family_ships():
    """Each family's checkpoint ships the code its family runs: the patched-decoder spec only with patched decoders,
    the GPT-2 family's bilinear attention functions only with it, the configuration files not with patched decoders
    (their configs are transformers' own); the Triton kernel with every family (the uncached op runs it on CUDA; it
    is imported on the first CUDA call only)."""
    import bench_checkpoint_code

    results = bench_checkpoint_code.main([])
    gpt2, t5 = results["GPT-2 family"], results["T5 family"]
    decoder = results["patched decoder (MLRLlama)"]
    assert "structattn_decoder_spec.py" not in gpt2 and "structattn_decoder_spec.py" not in t5
    assert "structattn_decoder_spec.py" in decoder and "structattn_decoder.py" in decoder
    assert "structattn_bilinear_attention.py" in gpt2
    assert not any(name.startswith("configuration_") or name.startswith("structattn_bilinear") for name in decoder)
    assert all("structattn_triton.py" in files and "structattn_mlr_plan.py" in files for files in results.values())
    assert all(count > 0 for files in results.values() for count in files.values())


def test_bench_half_read_times_both_reads_and_restores_the_dtypes():
    """Both reads of half-precision decode steps are timed against the float64 model (errors at bfloat16's
    resolution), and the dtypes the in-step read takes are this process's again afterwards."""
    import bench_half_read
    from hf_structattn.modeling import structattn_mlr_plan

    before = structattn_mlr_plan.READ_DTYPES
    result = bench_half_read.main(["--prompt", "16", "--steps", "2", "--warmup", "1"])
    assert structattn_mlr_plan.READ_DTYPES is before and torch.bfloat16 in before
    assert all(value > 0 for value in result["medians"].values()) and result["ratio"] > 0
    assert all(error < 0.1 for error in result["errors"].values())


def test_bench_decode_ab_restores_the_registries_it_writes_to():
    """Importing the old payload registers its attention functions and cache layers under the shared names; after
    ``main`` this process's own are registered again."""
    before = [dict(mapping) for mapping in bench_decode_ab.registries()]
    bench_decode_ab.main(["--against", "HEAD", "--prompt", "8", "--steps", "1", "--warmup", "0"])
    assert [dict(mapping) for mapping in bench_decode_ab.registries()] == before
    assert not [name for name in sys.modules if name.startswith("payload_at_")]


@pytest.mark.parametrize("argv, field", [(["--against", "HEAD", "--steps", "0"], "--steps"),
                                         (["--against", "HEAD", "--prompt", "4090"], "--prompt")])
def test_bench_decode_ab_rejects_bad_arguments(argv, field, capsys):
    with pytest.raises(SystemExit):
        bench_decode_ab.parse_args(argv)
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("argv, field", [(["--steps", "0"], "--steps"), (["--batches", "0"], "--batches"),
                                         (["--prompts", "4090"], "--prompts"), (["--modes", "fast"], "--modes")])
def test_bench_generation_rejects_bad_arguments(argv, field, capsys):
    with pytest.raises(SystemExit):
        bench_generation.parse_args(argv)
    assert field in capsys.readouterr().err


def test_bench_generation_modes_keep_their_order_without_duplicates():
    args = bench_generation.parse_args(["--modes", "compiled", "eager", "--static", "--compile"])
    assert args.modes == ["eager", "static", "compiled"]


# -------------------------------------------------------------------------------------- scripts/compare_runs.py


def _fake_run(folder, attention, model, tokenizer, bits):
    """A finished run's folder as recipes/train_clm.py leaves it: model + tokenizer, final metrics, eval curve."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "final_metrics.json").write_text(json.dumps(
        {"step": 4, "eval_bits_per_byte": bits, "train_tokens_per_cpu_second": 1000.0}))
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps({"step": step, "eval/bits_per_byte": bits + 1 / step})
                                                    for step in (1, 2, 4)) + "\n")


@pytest.mark.filterwarnings("ignore")
def test_compare_runs_table_and_plot(tmp_path, capsys):
    from hf_structattn.tokenization import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    fields = dict(vocab_size=257, n_positions=64, n_embd=64, n_head=1, n_layer=1, bos_token_id=256,
                  eos_token_id=256, pad_token_id=256)
    runs = []
    for attention, extra in (("dense", {}), ("mlr", {"mlr_ranks": [32, 16, 8, 8]})):
        torch.manual_seed(0)
        model = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**fields, attention=attention, **extra))
        folder = tmp_path / f"clm_{attention}"
        _fake_run(folder, attention, model, tokenizer, 2.0)
        runs.append(str(folder))
    plot = tmp_path / "plot" / "dense_vs_mlr.png"
    text = compare_runs.main([*runs, "--decode_tokens", "6", "--rounds", "2", "--plot", str(plot)])
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decode timing:")]
    assert [line.split(" done")[0] for line in progress[1:]] == [  # one line per round, before the table
        "decode timing: warm-up round", "decode timing: round 1/2", "decode timing: round 2/2"]
    assert plot.is_file() and plot.with_suffix(".md").read_text().strip() == text.strip()
    dense_row, mlr_row = [line for line in text.splitlines() if line.startswith("| clm_")]
    assert "1.00 [1.00-1.00]x" in dense_row  # every round's ratio of the baseline to itself
    cells = [cell.strip() for cell in mlr_row.strip("|").split("|")]
    allocated, formula_kv, formula_keys = (int(cell.replace(",", "")) for cell in cells[-3:])
    assert allocated >= formula_kv > formula_keys
    assert "fewer key bytes than dense keys" in text and "(it then holds" in text


def test_compare_runs_rejects_a_folder_without_final_metrics(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare_runs.parse_args([str(tmp_path)])
    assert "final_metrics.json" in capsys.readouterr().err


def test_speculation_counts_from_forward_input_lengths():
    # a 10-token prompt + a 3-token draft, then the last token + drafts of 3, 2 and 0 tokens (8 drafted); 12 new
    # tokens from 4 forwards, each of which emits one token of its own: 8 accepted
    drafted, accepted = bench_speculative.speculation_counts([13, 4, 3, 1], prompt=10, new_tokens=12)
    assert (drafted, accepted) == (3 + 3 + 2 + 0, 12 - 4)


@torch.no_grad()
def test_bench_speculative_table_on_saved_models(tmp_path, capsys):
    from hf_structattn.tokenization import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    fields = dict(vocab_size=257, n_positions=256, n_embd=32, n_head=1, n_layer=1, bos_token_id=256,
                  eos_token_id=256, pad_token_id=256)
    for attention, extra in (("dense", {}), ("mlr", {"mlr_ranks": [16, 8, 8]})):
        torch.manual_seed(0)
        model = StructAttnGPT2LMHeadModel(StructAttnGPT2Config(**fields, attention=attention, **extra))
        model.save_pretrained(tmp_path / f"clm_{attention}_stdlib")
        tokenizer.save_pretrained(tmp_path / f"clm_{attention}_stdlib")
    assert bench_speculative.main(["--runs", str(tmp_path), "--new_tokens", "24", "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| dense") or
            line.startswith("| mlr")]
    assert [row.split("|")[2].strip() for row in rows] == ["greedy", "prompt lookup"] * 2
    for row in rows[1::2]:
        drafted, accepted = (int(cell) for cell in row.split("|")[5:7])
        assert 0 <= accepted <= drafted


def test_bench_speculative_needs_the_main_jobs_models(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_speculative.main(["--runs", str(tmp_path)])
    assert "run `bash scripts/run.sh` first" in capsys.readouterr().err


def test_bench_decoder_patching_times_compiled_static_decode_of_stock_and_patched_models():
    """The compiled-decode cell of bench_decoder_patching: both models decode from a static cache prefilled by
    generate through a forward compiled by the given backend (a counting one here: inductor takes minutes), which
    traces each model's decode step (and nothing per step after the first)."""
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).eval()
    mlr = hf_structattn.patch(stock, mlr_ranks=[4, 2, 2], mlr_block_sizes=[16, 8])
    traced = []

    def counting_backend(graph, example_inputs):
        traced.append(graph)
        return graph.forward

    torch._dynamo.reset()
    times = bench_decoder_patching.compiled_decode({"stock sdpa": stock, "MLR": mlr}, prompt=20, steps=3, warmup=2,
                                                   backend=counting_backend)
    assert set(times) == {"stock sdpa", "MLR"} and all(value > 0 for value in times.values())
    assert 2 <= len(traced) <= 4  # one decode graph per model (a recompile on the second step at most)
    codes = [graph.code for graph in traced]
    # stock attention is one SDPA call; the patched step is MLR's compiled formulation (library baddbmm matmuls)
    assert any("scaled_dot_product_attention" in code and "baddbmm" not in code for code in codes)
    assert any("baddbmm" in code and "scaled_dot_product_attention" not in code for code in codes)


# ------------------------------------------------------------------------------------------ bench_real_weights


def test_bench_real_weights_scores_table_and_resume(tmp_path):
    from hf_structattn.decoder_patching import tiny_decoder

    model = tiny_decoder("llama")
    windows = torch.randint(1, 61, (2, 40), generator=torch.Generator().manual_seed(0))
    stock = bench_real_weights.window_scores(model, windows)
    assert stock["losses"].shape == stock["argmax"].shape == (2, 39)
    with torch.no_grad():
        reference = torch.nn.functional.cross_entropy(model(windows).logits[0, :-1].float(), windows[0, 1:])
    assert float(stock["losses"][0].mean()) == pytest.approx(float(reference), rel=1e-6)
    patched = hf_structattn.patch(model, mlr_ranks=[8, 4, 4], mlr_block_sizes=[16, 8])
    scores = bench_real_weights.window_scores(patched, windows)
    gaps = bench_real_weights.bucket_gaps(scores["losses"], stock["losses"])
    assert list(gaps) == ["1-39"] and gaps["1-39"] == pytest.approx(float((scores["losses"] - stock["losses"]).mean()))
    row = {"key": {"run": 1}, "ranks": "8,4,4", "level_order": "frequency", "key_cache_ratio": 0.5,
           "kv_cache_ratio": 0.75, "perplexity": 12.0, "perplexity_ratio": 1.02, "top1_agreement": 0.9,
           "added_nats_by_position": gaps}
    lines = bench_real_weights.table([row], 11.0).splitlines()
    assert lines[-1].startswith("| 8\\|4\\|4 | frequency | 0.500 | 0.750 | 12.000 | 1.0200 | 0.900 | 1-39: ")
    assert all(line.count("|") - line.count("\\|") == lines[0].count("|") for line in lines)
    results = tmp_path / "rows.jsonl"
    results.write_text(json.dumps(row) + "\n" + json.dumps({**row, "key": {"run": 2}, "level_order": "index"}) + "\n")
    assert list(bench_real_weights.read_rows(results, {"run": 1})) == [("8,4,4", "frequency")]


# ------------------------------------------------------------------------------------------ bench_real_checkpoint


def test_bench_real_checkpoint_recovery_runs_the_recipe_and_reads_its_curve(tmp_path):
    """The recovery part on a tiny Llama with a byte tokenizer: the recipe runs in-process with the benchmark's own
    arguments (2,048-token windows, distillation, cosine), resumes nothing when done, and the curve is the recipe's
    evaluations; quality() is perplexity / stock and top-1 agreement, computed here from the logits."""
    import types

    from hf_structattn.tokenization import build_byte_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                                      bos_token_id=256, eos_token_id=256, pad_token_id=256)
    source = tmp_path / "source"
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    build_byte_tokenizer().save_pretrained(source)
    texts = tmp_path / "text"
    for split, name in (("finetune", "decoder_patching.py"), ("heldout", "flops.py")):
        (texts / split).mkdir(parents=True)
        (texts / split / "a.txt").write_text((Path(ROOT) / "hf_structattn" / name).read_text()[:12000])
    args = types.SimpleNamespace(learning_rate=1e-3, recovery_steps=2, eval_every=1, work=str(tmp_path / "work"))
    run = bench_real_checkpoint.recovery(args, [16, 8, 8], texts, source)
    assert [point["step"] for point in run["curve"]] == [0, 1, 2] and run["steps"] == 2
    assert all(point["kl_to_stock"] >= 0 and 0 <= point["top1"] <= 1 for point in run["curve"])
    assert run["curve"][0]["cpu_minutes"] == 0 < run["cpu_minutes"]
    saved = json.loads((Path(run["folder"]) / "config.json").read_text())
    assert saved["mlr_ranks"] == [16, 8, 8] and saved["mlr_block_sizes"] == [1024, 512]
    recipe_args = json.loads((Path(run["folder"]) / "run_config.json").read_text())["args"]
    assert (recipe_args["objective"], recipe_args["lr_schedule"], recipe_args["seq_len"]) == ("distill", "cosine", 2048)
    assert bench_real_checkpoint.recovery(args, [16, 8, 8], texts, source)["curve"] == run["curve"]  # done: not rerun

    stock = transformers.LlamaForCausalLM.from_pretrained(source).eval()
    patched = transformers.AutoModelForCausalLM.from_pretrained(run["folder"], trust_remote_code=True).eval()
    windows = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    stock_scores = bench_real_checkpoint.window_scores(stock, windows)
    quality = bench_real_checkpoint.quality(patched, windows, stock_scores)
    with torch.no_grad():
        logits = {name: model(windows).logits[:, :-1].double() for name, model in (("stock", stock), ("mlr", patched))}
    loss = {name: torch.nn.functional.cross_entropy(value.transpose(1, 2), windows[:, 1:]).item()
            for name, value in logits.items()}
    agreement = (logits["stock"].argmax(-1) == logits["mlr"].argmax(-1)).double().mean().item()
    assert quality["perplexity_ratio"] == pytest.approx(math.exp(loss["mlr"] - loss["stock"]), rel=1e-5)
    assert quality["top1_agreement"] == pytest.approx(agreement)


def test_bench_real_checkpoint_table_has_one_cell_per_column():
    found = {("drift", "32,16,8,8"): {"key_cache_ratio": 0.672, "kv_cache_ratio": 0.836, "perplexity_ratio": 1.026,
                                      "top1_agreement": 0.96},
             ("recovery", "32,16,8,8"): {"cpu_minutes": 21.0, "steps": 40, "perplexity_ratio": 1.01,
                                         "top1_agreement": 0.97, "curve": [{"step": 0, "cpu_minutes": 0.0,
                                                                            "kl_to_stock": 0.03, "top1": 0.95}]},
             ("decode", "32,16,8,8"): {"allocated_key_ratio": 0.672, "eager_stock_ms": 50.0, "eager_mlr_ms": 60.0,
                                       "compiled_stock_ms": 30.0, "compiled_mlr_ms": 33.0},
             ("chat", "32,16,8,8"): {"stock": "Paris.", "before": "Paris!", "after": "Paris."}}
    lines = bench_real_checkpoint.table(["32,16,8,8", "16,16,16,16"], found, 11.08).splitlines()
    rows = [line for line in lines[:5] if line.startswith("|")]
    assert rows[3] == ("| 32\\|16\\|8\\|8 | 0.672 (0.672) | 0.836 | 1.0260 | 0.960 | 21 (40) | 1.0100 | 0.970 | "
                       "50.0 / 60.0 | 30.0 / 33.0 |")
    assert rows[4].startswith("| 16\\|16\\|16\\|16 | - (-) | - | - | - | - |")
    assert all(row.count("|") - row.count("\\|") == rows[0].count("|") for row in rows)
    assert "* 32|16|8|8, after recovery: 'Paris.'" in lines
