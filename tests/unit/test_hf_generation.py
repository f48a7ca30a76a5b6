"""``hf_generate``: HF generate behind the protocol's right-padded ``GenerationOutputSpec``.

References are written from plain forward passes of the tiny models (no ``generate``):
a per-row greedy loop on the unpadded prompt, and one forward pass of each returned
sequence for the ``get_logprobs``-layout log-probabilities.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from backends.torch_common.generation import (
    build_hf_generation_config,
    generation_lengths,
    hf_generate,
    right_to_left_padding,
)
from core.data import BatchedDataDict
from core.policy.generation_config import GenerationConfig
from core.testing.tiny_models import PAD_ID, build_tiny_model, random_batch
from tests.logs import warns
from tests.min_new_tokens_checks import assert_min_length, assert_stops_at_once, stop_heavy_ids

N_NEW = 8
TEMPERATURE = 0.7


def gen_cfg(**overrides) -> GenerationConfig:
    """The ``policy.generation`` section these tests sample with (HF generate: backend hf)."""
    cfg = dict(
        backend="hf",
        max_new_tokens=N_NEW,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=None,
        stop_token_ids=None,
        stop_strings=None,
    )
    cfg.update(overrides)
    return GenerationConfig.coerce(cfg)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return build_tiny_model(request.param)


@pytest.fixture(scope="module")
def batch():
    """Ragged right-padded prompts: lengths differ, row 0 fills the width."""
    ids, lengths = random_batch(4, 7, 256, seed=3)
    assert len(set(lengths.tolist())) > 1
    return BatchedDataDict(input_ids=ids, input_lengths=lengths)


@pytest.fixture(scope="module")
def baseline(model, batch):
    """Greedy output with no stop condition; rows' generated tokens as lists."""
    out = hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID)
    return out, generated_rows(out, batch)


# ----------------------------------------------------------------------------- references


def generated_rows(out, batch) -> list[list[int]]:
    """Each row's generated tokens, cut at its generation length."""
    rows = []
    for b, start in enumerate(batch["input_lengths"].tolist()):
        rows.append(out["output_ids"][b, start : start + int(out["generation_lengths"][b])].tolist())
    return rows


@torch.no_grad()
def greedy_reference(model, prompt: torch.Tensor, steps: int, stop_ids=()) -> list[int]:
    """Unbatched greedy decoding with full forward passes (no cache, no padding)."""
    ids, new = prompt[None, :], []
    for _ in range(steps):
        token = int(model(ids).logits[0, -1].argmax())
        new.append(token)
        if token in stop_ids:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return new


@torch.no_grad()
def sequence_logits(model, out, b: int) -> torch.Tensor:
    """Raw logits [L, V] of one forward pass over row b's unpadded output sequence."""
    length = int(out["unpadded_sequence_lengths"][b])
    return model(out["output_ids"][b : b + 1, :length]).logits[0].float()


def reference_logprobs(model, out, temperature: float) -> torch.Tensor:
    """The get_logprobs layout for ``out['output_ids']``: column i = log p(x_i | x_<i) at T."""
    ref = torch.zeros_like(out["logprobs"])
    for b in range(out["output_ids"].shape[0]):
        length = int(out["unpadded_sequence_lengths"][b])
        logp = torch.log_softmax(sequence_logits(model, out, b) / temperature, dim=-1)
        ids = out["output_ids"][b, 1:length]
        ref[b, 1:length] = logp[:-1].gather(1, ids[:, None])[:, 0]
    return ref


def check_layout(out, batch, model, temperature: float) -> None:
    """Prompt copied, padding, lengths consistent, logprobs == reference on generated positions, 0 elsewhere."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    width = ids.shape[1] + N_NEW
    assert out["output_ids"].shape == out["logprobs"].shape == (ids.shape[0], width)
    assert out["output_ids"].dtype == torch.long and out["logprobs"].dtype == torch.float32
    assert torch.equal(out["unpadded_sequence_lengths"], lengths + out["generation_lengths"])
    ref = reference_logprobs(model, out, temperature)
    for b, (start, total) in enumerate(zip(lengths.tolist(), out["unpadded_sequence_lengths"].tolist(), strict=True)):
        assert torch.equal(out["output_ids"][b, :start], ids[b, :start])
        assert (out["output_ids"][b, total:] == PAD_ID).all()
        assert (out["logprobs"][b, :start] == 0).all() and (out["logprobs"][b, total:] == 0).all()
        torch.testing.assert_close(out["logprobs"][b, start:total], ref[b, start:total], atol=1e-5, rtol=0)
        assert (out["logprobs"][b, start:total] < 0).all()


def first_stop(tokens: list[int], stop_ids) -> int:
    """Expected generation length under stop token ids."""
    return next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))


# ----------------------------------------------------------------------------- greedy


def test_greedy_matches_unbatched_reference(model, batch, baseline):
    out, rows = baseline
    for b, length in enumerate(batch["input_lengths"].tolist()):
        assert rows[b] == greedy_reference(model, batch["input_ids"][b, :length], N_NEW)
    assert (out["generation_lengths"] == N_NEW).all()
    check_layout(out, batch, model, TEMPERATURE)


def test_greedy_logprobs_use_configured_temperature(model, batch):
    out = hf_generate(model, batch, gen_cfg(temperature=1.3), greedy=True, pad_token_id=PAD_ID)
    check_layout(out, batch, model, 1.3)


def test_restores_training_mode_and_returns_cpu(model, batch):
    model.train()
    try:
        out = hf_generate(model, batch, gen_cfg(max_new_tokens=2), greedy=True, pad_token_id=PAD_ID)
        assert model.training
    finally:
        model.eval()
    assert all(v.device.type == "cpu" and not v.requires_grad for v in out.values())


def test_max_new_tokens_argument_overrides_config(model, batch):
    out = hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID, max_new_tokens=3)
    assert out["output_ids"].shape[1] == batch["input_ids"].shape[1] + 3
    assert (out["generation_lengths"] == 3).all()


# ----------------------------------------------------------------------------- stop tokens


def pick_stop_token(rows: list[list[int]]) -> int:
    """A token some row generates after step 0 for the first time, and some other row never generates."""
    for tokens in rows:
        for k in range(1, len(tokens) - 1):
            tok = tokens[k]
            if tok not in tokens[:k] and any(tok not in other for other in rows):
                return tok
    raise AssertionError("no usable stop token in the baseline")


@pytest.mark.parametrize("via", ["stop_token_ids", "eos_token_ids"])
def test_stop_token_ends_its_row_only(model, batch, baseline, via):
    _, rows = baseline
    tok = pick_stop_token(rows)
    kwargs = {"eos_token_ids": [tok]} if via == "eos_token_ids" else {}
    cfg = gen_cfg(stop_token_ids=[tok] if via == "stop_token_ids" else None)
    out = hf_generate(model, batch, cfg, greedy=True, pad_token_id=PAD_ID, **kwargs)
    expected = [first_stop(r, {tok}) for r in rows]
    assert out["generation_lengths"].tolist() == expected
    assert min(expected) < N_NEW and max(expected) == N_NEW  # one row stopped, another ran on
    assert generated_rows(out, batch) == [r[:n] for r, n in zip(rows, expected, strict=True)]
    check_layout(out, batch, model, TEMPERATURE)


def test_pad_token_equal_to_real_tokens_does_not_shorten_rows(model, batch, baseline):
    """HF pads finished rows with pad_token_id; here it is the stop token itself, so the
    length cannot be read off the ids and must come from the stop condition."""
    _, rows = baseline
    tok = pick_stop_token(rows)
    out = hf_generate(model, batch, gen_cfg(stop_token_ids=[tok]), greedy=True, pad_token_id=tok)
    expected = [first_stop(r, {tok}) for r in rows]
    assert out["generation_lengths"].tolist() == expected
    for b, (start, n) in enumerate(zip(batch["input_lengths"].tolist(), expected, strict=True)):
        assert out["output_ids"][b, start : start + n].tolist() == rows[b][:n]
        assert (out["output_ids"][b, start + n :] == tok).all()  # right padding with the given pad id


def test_model_generation_config_is_not_inherited(batch, baseline):
    """Checkpoint defaults (eos id, repetition penalty, top_k, sampling) must not leak in."""
    _, rows = baseline
    model = build_tiny_model("llama")
    reference_rows = generated_rows(hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID), batch)
    gc = model.generation_config
    gc.eos_token_id, gc.repetition_penalty, gc.top_k = pick_stop_token(reference_rows), 3.0, 2
    gc.do_sample, gc.temperature, gc.top_p, gc.no_repeat_ngram_size = True, 0.05, 0.5, 1
    out = hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID)
    assert generated_rows(out, batch) == reference_rows and (out["generation_lengths"] == N_NEW).all()

    torch.manual_seed(0)
    sampled = hf_generate(model, batch, gen_cfg(temperature=1.0), greedy=False, pad_token_id=PAD_ID)
    assert max(token_ranks(model, sampled, batch)) >= 50  # neither the model's top_k=2 nor HF's default 50


def test_uninheritable_field_warns(batch, caplog, monkeypatch):
    model = build_tiny_model("llama")
    model.generation_config.forced_eos_token_id = 5
    with warns(caplog, "forced_eos_token_id", monkeypatch):
        hf_generate(model, batch, gen_cfg(max_new_tokens=1), greedy=True, pad_token_id=PAD_ID)


# ----------------------------------------------------------------------------- min_new_tokens


@torch.no_grad()
def masked_greedy_reference(model, prompt: torch.Tensor, steps: int, stop_ids, min_new: int) -> list[int]:
    """Unbatched greedy decoding where the stop ids are masked while fewer than ``min_new``
    tokens exist, ending at the first stop token after that."""
    ids, new, banned = prompt[None, :], [], torch.tensor(sorted(stop_ids))
    for _ in range(steps):
        logits = model(ids).logits[0, -1].clone()
        if len(new) < min_new:
            logits[banned] = -float("inf")
        token = int(logits.argmax())
        new.append(token)
        if token in stop_ids:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return new


def test_min_new_tokens_full_length_greedy_and_sampled(model, batch):
    """With nearly every id a stop token, rows end at once; ``min_new_tokens`` keeps the stop
    tokens out until a row has that many (greedy = the masked argmax, step by step), sampled
    rows too (HF's own sampler and the per-row seeded one), while the logprobs stay the
    unmasked ``get_logprobs`` ones; 0 changes nothing."""
    stop = stop_heavy_ids()
    plain = hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID, eos_token_ids=stop)
    assert_stops_at_once(plain)
    zero = hf_generate(model, batch, gen_cfg(min_new_tokens=0), greedy=True, pad_token_id=PAD_ID, eos_token_ids=stop)
    assert all(torch.equal(zero[k], plain[k]) for k in plain)
    for min_new in (3, N_NEW):
        cfg = gen_cfg(min_new_tokens=min_new)
        out = hf_generate(model, batch, cfg, greedy=True, pad_token_id=PAD_ID, eos_token_ids=stop)
        assert_min_length(out, batch["input_lengths"], min_new, N_NEW, stop)
        check_layout(out, batch, model, TEMPERATURE)
        if min_new < N_NEW:  # where the mask lifts: the step-by-step reference
            for b, length in enumerate(batch["input_lengths"].tolist()):
                ref = masked_greedy_reference(model, batch["input_ids"][b, :length], N_NEW, set(stop), min_new)
                assert generated_rows(out, batch)[b] == ref
    cfg = gen_cfg(min_new_tokens=N_NEW, top_k=8)
    torch.manual_seed(0)
    sampled = hf_generate(model, batch, cfg, greedy=False, pad_token_id=PAD_ID, eos_token_ids=stop)
    data = BatchedDataDict({**batch.get_dict(), "sample_seeds": torch.tensor([5, 6, 7, 8])})
    seeded = hf_generate(model, data, cfg, greedy=False, pad_token_id=PAD_ID, eos_token_ids=stop)
    for out in (sampled, seeded):
        assert (out["generation_lengths"] == N_NEW).all()
        assert_min_length(out, batch["input_lengths"], N_NEW, N_NEW, stop)
        check_layout(out, batch, model, TEMPERATURE)
    # the argument overrides the config, and is cut to max_new_tokens
    short = hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID, eos_token_ids=stop, min_new_tokens=2)
    assert_min_length(short, batch["input_lengths"], 2, N_NEW, stop)
    capped = hf_generate(
        model,
        batch,
        gen_cfg(min_new_tokens=N_NEW),
        greedy=True,
        pad_token_id=PAD_ID,
        eos_token_ids=stop,
        max_new_tokens=3,
    )
    assert (capped["generation_lengths"] == 3).all()


def test_min_new_tokens_and_stop_strings(model, batch, baseline, tokenizer):
    """A stop string completed before the minimum never ends the row, not even later; one
    completed by a token after it does (``stop_string_ends_row``, the rule of every engine)."""
    _, rows = baseline
    b, k, word = pick_word(tokenizer, rows)  # row b generates `word` first at token k + 1
    early = hf_generate(
        model, batch, gen_cfg(stop_strings=[word]), greedy=True, pad_token_id=PAD_ID, tokenizer=tokenizer
    )
    assert early["generation_lengths"][b] == k + 1 < N_NEW
    late = hf_generate(
        model,
        batch,
        gen_cfg(stop_strings=[word], min_new_tokens=k + 1),
        greedy=True,
        pad_token_id=PAD_ID,
        tokenizer=tokenizer,
    )
    expected = [
        next((t for t in range(k + 2, N_NEW + 1) if word in tokenizer.decode(r[k + 1 : t])), N_NEW) for r in rows
    ]
    assert late["generation_lengths"][b] == expected[b] > k + 1
    assert generated_rows(late, batch)[b] == rows[b][: expected[b]]


# ----------------------------------------------------------------------------- stop strings


def expected_string_stop(tokenizer, tokens: list[int], strings) -> int:
    """First k such that the decoded first k generated tokens contain a stop string."""
    for k in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:k]) for s in strings):
            return k
    return len(tokens)


def pick_word(tokenizer, rows, min_step=1):
    """(row, step, word) of a generated word that first appears in its row at ``step``."""
    for b, tokens in enumerate(rows):
        for k in range(min_step, len(tokens) - 1):
            word = tokenizer.decode([tokens[k]])
            if word not in tokenizer.decode(tokens[:k]):
                return b, k, word
    raise AssertionError("no usable word")


def test_stop_string_single_word(model, batch, baseline, tokenizer):
    _, rows = baseline
    _, _, word = pick_word(tokenizer, rows)
    out = hf_generate(model, batch, gen_cfg(stop_strings=[word]), greedy=True, pad_token_id=PAD_ID, tokenizer=tokenizer)
    expected = [expected_string_stop(tokenizer, r, [word]) for r in rows]
    assert min(expected) < N_NEW
    assert out["generation_lengths"].tolist() == expected
    assert generated_rows(out, batch) == [r[:n] for r, n in zip(rows, expected, strict=True)]
    check_layout(out, batch, model, TEMPERATURE)


def test_stop_string_spanning_two_tokens(model, batch, baseline, tokenizer):
    _, rows = baseline
    b, k, _ = pick_word(tokenizer, rows, min_step=2)
    phrase = tokenizer.decode(rows[b][k - 1 : k + 1])  # "wA wB": matched only once wB is generated
    out = hf_generate(
        model, batch, gen_cfg(stop_strings=[phrase]), greedy=True, pad_token_id=PAD_ID, tokenizer=tokenizer
    )
    expected = [expected_string_stop(tokenizer, r, [phrase]) for r in rows]
    assert expected[b] == k + 1
    assert out["generation_lengths"].tolist() == expected


def test_per_row_stop_strings_apply_to_their_row_only(model, batch, baseline, tokenizer):
    _, rows = baseline
    b, _, word = pick_word(tokenizer, rows)
    data = BatchedDataDict(batch.get_dict())
    data["stop_strings"] = [[word] if i == b else None for i in range(len(rows))]
    out = hf_generate(model, data, gen_cfg(), greedy=True, pad_token_id=PAD_ID, tokenizer=tokenizer)
    expected = [expected_string_stop(tokenizer, r, [word]) if i == b else N_NEW for i, r in enumerate(rows)]
    assert expected[b] < N_NEW
    assert out["generation_lengths"].tolist() == expected


def test_stop_string_in_prompt_does_not_stop(model, batch, baseline, tokenizer):
    """Only generated text is searched (as vLLM does): the prompt's last word is no stop."""
    _, rows = baseline
    b = 0
    word = tokenizer.decode([int(batch["input_ids"][b, int(batch["input_lengths"][b]) - 1])])
    out = hf_generate(model, batch, gen_cfg(stop_strings=[word]), greedy=True, pad_token_id=PAD_ID, tokenizer=tokenizer)
    assert out["generation_lengths"][b] == expected_string_stop(tokenizer, rows[b], [word])


# ----------------------------------------------------------------------------- sampling


def token_ranks(model, out, batch) -> list[int]:
    """Rank of every generated token among the raw logits that produced it (0 = argmax)."""
    ranks = []
    for b, start in enumerate(batch["input_lengths"].tolist()):
        logits = sequence_logits(model, out, b)
        for pos in range(start, int(out["unpadded_sequence_lengths"][b])):
            row = logits[pos - 1]
            ranks.append(int((row > row[out["output_ids"][b, pos]]).sum()))
    return ranks


def test_sampling_logprobs_reproducibility_and_filters(model, batch):
    cfg = gen_cfg(top_k=20, top_p=0.9)
    torch.manual_seed(1234)
    out = hf_generate(model, batch, cfg, greedy=False, pad_token_id=PAD_ID)
    torch.manual_seed(1234)
    again = hf_generate(model, batch, cfg, greedy=False, pad_token_id=PAD_ID)
    assert all(torch.equal(out[k], again[k]) for k in out)
    assert (out["generation_lengths"] == N_NEW).all()
    # Logprobs are the raw (unfiltered) distribution at the temperature, as get_logprobs sees it.
    check_layout(out, batch, model, TEMPERATURE)
    assert max(token_ranks(model, out, batch)) < 20  # top-k applied
    # top-p: the mass strictly above each sampled token (in the top-k renormalised, tempered
    # distribution HF samples from) is below top_p.
    for b, start in enumerate(batch["input_lengths"].tolist()):
        logits = sequence_logits(model, out, b) / TEMPERATURE
        for pos in range(start, int(out["unpadded_sequence_lengths"][b])):
            kth = logits[pos - 1].topk(20).values[-1]
            probs = torch.softmax(logits[pos - 1].masked_fill(logits[pos - 1] < kth, -float("inf")), -1)
            chosen = probs[out["output_ids"][b, pos]]
            assert probs[probs > chosen].sum() < 0.9 + 1e-6


def test_sampling_without_top_k_is_unfiltered(model, batch):
    """top_k None must not fall back to HF's default top_k=50."""
    torch.manual_seed(7)
    out = hf_generate(model, batch, gen_cfg(temperature=1.0), greedy=False, pad_token_id=PAD_ID)
    assert max(token_ranks(model, out, batch)) >= 50
    check_layout(out, batch, model, 1.0)


# ----------------------------------------------------------------------------- per-row seeds

SEEDS = torch.tensor([11, 2**32 - 1, 0, 7])


def seeded(batch, rows=None, seeds=SEEDS):
    """``batch``'s rows ``rows`` (all by default) with their ``sample_seeds``."""
    rows = list(range(batch.size)) if rows is None else rows
    data = batch.select_indices(rows)
    data["sample_seeds"] = seeds[rows]
    return data


def test_sample_seeds_make_each_row_a_function_of_its_seed(model, batch):
    cfg = gen_cfg(top_k=20, top_p=0.9)
    torch.manual_seed(0)
    first = hf_generate(model, seeded(batch), cfg, greedy=False, pad_token_id=PAD_ID)
    torch.manual_seed(1)  # the global RNG plays no part
    assert_equal_outputs(hf_generate(model, seeded(batch), cfg, greedy=False, pad_token_id=PAD_ID), first)
    perm = [2, 0, 3, 1]
    permuted = hf_generate(model, seeded(batch, perm), cfg, greedy=False, pad_token_id=PAD_ID)
    assert_equal_outputs(permuted, first.select_indices(perm))
    for b in range(batch.size):  # a row alone (other left-padding width, no neighbours)
        alone = hf_generate(model, seeded(batch, [b]), cfg, greedy=False, pad_token_id=PAD_ID)
        assert_equal_outputs(alone, first.select_indices([b]))
    other = hf_generate(model, seeded(batch, seeds=(SEEDS + 1) % 2**32), cfg, greedy=False, pad_token_id=PAD_ID)
    assert (other["output_ids"] != first["output_ids"]).any(dim=1).sum() >= 2
    # Still sampling (not argmax) from the filtered distribution, with get_logprobs logprobs.
    ranks = token_ranks(model, first, batch)
    assert 0 < max(ranks) < 20
    check_layout(first, batch, model, TEMPERATURE)


def assert_equal_outputs(out, ref):
    assert torch.equal(out["output_ids"], ref["output_ids"])
    assert torch.equal(out["generation_lengths"], ref["generation_lengths"])
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)


def test_sample_seeds_sample_the_warped_distribution(batch):
    """256 seeded copies of one prompt: the first tokens' frequencies follow the
    temperature + top-k distribution HF itself would sample from."""
    model = build_tiny_model("llama")
    rows = 256
    data = BatchedDataDict(
        input_ids=batch["input_ids"][:1].repeat(rows, 1),
        input_lengths=batch["input_lengths"][:1].repeat(rows),
        sample_seeds=torch.arange(rows),
    )
    out = hf_generate(model, data, gen_cfg(top_k=5), greedy=False, pad_token_id=PAD_ID, max_new_tokens=1)
    start = int(batch["input_lengths"][0])
    with torch.no_grad():
        logits = model(batch["input_ids"][:1, :start]).logits[0, -1] / TEMPERATURE
    top = logits.topk(5)
    expected = torch.softmax(top.values, -1)
    drawn = out["output_ids"][:, start]
    assert torch.isin(drawn, top.indices).all()
    observed = torch.stack([(drawn == t).float().mean() for t in top.indices])
    assert 0.5 * (observed - expected).abs().sum() < 0.15, (observed, expected)


def test_sample_seeds_are_ignored_by_greedy_and_checked(model, batch, baseline):
    out = hf_generate(model, seeded(batch), gen_cfg(), greedy=True, pad_token_id=PAD_ID)
    assert torch.equal(out["output_ids"], baseline[0]["output_ids"])
    for seeds, match in [
        (SEEDS[:3], r"\[B\] = \(4,\) integer"),
        (SEEDS.float(), "integer array"),
        (torch.tensor([1, 2, -1, 3]), r"row 2 has -1"),
        (torch.tensor([1, 2**32, 2, 3]), r"\[0, 2\*\*32\); row 1 has 4294967296"),
    ]:
        data = BatchedDataDict(batch.get_dict())
        data["sample_seeds"] = seeds
        with pytest.raises(ValueError, match=match):
            hf_generate(model, data, gen_cfg(), greedy=False, pad_token_id=PAD_ID)


def test_hf_config_fields():
    greedy = build_hf_generation_config(
        gen_cfg(top_k=5, top_p=0.5), greedy=True, max_new_tokens=4, stop_token_ids=[], pad_token_id=0
    )
    assert greedy.do_sample is False and greedy.eos_token_id == [] and greedy.output_logits
    sample = build_hf_generation_config(
        gen_cfg(), greedy=False, max_new_tokens=4, stop_token_ids=[2, 9], pad_token_id=0
    )
    assert (sample.do_sample, sample.top_k, sample.top_p, sample.temperature) == (True, 0, 1.0, TEMPERATURE)
    assert sample.eos_token_id == [2, 9] and sample.repetition_penalty == 1.0


# ----------------------------------------------------------------------------- synced_gpus / FSDP2


def test_synced_gpus_with_fsdp2_module(batch):
    """An FSDP2 (fully_shard) module on a 1-rank gloo group: synced_gpus runs HF's all-reduce
    path, and results equal the unsharded model's."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model = build_tiny_model("llama")
    ref = hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            out = hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID, synced_gpus=True)
        finally:
            dist.destroy_process_group()
    assert all(torch.equal(ref[k], out[k]) for k in ("output_ids", "generation_lengths"))
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- helpers


def test_right_to_left_padding():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    left, mask = right_to_left_padding(ids, torch.tensor([3, 2]), pad_token_id=1)
    assert left.tolist() == [[5, 6, 7], [1, 8, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 1, 1]]


def test_generation_lengths_from_stop_conditions():
    generated = torch.tensor([[4, 2, 2, 2], [4, 5, 6, 7], [2, 0, 0, 0], [4, 5, 6, 7]])
    lengths = generation_lengths(generated, [2], stopped_at=torch.tensor([3, 2, 0, 0]))
    assert lengths.tolist() == [2, 2, 1, 4]  # earliest of stop id / stop string, else T


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "ids, lengths, match",
    [
        (torch.ones(5, dtype=torch.long), torch.tensor([5]), "2-D"),
        (torch.ones(2, 5, dtype=torch.long), torch.tensor([5, 5, 5]), r"input_lengths must have shape \[B\]"),
        (torch.ones(2, 5, dtype=torch.long), torch.tensor([5, 0]), r"row 1 has length 0"),
        (torch.ones(2, 5, dtype=torch.long), torch.tensor([6, 5]), r"\[1, S=5\]; row 0 has length 6"),
    ],
)
def test_bad_inputs(model, ids, lengths, match):
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths)
    with pytest.raises(ValueError, match=match):
        hf_generate(model, data, gen_cfg(), greedy=True, pad_token_id=PAD_ID)


def test_bad_config(model, batch):
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        hf_generate(model, batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID, max_new_tokens=0)
    with pytest.raises(ValueError, match="no tokenizer"):
        hf_generate(model, batch, gen_cfg(stop_strings=["w5"]), greedy=True, pad_token_id=PAD_ID)
    # The section refuses what generate would (a plain mapping is validated on the way in)...
    bad = {**gen_cfg().to_dict(), "max_new_tokens": -1}
    with pytest.raises(ValueError, match=r"policy.generation.max_new_tokens: must be > 0, got -1"):
        hf_generate(model, batch, bad, greedy=True, pad_token_id=PAD_ID)
    with pytest.raises(ValueError, match=r"policy.generation.top_k: 0: use -1 or null"):
        hf_generate(model, batch, {**bad, "max_new_tokens": 2, "top_k": 0}, greedy=False, pad_token_id=PAD_ID)
    # ...and generate's own guards hold for a section changed after validation.
    section = gen_cfg()
    section.temperature = 0.0
    with pytest.raises(ValueError, match="temperature must be > 0"):
        hf_generate(model, batch, section, greedy=True, pad_token_id=PAD_ID)


def test_bad_stop_strings(model, batch, tokenizer):
    with pytest.raises(ValueError, match="non-empty str"):
        hf_generate(model, batch, gen_cfg(stop_strings=[""]), greedy=True, pad_token_id=PAD_ID, tokenizer=tokenizer)
    data = BatchedDataDict(batch.get_dict())
    data["stop_strings"] = [None]
    with pytest.raises(ValueError, match="one entry per row"):
        hf_generate(model, data, gen_cfg(), greedy=True, pad_token_id=PAD_ID, tokenizer=tokenizer)
