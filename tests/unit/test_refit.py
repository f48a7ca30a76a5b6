"""``core.refit`` without Ray or vLLM: the manifest, the bucket plans and the packing of tensors
into a bucket (transports, receiver and sender: tests/unit/test_refit_transports.py).

Every test checks exact values (bit-exact tensors, exact bucket plans, the tensor named
in each error), so a broken rule fails instead of passing silently.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.policy.config import PolicyConfig
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
from core.testing.tiny_models import tiny_config
from tests.unit.refit_values import assert_bit_equal, bits, policy_config, special_values, vllm_generation

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


def test_refit_dtype():
    """What the sender casts the stream to: dtype_name(policy.generation_dtype)."""

    def refit_dtype(policy: PolicyConfig) -> str:
        return dtype_name(policy.generation_dtype)

    assert refit_dtype(policy_config("float32", vllm_generation(precision="bfloat16"))) == "bfloat16"
    assert refit_dtype(policy_config("float32", vllm_generation(precision="bf16"))) == "bfloat16"
    assert refit_dtype(policy_config("bfloat16", vllm_generation())) == "bfloat16"
    assert refit_dtype(policy_config("float32", vllm_generation(precision=None))) == "float32"
    assert refit_dtype(policy_config("float16", None)) == "float16"
    assert refit_dtype(policy_config("float32", {"backend": "hf", "max_new_tokens": 4})) == "float32"
    with pytest.raises(RefitError, match="int8"):
        refit_dtype(policy_config("float32", vllm_generation(precision="int8")))


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
