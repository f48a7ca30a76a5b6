"""What one ``dualrl bench`` run shares, in either mode (``benchmarks.lib.compare``: every layout;
``benchmarks.lib.gpu``: every backend on one device): :class:`Bench`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lib.models import hf_config, load_tokenizer, prepare_model, random_llama
from benchmarks.lib.sizes import Size


@dataclass
class Bench:
    """A run's arguments, size, device and model, its Ray session, and what it measured so far.

    ``dualrl bench`` keeps its baselines here (the HF child paired with every layout, TRL's
    GRPO trainer, the shared vLLM engine) and builds one results dict; ``--gpu`` records one
    row at a time (:meth:`record`)."""

    args: argparse.Namespace
    size: Size
    tmp: Path = Path(".")
    device: str = "cpu"  # "cuda" | "cpu"
    model_path: str = ""
    tokenizer_path: str = ""
    tokenizer: Any = None
    config: Any = None  # the model's HF config
    session: Any = None  # benchmarks.lib.ray_session.RaySession
    notes: list[str] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    # dualrl bench: the baselines and the engine every layout shares
    hf: Any = None
    hf_row: dict | None = None
    trl: Any = None
    engine: Any = None
    lora_engine: Any = None  # the adapter-refit engine of -lora layouts (refit section)
    refit_skipped: str | None = None

    def load_model(self, model: str | None = None, model_dir: str | None = None, task: str = "arithmetic") -> None:
        """``model`` (any HF model: ``benchmarks.lib.models.prepare_model``) or the size's random
        Llama (built in ``model_dir``, or reused from it; else in the run's temp dir) with the
        built-in tokenizer of the GRPO ``task`` (``--grpo-task``); its HF config and tokenizer."""
        if model:
            self.model_path, self.tokenizer_path = prepare_model(model, self.tmp)
        else:
            from benchmarks.lib.grpo_step import task_tokenizer

            tokenizer, vocab = task_tokenizer(task)
            shape = {**self.size.shape, "vocab_size": max(vocab, self.size.shape["vocab_size"])}
            where = Path(model_dir) if model_dir else self.tmp / f"bench-{self.args.size}-{task}"
            self.model_path = self.tokenizer_path = random_llama(shape, where, tokenizer=tokenizer)
        self.config = hf_config(self.model_path)
        self.tokenizer = load_tokenizer(self.tokenizer_path)

    def record(self, row: dict) -> dict:
        """Keep a row, append it to ``--json`` at once (a killed run keeps it), say so on stderr."""
        self.records.append(row)
        if self.args.json:
            with open(self.args.json, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        what = " ".join(str(row[k]) for k in ("kind", "backend", "mbs") if k in row)
        print(
            f"[gpu bench] {what}" + (f": ERROR {row['error']}" if "error" in row else ""), file=sys.stderr, flush=True
        )
        return row

    @property
    def tokens(self) -> int:
        return self.args.batch * self.args.seq
