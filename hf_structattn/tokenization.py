"""A byte-level tokenizer that needs no download: 256 byte tokens plus ``<|endoftext|>``.

Any text round-trips exactly (UTF-8 bytes are the tokens), so it suits character-level language modelling on
source code, and it saves/loads as an ordinary ``PreTrainedTokenizerFast``.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with vocab size 257 (ids 0..255 are bytes, 256 is ``<|endoftext|>``)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = _bytes_to_unicode()
    vocab = {byte_to_unicode[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    vocab[END_OF_TEXT] = 256
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                   pad_token=END_OF_TEXT, unk_token=None, clean_up_tokenization_spaces=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (the alphabet of the ByteLevel pre-tokenizer)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))
