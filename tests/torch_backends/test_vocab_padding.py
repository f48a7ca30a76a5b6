"""The DTensor backend's vocabulary-padding helpers in one process (the padded policy on every
layout: tests/backends/test_padded_vocab.py): zero rows, ties kept, config untouched, padded
logits at the dtype's lowest with zero gradient into the padded rows, export cut back; and the
preflight no longer asks tp to divide the vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.policy.preflight import check_tensor_parallel_fits
from core.testing.tiny_models import tiny_config
from tests.padded_vocab import V


def test_tp_no_longer_needs_to_divide_the_vocab():
    cfg = tiny_config("llama")
    cfg.vocab_size = V
    check_tensor_parallel_fits(cfg, 2, "policy.parallel.tensor_parallel_size")
    cfg.num_key_value_heads = 3
    cfg.num_attention_heads = 3
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=3, num_key_value_heads=3"):
        check_tensor_parallel_fits(cfg, 2, "policy.parallel.tensor_parallel_size")


def test_pad_vocab_in_process():
    """The padding helpers on one process: zero rows, ties kept, config untouched, padded
    logits at the dtype's lowest with zero gradient into the padded rows, export cut back."""
    from backends.torch_dtensor.vocab_padding import OriginalVocabLoss, mask_padded_logits, pad_vocab_, unpad_rows

    for tie in (False, True):
        cfg = tiny_config("llama")
        cfg.vocab_size, cfg.tie_word_embeddings = V, tie
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        before = model.get_input_embeddings().weight.detach().clone()
        assert pad_vocab_(model, 304) is not None
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert emb.weight.shape == head.weight.shape == (304, 64) and model.config.vocab_size == V
        assert (head.weight is emb.weight) == tie
        assert torch.equal(emb.weight[:V], before) and torch.count_nonzero(emb.weight[V:]) == 0
        ids = torch.randint(0, V, (2, 5))
        logits = model(input_ids=ids).logits
        assert logits.shape[-1] == 304 and (logits[..., V:] == torch.finfo(logits.dtype).min).all()
        torch.log_softmax(logits, -1).gather(-1, ids[..., None]).sum().backward()
        assert torch.count_nonzero(head.weight.grad[V:]) == 0 and torch.count_nonzero(emb.weight.grad[V:]) == 0
        assert unpad_rows(emb.weight, (V, 64)).shape == (V, 64)
    with pytest.raises(ValueError, match="config vocab_size=301 but the input embedding has 304 rows"):
        pad_vocab_(model, 304)  # already padded
    assert pad_vocab_(AutoModelForCausalLM.from_config(cfg), V) is None  # nothing to pad: no hook
    with pytest.raises(ValueError, match=r"does not fit its HF shape \(301, 32\)"):
        unpad_rows(torch.zeros(304, 64), (V, 32))
    plain = torch.zeros(1, 2, 304)
    assert (mask_padded_logits(plain, V)[..., V:] < -1e38).all() and mask_padded_logits(plain[..., :V], V) is not None
    seen = []
    wrapped = OriginalVocabLoss(lambda logits, *rest: seen.append(logits.shape) or (logits.sum(), {}), V)
    wrapped(plain, None, None, None)
    assert seen == [(1, 2, V)] and not hasattr(wrapped, "loss_from_logprobs")
