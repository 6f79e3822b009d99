"""The held-out split of the LM designs' corpus has no near-copies of training files
(hf_structattn.training.data.near_copy_flags): the rule on small texts whose similarity is known, and on the real
standard library, where the code-page tables cp437.py and cp862.py were held out beside their near-copies in
training."""

import numpy as np
import pytest

from hf_structattn.training import data


def _words(count, seed):
    return " ".join(f"w{value}" for value in np.random.default_rng(seed).integers(0, 10_000, count))


def test_shingles_are_the_distinct_word_5grams_whitespace_insensitive():
    vocabulary = {}
    assert data.shingles("a b c d e f", vocabulary).size == 2  # "a b c d e", "b c d e f"
    grams = data.shingles("a b c d e a b c d e", vocabulary)  # 6 grams, "a b c d e" twice
    assert grams.size == 5 and np.array_equal(grams, np.unique(grams))
    assert np.array_equal(data.shingles("a\tb c\n\nd e", vocabulary), data.shingles("a b c d e", vocabulary))
    assert data.shingles("short text", vocabulary).size == 1  # fewer than 5 words: one gram


def test_a_held_out_near_copy_is_flagged_and_an_unrelated_or_distant_one_is_not():
    base = _words(400, 0)
    words = base.split()
    edited = " ".join("changed" if index % 40 == 20 else word for index, word in enumerate(words))  # 10 edits
    distant = " ".join(words[:200]) + " " + _words(200, 9)  # half of it shared
    texts = [base, edited, _words(400, 1), distant, _words(50, 2)]
    held_out = [False, True, True, True, False]
    flags, found = data.near_copy_flags(texts, held_out)
    assert flags == [False, True, False, False, False]
    ((index, partner, similarity),) = found
    # 10 edits inside the text change the 5 grams over each: 396 - 50 shared of 396 + 396 - 346 grams
    assert (index, partner) == (1, 0) and similarity == pytest.approx(346 / 446)
    assert data.near_copy_flags(texts, held_out, threshold=0.2)[0] == [False, True, False, True, False]
    assert data.near_copy_flags(texts, [True] * 5)[0] == [False] * 5  # nothing in training: nothing to copy


def test_the_stdlib_validation_split_holds_out_no_near_copy_of_a_training_file():
    plain = data.load_stdlib_corpus()
    clean = data.load_stdlib_corpus(near_copy_jaccard=data.NEAR_COPY_JACCARD)
    assert "cp437.py ~ encodings/cp865.py 0.95" in clean.description
    assert "cp862.py ~ encodings/cp865.py 0.72" in clean.description
    moved = clean.train_documents - plain.train_documents
    assert moved == plain.validation_documents - clean.validation_documents and 2 <= moved <= 10
    # what moved is at least the two code-page tables' 5.8 % of the held-out bytes
    assert clean.validation.numel() <= 0.95 * plain.validation.numel()
    assert clean.train.numel() + clean.validation.numel() == plain.train.numel() + plain.validation.numel()
    assert bytes(plain.validation.clamp(max=255).tolist()).count(b"cp437 generated from 'VENDORS/MICSFT/PC/CP437.TXT'")
    assert not bytes(clean.validation.clamp(max=255).tolist()).count(b"CP437")
