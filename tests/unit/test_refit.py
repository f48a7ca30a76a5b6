"""``core.refit`` without Ray or vLLM: manifest, buckets, packing, the shm and gloo
transports, the engine-side receiver rules and the policy-side sender mixin.

Every test checks exact values (bit-exact tensors, exact bucket plans, the tensor named
in each error), so a broken rule fails instead of passing silently.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.policy.config import PolicyConfig
from core.refit import collective
from core.refit.buckets import GB, bucket_sizes, buffer_bytes, plan_buckets, take_bucket
from core.refit.manifest import (
    RefitError,
    RefitManifest,
    TensorSpec,
    dtype_name,
    manifest_for_hf_config,
    tied_aliases,
)
from core.refit.packing import ALIGN, Slot, as_torch, pack_into, plan_layout, unpack, view_of
from core.refit.receiver import RefitReceiver
from core.refit.sender import RefitSender
from core.refit.shm import ShmBucketWriter, open_bucket
from core.testing.tiny_models import tiny_config

# Integer views with the same bits, for bit-exact comparisons (NaN != NaN, -0.0 == 0.0).
_BITS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.dtype])


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


def special_values(shape, dtype, seed=0) -> torch.Tensor:
    """Random values with NaN, +-inf and -0.0 mixed in (when there is room)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    flat = t.view(-1)
    for i, v in enumerate([float("nan"), float("inf"), float("-inf"), -0.0]):
        if i < flat.numel():
            flat[i] = v
    return t


# ============================================================================ manifest


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.bfloat16, "bfloat16"),
        (torch.float32, "float32"),
        (torch.float16, "float16"),
        (torch.half, "float16"),
        (torch.float64, "float64"),
        (np.dtype("float32"), "float32"),
        (np.float32, "float32"),
        (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
        (ml_dtypes.bfloat16, "bfloat16"),
        ("bf16", "bfloat16"),
        ("fp32", "float32"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("float", "float32"),
        ("double", "float64"),
        ("bfloat16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
    ],
)
def test_dtype_name_normalises(dtype, expected):
    assert dtype_name(dtype) == expected


@pytest.mark.parametrize(
    "dtype, shown",
    [
        (torch.int8, "torch.int8"),
        (np.dtype("int8"), "int8"),
        ("int8", "int8"),
        ("fp8", "fp8"),
        (torch.bool, "torch.bool"),
    ],
)
def test_dtype_name_rejects_unsupported(dtype, shown):
    with pytest.raises(RefitError, match="cannot be refit") as err:
        dtype_name(dtype)
    assert shown in str(err.value)


def test_from_info_torch_dtypes_and_strings():
    m = RefitManifest.from_info({"a": ((2, 3), torch.bfloat16), "b": ([4], "fp32"), "c": ((), np.dtype("float16"))})
    assert m.names == ["a", "b", "c"]
    assert m["a"] == TensorSpec((2, 3), "bfloat16")
    assert m["b"] == TensorSpec((4,), "float32")
    assert m["c"] == TensorSpec((), "float16")
    assert m.to_info() == {"a": ((2, 3), "bfloat16"), "b": ((4,), "float32"), "c": ((), "float16")}
    assert RefitManifest.from_info(m) is m
    assert len(m) == 3 and "a" in m and "z" not in m


@pytest.mark.parametrize("value", [(5, "float32"), ((2, "x"), "float32"), "bad", ((2,),), None])
def test_from_info_bad_entry_names_the_key(value):
    with pytest.raises(RefitError, match="'layer.w'"):
        RefitManifest.from_info({"ok": ((1,), "float32"), "layer.w": value})


def test_from_info_unsupported_dtype_names_key_and_dtype():
    with pytest.raises(RefitError) as err:
        RefitManifest.from_info({"ok": ((1,), "float32"), "layer.w": ((2,), torch.int8)})
    assert "'layer.w'" in str(err.value) and "torch.int8" in str(err.value)


@pytest.mark.parametrize("info", [{}, [("a", ((1,), "float32"))], None])
def test_from_info_rejects_empty_or_non_mapping(info):
    with pytest.raises(RefitError, match="non-empty mapping"):
        RefitManifest.from_info(info)


def test_cast_and_nbytes():
    m = RefitManifest.from_info({"a": ((2, 3), "float32"), "b": ((5,), "float32"), "s": ((), "float32")})
    assert m.nbytes == (6 + 5 + 1) * 4
    assert TensorSpec((2, 3), "float64").nbytes == 48
    assert TensorSpec((0, 7), "bfloat16").nbytes == 0
    bf = m.cast(torch.bfloat16)
    assert bf.names == m.names
    assert bf.to_info() == {"a": ((2, 3), "bfloat16"), "b": ((5,), "bfloat16"), "s": ((), "bfloat16")}
    assert bf.nbytes == 12 * 2
    assert m["a"].dtype == "float32"  # cast returns a new manifest


EXPECTED = RefitManifest.from_info(
    {"embed": ((16, 8), "bfloat16"), "w": ((8, 8), "bfloat16"), "norm": ((8,), "bfloat16")}
)


def test_check_against_accepts_exact_match():
    RefitManifest.from_info(EXPECTED.to_info()).check_against(EXPECTED)


@pytest.mark.parametrize(
    "info, needle",
    [
        ({**EXPECTED.to_info(), "extra": ((1,), "bfloat16")}, "unknown tensor 'extra'"),
        ({**EXPECTED.to_info(), "w": ((8, 4), "bfloat16")}, "'w': stream shape [8, 4] but the engine expects [8, 8]"),
        (
            {**EXPECTED.to_info(), "norm": ((8,), "float32")},
            "'norm': stream dtype float32 but the engine serves bfloat16",
        ),
        ({k: v for k, v in EXPECTED.to_info().items() if k != "embed"}, "missing tensor 'embed'"),
    ],
)
def test_check_against_names_the_tensor(info, needle):
    with pytest.raises(RefitError) as err:
        RefitManifest.from_info(info).check_against(EXPECTED)
    assert needle in str(err.value)
    assert "refit manifest does not match the engine" in str(err.value)


def test_check_against_uses_what_in_message():
    with pytest.raises(RefitError, match="the vLLM worker 3 has no such weight"):
        RefitManifest.from_info({"x": ((1,), "bfloat16")}).check_against(EXPECTED, "vLLM worker 3")


def test_check_against_optional_may_be_missing_but_not_wrong():
    expected = RefitManifest(
        EXPECTED.specs | {"lm_head.weight": TensorSpec((16, 8), "bfloat16")}, optional=["lm_head.weight"]
    )
    RefitManifest.from_info(EXPECTED.to_info()).check_against(expected)  # left out: fine
    RefitManifest.from_info(expected.to_info()).check_against(expected)  # sent: fine
    with pytest.raises(RefitError, match="'lm_head.weight': stream shape"):  # sent wrong: refused
        RefitManifest.from_info({**EXPECTED.to_info(), "lm_head.weight": ((8, 16), "bfloat16")}).check_against(expected)


def test_check_against_caps_messages_per_kind():
    stream = RefitManifest.from_info({f"u{i}": ((1,), "bfloat16") for i in range(5)})
    with pytest.raises(RefitError) as err:
        stream.check_against(EXPECTED)
    msg = str(err.value)
    assert "'u0'" in msg and "'u1'" in msg and "'u2'" in msg
    assert "'u3'" not in msg and "'u4'" not in msg
    assert "... and 2 more like it" in msg
    # the 3 missing tensors are within the cap: all named, no count
    assert "missing tensor 'embed'" in msg and "missing tensor 'w'" in msg and "missing tensor 'norm'" in msg
    assert msg.count("more like it") == 1


@pytest.mark.parametrize(
    "name, optional", [("llama_tied", {"lm_head.weight"}), ("llama", set()), ("qwen2", set()), ("qwen3", set())]
)
def test_manifest_for_hf_config_matches_hf_state_dict(name, optional):
    manifest = manifest_for_hf_config(tiny_config(name), "float32")
    state = AutoModelForCausalLM.from_config(tiny_config(name)).state_dict()
    assert manifest.names == list(state)
    assert {n: s.shape for n, s in manifest.specs.items()} == {n: tuple(t.shape) for n, t in state.items()}
    assert {s.dtype for s in manifest.specs.values()} == {"float32"}
    assert manifest.optional == optional
    assert "lm_head.weight" in manifest
    # A stream of the de-duplicated parameters (what a tied exporter writes) is accepted.
    model = AutoModelForCausalLM.from_config(tiny_config(name))
    stream = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    RefitManifest.from_info(stream).check_against(manifest)
    assert manifest_for_hf_config(tiny_config(name), "bf16").cast("float32").to_info() == manifest.to_info()
    # The torch workers leave exactly the optional aliases out of their stream.
    assert tied_aliases(model) == manifest.aliases
    assert set(tied_aliases(model)) == optional


def test_fused_experts_refit_in_the_checkpoint_format():
    """Qwen3-MoE: transformers fuses the experts in memory; the engine's manifest lists them one
    per expert (the format vLLM loads and the JAX backend streams), and the torch stream's
    split (core.refit.checkpoint_names) gives exactly those names, shapes and values --
    transformers' own reverse conversion of a real state dict."""
    from transformers.core_model_loading import revert_weight_conversion

    from backends.jax_pjit.hf_mapping import expected_entries
    from backends.jax_pjit.models import config_from_hf
    from core.refit.checkpoint_names import checkpoint_refit_info, checkpoint_weights, fused_expert_names

    config = tiny_config("qwen3_moe")
    manifest = manifest_for_hf_config(config, "float32")
    model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    assert fused_expert_names(state) == [
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
    ]
    reverted = revert_weight_conversion(model, dict(state))
    streamed = dict(checkpoint_weights(state.items()))
    assert sorted(streamed) == sorted(reverted) == sorted(manifest.specs)
    for name, tensor in reverted.items():
        assert torch.equal(streamed[name], tensor), name
    info = checkpoint_refit_info({n: (tuple(t.shape), "float32") for n, t in state.items()})
    assert {n: s for n, (s, _) in info.items()} == {n: s.shape for n, s in manifest.specs.items()}
    assert info["model.layers.1.mlp.experts.7.up_proj.weight"] == ((32, 64), "float32")
    # The JAX backend's weight table streams the same per-expert names and shapes.
    jax_names = {e.hf_name: tuple(e.hf_shape) for e in expected_entries(config_from_hf(config))}
    assert jax_names == {n: s.shape for n, s in manifest.specs.items()}


def _policy(precision: str, generation=None) -> PolicyConfig:
    return PolicyConfig.coerce(
        {
            "backend": "torch_fsdp",
            "model_name": "m",
            "tokenizer": {"name": "m"},
            "train_global_batch_size": 2,
            "train_micro_batch_size": 1,
            "logprob_batch_size": 1,
            "max_total_sequence_length": 16,
            "precision": precision,
            "max_grad_norm": None,
            "generation": generation,
        },
        "policy",
    )


def _vllm(**vllm_cfg):
    return {"backend": "vllm", "max_new_tokens": 4, "vllm_cfg": {"max_model_len": 16, **vllm_cfg}}


def test_refit_dtype():
    """What the sender casts the stream to: dtype_name(policy.generation_dtype)."""

    def refit_dtype(policy: PolicyConfig) -> str:
        return dtype_name(policy.generation_dtype)

    assert refit_dtype(_policy("float32", _vllm(precision="bfloat16"))) == "bfloat16"
    assert refit_dtype(_policy("float32", _vllm(precision="bf16"))) == "bfloat16"
    assert refit_dtype(_policy("bfloat16", _vllm())) == "bfloat16"
    assert refit_dtype(_policy("float32", _vllm(precision=None))) == "float32"
    assert refit_dtype(_policy("float16", None)) == "float16"
    assert refit_dtype(_policy("float32", {"backend": "hf", "max_new_tokens": 4})) == "float32"
    with pytest.raises(RefitError, match="int8"):
        refit_dtype(_policy("float32", _vllm(precision="int8")))


# ============================================================================ buckets


def test_buffer_bytes():
    assert buffer_bytes(None) == GB
    assert buffer_bytes(None, default_gb=2) == 2 * GB
    assert buffer_bytes(1) == GB
    assert buffer_bytes(0.5) == GB // 2
    assert buffer_bytes(384 / GB) == 384
    assert buffer_bytes(1e-15) == 1  # never a zero-byte bucket


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, True, False, "1", [1]])
def test_buffer_bytes_rejects(bad):
    with pytest.raises(ValueError, match="refit_buffer_size_gb"):
        buffer_bytes(bad)


def manifest_of(sizes: dict[str, int], dtype="float32") -> RefitManifest:
    """A manifest whose tensors have the given byte sizes (1-d float32)."""
    return RefitManifest({n: TensorSpec((b // 4,), dtype) for n, b in sizes.items()})


def test_plan_buckets_exact_plan_with_oversize_tensor():
    sizes = {"a": 40, "b": 40, "big": 400, "c": 40, "d": 40, "e": 40, "f": 100, "g": 0}
    m = manifest_of(sizes)
    plan = plan_buckets(m, 100)
    assert plan == [["a", "b"], ["big"], ["c", "d"], ["e"], ["f", "g"]]
    assert bucket_sizes(plan, m) == [80, 400, 80, 40, 100]


@pytest.mark.parametrize("max_bytes", [1, 4, 37, 100, 128, 1000, 10**9])
def test_plan_buckets_properties(max_bytes):
    rng = np.random.default_rng(max_bytes)
    sizes = {f"t{i}": int(s) * 4 for i, s in enumerate(rng.integers(0, 60, size=40))}
    m = manifest_of(sizes)
    plan = plan_buckets(m, max_bytes)
    assert [n for bucket in plan for n in bucket] == m.names
    assert all(bucket for bucket in plan)
    for bucket, size in zip(plan, bucket_sizes(plan, m), strict=True):
        assert size <= max_bytes or len(bucket) == 1
    # greedy: the next bucket's first tensor would not have fitted in the previous bucket
    for prev, nxt in itertools.pairwise(plan):
        assert sum(sizes[n] for n in prev) + sizes[nxt[0]] > max_bytes
    if max_bytes >= m.nbytes:
        assert plan == [m.names]


def test_plan_buckets_empty_manifest():
    assert plan_buckets(RefitManifest({}), 100) == []


def test_take_bucket():
    stream = iter([("a", 1), ("b", 2), ("c", 3)])
    assert take_bucket(stream, ["a", "b"]) == [("a", 1), ("b", 2)]
    assert take_bucket(stream, []) == []
    with pytest.raises(RefitError, match="stream ended before 'd'"):
        take_bucket(stream, ["c", "d"])


def test_take_bucket_out_of_order():
    stream = iter([("a", 1), ("b", 2)])
    with pytest.raises(RefitError, match="asked for 'b' but the stream is at 'a'"):
        take_bucket(stream, ["b"])


# ============================================================================ packing


def test_plan_layout_offsets_are_aligned_and_disjoint():
    items = [
        ("a", torch.zeros(2, 3)),
        ("b", torch.zeros(3, dtype=torch.bfloat16)),
        ("c", torch.zeros(64)),
        ("d", torch.zeros(65, dtype=torch.float16)),
        ("e", torch.zeros(())),
    ]
    slots, total = plan_layout(items)
    assert [s.offset for s in slots] == [0, 256, 512, 768, 1024]
    assert [s.nbytes for s in slots] == [24, 6, 256, 130, 4]
    assert [s.dtype for s in slots] == ["float32", "bfloat16", "float32", "float16", "float32"]
    assert [s.shape for s in slots] == [(2, 3), (3,), (64,), (65,), ()]
    assert total == 1280
    assert all(s.offset % ALIGN == 0 for s in slots) and total % ALIGN == 0
    for s, nxt in itertools.pairwise(slots):
        assert s.offset + s.nbytes <= nxt.offset
    assert plan_layout([]) == ([], ALIGN)


def test_plan_layout_rejects_integer_tensors():
    with pytest.raises(RefitError, match="torch.int64"):
        plan_layout([("ids", torch.zeros(3, dtype=torch.int64))])


def test_slot_list_round_trip():
    slot = Slot("model.w", "bfloat16", (2, 3), 512, 12)
    assert slot.to_list() == ["model.w", "bfloat16", [2, 3], 512, 12]
    assert Slot.from_list(slot.to_list()) == slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_pack_unpack_round_trip_bit_exact(dtype):
    shapes = [(3, 5), (1,), (), (7,), (2, 3, 5), (0, 4), (129,)]
    items = [(f"t{i}", special_values(s, dtype, seed=i)) for i, s in enumerate(shapes)]
    items.append(("strided", special_values((6, 4), dtype, seed=99)[:, ::2]))  # non-contiguous source
    slots, total = plan_layout(items)
    buffer = torch.full((total,), 0xAB, dtype=torch.uint8)
    pack_into(buffer, slots, items)
    out = unpack(buffer, slots)
    assert [n for n, _ in out] == [n for n, _ in items]
    for (_, got), (_, want) in zip(out, items, strict=True):
        assert_bit_equal(got, want.contiguous())
    # unpack returns views into the buffer, not copies
    got = out[0][1]
    assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    buffer[slots[0].offset : slots[0].offset + slots[0].nbytes] = 0
    assert torch.count_nonzero(bits(got)).item() == 0


def test_mixed_dtypes_in_one_bucket():
    items = [
        ("a", special_values((3,), torch.bfloat16)),
        ("b", special_values((5, 2), torch.float32, 1)),
        ("c", special_values((1,), torch.float16, 2)),
        ("d", special_values((), torch.float64, 3)),
    ]
    slots, total = plan_layout(items)
    buffer = torch.empty(total, dtype=torch.uint8)
    pack_into(buffer, slots, items)
    for (_, got), (_, want) in zip(unpack(buffer, slots), items, strict=True):
        assert_bit_equal(got, want)


def test_view_of_too_small_or_wrong_buffer():
    slot = Slot("model.w", "float32", (4, 4), 256, 64)
    view_of(torch.empty(320, dtype=torch.uint8), slot)  # exactly big enough
    with pytest.raises(RefitError, match="'model.w': needs 320 bytes, has 319"):
        view_of(torch.empty(319, dtype=torch.uint8), slot)
    with pytest.raises(RefitError, match="'model.w'"):
        view_of(torch.empty(320, dtype=torch.int8), slot)
    with pytest.raises(RefitError, match="'model.w'"):
        view_of(torch.empty(2, 320, dtype=torch.uint8), slot)


def test_as_torch_passes_torch_through():
    t = torch.ones(3)
    assert as_torch(t) is t


def test_as_torch_numpy_float32_is_zero_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = as_torch(a)
    assert t.dtype == torch.float32 and t.shape == (3, 4)
    assert np.shares_memory(t.numpy(), a)
    t[1, 2] = -7.0
    assert a[1, 2] == -7.0
    a[0, 0] = 42.0
    assert t[0, 0].item() == 42.0


def test_as_torch_numpy_bfloat16_matches_torch_conversion():
    values = np.array([[1.0, -2.5, 3.140625], [1e-3, -1e4, 65504.0]], dtype=np.float32)
    a = values.astype(ml_dtypes.bfloat16)
    t = as_torch(a)
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3)
    assert torch.equal(bits(t), bits(torch.from_numpy(values).to(torch.bfloat16)))
    assert np.array_equal(t.view(torch.int16).numpy(), a.view(np.int16))
    assert np.shares_memory(t.view(torch.int16).numpy(), a)  # still zero copy


def test_as_torch_non_contiguous_and_zero_d_numpy():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    t = as_torch(a)
    assert t.is_contiguous() and torch.equal(t, torch.from_numpy(np.ascontiguousarray(a)))
    s = as_torch(np.array(2.5, dtype=np.float32))
    assert s.shape == () and s.item() == 2.5  # a 0-d weight keeps its shape (the manifest's)
    b = as_torch(np.array(1.5, dtype=ml_dtypes.bfloat16))
    assert b.shape == () and b.dtype == torch.bfloat16 and b.item() == 1.5


# ============================================================================ shm


@pytest.fixture
def writer():
    w = ShmBucketWriter(prefix=f"dualrl-refit-test-{os.getpid()}")
    yield w
    w.release()


def test_shm_write_open_round_trip(writer):
    items = [
        ("a", special_values((3, 4), torch.float32)),
        ("b", special_values((5,), torch.bfloat16, 1)),
        ("c", special_values((), torch.float16, 2)),
    ]
    handle = writer.write(items)
    assert handle["kind"] == "shm"
    assert os.path.exists(handle["path"])
    assert os.path.getsize(handle["path"]) == handle["nbytes"] == plan_layout(items)[1]
    assert [s[0] for s in handle["slots"]] == ["a", "b", "c"]
    opened = open_bucket(handle)
    assert [n for n, _ in opened] == ["a", "b", "c"]
    for (_, got), (_, want) in zip(opened, items, strict=True):
        assert_bit_equal(got, want)


def test_shm_next_bucket_unlinks_previous_and_release_unlinks(writer):
    first = writer.write([("a", torch.ones(4))])
    second = writer.write([("b", torch.full((2,), 3.0))])
    assert first["path"] != second["path"]
    assert not os.path.exists(first["path"])
    assert os.path.exists(second["path"])
    writer.release()
    assert not os.path.exists(second["path"])
    writer.release()  # idempotent


def test_shm_open_released_bucket_is_a_clear_error(writer):
    handle = writer.write([("a", torch.ones(4))])
    writer.release()
    with pytest.raises(FileNotFoundError, match="already released") as err:
        open_bucket(handle)
    assert handle["path"] in str(err.value)


def test_shm_views_survive_unlink(writer):
    want = special_values((64, 3), torch.bfloat16)
    handle = writer.write([("w", want)])
    ((_, got),) = open_bucket(handle)
    writer.release()
    assert not os.path.exists(handle["path"])
    assert_bit_equal(got, want)
    assert_bit_equal(got.clone(), want)


# ============================================================================ collective (gloo, 2 threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(rank0_fn, rank1_fn, timeout_s=20.0):
    """Run ``fn(group)`` for ranks 0 and 1 of a fresh gloo refit group in two threads.
    Returns ``{rank: result or exception}``; fails (instead of hanging) past the timeout."""
    port = free_port()
    results: dict[int, object] = {}

    def run(rank, fn):
        group = None
        try:
            group = collective.init_group("127.0.0.1", port, rank, 2, torch.device("cpu"), timeout_s=timeout_s)
            results[rank] = fn(group)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[rank] = exc
        finally:
            collective.destroy(group)

    threads = [threading.Thread(target=run, args=(r, f), daemon=True) for r, f in ((0, rank0_fn), (1, rank1_fn))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    assert not any(t.is_alive() for t in threads), f"collective refit hung; results so far: {results}"
    return results


def receive_all(group):
    return list(collective.receive_buckets(group))


BUCKETS = [
    [("embed", special_values((16, 8), torch.bfloat16, 0)), ("scale", special_values((), torch.float32, 1))],
    [
        ("w", special_values((8, 5), torch.float32, 2)),
        ("b", special_values((5,), torch.float16, 3)),
        ("d", special_values((3, 1), torch.float64, 4)),
    ],
    [("head", special_values((16, 8), torch.bfloat16, 5))],
]


def test_collective_send_receive_bit_exact():
    results = run_pair(lambda g: collective.send_buckets(g, iter(BUCKETS)), receive_all)
    assert results[0] == sum(plan_layout(b)[1] for b in BUCKETS), results
    received = results[1]
    assert not isinstance(received, BaseException), received
    assert [[n for n, _ in b] for b in received] == [[n for n, _ in b] for b in BUCKETS]
    for got_bucket, want_bucket in zip(received, BUCKETS, strict=True):
        for (_, got), (_, want) in zip(got_bucket, want_bucket, strict=True):
            assert_bit_equal(got, want)


def test_collective_empty_stream_ends_receiver():
    results = run_pair(lambda g: collective.send_buckets(g, iter([])), receive_all)
    assert results == {0: 0, 1: []}


def test_collective_sender_failure_still_ends_receiver():
    def failing_buckets():
        yield BUCKETS[0]
        yield BUCKETS[1]
        raise ValueError("gather of bucket 3 failed")

    results = run_pair(lambda g: collective.send_buckets(g, failing_buckets()), receive_all)
    assert isinstance(results[0], ValueError) and "bucket 3" in str(results[0])
    received = results[1]
    assert not isinstance(received, BaseException), received
    assert [[n for n, _ in b] for b in received] == [["embed", "scale"], ["w", "b", "d"]]
    for got_bucket, want_bucket in zip(received, BUCKETS[:2], strict=True):
        for (_, got), (_, want) in zip(got_bucket, want_bucket, strict=True):
            assert_bit_equal(got, want)


def test_init_group_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank 2 outside world_size 2"):
        collective.init_group("127.0.0.1", free_port(), 2, 2, torch.device("cpu"), timeout_s=1)


# ============================================================================ receiver


RX_EXPECTED = RefitManifest.from_info({"a": ((2, 3), "bfloat16"), "b": ((4,), "bfloat16"), "c": ((3,), "bfloat16")})


def rx_tensors():
    return {n: special_values(s.shape, torch.bfloat16, i) for i, (n, s) in enumerate(RX_EXPECTED.specs.items())}


def load(rx: RefitReceiver, items):
    rx.check_bucket(items)
    rx.mark_loaded(items)


def test_receiver_complete_stream():
    rx = RefitReceiver(RX_EXPECTED, weights_valid=True)
    t = rx_tensors()
    for refit in (1, 2):
        rx.begin(RX_EXPECTED.to_info())
        load(rx, [("a", t["a"]), ("b", t["b"])])
        assert rx.weights_valid is False  # mixed weights while the stream is open
        with pytest.raises(RefitError, match="a refit is in progress"):
            rx.require_valid()
        load(rx, [("c", t["c"])])
        assert rx.finish() == 3
        assert rx.weights_valid is True and rx.stale_reason is None
        assert rx.refits_completed == refit
        assert rx.bytes_received == refit * (6 + 4 + 3) * 2
        rx.require_valid()


def test_receiver_refuses_mismatched_manifest_and_keeps_state():
    for valid in (True, False):
        rx = RefitReceiver(RX_EXPECTED, weights_valid=valid, engine="vLLM engine (worker 0)")
        bad = {**RX_EXPECTED.to_info(), "b": ((5,), "bfloat16")}
        with pytest.raises(RefitError, match=r"'b': stream shape \[5\] but the vLLM engine \(worker 0\) expects \[4\]"):
            rx.begin(bad)
        assert rx.weights_valid is valid
        assert rx.manifest is None
        with pytest.raises(RefitError, match="int8"):
            rx.begin({**RX_EXPECTED.to_info(), "b": ((4,), "int8")})
        assert rx.weights_valid is valid


def test_receiver_bucket_before_begin():
    rx = RefitReceiver(RX_EXPECTED, weights_valid=True)
    with pytest.raises(RefitError, match="before prepare_refit_info"):
        rx.check_bucket([("a", rx_tensors()["a"])])
    with pytest.raises(RefitError, match="finish_refit without prepare_refit_info"):
        rx.finish()


def _bad_buckets():
    t = rx_tensors()
    return {
        "unknown": ([("zz", t["a"])], "unknown tensor 'zz'"),
        "dup_in_bucket": ([("a", t["a"]), ("a", t["a"])], "tensor 'a' sent twice"),
        "shape": (
            [("b", torch.zeros(5, dtype=torch.bfloat16))],
            r"'b': bucket shape \[5\] but the manifest says \[4\]",
        ),
        "dtype": (
            [("b", torch.zeros(4, dtype=torch.float32))],
            "'b': bucket dtype float32 but the manifest says bfloat16",
        ),
        "int_dtype": ([("b", torch.zeros(4, dtype=torch.int8))], "'b'.*cannot be refit"),
    }


@pytest.mark.parametrize("case", list(_bad_buckets()))
def test_receiver_bad_bucket_before_any_load_keeps_weights(case):
    items, needle = _bad_buckets()[case]
    rx = RefitReceiver(RX_EXPECTED, weights_valid=True)
    rx.begin(RX_EXPECTED.to_info())
    with pytest.raises(RefitError, match=needle):
        rx.check_bucket(items)
    assert rx.weights_valid is True  # nothing was loaded: the old weights still stand
    rx.require_valid()
    with pytest.raises(RefitError, match="before prepare_refit_info"):  # the stream was closed
        rx.check_bucket([("a", rx_tensors()["a"])])


@pytest.mark.parametrize("case", list(_bad_buckets()))
def test_receiver_bad_bucket_after_partial_load_is_stale(case):
    items, needle = _bad_buckets()[case]
    t = rx_tensors()
    rx = RefitReceiver(RX_EXPECTED, weights_valid=True)
    rx.begin(RX_EXPECTED.to_info())
    load(rx, [("c", t["c"])])
    with pytest.raises(RefitError, match=needle):
        rx.check_bucket(items)
    assert rx.weights_valid is False
    assert "failed after loading part of the weights" in rx.stale_reason
    with pytest.raises(RefitError, match="refuses to generate: the last refit failed") as err:
        rx.require_valid()
    assert needle.split("'")[1] in str(err.value)  # the reason names the tensor
    # a complete refit makes the engine usable again
    rx.begin(RX_EXPECTED.to_info())
    load(rx, list(t.items()))
    rx.finish()
    rx.require_valid()


def test_receiver_duplicate_across_buckets():
    t = rx_tensors()
    rx = RefitReceiver(RX_EXPECTED, weights_valid=True)
    rx.begin(RX_EXPECTED.to_info())
    load(rx, [("a", t["a"])])
    with pytest.raises(RefitError, match="tensor 'a' sent twice in one refit"):
        rx.check_bucket([("a", t["a"])])
    assert rx.weights_valid is False


def test_receiver_incomplete_stream_is_stale():
    t = rx_tensors()
    rx = RefitReceiver(RX_EXPECTED, weights_valid=True)
    rx.begin(RX_EXPECTED.to_info())
    load(rx, [("a", t["a"])])
    with pytest.raises(RefitError, match=r"incomplete refit stream: 2 of 3 tensors never arrived \('b', 'c'\)"):
        rx.finish()
    assert rx.weights_valid is False
    assert rx.refits_completed == 0
    with pytest.raises(RefitError, match="incomplete refit stream"):
        rx.require_valid()


def test_receiver_incomplete_message_is_capped():
    expected = RefitManifest.from_info({f"t{i}": ((1,), "float32") for i in range(6)})
    rx = RefitReceiver(expected, weights_valid=True)
    rx.begin(expected.to_info())
    load(rx, [("t0", torch.zeros(1))])
    with pytest.raises(RefitError, match=r"5 of 6 tensors never arrived \('t1', 't2', 't3' and 2 more\)"):
        rx.finish()


def test_receiver_abandoned_refit_is_stale():
    t = rx_tensors()
    rx = RefitReceiver(RX_EXPECTED, weights_valid=True)
    rx.begin(RX_EXPECTED.to_info())
    load(rx, [("a", t["a"])])
    rx.begin(RX_EXPECTED.to_info())  # a new stream before the old one finished
    assert rx.weights_valid is False and "abandoned part-way" in rx.stale_reason
    assert rx.received == set()
    load(rx, list(t.items()))
    rx.finish()
    assert rx.weights_valid is True


def test_receiver_dummy_weights_until_complete_refit():
    t = rx_tensors()
    rx = RefitReceiver(RX_EXPECTED, weights_valid=False, engine="vLLM engine")
    with pytest.raises(RefitError, match="the vLLM engine refuses to generate: it was started with dummy weights"):
        rx.require_valid()
    rx.begin(RX_EXPECTED.to_info())
    load(rx, [("a", t["a"]), ("b", t["b"])])
    with pytest.raises(RefitError, match="incomplete"):
        rx.finish()
    with pytest.raises(RefitError):
        rx.require_valid()
    rx.begin(RX_EXPECTED.to_info())
    load(rx, list(t.items()))
    assert rx.finish() == 3
    rx.require_valid()
    assert rx.weights_valid is True and rx.refits_completed == 1


# ============================================================================ sender


BUFFER_BYTES = 384  # exact in binary: buffer_bytes(384 / GB) == 384
SENDER_SHAPES = {"embed": (16, 8), "l0.w": (8, 8), "l0.b": (8,), "l1.w": (8, 8), "norm": (8,), "head": (16, 8)}
# bf16 sizes: 256, 128, 16, 128, 16, 256 bytes -> buckets of <= 384 bytes
SENDER_PLAN = [["embed", "l0.w"], ["l0.b", "l1.w", "norm"], ["head"]]


class TinySender(RefitSender):
    """A policy worker reduced to what ``RefitSender`` needs: cfg, rank, device, two hooks."""

    def __init__(self, rank: int = 0, numpy_weights: bool = False) -> None:
        self.cfg = _policy("float32", _vllm(precision="bfloat16"))  # the worker's typed policy section
        self.cfg.refit_buffer_size_gb = BUFFER_BYTES / GB
        self.rank = rank
        self.device = torch.device("cpu")
        self.numpy_weights = numpy_weights
        # Finite values (and -0.0): torch and ml_dtypes round finite float32 -> bfloat16 the
        # same way, but canonicalise NaN differently.
        g = torch.Generator().manual_seed(0)
        self.weights = {n: torch.randn(s, generator=g) for n, s in SENDER_SHAPES.items()}
        self.weights["l0.b"][0] = -0.0
        self.iterations = 0

    def prepare_refit_info(self):
        if self.numpy_weights:  # the JAX worker's form: numpy dtype names
            return {n: (tuple(t.shape), str(t.numpy().dtype)) for n, t in self.weights.items()}
        return {n: (tuple(t.shape), t.dtype) for n, t in self.weights.items()}

    def iter_full_weights(self, dtype=None):
        self.iterations += 1
        for name, tensor in self.weights.items():
            if self.numpy_weights:  # like the JAX worker: host numpy arrays, ml_dtypes bfloat16
                yield name, tensor.numpy().astype(np.dtype(dtype or "float32"))
            else:
                yield name, tensor if dtype is None else tensor.to(getattr(torch, dtype))


@pytest.fixture(params=["torch", "numpy"])
def sender(request):
    s = TinySender(numpy_weights=request.param == "numpy")
    yield s
    s.finish_refit_stream()


def test_sender_manifest_is_generation_dtype(sender):
    m = sender.refit_manifest()
    assert m.names == list(SENDER_SHAPES)
    assert m.to_info() == {n: (s, "bfloat16") for n, s in SENDER_SHAPES.items()}


def test_sender_ipc_buckets_in_order(sender):
    plan = sender.prepare_weights_for_ipc()
    assert plan == SENDER_PLAN
    rx = RefitReceiver(sender.refit_manifest(), weights_valid=False)
    rx.begin(sender.refit_manifest().to_info())
    paths = []
    for keys in plan:
        handle = sender.get_weights_ipc_handles(keys)
        assert handle["kind"] == "shm"
        assert all(not os.path.exists(p) for p in paths)  # the previous bucket was unlinked
        paths.append(handle["path"])
        items = open_bucket(handle)
        assert [n for n, _ in items] == keys
        for name, got in items:
            assert_bit_equal(got, sender.weights[name].to(torch.bfloat16))
        load(rx, items)
    assert os.path.exists(paths[-1])
    sender.finish_refit_stream()
    assert not os.path.exists(paths[-1])
    assert rx.finish() == len(SENDER_SHAPES)
    assert rx.bytes_received == sender.refit_manifest().nbytes
    rx.require_valid()


def test_sender_buffer_size_argument_overrides_config(sender):
    assert sender.prepare_weights_for_ipc(1.0) == [list(SENDER_SHAPES)]
    assert sender.prepare_weights_for_ipc(256 / GB) == [["embed"], ["l0.w", "l0.b"], ["l1.w", "norm"], ["head"]]


def test_sender_out_of_order_bucket(sender):
    plan = sender.prepare_weights_for_ipc()
    with pytest.raises(RefitError, match="asked for 'l0.b' but the stream is at 'embed'"):
        sender.get_weights_ipc_handles(plan[1])


def test_sender_bucket_before_prepare():
    s = TinySender()
    with pytest.raises(RefitError, match="before prepare_weights_for_ipc"):
        s.get_weights_ipc_handles(["embed"])
    s.prepare_weights_for_ipc()
    s.finish_refit_stream()
    with pytest.raises(RefitError, match="before prepare_weights_for_ipc"):
        s.get_weights_ipc_handles(["embed"])


def test_sender_restart_begins_a_fresh_stream(sender):
    plan = sender.prepare_weights_for_ipc()
    sender.get_weights_ipc_handles(plan[0])
    assert sender.prepare_weights_for_ipc() == plan  # abandoned stream: start over
    handle = sender.get_weights_ipc_handles(plan[0])
    assert [n for n, _ in open_bucket(handle)] == plan[0]
    assert sender.iterations == 2


def test_sender_other_ranks_gather_but_do_not_ship():
    s = TinySender(rank=1)
    plan = s.prepare_weights_for_ipc()
    assert [s.get_weights_ipc_handles(keys) for keys in plan] == [None, None, None]
    assert getattr(s, "_shm_writer", None) is None
    with pytest.raises(RefitError, match="stream ended before"):  # the stream really was consumed
        s.get_weights_ipc_handles(["embed"])
    s.finish_refit_stream()
    assert s.init_collective("127.0.0.1", 1, 2) is None


def test_sender_collective_needs_init():
    s = TinySender()
    with pytest.raises(RefitError, match="before init_collective"):
        s.broadcast_weights_for_collective()


def test_sender_broadcast_over_gloo():
    s = TinySender(numpy_weights=True)
    port = free_port()
    received = {}

    def engine_side():
        try:
            group = collective.init_group("127.0.0.1", port, 1, 2, torch.device("cpu"), timeout_s=20)
            try:
                received["buckets"] = list(collective.receive_buckets(group))
            finally:
                collective.destroy(group)
        except BaseException as exc:  # noqa: BLE001
            received["error"] = exc

    thread = threading.Thread(target=engine_side, daemon=True)
    thread.start()
    try:
        assert s.init_collective("127.0.0.1", port, 2, timeout_s=20) == 0
        sent = s.broadcast_weights_for_collective()
    finally:
        collective.destroy(getattr(s, "_refit_group", None))
    thread.join(30)
    assert not thread.is_alive()
    assert "error" not in received, received
    buckets = received["buckets"]
    assert [[n for n, _ in b] for b in buckets] == SENDER_PLAN
    assert sent == sum(plan_layout(b)[1] for b in buckets)
    for bucket in buckets:
        for name, got in bucket:
            assert_bit_equal(got, s.weights[name].to(torch.bfloat16))
    assert s._refit_stream is None  # closed after broadcasting


def test_tied_aliases_are_known_and_filled_in_when_the_stream_leaves_them_out():
    """A JAX stream of a tied model has no ``lm_head.weight``; the engine (which reloads layer
    by layer) still gets it, carrying the embedding; a stream that sends it is left alone."""
    expected = manifest_for_hf_config(tiny_config("llama_tied"), "float32")
    assert expected.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert manifest_for_hf_config(tiny_config("llama"), "float32").aliases == {}
    embed = torch.ones(tuple(expected["model.embed_tokens.weight"].shape))
    without = {n: s for n, s in expected.to_info().items() if n != "lm_head.weight"}
    rx = RefitReceiver(expected, weights_valid=True)
    rx.begin(without)
    items = [("model.embed_tokens.weight", embed)]
    rx.check_bucket(items)
    filled = rx.with_tied_aliases(items)
    assert [n for n, _ in filled] == ["model.embed_tokens.weight", "lm_head.weight"] and filled[1][1] is embed
    assert [n for n, _ in rx.with_tied_aliases([("model.norm.weight", torch.ones(64))])] == ["model.norm.weight"]
    rx.begin(expected.to_info())  # torch's stream: the alias is sent, nothing is added
    assert [n for n, _ in rx.with_tied_aliases(items)] == ["model.embed_tokens.weight"]
