"""A byte-level tokenizer for English task text, built locally (no training, no download).

One token per UTF-8 byte (ids 3..258 are bytes 0..255) plus ``<pad>`` 0, ``<s>`` 1 and
``</s>`` 2; encoding adds ``<s>`` in front, decoding joins the bytes back, so any text
round-trips exactly.  The tokenizer of ``builtin:reasoning-gym-llama``.

Why bytes rather than a BPE trained on generated task text: the tasks a tiny model can learn
in minutes on a CPU read and write letters (``spell_backward`` reverses a word,
``letter_counting`` counts a letter in a phrase).  A BPE token hides the letters of the word it
stands for, so a ~1 M-parameter model would first have to learn each token's spelling from
scratch; bytes show them, cover every task's text without an unknown token (reasoning-gym's
prompts are not all ASCII), and need no corpus, so the vocabulary cannot drift with the task
settings.  Their cost is sequence length: a prompt is as many tokens as characters, two to four
times a BPE's; at the recipe's settings (prompts of at most ~100 characters) that is affordable.

It is a real ``PreTrainedTokenizerFast`` saved with ``save_pretrained`` (a byte-level BPE
without merges, as GPT-2's byte alphabet): vLLM, the policy workers and
``AutoTokenizer.from_pretrained`` load it from its directory like any hub tokenizer.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
#: The first byte's id (bytes follow the specials in byte order: id = byte + BYTE_OFFSET).
BYTE_OFFSET = len(SPECIAL_TOKENS)


def byte_symbols() -> list[str]:
    """The printable character standing for each byte 0..255 (GPT-2's byte-level alphabet,
    which the ``tokenizers`` ByteLevel pre-tokenizer and decoder use): printable Latin-1
    bytes stand for themselves, the others for code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def byte_tokenizer():
    """The tokenizer (specials first: pad 0, bos 1, eos 2; then the 256 bytes in order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *byte_symbols()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: every byte is its own pre-token, the text as it is.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
