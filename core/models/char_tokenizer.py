"""A character-level tokenizer for the built-in arithmetic task, built locally.

One token per character (digits, the operators, ``=``, brackets and space) plus the usual
specials.  Encoding adds ``<s>`` in front (a template post-processor), decoding fuses the
characters back without separators, so ``decode(encode("12+7=")) == "12+7="``.  It is a
real ``PreTrainedTokenizerFast`` saved with ``save_pretrained``: vLLM, the policy workers
and ``AutoTokenizer.from_pretrained`` load it from its directory like any hub tokenizer.
"""

from __future__ import annotations

import re

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


#: The tool-use variant's extra vocabulary (``builtin:arithmetic-llama-tools``): the newline
#: and JSON punctuation as characters, and the words of the Hermes / Qwen calculator call
#: (core/environments/tools/parser.py) as whole tokens -- the tokenizer has no letters, so a
#: call is ``<tool_call>{"name":"calculator","arguments":{"expression":"1+2"}}</tool_call>``
#: in 16 tokens plus the expression, short enough for a 96-token conversation.  Not special
#: tokens: decoding with ``skip_special_tokens`` (what the environment reads) keeps them.
TOOL_CHARACTERS = tuple('\n{}:,"')
TOOL_WORDS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    '"name"',
    '"calculator"',
    '"arguments"',
    '"expression"',
)


def tool_char_tokenizer():
    """The character tokenizer plus ``TOOL_CHARACTERS`` and ``TOOL_WORDS`` (ids 21-34, after
    the character tokenizer's own ids, which keep their values).  A word is one token wherever
    it appears (the pre-tokenizer matches words before single characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS + TOOL_CHARACTERS + TOOL_WORDS)}
    words = "|".join(re.escape(word) for word in TOOL_WORDS)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{words}|[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
