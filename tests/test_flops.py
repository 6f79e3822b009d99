"""FLOP / cache accounting checked against hand-computed numbers and independent brute-force pair loops."""

import pytest
import torch
from transformers import T5Config

from hf_structattn import StructAttnGPT2Config, StructAttnT5Config

from hf_structattn.flops import (
    attention_cost_report,
    attention_pairs,
    default_btt_factors,
    dyadic_block_sizes,
    flops_per_token,
    key_cache_bytes,
    key_cache_elements,
    kv_cache_bytes,
    mlr_pairs_per_depth,
    nonembedding_matmul_params,
    pv_macs,
    qk_projection_macs,
    score_macs,
    value_cache_elements,
)

PAPER_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]  # r = 64
DYADIC_1024 = [512, 256, 128, 64, 32, 16, 8]
# sum_l r_l / 2^(l-1) = 32 + 4 + 1.5 + 0.5 + 0.25 + 0.125 + 0.0625 + 0.015625, by hand
PAPER_PER_PAIR = 38.453125


# ----------------------------------------------------------------------------- brute force (independent code)


def brute_mlr_score_macs(seq_len, block_sizes, ranks, causal):
    total = 0
    for i in range(seq_len):
        for j in range(seq_len):
            if causal and j > i:
                continue
            depth = 1
            for size in block_sizes:
                if i // size == j // size:
                    depth += 1
            total += sum(ranks[:depth])
    return total


def brute_swa_pairs(seq_len, window, causal):
    count = 0
    for i in range(seq_len):
        for j in range(seq_len):
            if causal:
                count += 0 <= i - j < window
            else:
                count += abs(i - j) < window
    return count


def brute_mlr_peak_key_cache(context_len, block_sizes, ranks):
    """Replay generation: after each token, level l holds the keys of the newest token's level-l block.
    Returns the sum over levels of each level's peak (the preallocated cache size)."""
    peaks = [0] * len(ranks)
    for n in range(1, context_len + 1):
        newest = n - 1
        peaks[0] = max(peaks[0], n * ranks[0])
        for level, (size, rank) in enumerate(zip(block_sizes, ranks[1:]), start=1):
            held = sum(1 for p in range(n) if p // size == newest // size) * rank
            peaks[level] = max(peaks[level], held)
    return sum(peaks)


# ------------------------------------------------------------------------------------------- MLR, paper case


def test_mlr_paper_ranks_noncausal_score_ratio():
    mlr = score_macs("mlr", 1024, ranks=PAPER_RANKS, block_sizes=DYADIC_1024)
    dense = score_macs("dense", 1024, head_dim=64)
    assert mlr == 40_321_024  # 1024^2 * 38.453125
    assert dense == 67_108_864  # 1024^2 * 64
    assert mlr / dense == pytest.approx(0.60083, abs=1e-5)
    assert mlr / dense == PAPER_PER_PAIR / 64
    # block sizes derived from the training length give the same thing
    assert score_macs("mlr", 1024, ranks=PAPER_RANKS, n_positions=1024) == mlr
    assert dyadic_block_sizes(1024, 8) == DYADIC_1024


def test_mlr_paper_ranks_causal_score():
    # causal level-l pairs: p_l blocks * b(b+1)/2 = 512 * (b_l + 1) with b_1 = 1024
    # 32*1025 + 8*513 + 6*257 + 4*129 + 4*65 + 4*33 + 4*17 + 2*9 = 39440
    mlr = score_macs("mlr", 1024, causal=True, ranks=PAPER_RANKS, block_sizes=DYADIC_1024)
    dense = score_macs("dense", 1024, causal=True, head_dim=64)
    assert mlr == 512 * 39_440
    assert dense == 1024 * 1025 // 2 * 64
    assert mlr / dense == pytest.approx(39_440 / 65_600)


def test_mlr_paper_ranks_pv_keeps_full_head_dim():
    assert pv_macs("mlr", 1024, ranks=PAPER_RANKS, block_sizes=DYADIC_1024) == 1024 * 1024 * 64
    assert pv_macs("mlr", 1024, causal=True, ranks=PAPER_RANKS, block_sizes=DYADIC_1024) == 524_800 * 64


def test_mlr_paper_ranks_cache_ratios():
    # 1024*32 + 512*8 + 256*6 + 128*4 + 64*4 + 32*4 + 16*4 + 8*2
    keys = key_cache_elements("mlr", 1024, PAPER_RANKS, DYADIC_1024, 64)
    assert keys == 39_376
    dense_keys = key_cache_elements("dense", 1024, head_dim=64)
    assert dense_keys == 65_536
    assert keys / dense_keys == pytest.approx(0.60083, abs=1e-5)
    kv = kv_cache_bytes("mlr", 1024, PAPER_RANKS, DYADIC_1024, 64)
    dense_kv = kv_cache_bytes("dense", 1024, head_dim=64)
    assert kv == (39_376 + 65_536) * 2
    assert dense_kv == 131_072 * 2
    assert kv / dense_kv == pytest.approx(0.800, abs=5e-4)
    assert kv / dense_kv == pytest.approx(104_912 / 131_072)


# ----------------------------------------------------------------------------------------- MLR, brute force


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_len", [1, 3, 16, 21])
def test_mlr_tiny_matches_brute_force(seq_len, causal):
    blocks, ranks = (8, 4), (2, 1, 1)
    expected = brute_mlr_score_macs(seq_len, blocks, ranks, causal)
    assert score_macs("mlr", seq_len, causal=causal, ranks=ranks, block_sizes=blocks) == expected
    assert sum(mlr_pairs_per_depth(seq_len, blocks, causal)) == (seq_len * (seq_len + 1) // 2 if causal
                                                                 else seq_len ** 2)
    assert pv_macs("mlr", seq_len, causal=causal, ranks=ranks, block_sizes=blocks) == 4 * (
        seq_len * (seq_len + 1) // 2 if causal else seq_len ** 2)


def test_mlr_tiny_hand_counts():
    # T=16, blocks (8,4), ranks (2,1,1): level 1 all pairs * 2, level 2 two 8-blocks * 1, level 3 four 4-blocks * 1
    assert score_macs("mlr", 16, ranks=(2, 1, 1), block_sizes=(8, 4)) == 256 * 2 + 2 * 64 + 4 * 16  # 704
    assert score_macs("mlr", 16, causal=True, ranks=(2, 1, 1), block_sizes=(8, 4)) == 136 * 2 + 2 * 36 + 4 * 10
    # depth 1: 256 - 128 pairs, depth 2: 128 - 64, depth 3: 64
    assert mlr_pairs_per_depth(16, (8, 4)) == [128, 64, 64]


@pytest.mark.parametrize("context_len", [1, 3, 4, 5, 8, 16, 21])
def test_mlr_key_cache_matches_replay(context_len):
    blocks, ranks = (8, 4), (2, 1, 1)
    assert key_cache_elements("mlr", context_len, ranks, blocks, 4) == brute_mlr_peak_key_cache(
        context_len, blocks, ranks)
    assert value_cache_elements("mlr", context_len, 4) == 4 * context_len


def test_mlr_degenerate_equals_dense():
    assert score_macs("mlr", 37, ranks=[64], block_sizes=[]) == score_macs("dense", 37, head_dim=64)
    # every block at least as long as the sequence: all pairs share every level
    assert score_macs("mlr", 8, ranks=(2, 1, 1), block_sizes=(16, 8)) == score_macs("dense", 8, head_dim=4)
    assert key_cache_elements("mlr", 8, (2, 1, 1), (16, 8)) == key_cache_elements("dense", 8, head_dim=4)


# ----------------------------------------------------------------------------------------------------- SWA


def test_swa_hand_counts():
    # causal rows see 1, 2, 3, 4, 4, 4, 4, 4, 4, 4 keys = 34; two-sided: 10 + 2*(9 + 8 + 7) = 58
    assert attention_pairs("swa", 10, causal=True, window=4, head_dim=8) == 34
    assert attention_pairs("swa", 10, causal=False, window=4, head_dim=8) == 58
    assert brute_swa_pairs(10, 4, True) == 34 and brute_swa_pairs(10, 4, False) == 58
    assert score_macs("swa", 10, causal=True, window=4, head_dim=8) == 34 * 8
    assert pv_macs("swa", 10, causal=False, window=4, head_dim=8) == 58 * 8
    assert key_cache_elements("swa", 10, head_dim=8, window=4) == 4 * 8
    assert key_cache_elements("swa", 3, head_dim=8, window=4) == 3 * 8
    assert kv_cache_bytes("swa", 10, head_dim=8, window=4) == (32 + 32) * 2


@pytest.mark.parametrize("seq_len,window", [(1, 1), (5, 1), (7, 3), (3, 9), (12, 12)])
def test_swa_matches_brute_force(seq_len, window):
    for causal in (False, True):
        assert attention_pairs("swa", seq_len, causal=causal, window=window, head_dim=2) == brute_swa_pairs(
            seq_len, window, causal)


# -------------------------------------------------------------------------------------------------- dense


def test_dense_hand_counts():
    assert score_macs("dense", 10, head_dim=8) == 800
    assert score_macs("dense", 10, causal=True, head_dim=8) == 55 * 8
    assert score_macs("dense", 10, head_dim=8, n_embd=16, include_projections=True) == 800 + 2 * 10 * 16 * 8
    assert key_cache_bytes("dense", 10, head_dim=8, dtype_bytes=torch.float32) == 320
    assert kv_cache_bytes("dense", 10, head_dim=8, dtype_bytes=torch.bfloat16) == 320


# --------------------------------------------------------------------------------------------- bilinear MLR


def test_bilinear_mlr_hand_counts():
    # ranks (2,1,1), p = (1,2,4): per-pair cost 1*2 + 2*1 + 4*1 = 8; D = 8, H = 2 -> dv = 4
    geometry = dict(ranks=(2, 1, 1), n_embd=8, n_head=2)
    assert score_macs("bilinear_mlr", 5, **geometry) == 25 * 8
    assert score_macs("bilinear_mlr", 5, causal=True, **geometry) == 15 * 8
    # App. D: 2*T*D*r with r = 2 + 1 + 1
    assert qk_projection_macs("bilinear_mlr", 5, **geometry) == 2 * 5 * 8 * 4
    assert score_macs("bilinear_mlr", 5, include_projections=True, **geometry) == 200 + 320
    assert pv_macs("bilinear_mlr", 5, **geometry) == 25 * 4
    assert key_cache_elements("bilinear_mlr", 5, (2, 1, 1), n_embd=8) == 5 * 8
    assert value_cache_elements("bilinear_mlr", 5, n_embd=8, n_head=2) == 5 * 4


# --------------------------------------------------------------------------------------------- bilinear BTT


def test_bilinear_btt_hand_counts():
    # D = 16, a=b=c=d=4, s=1, T=3: scores T^2 D = 144; key M_h x per token c*d*b*s + b*a*c*s = 64 + 64
    geometry = dict(n_embd=16, n_head=2, btt_rank=1, btt_factors=(4, 4, 4, 4))
    assert score_macs("bilinear_btt", 3, **geometry) == 144
    assert qk_projection_macs("bilinear_btt", 3, **geometry) == 3 * 128
    assert qk_projection_macs("bilinear_btt", 3, **geometry) == 2 * 1 * 3 * 16 ** 1.5  # 2 s T D^{3/2}
    assert score_macs("bilinear_btt", 3, include_projections=True, **geometry) == 144 + 384
    assert pv_macs("bilinear_btt", 3, **geometry) == 9 * 8
    assert key_cache_elements("bilinear_btt", 3, n_embd=16) == 48


def test_bilinear_btt_unbalanced_factors():
    # D = 8, (a,b,c,d) = (2,4,2,4), s = 2: c*d*b*s = 2*4*4*2 = 64, b*a*c*s = 4*2*2*2 = 32 per token
    geometry = dict(n_embd=8, n_head=1, btt_rank=2, btt_factors=(2, 4, 2, 4))
    assert qk_projection_macs("bilinear_btt", 5, **geometry) == 5 * 96
    assert default_btt_factors(16) == (4, 4, 4, 4)
    assert default_btt_factors(768) == (24, 32, 24, 32)


# ------------------------------------------------------------------------------------------- config level


GPT2_MLR = dict(attention="mlr", n_embd=512, n_head=8, n_positions=1024, n_layer=2, mlr_ranks=PAPER_RANKS)


def test_report_mlr_paper_config():
    report = attention_cost_report(StructAttnGPT2Config(**GPT2_MLR), causal=False)
    assert report.score_ratio == pytest.approx(0.60083, abs=1e-5)
    assert report.attention_ratio == pytest.approx((38.453125 + 64) / 128)
    assert report.key_cache_ratio == pytest.approx(0.60083, abs=1e-5)
    assert report.kv_cache_ratio == pytest.approx(0.800, abs=5e-4)
    # per token per head 1024 * 38.453125 = 39376 MACs; x 2 FLOPs x 2 layers x 8 heads
    assert report.score_flops_per_token == 39_376 * 32
    assert report.dense_score_flops_per_token == 65_536 * 32
    # 39376 key entries per head-layer, 16 head-layers, 2 bytes
    assert report.key_cache_bytes == 39_376 * 16 * 2
    assert report.dense_kv_cache_bytes == 131_072 * 16 * 2
    causal = attention_cost_report(StructAttnGPT2Config(**GPT2_MLR))
    assert causal.causal and causal.score_ratio == pytest.approx(39_440 / 65_600)
    text = str(causal)
    assert "mlr" in text and "0.6012" in text and "FLOPs = 2 x MACs" in text


def test_report_other_variants():
    base = dict(n_embd=16, n_head=2, n_positions=8, n_layer=1)
    swa = attention_cost_report(StructAttnGPT2Config(**base, attention="swa", sliding_window=4), causal=True)
    # T = 8, w = 4: causal pairs 1+2+3+4*5 = 26 vs 36; cache 4 vs 8 positions
    assert swa.score_ratio == pytest.approx(26 / 36)
    assert swa.kv_cache_ratio == pytest.approx(0.5)
    btt = attention_cost_report(StructAttnGPT2Config(**base, attention="bilinear_btt", btt_rank=1), causal=False)
    assert btt.score_ratio == pytest.approx(16 / 8)  # key width D = 16 vs head dim 8
    assert btt.key_cache_ratio == pytest.approx(2.0)
    assert btt.kv_cache_ratio == pytest.approx((16 + 8) / 16)
    bmlr = attention_cost_report(StructAttnGPT2Config(**base, attention="bilinear_mlr", bilinear_mlr_ranks=[2, 1, 1]),
                                 causal=False)
    assert bmlr.score_ratio == pytest.approx(8 / 8)
    assert bmlr.key_width == 8 and bmlr.value_dim == 8


def test_flops_per_token_dense_by_hand():
    config = StructAttnGPT2Config(attention="dense", n_embd=8, n_head=2, n_positions=4, n_layer=1)
    # matmul params: q,k 2*64 + v,o 2*64 + MLP 2*8*32 = 768
    assert nonembedding_matmul_params(config) == 768
    # causal T=4: 10 pairs * head dim 4 for scores and again for PV = 80 MACs per head, 2 heads, / 4 tokens, x2
    forward = 2 * 768 + 2 * 1 * 2 * 80 / 4
    assert flops_per_token(config, 4, training=False) == pytest.approx(forward)
    assert flops_per_token(config, 4) == pytest.approx(3 * forward)
    assert flops_per_token(config, 4, params_nonembedding=1000, training=False) == pytest.approx(2000 + 80)


def test_nonembedding_params_btt():
    config = StructAttnGPT2Config(attention="bilinear_btt", n_embd=16, n_head=2, n_positions=8, n_layer=1, btt_rank=1,
                                  btt_factors=[4, 4, 4, 4])
    # key factors 2 heads * (64 + 64); v,o 2*256; MLP 2*16*64
    assert nonembedding_matmul_params(config) == 256 + 512 + 2048


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("call,field", [
    (lambda: score_macs("mlr", 8, ranks=(2, 1, 1), block_sizes=(4, 2), head_dim=5), "ranks"),
    (lambda: score_macs("mlr", 8, ranks=(2, 1, 1), block_sizes=(8, 3)), "block_sizes"),
    (lambda: score_macs("mlr", 8, ranks=(2, 1, 1), block_sizes=(4, 4)), "block_sizes"),
    (lambda: score_macs("mlr", 8, ranks=(2, 1, 1), block_sizes=(4,)), "block_sizes"),
    (lambda: score_macs("mlr", 8, ranks=(2, 0, 1), block_sizes=(4, 2)), "ranks"),
    (lambda: score_macs("mlr", 8, ranks=(2, 1, 1)), "block_sizes"),
    (lambda: score_macs("flash", 8, head_dim=4), "variant"),
    (lambda: score_macs("dense", -1, head_dim=4), "seq_len"),
    (lambda: score_macs("swa", 8, head_dim=4, window=0), "window"),
    (lambda: score_macs("bilinear_mlr", 8, ranks=(2, 1, 1), n_embd=6, n_head=2), "n_embd"),
    (lambda: score_macs("bilinear_btt", 8, n_embd=16, n_head=2, btt_rank=1, btt_factors=(2, 8, 3, 5)),
     "btt_factors"),
    (lambda: score_macs("bilinear_btt", 8, n_embd=16, n_head=2, btt_rank=0), "btt_rank"),
    (lambda: key_cache_elements("mlr", 8, (2, 1, 1), (8, 3)), "block_sizes"),
    (lambda: kv_cache_bytes("dense", 8, head_dim=4, dtype_bytes=0), "dtype_bytes"),
    (lambda: dyadic_block_sizes(1000, 8), "n_positions"),
])
def test_invalid_inputs_name_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


@pytest.mark.parametrize("override,field", [
    (dict(mlr_ranks=[32, 8, 6, 4, 4, 4, 4, 3]), "mlr_ranks"),
    (dict(mlr_block_sizes=[512, 256, 100, 64, 32, 16, 8]), "mlr_block_sizes"),
    (dict(attention="linear"), "attention"),
    (dict(n_positions=1000), "n_positions"),
    (dict(n_head=7), "n_head"),
    (dict(attention="swa"), "sliding_window"),
    (dict(attention="swa", sliding_window=-2), "sliding_window"),
    (dict(attention="bilinear_mlr"), "bilinear_mlr_ranks"),
    (dict(attention="bilinear_btt", btt_rank=1, btt_factors=[16, 32, 32, 17]), "btt_factors"),
])
def test_invalid_config_is_refused_when_built_naming_the_field(override, field):
    """The counts take validated configs: the config itself refuses a geometry the counts could not use."""
    with pytest.raises(ValueError, match=field):
        StructAttnGPT2Config(**dict(GPT2_MLR, **override))


def test_mixed_stacks_are_counted_layer_by_layer():
    """A global + SWA stack costs the layer-weighted mean of the all-dense and all-SWA stacks."""
    from hf_structattn.flops import flops_per_token

    base = dict(vocab_size=257, n_positions=1024, n_embd=128, n_head=2, n_layer=6, sliding_window=128)
    dense = flops_per_token(StructAttnGPT2Config(**base, attention="dense"), 1024)
    swa = flops_per_token(StructAttnGPT2Config(**base, attention="swa"), 1024)
    mixed_config = StructAttnGPT2Config(**base, attention="dense",
                                        attention_layers=["dense", "swa", "swa", "dense", "swa", "swa"])
    mixed = flops_per_token(mixed_config, 1024)
    assert swa < dense
    assert mixed == pytest.approx((2 * dense + 4 * swa) / 6, rel=1e-12)
    assert nonembedding_matmul_params(mixed_config) == nonembedding_matmul_params(StructAttnGPT2Config(**base))
    with pytest.raises(ValueError, match="attention_layers"):
        StructAttnGPT2Config(**base, attention="dense", attention_layers=["dense"])


def _counted_forward_flops(model, encoder_len, decoder_len, bias_grad=False):
    """Matmul FLOPs of one (1, encoder_len) -> (1, decoder_len) forward, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    input_ids = torch.randint(2, model.config.vocab_size, (1, encoder_len))
    labels = torch.randint(2, model.config.vocab_size, (1, decoder_len))
    counter = FlopCounterMode(display=False)
    with counter, torch.set_grad_enabled(bias_grad):
        model(input_ids=input_ids, labels=labels)
    return counter.get_total_flops()


@pytest.mark.parametrize("encoder_len,decoder_len", [(37, 9), (64, 17)])
def test_encoder_decoder_flops_match_torch_flop_counter(encoder_len, decoder_len):
    """Independent check: torch.utils.flop_counter on a real T5 forward (eager attention) and on a patched MLR
    T5 (its materialised-score path, taken when the relative bias needs a gradient) counts what
    ``encoder_decoder_flops`` predicts, partial MLR blocks included."""
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_structattn import patch
    from hf_structattn.flops import encoder_decoder_flops

    config = T5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                      feed_forward_proj="gated-gelu", decoder_start_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    dense = T5ForConditionalGeneration(config)
    geometry = dict(ranks=[4, 2, 1, 1], block_sizes=[16, 8, 4])

    def masked_future(variant, **kw):
        # eager / materialised causal attention computes the whole square and masks it; we count causal pairs
        return 2 * config.num_heads * config.num_decoder_layers * sum(
            f(variant, decoder_len, causal=False, **kw) - f(variant, decoder_len, causal=True, **kw)
            for f in (score_macs, pv_macs))

    expected = encoder_decoder_flops(dense.config, encoder_len, decoder_len, training=False)
    counted = _counted_forward_flops(dense, encoder_len, decoder_len)
    assert counted == expected + masked_future("dense", head_dim=8)
    assert encoder_decoder_flops(dense.config, encoder_len, decoder_len) == 3 * expected

    mlr = patch(dense, attention="mlr", mlr_ranks=geometry["ranks"], mlr_block_sizes=geometry["block_sizes"])
    assert mlr.config._attn_implementation == "eager"  # patch keeps the implementation; the count is of the
    mlr.set_attn_implementation("sdpa")  # fused op's materialised-score (math) path, not of the eager reference
    mlr_expected = encoder_decoder_flops(mlr.config, encoder_len, decoder_len, training=False)
    counted = _counted_forward_flops(mlr, encoder_len, decoder_len, bias_grad=True)
    assert counted == mlr_expected + masked_future("mlr", **geometry)
    # only the score terms differ, by exactly the pairs that skip levels 2..4
    saving = 2 * config.num_heads * (
        config.num_layers * (score_macs("dense", encoder_len, head_dim=8) - score_macs("mlr", encoder_len, **geometry))
        + config.num_decoder_layers * (score_macs("dense", decoder_len, causal=True, head_dim=8)
                                       - score_macs("mlr", decoder_len, causal=True, **geometry)))
    assert saving > 0 and expected - mlr_expected == saving


def test_encoder_decoder_flops_name_bad_lengths_and_take_validated_configs():
    from hf_structattn.flops import encoder_decoder_flops

    base = dict(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, vocab_size=50)
    with pytest.raises(ValueError, match="encoder_len"):
        encoder_decoder_flops(T5Config(**base), 0, 4)
    with pytest.raises(ValueError, match="decoder_len"):
        encoder_decoder_flops(StructAttnT5Config(**base), 8, -1)
    # a stock T5Config is dense everywhere, like a StructAttnT5Config with the default roles
    assert encoder_decoder_flops(T5Config(**base), 8, 4) == encoder_decoder_flops(StructAttnT5Config(**base), 8, 4)
    # the config refuses what the counts could not use, naming the field
    with pytest.raises(ValueError, match="d_ff"):
        StructAttnT5Config(**dict(base, d_ff=0))
    with pytest.raises(ValueError, match="encoder_attention"):
        StructAttnT5Config(**dict(base, encoder_attention="sparse"))
    with pytest.raises(ValueError, match="mlr_ranks"):
        StructAttnT5Config(**dict(base, encoder_attention="mlr", mlr_ranks=[4, 2]))


def test_cost_report_of_a_mixed_stack_is_the_layer_weighted_mix():
    base = dict(vocab_size=257, n_positions=1024, n_embd=128, n_head=2, n_layer=6, sliding_window=128)
    dense = attention_cost_report(StructAttnGPT2Config(**base, attention="dense"))
    swa = attention_cost_report(StructAttnGPT2Config(**base, attention="swa"))
    mixed = attention_cost_report(StructAttnGPT2Config(**base, attention="dense",
                                                       attention_layers=["dense", "swa", "swa", "dense", "swa", "swa"]))
    assert mixed.variant == "dense|swa|swa|dense|swa|swa"
    for field in ("score_flops_per_token", "pv_flops_per_token", "key_cache_bytes", "kv_cache_bytes"):
        assert getattr(mixed, field) == pytest.approx((2 * getattr(dense, field) + 4 * getattr(swa, field)) / 6,
                                                      rel=1e-12), field
    assert mixed.dense_kv_cache_bytes == dense.kv_cache_bytes and swa.kv_cache_ratio < mixed.kv_cache_ratio < 1
