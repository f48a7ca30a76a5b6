"""Bad input to ``dualrl sft`` / ``dualrl dpo``: exit code 2 and a message naming the row,
column or key, before any worker starts (every case here fails in the driver's checks)."""

from __future__ import annotations

import json

import pytest

from dualrl.cli import main

NO_VAL = {
    "sft": ["sft.val_batches=0", "sft.val_at_start=false", "sft.val_at_end=false"],
    "dpo": ["dpo.val_batches=0", "dpo.val_at_start=false", "dpo.val_at_end=false"],
}
# A minimal chat template for the character tokenizer (it has none): enough to render turns.
CHAT = (
    "policy.tokenizer.chat_template=\"{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }} "
    '{% endfor %}{% if add_generation_prompt %}a={% endif %}"'
)


def _run(capsys, tmp_path, algorithm: str, *overrides: str) -> str:
    paths = [f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]
    file_data = any(o.startswith("data.dataset_name=") for o in overrides)
    task = ["data.arithmetic=null"] if file_data and "data.arithmetic" not in " ".join(overrides) else []
    assert main([algorithm, *NO_VAL[algorithm], *paths, *task, *overrides]) == 2
    return capsys.readouterr().err


def _jsonl(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_missing_response_column(tmp_path, capsys):
    path = _jsonl(tmp_path, [{"prompt": "1+1=", "reply": "2"}])
    err = _run(capsys, tmp_path, "sft", f"data.dataset_name={path}", "data.response_key=response")
    assert "data.response_key: column 'response' is not in dataset" in err and "['prompt', 'reply']" in err


def test_sft_empty_dataset(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    err = _run(capsys, tmp_path, "sft", f"data.dataset_name={tmp_path / 'empty.jsonl'}")
    assert "data.dataset_name: dataset file" in err and "is empty" in err


def test_sft_conversation_without_assistant_turn(tmp_path, capsys):
    rows = [
        {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]},
        {"messages": [{"role": "user", "content": "2+2="}]},
    ]
    path = _jsonl(tmp_path, rows)
    err = _run(
        capsys,
        tmp_path,
        "sft",
        f"data.dataset_name={path}",
        "data.messages_key=messages",
        "data.response_key=null",
        CHAT,
    )
    assert "data.messages_key: row 1 of dataset" in err and "no assistant turn in column 'messages'" in err


def test_sft_messages_without_a_chat_template_start_with_the_prompt(tmp_path, capsys):
    # Without a chat template a conversation is raw text, as a multi-turn rollout writes it:
    # its first message is the prompt.
    path = _jsonl(tmp_path, [{"messages": [{"role": "assistant", "content": "2"}]}])
    err = _run(
        capsys, tmp_path, "sft", f"data.dataset_name={path}", "data.messages_key=messages", "data.response_key=null"
    )
    assert "data.messages_key: row 0 of dataset" in err and "starts with an assistant turn" in err


def test_sft_every_sequence_over_the_limit(tmp_path, capsys):
    path = _jsonl(tmp_path, [{"prompt": "12+34=", "answer": "46"}] * 3)
    err = _run(
        capsys,
        tmp_path,
        "sft",
        f"data.dataset_name={path}",
        "data.on_long_sequence=filter",
        "policy.max_total_sequence_length=4",
    )
    assert "policy.max_total_sequence_length: all 3 rows of dataset" in err


def test_sft_one_sequence_over_the_limit_in_error_mode(tmp_path, capsys):
    path = _jsonl(tmp_path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "12+34+56=", "answer": "102"}])
    err = _run(
        capsys,
        tmp_path,
        "sft",
        f"data.dataset_name={path}",
        "data.on_long_sequence=error",
        "policy.max_total_sequence_length=10",
    )
    assert "row 1 of dataset" in err and "14 tokens, over the limit of 10" in err


def test_dpo_chosen_identical_to_rejected(tmp_path, capsys):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "4", "rejected": "4"}]
    err = _run(capsys, tmp_path, "dpo", f"data.dataset_name={_jsonl(tmp_path, rows)}")
    assert "row 1 of dataset" in err and "'chosen' and 'rejected'" in err and "no preference to learn" in err


def test_dpo_missing_rejected_column(tmp_path, capsys):
    rows = [{"prompt": "1+1=", "chosen": "2", "worse": "3"}]
    err = _run(capsys, tmp_path, "dpo", f"data.dataset_name={_jsonl(tmp_path, rows)}")
    assert "data.rejected_key: column 'rejected' is not in dataset" in err


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "cluster.gpus_per_node=1 policy.train_global_batch_size=3 policy.train_micro_batch_size=1",
            "policy.train_global_batch_size: must be even for DPO, got 3",
        ),
        ("cluster.gpus_per_node=1 policy.train_micro_batch_size=1", "policy.train_micro_batch_size: must be even"),
        ("dpo.val_global_batch_size=7", "dpo.val_global_batch_size: must be even"),
        ("policy.dynamic_batching.enabled=true", "policy.dynamic_batching.enabled: not supported by DPO"),
        ("data.response_key=answer", "data.response_key: not used by dualrl dpo (a key of sft)"),
        ("dpo.reference_policy_kl_penalty=0", "dpo.reference_policy_kl_penalty: must be > 0"),
    ],
)
def test_dpo_config_errors(tmp_path, capsys, override, message):
    assert message in _run(capsys, tmp_path, "dpo", *override.split())


@pytest.mark.parametrize(
    "override, message",
    [
        ("env.name=arithmetic env.num_workers=1", "env: not used by dualrl sft"),
        ("data.messages_key=messages", "data.response_key: 'answer' is not used when data.messages_key is set"),
        ("data.answer_key=answer", "data.answer_key: not used by dualrl sft (a key of grpo)"),
        ("sft.val_micro_batch_size=48", "sft.val_global_batch_size: 128 is not divisible by val_micro_batch_size (48)"),
        ("data.on_long_sequence=cut", "data.on_long_sequence"),
        (
            "policy.sequence_packing.enabled=true policy.sequence_packing.train_mb_tokens=16",
            "policy.sequence_packing.train_mb_tokens: 16 is smaller than max_total_sequence_length",
        ),
        ("checkpointing.export_hf_dir=3", "checkpointing.export_hf_dir"),
        (
            "data.dataset_name=rows.jsonl data.arithmetic.max_value=9",
            "data.arithmetic: not used: data.dataset_name is not a built-in arithmetic task",
        ),
    ],
)
def test_sft_config_errors(tmp_path, capsys, override, message):
    assert message in _run(capsys, tmp_path, "sft", *override.split())
