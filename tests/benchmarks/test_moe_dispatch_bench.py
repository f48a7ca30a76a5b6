"""``python -m benchmarks.moe_dispatch``: its layers, its refusals and one real (tiny) run."""

from __future__ import annotations

import json

import pytest

from benchmarks import moe_dispatch

A3B = "tests/data/hf_configs/Qwen3-30B-A3B/config.json"


def test_layers_come_from_the_registry_or_a_real_config():
    assert moe_dispatch.layer_of(A3B) == moe_dispatch.Layer("Qwen3-30B-A3B", 2048, 768, 128, 8)
    assert moe_dispatch.layer_of("qwen3_moe_bench") == moe_dispatch.Layer("qwen3_moe_bench", 512, 704, 8, 2)
    with pytest.raises(SystemExit, match="not a MoE config"):
        moe_dispatch.layer_of("llama")
    with pytest.raises(SystemExit, match="neither a config.json path"):
        moe_dispatch.layer_of("no_such_model")


def test_a_tiny_run_measures_every_dispatch_against_dense(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    argv = ["--models", "qwen3_moe", "--tokens", "24", "--iters", "1", "--blocks", "8", "--json", str(out)]
    assert moe_dispatch.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["dispatch"] for r in rows] == ["dense", "grouped", "blocked-8"]
    for r in rows:
        assert r["forward_s"] > 0 and r["train_s"] > 0 and r["err"] < 1e-5, r
    assert rows[0]["forward_x"] == 1.0
    assert "| qwen3_moe | 24 | blocked-8 |" in capsys.readouterr().out
