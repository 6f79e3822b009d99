"""One-line errors for token ids outside the vocabulary, at no cost to a forward that succeeds.

An out-of-range id makes the token embedding raise a bare ``IndexError: index out of range in self`` on the CPU.
Checking the ids before embedding them would read the device on every forward (a host sync on CUDA), so nothing is
checked on the way in: the models catch the embedding's ``IndexError`` and only then read the ids to name the
offending one. On CUDA an out-of-range id is a device-side assert, as in stock transformers.
"""

import functools
import inspect
from typing import Optional

import torch

IGNORE_INDEX = -100  # labels at this value are ignored by the loss (transformers' convention)


def out_of_vocabulary(num_embeddings: int, **named_ids) -> Optional[str]:
    """The one-line message naming the first id of ``named_ids`` (name -> integer tensor or None) outside
    ``[0, num_embeddings)`` (``labels`` may also hold -100), or None when every id is inside. Reads the ids: call it
    only after the embedding failed."""
    for name, ids in named_ids.items():
        if not torch.is_tensor(ids) or ids.is_floating_point() or ids.is_complex() or ids.numel() == 0:
            continue
        bad = (ids < 0) | (ids >= num_embeddings)
        if name == "labels":
            bad &= ids != IGNORE_INDEX
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            return (f"{name}[{', '.join(map(str, index))}] = {int(ids[index])} is not a token id of this model: its "
                    f"vocabulary has {num_embeddings} tokens (ids 0 to {num_embeddings - 1})")
    return None


def vocabulary_error(error: IndexError, num_embeddings: int, **named_ids) -> IndexError:
    """What to raise for ``error``, an ``IndexError`` raised while embedding ``named_ids``: the one-line
    ``out_of_vocabulary`` error (caused by ``error``) when an id is outside the vocabulary, else ``error`` itself."""
    message = out_of_vocabulary(num_embeddings, **named_ids)
    if message is None:
        return error
    clear = IndexError(message)
    clear.__cause__ = error
    return clear


def naming_out_of_vocabulary_ids(forward, id_names=("input_ids", "inputs", "decoder_input_ids", "labels")):
    """``forward`` (or ``generate``) re-raising an ``IndexError`` as the one-line ``out_of_vocabulary`` error when
    one of the token ids it was called with (``id_names``, given by keyword or position) is outside the input
    embedding; any other ``IndexError`` passes unchanged."""

    @functools.wraps(forward)
    def checked(self, *args, **kwargs):
        try:
            return forward(self, *args, **kwargs)
        except IndexError as error:
            try:
                bound = inspect.signature(checked).bind_partial(self, *args, **kwargs).arguments
            except TypeError:  # arguments the signature does not take: the forward's own error was another one
                bound = {}
            given = {**bound, **kwargs}  # keywords that went into the signature's **kwargs too
            named = {name: given.get(name) for name in id_names}
            raise vocabulary_error(error, self.get_input_embeddings().num_embeddings, **named)

    return checked


__all__ = ["naming_out_of_vocabulary_ids", "out_of_vocabulary", "vocabulary_error"]
