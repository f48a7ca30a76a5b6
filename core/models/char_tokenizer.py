"""A character-level tokenizer for the built-in arithmetic task, built locally.

One token per character (digits, the operators, ``=``, brackets and space) plus the usual
specials.  Encoding adds ``<s>`` in front (a template post-processor), decoding fuses the
characters back without separators, so ``decode(encode("12+7=")) == "12+7="``.  It is a
real ``PreTrainedTokenizerFast`` saved with ``save_pretrained``: vLLM, the policy workers
and ``AutoTokenizer.from_pretrained`` load it from its directory like any hub tokenizer.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHARACTERS = tuple("0123456789+-*=() ")


def char_tokenizer():
    """The tokenizer (specials first: pad 0, bos 1, eos 2, unk 3; then the characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own pre-token: the word-level model then maps it to one id.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
