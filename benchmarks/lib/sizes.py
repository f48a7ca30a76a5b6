"""The workloads of ``dualrl bench`` and ``dualrl bench --gpu`` by size: one :class:`Size` notion.

A size is a random Llama's shape (the character tokenizer's vocabulary, or Llama-3.2-1B's),
the batch every call gets, the precision and the number of calls; ``dualrl bench`` adds the
GRPO step's workload (:class:`GRPOWorkload`), ``--gpu`` the micro batches it sweeps and the
one its fp32 loss check uses.  Flags override each field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class GRPOWorkload:
    prompts: int  # per step
    group: int  # generations per prompt
    new_tokens: int
    seq: int  # policy.max_total_sequence_length (prompt <= 16 tokens + completion)
    micro_batch: int  # per-rank train / logprob micro batch (rows)
    steps: int  # timed steps
    warmup: int = 1  # untimed steps first (compile, first refit, allocator)
    full_length: bool = False  # every completion exactly new_tokens long (min_new_tokens = new_tokens)
    #: A -packed / -shared layout's packed row (its token budget) holds this many full-length
    #: sequences.  Short rows keep a dense packed mask cheap (torch); a worker that gives each
    #: device one packed row per micro batch runs many small micro batches with them, and JAX's
    #: banded attention makes wide rows cheap (docs/results.md, packed rows on JAX).
    packed_row_sequences: int = 2

    @property
    def samples(self) -> int:
        return self.prompts * self.group

    @property
    def prompt_room(self) -> int:
        """Tokens of ``seq`` left for the prompt."""
        return self.seq - self.new_tokens

    def with_overrides(
        self,
        new_tokens: int | None = None,
        prompts: int | None = None,
        group: int | None = None,
        full_length: bool | None = None,
    ) -> GRPOWorkload:
        """This workload with the given fields replaced (``None``: kept); ``seq`` follows
        ``new_tokens`` so that the prompts keep their room."""
        new_tokens = self.new_tokens if new_tokens is None else new_tokens
        return replace(
            self,
            new_tokens=new_tokens,
            seq=self.prompt_room + new_tokens,
            prompts=self.prompts if prompts is None else prompts,
            group=self.group if group is None else group,
            full_length=self.full_length if full_length is None else full_length,
        )


@dataclass(frozen=True)
class Size:
    shape: dict[str, Any]  # HF Llama config fields
    batch: int
    seq: int
    precision: str = "float32"
    micro: int | None = None  # rows per micro batch and rank (None: the whole local batch)
    iters: int = 3  # timed calls per operation
    warmup: int = 1  # untimed calls first (JAX compiles in the first)
    grpo: GRPOWorkload | None = None  # dualrl bench's GRPO step
    mbs: tuple[int, ...] = ()  # dualrl bench --gpu: the micro batch sizes swept
    check_mbs: int = 1  # dualrl bench --gpu: the micro batch of the fp32 loss check


def llama(
    hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, positions: int, tied: bool = True
) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=positions,
        tie_word_embeddings=tied,
    )


#: Llama-3.2-1B's shape (random init, default RoPE): 1.24 B parameters, tied embeddings.
LLAMA_1B = llama(2048, 8192, 16, 32, 8, 128256, 4096)

#: ``dualrl bench``
SIZES: dict[str, Size] = {
    # the built-in model's shape (vocab 32 = the character tokenizer rounded up for tp 2 / 4)
    "tiny": Size(
        llama(256, 512, 2, 8, 4, 32, 128),
        batch=8,
        seq=32,
        iters=2,
        grpo=GRPOWorkload(prompts=4, group=4, new_tokens=6, seq=32, micro_batch=8, steps=1),
    ),
    "small": Size(
        llama(512, 1536, 8, 8, 4, 32, 512),
        batch=8,
        seq=256,
        iters=3,
        grpo=GRPOWorkload(prompts=16, group=8, new_tokens=16, seq=32, micro_batch=32, steps=2),
    ),
    "1b": Size(
        LLAMA_1B,
        batch=8,
        seq=2048,
        precision="bfloat16",
        micro=4,
        iters=5,
        warmup=2,
        grpo=GRPOWorkload(prompts=32, group=8, new_tokens=256, seq=512, micro_batch=16, steps=3),
    ),
}

#: ``dualrl bench --gpu``: every row full length; the CPU smoke is its ``tiny``.
GPU_SIZES: dict[str, Size] = {
    "1b": Size(LLAMA_1B, batch=8, seq=2048, precision="bfloat16", warmup=2, mbs=(1, 2, 4), check_mbs=1),
    "tiny": Size(llama(128, 256, 2, 4, 2, 64, 128), batch=4, seq=64, mbs=(2,), check_mbs=2),
}
