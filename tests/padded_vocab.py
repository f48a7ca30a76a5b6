"""A tiny model whose vocabulary (301) tensor parallelism does not divide, and batches that use
all of it: the padded-vocabulary tests' data (tests/backends/test_padded_vocab.py,
tests/generation/test_refit_padded_vocab.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from core.data import BatchedDataDict
from core.testing.tiny_models import PAD_ID, random_batch, tiny_config, tiny_tokenizer
from tests.torch_backends.conftest import SEQ, pg_batch

V = 301  # odd: no tp > 1 divides it


def save_v301_model(base: str, path: Path, tie: bool = False, seed: int = 0) -> Path:
    """The named tiny model (``core.testing.tiny_models``) with a 301-token vocabulary."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(base)
    cfg.vocab_size = V
    cfg.tie_word_embeddings = tie
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.02)  # exercise Qwen2's q/k/v bias (HF inits it to 0)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path / "tokenizer")
    return path


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def ids_301(ids: torch.Tensor) -> torch.Tensor:
    """Valid positions get ids over the whole [4, 301), the shard edges (150 | 151 on tp=2)
    and the last real id 300 included; padding stays PAD_ID."""
    g = torch.Generator().manual_seed(int(ids.sum()))
    out = torch.where(ids == PAD_ID, ids, torch.randint(4, V, ids.shape, generator=g))
    out[0, 1:5] = torch.tensor([150, 151, 300, 299])  # row 0 has the full length
    return out


def ragged_301(batch: int, seed: int) -> BatchedDataDict:
    ids, lens = random_batch(batch, SEQ, V, seed=seed)
    return BatchedDataDict(input_ids=ids_301(ids), input_lengths=lens)


def pg_batch_301(batch: int, seed: int) -> BatchedDataDict:
    data = pg_batch(batch, seed)
    data["input_ids"] = ids_301(data["input_ids"])
    return data
