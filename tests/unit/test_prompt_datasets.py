"""Prompt datasets: sources (JSONL / parquet / directory / hub / built-in), formatting,
length limits, validation splits and the resumable loader.

Every file source is written to ``tmp_path`` and read through the real
``datasets.load_dataset`` path; the tokenizer is the local word-level test tokenizer (one
token per whitespace-separated word), so prompt lengths are known by counting words.
"""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.datasets import (
    BatchLoader,
    DatasetLoadError,
    build_prompt_datasets,
    builtin_rows,
    format_prompt,
    load_rows,
    tokenize_prompt,
)
from core.datasets.config import DataConfig
from core.environments.arithmetic import ArithmeticTask
from core.environments.config import ArithmeticTaskConfig
from core.testing.tiny_models import tiny_tokenizer
from tests.logs import warns

CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
WORDS = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()


@pytest.fixture
def tok():
    return tiny_tokenizer()


@pytest.fixture
def bos_tok():
    """The test tokenizer, but adding BOS like most LM tokenizers do."""
    from tokenizers.processors import TemplateProcessing

    t = tiny_tokenizer()
    t.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.bos_token_id)])
    return t


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_rows(n, words=2):
    """n distinct prompts of ``words`` words each, answers "0".."n-1", plus an extra column."""
    return [
        {"prompt": " ".join(WORDS[(i + j) % 26] for j in range(words)) + f" w{30 + i}", "answer": i, "level": i % 3}
        for i in range(n)
    ]


def cfg(name, **data) -> DataConfig:
    """A GRPO ``data`` section (validated, as a run would get it)."""
    base = {
        "dataset_name": name,
        "dataset_config": None,
        "split": "train",
        "val_dataset_name": None,
        "val_split": None,
        "prompt_key": "prompt",
        "answer_key": "answer",
        "prompt_template": "{prompt}",
        "system_prompt": None,
        "use_chat_template": "auto",
        "max_input_seq_length": 64,
        "on_long_prompt": "error",
        "shuffle": True,
    }
    return DataConfig.coerce({**base, **data}, "data")


def changed(data: DataConfig, **changes) -> DataConfig:
    return DataConfig.coerce({**data.to_dict(), **changes}, "data")


def build(data: DataConfig, tok, task=None, *, num_val: int, seed: int):
    """``build_prompt_datasets`` as GRPO calls it: ``task`` is ``env.arithmetic``."""
    task = None if task is None else ArithmeticTaskConfig.coerce(task, "env.arithmetic")
    return build_prompt_datasets(data, task, tok, num_val=num_val, seed=seed)


def prompts(ds):
    return [ds[i].metadata["raw_prompt"] for i in range(ds.size)]


# ---------------------------------------------------------------- sources
def test_jsonl_rows_become_tokenized_prompts_with_metadata(tmp_path, tok):
    rows = make_rows(6)
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    train, val = build(cfg(path), tok, num_val=2, seed=0)
    assert (train.size, val.size, len(train)) == (4, 2, 4)
    for ds in (train, val):
        for k in range(ds.size):
            d = ds[k]
            src = rows[d.metadata["index"]]
            assert d.prompt == src["prompt"]
            assert list(d.input_ids) == tok(src["prompt"])["input_ids"]
            assert d.metadata == {
                "ground_truth": str(src["answer"]),
                "index": src["answer"],
                "raw_prompt": src["prompt"],
                "level": src["level"],
            }


def test_json_array_and_parquet_load_with_other_column_names(tmp_path, tok):
    rows = [{"question": f"a b w{40 + i}", "solution": f"s{i}"} for i in range(5)]
    (tmp_path / "q.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "q.parquet")
    assert load_rows(str(tmp_path / "q.json"), None, "train") == rows
    assert load_rows(str(tmp_path / "q.parquet"), None, "train") == rows
    c = cfg(str(tmp_path / "q.parquet"), prompt_key="question", answer_key="solution")
    train, val = build(c, tok, num_val=1, seed=3)
    got = sorted(
        (d.metadata["raw_prompt"], d.metadata["ground_truth"])
        for ds in (train, val)
        for d in (ds[i] for i in range(ds.size))
    )
    assert got == sorted((r["question"], r["solution"]) for r in rows)
    c.answer_key = None
    assert train.size == 4 and build(c, tok, num_val=1, seed=3)[0][0].metadata["ground_truth"] is None


def test_missing_file_names_path_and_config_key(tmp_path, tok):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"data\.dataset_name.*nope\.jsonl"):
        build(cfg(missing), tok, num_val=1, seed=0)
    good = write_jsonl(tmp_path / "p.jsonl", make_rows(4))
    with pytest.raises(FileNotFoundError, match=r"data\.val_dataset_name.*val\.parquet"):
        build(cfg(good, val_dataset_name=str(tmp_path / "val.parquet")), tok, num_val=1, seed=0)
    with pytest.raises(FileNotFoundError, match=r"\./rel/dir"):
        load_rows("./rel/dir", None, "train")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": ')
    with pytest.raises(DatasetLoadError, match=r"data\.dataset_name: could not load .*bad\.jsonl"):
        load_rows(str(tmp_path / "bad.jsonl"), None, "train")


def test_missing_columns_list_the_available_ones(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", make_rows(4))
    with pytest.raises(
        ValueError,
        match=r"data\.prompt_key.*'question'.*\['answer', 'level', "
        r"'prompt'\]",
    ):
        build(cfg(path, prompt_key="question"), tok, num_val=1, seed=0)
    with pytest.raises(ValueError, match=r"data\.answer_key.*'solution'.*available columns"):
        build(cfg(path, answer_key="solution"), tok, num_val=1, seed=0)
    with pytest.raises(ValueError, match=r"data\.prompt_key.*built-in.*\['answer', 'prompt'\]"):
        build(cfg("arithmetic", prompt_key="question"), tok, num_val=1, seed=0)


def test_empty_sources_are_rejected(tmp_path, tok):
    (tmp_path / "e.jsonl").write_text("\n\n")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    for name in ("e.jsonl", "e.parquet"):
        with pytest.raises(ValueError, match=rf"data\.dataset_name.*{name}.*empty"):
            build(cfg(str(tmp_path / name)), tok, num_val=0, seed=0)


def test_directory_source_serves_its_splits(tmp_path, tok):
    write_jsonl(tmp_path / "train.jsonl", make_rows(5))
    write_jsonl(tmp_path / "test.jsonl", [{"prompt": "x y", "answer": 7}])
    train, val = build(cfg(str(tmp_path), val_split="test"), tok, num_val=3, seed=0)
    assert train.size == 5 and prompts(val) == ["x y"]
    # A single file has no "test" split: asking for one must not re-read the train rows.
    with pytest.raises(ValueError, match=r"data\.val_split.*single file"):
        build(cfg(str(tmp_path / "train.jsonl"), val_split="test"), tok, num_val=1, seed=0)


def test_unknown_hub_dataset_names_dataset_and_key(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # Offline mode is read at import time, so set the module flags as well as the env var.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetLoadError, match=r"data\.dataset_name.*no-such-org/no-such-dataset"):
        load_rows("no-such-org/no-such-dataset", None, "train")


# ---------------------------------------------------------------- formatting
def test_prompt_template_and_bad_templates(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", make_rows(3))
    train, _ = build(cfg(path, prompt_template="q : {prompt} ="), tok, num_val=0, seed=0)
    d = train[0]
    assert d.prompt == f"q : {d.metadata['raw_prompt']} ="
    assert list(d.input_ids) == tok(d.prompt)["input_ids"]
    for bad in ("{question}", "{prompt} {x}", "no field", "{prompt"):  # refused by the section or the formatter
        with pytest.raises(ValueError, match=r"data\.prompt_template"):
            build(cfg(path, prompt_template=bad), tok, num_val=0, seed=0)


def test_chat_template_modes(bos_tok):
    data = cfg("x", prompt_template="q {prompt}")
    assert format_prompt("a b", data, bos_tok) == "q a b"  # auto, no template: plain text
    with pytest.raises(ValueError, match=r"data\.use_chat_template.*tokenizer \w+.*no chat_temp"):
        format_prompt("a b", changed(data, use_chat_template=True), bos_tok)
    with pytest.raises(ValueError, match=r"data\.system_prompt"):
        format_prompt("a b", changed(data, system_prompt="s"), bos_tok)
    bos_tok.chat_template = CHAT_TEMPLATE
    for mode in ("auto", True):
        assert format_prompt("a b", changed(data, use_chat_template=mode), bos_tok) == "<s> q a b "
    assert format_prompt("a b", changed(data, use_chat_template=False), bos_tok) == "q a b"
    assert format_prompt("a b", changed(data, system_prompt="z"), bos_tok) == "<s> z <s> q a b "
    # The rendered template carries its BOS; the plain path gets it from the tokenizer.
    bos = bos_tok.bos_token_id
    assert tokenize_prompt("<s> q a b ", bos_tok, True).count(bos) == 1
    assert tokenize_prompt("q a b", bos_tok, False)[0] == bos


def test_chat_template_is_applied_to_dataset_prompts(tmp_path, bos_tok):
    bos_tok.chat_template = CHAT_TEMPLATE
    path = write_jsonl(tmp_path / "p.jsonl", make_rows(3))
    train, _ = build(cfg(path), bos_tok, num_val=0, seed=0)
    d = train[0]
    assert d.prompt == f"<s> {d.metadata['raw_prompt']} "
    assert list(d.input_ids) == bos_tok(d.prompt, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- length limits
def test_long_prompt_error_names_row_length_and_limit(tmp_path, tok, caplog):
    rows = make_rows(6)
    rows[4]["prompt"] = "a b c d e f g"  # 7 tokens; the others have 3
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=r"data\.max_input_seq_length: row 4 .* 7 tokens.* "
        r"limit of 5.*on_long_prompt: filter",
    ):
        build(cfg(path, max_input_seq_length=5), tok, num_val=1, seed=0)
    with warns(caplog, "dropped 1 of 6"):
        train, val = build(cfg(path, max_input_seq_length=5, on_long_prompt="filter"), tok, num_val=1, seed=0)
    assert train.num_filtered == 1 and train.size + val.size == 5
    assert "a b c d e f g" not in prompts(train) + prompts(val)
    with pytest.raises(ValueError, match=r"all 6 rows .* dropped"):
        build(cfg(path, max_input_seq_length=2, on_long_prompt="filter"), tok, num_val=1, seed=0)


# ---------------------------------------------------------------- validation splits
def test_held_out_split_is_disjoint_deterministic_and_seeded(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", make_rows(20))
    train, val = build(cfg(path), tok, num_val=5, seed=1)
    assert (train.size, val.size) == (15, 5)
    assert not set(prompts(train)) & set(prompts(val))
    assert sorted(prompts(train) + prompts(val)) == sorted(r["prompt"] for r in make_rows(20))
    again = build(cfg(path), tok, num_val=5, seed=1)
    assert (prompts(again[0]), prompts(again[1])) == (prompts(train), prompts(val))
    assert prompts(build(cfg(path), tok, num_val=5, seed=2)[1]) != prompts(val)
    with pytest.raises(ValueError, match=r"grpo\.max_val_samples.*20 usable"):
        build(cfg(path), tok, num_val=20, seed=1)


def test_validation_from_a_second_file(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", make_rows(6))
    val_rows = [{"prompt": f"v w{50 + i}", "answer": f"r{i}"} for i in range(4)]
    vpath = write_jsonl(tmp_path / "v.jsonl", val_rows)
    train, val = build(cfg(path, val_dataset_name=vpath), tok, num_val=3, seed=0)
    assert train.size == 6  # nothing held out of train
    assert prompts(val) == [r["prompt"] for r in val_rows[:3]]
    assert [val[i].metadata["ground_truth"] for i in range(3)] == ["r0", "r1", "r2"]


# ---------------------------------------------------------------- loader
def finite_dataset(tmp_path, tok, n=10):
    path = write_jsonl(tmp_path / "p.jsonl", make_rows(n))
    return build(cfg(path), tok, num_val=0, seed=0)[0]


def order(loader, batches):
    return [[d.metadata["index"] for d in loader.next_batch()] for _ in range(batches)]


def test_loader_order_is_seeded_and_epochs_reshuffle(tmp_path, tok):
    ds = finite_dataset(tmp_path, tok)
    a = order(BatchLoader(ds, 3, shuffle=True, seed=5), 6)
    assert a == order(BatchLoader(ds, 3, shuffle=True, seed=5), 6)
    assert a != order(BatchLoader(ds, 3, shuffle=True, seed=6), 6)
    # 10 prompts, batches of 3: each epoch gives 3 batches of distinct prompts, tail dropped.
    epoch0, epoch1 = sum(a[:3], []), sum(a[3:], [])
    assert len(set(epoch0)) == len(set(epoch1)) == 9 and epoch0 != epoch1
    assert order(BatchLoader(ds, 4, shuffle=False, seed=5), 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match=r"batch_size 11 .*\(10 examples"):
        BatchLoader(ds, 11, shuffle=True, seed=0)


def test_loader_state_round_trip_across_an_epoch_boundary(tmp_path, tok):
    ds = finite_dataset(tmp_path, tok)
    ref = BatchLoader(ds, 3, shuffle=True, seed=2)
    order(ref, 2)
    state = ref.state_dict()
    assert state == {"epoch": 0, "position": 6, "seed": 2, "dataset_size": 10, "batch_size": 3}
    expected = order(ref, 4)  # crosses into epochs 1 and 2
    resumed = BatchLoader(ds, 3, shuffle=True, seed=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as stored in a checkpoint
    assert order(resumed, 4) == expected and resumed.epoch == ref.epoch == 1
    for key, value in (("seed", 3), ("batch_size", 2), ("dataset_size", 11)):
        with pytest.raises(ValueError, match=rf"{key}={value} does not match"):
            BatchLoader(ds, 3, shuffle=True, seed=2).load_state_dict({**state, key: value})


# ---------------------------------------------------------------- built-in arithmetic
def test_builtin_rows_are_the_task_problems():
    task = ArithmeticTask({"max_value": 9})
    assert builtin_rows("arithmetic", {"max_value": 9}, 4, 10, 3) == task.problems(4, 10, 3)


def test_builtin_validation_is_held_out_of_an_infinite_train_stream(tok):
    c, task = cfg("arithmetic"), {"max_value": 9}
    train, val = build(c, tok, task, num_val=30, seed=7)
    held_out = set(prompts(val))
    assert train.size is None and len(held_out) == 30 and val.size == 30
    with pytest.raises(TypeError, match="infinite"):
        len(train)
    stream = [train[i] for i in range(2000)]
    assert not held_out & {d.metadata["raw_prompt"] for d in stream}
    train2, _ = build(c, tok, task, num_val=30, seed=7)
    for i in (0, 1, 17, 1999):
        assert train2[i] == stream[i]
    task = ArithmeticTask({"max_value": 9})
    assert val[0].metadata["raw_prompt"] == task.problem(8, 0)["prompt"]  # seed + 1
    assert stream[0].metadata["ground_truth"] == task.problem(7, stream[0].metadata["index"])["answer"]


def test_val_seed_fixes_the_validation_set_across_run_seeds(tmp_path, tok):
    c, task = cfg("arithmetic", val_seed=8), {"max_value": 9}
    train7, val7 = build(c, tok, task, num_val=30, seed=7)
    train9, val9 = build(c, tok, task, num_val=30, seed=9)
    assert prompts(val7) == prompts(val9) == prompts(build(cfg("arithmetic"), tok, task, num_val=30, seed=7)[1])
    assert [train7[i].prompt for i in range(50)] != [train9[i].prompt for i in range(50)]
    assert not set(prompts(val9)) & {train9[i].metadata["raw_prompt"] for i in range(2000)}
    path = write_jsonl(tmp_path / "p.jsonl", make_rows(20))
    held = [prompts(build(cfg(path, val_seed=3), tok, num_val=5, seed=s)[1]) for s in (1, 2)]
    assert held[0] == held[1] == prompts(build(cfg(path), tok, num_val=5, seed=3)[1])


def test_builtin_space_too_small(tok):
    c, task = cfg("arithmetic"), {"max_value": 2, "operations": ["+"]}
    with pytest.raises(ValueError, match=r"grpo\.max_val_samples.*has 9"):
        build(c, tok, task, num_val=5, seed=0)
    train, val = build(c, tok, task, num_val=4, seed=0)  # 9 >= 2 * 4
    assert not set(prompts(val)) & {train[i].metadata["raw_prompt"] for i in range(200)}


def test_builtin_long_prompts_error_or_are_skipped(tok):
    # Prompts with a "+" render to 4 tokens, the others to 1: a limit of 2 splits them.
    tok.chat_template = (
        "{% for m in messages %}{% if '+' in m['content'] %}a b c {% endif %}{{ m['content'] }}{% endfor %}"
    )
    c, task = cfg("arithmetic", max_input_seq_length=2), {"max_value": 9}
    with pytest.raises(ValueError, match=r"data\.max_input_seq_length.* 4 tokens.*limit of 2"):
        build(c, tok, task, num_val=8, seed=0)
    c.on_long_prompt = "filter"
    train, val = build(c, tok, task, num_val=8, seed=0)
    items = [train[i].metadata["raw_prompt"] for i in range(100)]
    assert all("-" in p for p in items + prompts(val))
    assert train.num_filtered > 0 and val.num_filtered > 0


def test_infinite_loader_state_round_trip(tok):
    train, _ = build(cfg("arithmetic"), tok, num_val=4, seed=0)
    ref = BatchLoader(train, 5, shuffle=True, seed=0)
    order(ref, 3)
    state = ref.state_dict()
    assert state["dataset_size"] == -1 and state["position"] == 15
    expected = [[d.prompt for d in ref.next_batch()] for _ in range(3)]
    resumed = BatchLoader(train, 5, shuffle=True, seed=0)
    resumed.load_state_dict(state)
    assert [[d.prompt for d in resumed.next_batch()] for _ in range(3)] == expected


def test_import_is_backend_free():
    code = "import sys, core.datasets; print([m for m in ('torch', 'jax', 'ray', 'datasets') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
