"""Smoke test of ``python -m benchmarks.trl_compare`` (the TRL part is skipped without trl)."""

from __future__ import annotations

import pytest

from benchmarks import trl_compare as entry
from benchmarks.lib import trl_compare as bench
from benchmarks.lib.trl import trl_version


def test_trl_gets_the_ids_the_loops_train_on():
    from core.environments.arithmetic import ArithmeticTask
    from core.models.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    pairs = bench.build_examples(tok, "dpo", 4)
    seqs, trl = bench.rows("dpo", pairs), bench.trl_examples("dpo", pairs)
    assert len(pairs) == 2 and len(seqs) == 4
    for k, pair in enumerate(trl):
        chosen, rejected = seqs[2 * k], seqs[2 * k + 1]  # chosen at even rows, rejected at odd rows
        assert chosen[0] == pair["prompt_ids"] + pair["chosen_ids"]
        assert rejected[0] == pair["prompt_ids"] + pair["rejected_ids"]
        assert pair["chosen_ids"][-1] == pair["rejected_ids"][-1] == tok.eos_token_id
        assert pair["chosen_ids"] != pair["rejected_ids"]
        assert chosen[1] == [0] * len(pair["prompt_ids"]) + [1] * len(pair["chosen_ids"])
    sft = bench.trl_examples("sft", bench.build_examples(tok, "sft", 4))
    problem = ArithmeticTask(None).problem(bench.SEED, 0)
    assert tok.decode(sft[0]["input_ids"], skip_special_tokens=True) == problem["prompt"] + problem["answer"]
    assert sft[0]["input_ids"][0] == tok.bos_token_id and sft[0]["input_ids"][-1] == tok.eos_token_id
    examples = bench.build_examples(tok, "sft", 4)
    batch = bench.to_batch("sft", examples, tok.pad_token_id)
    facts = bench.batch_facts(bench.rows("sft", examples))
    assert int(batch["input_lengths"].sum()) == facts["real_tokens"]
    assert int(batch["token_mask"].sum()) == facts["loss_tokens"]
    assert batch["input_ids"].shape == (4, facts["width"])


@pytest.mark.slow
def test_benchmark_runs_trl_and_a_layout(ray_session, capsys):
    if trl_version() is None:
        pytest.skip("trl is not installed (pip install trl)")
    rc = entry.main(
        ["--algorithms", "dpo", "--layouts", "dtensor-dp1", "--batch", "4", "--steps", "1", "--warmup", "1"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAILED" not in out
    rows = {line.split("|")[2].strip(): line for line in out.splitlines() if line.startswith("| dpo ")}
    assert {"trl", "dtensor-dp1"} <= set(rows)
    assert "TRL same rows/masks: yes" in out
    # Same initial weights, same batch: the first steps agree (loss log 2, same grad norm).
    assert "loss 0.693147 vs 0.693147 (ok); grad_norm" in out and "DIFF" not in out
