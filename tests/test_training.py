"""Training features: activation (gradient) checkpointing, bf16 autocast, transformers.Trainer, torch.compile."""

import warnings

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from conftest import tiny_lm


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    # torch.compile wraps the module as `_orig_mod`
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("variant", ["mlr", "mixed"])
def test_gradient_checkpointing_gives_the_same_gradients(variant):
    model = tiny_lm(variant).double().train()  # float64: recomputation must give the same gradients exactly
    ids = torch.randint(2, 61, (2, 48))
    loss, grads = _loss_and_grads(model, ids)
    with warnings.catch_warnings():  # transformers 5.24 deprecates gradient_checkpointing_enable (FutureWarning)
        warnings.simplefilter("error", FutureWarning)
        model.activation_checkpointing_enable()
        assert model.is_activation_checkpointing
    loss_ckpt, grads_ckpt = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-12, rtol=1e-12, msg=name)


@pytest.mark.parametrize("variant", ["mlr", "bilinear_mlr", "bilinear_btt"])
def test_bfloat16_autocast_trains(variant):
    model = tiny_lm(variant).train()
    ids = torch.randint(2, 61, (2, 48))
    exact = model(ids, labels=ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - exact.item()) < 0.05 * exact.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_trainer_reduces_the_loss(tmp_path):
    model = tiny_lm("mixed").train()
    generator = torch.Generator().manual_seed(0)
    # a learnable pattern: arithmetic progressions modulo 59 with a random start and stride per row
    starts = torch.randint(0, 59, (64, 1), generator=generator)
    strides = torch.randint(1, 4, (64, 1), generator=generator)
    ids = (starts + strides * torch.arange(48)) % 59 + 2
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=8, learning_rate=1e-2,
                             logging_steps=5, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.5 * losses[0]
    assert result.global_step == 40


def test_torch_compile_training_step_matches_eager():
    model = tiny_lm("mlr").train()
    ids = torch.randint(2, 61, (2, 64))
    loss, grads = _loss_and_grads(model, ids)
    compiled = torch.compile(model, backend="aot_eager")
    compiled_loss, compiled_grads = _loss_and_grads(compiled, ids)
    torch.testing.assert_close(compiled_loss, loss, atol=1e-5, rtol=1e-5)
    assert compiled_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(compiled_grads[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("side", ["validation", "train"])
def test_a_single_text_file_always_gives_both_splits(tmp_path, side):
    """The hash split puts a lone file's only document wholly in validation (probability validation_percent) or in
    train; either way the corpus must hold out a tail instead of leaving a split empty."""
    from hf_structattn.training.data import is_validation, load_text_files_corpus

    name = next(f"corpus_{i}.txt" for i in range(10_000)
                if is_validation(f"{tmp_path / f'corpus_{i}.txt'}#0", 5.0) == (side == "validation"))
    text_file = tmp_path / name
    text_file.write_text("def f(x):\n    return x + 1\n" * 300)
    corpus = load_text_files_corpus([str(text_file)], validation_percent=5.0)
    total = len(text_file.read_bytes()) + 1  # bytes + the end-of-document token
    assert corpus.train.numel() > 0 and corpus.validation.numel() > 0
    assert corpus.train.numel() + corpus.validation.numel() == total
    assert corpus.validation.numel() == total - int(total * 0.95)
