"""The paths a GPU runs, against float64 references computed on the CPU.

* ``mlr_attention`` through its dispatcher (on CUDA ``auto`` is the Triton kernel) and its math path: bf16 and fp32,
  odd shapes (T = 37, ranks 5|3|4|2, value width 10), a left-padded row with its own positions and a row that
  continues at an offset, causal and bidirectional, outputs and q/k/v gradients; the math path with a learned
  additive bias (T5's relative position bias) and its gradient.
* Generation on the device: greedy decode steps with the hierarchical cache, and compiled static-cache decode steps
  (inductor on CUDA), each step's logits against the CPU float64 uncached forward of the same tokens, on a
  left-padded batch that crosses MLR block boundaries.

On CUDA this is the first part of ``scripts/gpu_check.sh``. Without CUDA the same cases run on the CPU at the same
tiny sizes, the Triton kernel under its interpreter (the check's rehearsal, and the default suite).
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` of the process

from conftest import tiny_lm  # noqa: E402
from hf_structattn import mlr_attention, mlr_attention_reference  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
# on CUDA "auto" is the Triton kernel; on the CPU "auto" is the fused flash path and the kernel runs interpreted
IMPLEMENTATIONS = ["auto", "math"] + ([] if CUDA or not HAS_TRITON else ["triton"])
# (output, gradient) tolerances relative to the reference's largest magnitude
TOLERANCE = {torch.float32: (2e-5, 5e-5), torch.bfloat16: (2e-2, 4e-2)}
RANKS, BLOCKS, VALUE_DIM, LENGTH = [5, 3, 4, 2], [16, 8, 4], 10, 37


def _inputs(dtype, seed=0):
    """q, k (2, 3, 37, 14), v (2, 3, 37, 10), positions (2, 37) and keep-mask (2, 37): row 0 continues at position
    9 (shifted blocks), row 1 is left-padded by 6 (its real tokens start at position 0)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, LENGTH, sum(RANKS), generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(2, 3, LENGTH, VALUE_DIM, generator=gen).to(dtype)
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    mask[1, :6] = False
    positions = torch.stack([torch.arange(LENGTH) + 9, (mask[1].long().cumsum(-1) - 1).clamp(min=0)])
    return q, k, v, positions, mask


def _grads(fn, tensors, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def _assert_close(got, expected, tolerance, what):
    scale = max(1.0, expected.abs().max().item())
    error = (got.double().cpu() - expected).abs().max().item()
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} > {tolerance:.1g} x {scale:.3g}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dispatcher_and_kernels_on_the_device_equal_the_float64_reference(implementation, dtype, causal):
    q, k, v, positions, mask = _inputs(dtype)
    live = mask[:, None, :, None]  # padded query rows are unspecified: they carry no gradient and are not compared
    grad_out = torch.randn(2, 3, LENGTH, VALUE_DIM, generator=torch.Generator().manual_seed(1)) * live
    kwargs = dict(ranks=RANKS, block_sizes=BLOCKS, causal=causal, scales="mup")
    on_device = [t.to(DEVICE) for t in (positions, mask)]
    out, grads = _grads(lambda a, b, c: mlr_attention(a, b, c, positions=on_device[0], attention_mask=on_device[1],
                                                      implementation=implementation, **kwargs),
                        [t.to(DEVICE) for t in (q, k, v)], grad_out.to(DEVICE))
    ref, ref_grads = _grads(lambda a, b, c: mlr_attention_reference(a, b, c, positions=positions,
                                                                    attention_mask=mask, **kwargs),
                            [t.double() for t in (q, k, v)], grad_out.double())
    assert out.device.type == DEVICE and out.dtype == dtype and torch.isfinite(out).all()
    out_tol, grad_tol = TOLERANCE[dtype]
    _assert_close(out * live.to(DEVICE), ref * live, out_tol, "output")
    for name, mine, theirs in zip("qkv", grads, ref_grads):
        assert mine.dtype == dtype and torch.isfinite(mine).all(), name
        _assert_close(mine, theirs, grad_tol, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_learned_bias_and_its_gradient_on_the_device(dtype):
    """A bias that needs a gradient (T5's relative position bias) takes the math path on every device."""
    q, k, v, positions, mask = _inputs(dtype, seed=2)
    bias = torch.randn(1, 3, LENGTH, LENGTH, generator=torch.Generator().manual_seed(3))
    grad_out = torch.randn(2, 3, LENGTH, VALUE_DIM, generator=torch.Generator().manual_seed(4)) * mask[:, None, :, None]
    kwargs = dict(ranks=RANKS, block_sizes=BLOCKS, causal=False, scales=1.0)
    out, grads = _grads(lambda a, b, c, d: mlr_attention(a, b, c, bias=d, attention_mask=mask.to(DEVICE), **kwargs),
                        [t.to(DEVICE) for t in (q, k, v)] + [bias.to(DEVICE)], grad_out.to(DEVICE))
    ref, ref_grads = _grads(lambda a, b, c, d: mlr_attention_reference(a, b, c, bias=d, attention_mask=mask, **kwargs),
                            [t.double() for t in (q, k, v)] + [bias.double()], grad_out.double())
    out_tol, grad_tol = TOLERANCE[dtype]
    live = mask[:, None, :, None]
    _assert_close(out * live.to(DEVICE), ref * live, out_tol, "output")
    for name, mine, theirs in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads):
        _assert_close(mine, theirs, grad_tol, name)


def _left_padded_prompt():
    """(2, 21) prompt ids and mask: row 1 is left-padded by 5; 21 + 16 new tokens cross the 8- and 16-token blocks
    of the tiny model (n_positions 64: blocks 32, 16, 8)."""
    ids = torch.randint(2, 61, (2, 21), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 1  # the pad token
    return ids, mask


def _reference_step_logits(sequences, prompt_mask, new_tokens):
    """The CPU float64 uncached forward of ``sequences`` (B, P + N): logits (B, N, V) that predicted each new
    token (what step i of generate scored)."""
    reference = tiny_lm("mlr").double()
    mask = torch.cat([prompt_mask, torch.ones(prompt_mask.shape[0], new_tokens, dtype=prompt_mask.dtype)], -1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate gives a left-padded row
    with torch.no_grad():
        logits = reference(sequences.cpu(), attention_mask=mask, position_ids=positions, use_cache=False).logits
    prompt = prompt_mask.shape[1]
    return logits[:, prompt - 1:prompt - 1 + new_tokens]


@pytest.mark.parametrize("mode", ["cached", "compiled static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_steps_on_the_device_equal_the_cpu_float64_forward(mode, dtype):
    new_tokens = 16
    model = tiny_lm("mlr").to(DEVICE, dtype)
    ids, mask = _left_padded_prompt()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=1)
    if mode == "compiled static":
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, backend="inductor" if CUDA else "eager")
    with torch.no_grad():
        output = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), **kwargs)
    logits = torch.stack(output.logits, 1)  # (B, N, V)
    assert logits.device.type == DEVICE and logits.shape[1] == new_tokens
    expected = _reference_step_logits(output.sequences, mask, new_tokens)
    # the reference scores the device's own tokens, so near-ties in low precision cannot make the rows diverge
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 6e-2}[dtype]
    _assert_close(logits.float(), expected, tolerance, f"{mode} step logits")
