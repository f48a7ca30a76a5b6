"""The flax Llama/Qwen2/Qwen3/Qwen3-MoE/Gemma3 models against HF transformers (torch), and the HF <-> JAX mapping.

All on CPU in float32: logits must agree with HF within 1e-5 on ragged right-padded
batches, KV-cache decoding must reproduce the full forward, and checkpoints must
round-trip exactly through ``save_hf_checkpoint`` / ``transformers.from_pretrained``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from backends.jax_pjit import hf_mapping
from backends.jax_pjit.logical_axes import PARAM_AXES, RULES
from backends.jax_pjit.models import abstract_model, config_from_hf, gemma3, logical_axes_tree, make_apply_fn
from backends.jax_pjit.models.gemma3 import Gemma3Config
from backends.jax_pjit.models.layers import activation_constraint, rope_inv_freq
from backends.jax_pjit.models.llama import CausalLM
from core.data.context_parallel import attention_allowed, load_balanced_columns, row_segments
from core.testing.tiny_models import random_batch, save_tiny_model, tiny_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
ALL_MODELS = ["llama", "qwen2", "qwen3", "qwen3_moe", "llama_tied", "llama3_rope", "mistral", "gemma3"]
BATCH, SEQ = 3, 12


def _save_variant(name: str, path) -> None:
    """Tiny checkpoints beyond ``TINY_MODELS``: llama with llama3 RoPE scaling, window-free Mistral."""
    from transformers import AutoModelForCausalLM, MistralConfig

    if name == "llama3_rope":
        cfg = tiny_config("llama")
        cfg.rope_parameters = dict(LLAMA3_ROPE)
    else:
        base = tiny_config("llama")
        cfg = MistralConfig(
            vocab_size=base.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            sliding_window=None,
            pad_token_id=0,
        )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(name) -> (path, hf_model)``, each saved once per module."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            if name in ("llama3_rope", "mistral"):
                _save_variant(name, path)
            else:
                save_tiny_model(name, path)
            cache[name] = (path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        return cache[name]

    return get


def _batch(seed=0, batch=BATCH, seq=SEQ):
    ids, lengths = random_batch(batch, seq, 256, seed=seed)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids, mask


def _hf_logits(hf_model, ids, mask) -> np.ndarray:
    with torch.no_grad():
        return hf_model(input_ids=ids, attention_mask=mask).logits.float().numpy()


def _jax_logits(model, ids, mask) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy())).astype(jnp.float32))


# --------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("name", ALL_MODELS)
def test_logits_match_hf(checkpoint, name):
    path, hf_model = checkpoint(name)
    model, cfg, _ = hf_mapping.from_pretrained(path)
    ids, mask = _batch()
    ref, out = _hf_logits(hf_model, ids, mask), _jax_logits(model, ids, mask)
    valid = mask.numpy().astype(bool)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.isfinite(out).all()  # padding positions included
    np.testing.assert_allclose(out[valid], ref[valid], atol=1e-5, rtol=0)
    rotary = hf_model.model.rotary_emb
    if isinstance(cfg, Gemma3Config):  # one inv_freq per layer type
        for layer_type in set(cfg.layer_types):
            theirs = getattr(rotary, f"{layer_type}_inv_freq").numpy()
            np.testing.assert_allclose(gemma3.rope_inv_freq(cfg.rope_of(layer_type), cfg.head_dim), theirs, rtol=1e-6)
    else:
        np.testing.assert_allclose(rope_inv_freq(cfg), rotary.inv_freq.numpy(), rtol=1e-6)


def test_both_backends_record_and_replay_hfs_routing(checkpoint):
    """The router logits the load-balancing loss reads: the JAX model's (captured in a jitted
    forward) within 1e-5 of HF's ``output_router_logits``, the torch backends' hooks
    (``RouterRecorder``) HF's own, one [sparse layers, B, S, experts] array each.  Routing
    replay: replaying a forward's own experts changes nothing, other experts change the logits
    -- identically (1e-5) on the HF model with the torch hooks and on the JAX model."""
    import warnings

    from backends.torch_common.moe import RouterRecorder
    from core.kernels.moe import routed_experts_of

    path, hf_model = checkpoint("qwen3_moe")
    ids, mask = _batch()
    recorder = RouterRecorder(hf_model, "qwen3_moe", normalize=True)
    with torch.no_grad(), recorder.recording() as recorded:
        hf_out = hf_model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    ref = torch.stack([r.reshape(BATCH, SEQ, -1) for r in hf_out.router_logits]).numpy()
    assert ref.shape == (1, BATCH, SEQ, 8)  # layer 0 is dense (mlp_only_layers)
    np.testing.assert_array_equal(recorder.stacked(recorded, BATCH).numpy(), ref)

    own = routed_experts_of(torch.from_numpy(ref), 2)  # (B, S, L, K)
    other = (own + 3) % 8  # still 2 distinct experts per token
    as_hooks = lambda r: r.movedim(2, 0).reshape(r.shape[2], BATCH * SEQ, 2)  # noqa: E731

    def torch_logits(routed):
        with torch.no_grad(), recorder.recording(as_hooks(routed)):
            return hf_model(input_ids=ids, attention_mask=mask).logits.numpy()

    valid = mask.numpy().astype(bool)
    np.testing.assert_allclose(torch_logits(own)[valid], hf_out.logits.numpy()[valid], atol=1e-6, rtol=0)
    replayed = torch_logits(other)
    assert np.abs(replayed - hf_out.logits.numpy())[valid].max() > 1e-3

    model, _, _ = hf_mapping.from_pretrained(path)
    apply_fn, params = make_apply_fn(model)
    forward = jax.jit(lambda p, i, m, r: apply_fn(p, i, m, capture_router=True, routing=r))
    jids, jmask = jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy())
    logits, router = forward(params, jids, jmask, jnp.asarray(other.movedim(2, 0).numpy()))
    np.testing.assert_allclose(np.asarray(router)[:, valid], ref[:, valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(logits)[valid], replayed[valid], atol=1e-5, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no sow outside nnx.capture
        plain = jax.jit(apply_fn)(params, jids, jmask)
    np.testing.assert_allclose(np.asarray(plain)[valid], hf_out.logits.numpy()[valid], atol=1e-5, rtol=0)


def test_gemma3_window_and_softcap_bind(checkpoint):
    """The tiny Gemma3's sliding window and final-logit cap change its logits (so the HF
    comparisons above test them): without either, the logits move by far more than 1e-5.
    A padded vocabulary leaves the real logits unchanged."""
    model, cfg, _ = hf_mapping.from_pretrained(checkpoint("gemma3")[0])
    ids, mask = _batch()
    valid = mask.numpy().astype(bool)
    ref = _jax_logits(model, ids, mask)
    for change in (dict(sliding_window=10**6), dict(final_logit_softcapping=None)):
        other = abstract_model(dataclasses.replace(cfg, **change))
        nnx.update(other, nnx.state(model, nnx.Param))
        assert np.abs(_jax_logits(other, ids, mask) - ref)[valid].max() > 1e-3, change
    # a padded vocabulary is masked after the cap (capped padding would read -cap, not "never")
    padded, padded_cfg, _ = hf_mapping.from_pretrained(checkpoint("gemma3")[0], make_vocab_size_divisible_by=384)
    out = _jax_logits(padded, ids, mask)
    assert out.shape[-1] == padded_cfg.padded_vocab_size == 384
    np.testing.assert_allclose(out[..., : cfg.vocab_size][valid], ref[valid], atol=1e-6, rtol=0)
    assert (out[..., cfg.vocab_size :] == np.finfo(np.float32).min).all()


def test_fully_masked_rows_are_finite(checkpoint):
    """A query row with no valid key must not produce NaN: an all-padding row on the plain
    (right-padded) path, and left padding through an explicit ``allowed`` mask."""
    model, _, _ = hf_mapping.from_pretrained(checkpoint("llama")[0])
    ids = jnp.full((2, 6), 5, jnp.int32)
    assert np.isfinite(np.asarray(model(ids, jnp.asarray([[1, 1, 1, 0, 0, 0], [0] * 6])))).all()
    keys = jnp.asarray([[0, 0, 1, 1, 1, 1], [0] * 6], bool)
    allowed = jnp.tril(jnp.ones((6, 6), bool))[None] & keys[:, None, :]
    assert np.isfinite(np.asarray(model(ids, None, allowed=allowed))).all()


def test_bf16_compute_close_to_fp32(checkpoint):
    path, _ = checkpoint("qwen2")
    fp32, _, _ = hf_mapping.from_pretrained(path)
    bf16, _, _ = hf_mapping.from_pretrained(path, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    ids, mask = _batch()
    logits = bf16(jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy()))
    assert logits.dtype == jnp.bfloat16
    assert nnx.state(bf16, nnx.Param)["norm"]["scale"].get_value().dtype == jnp.float32
    ref, out = _jax_logits(fp32, ids, mask), np.asarray(logits.astype(jnp.float32))
    valid = mask.numpy().astype(bool)
    assert np.isfinite(out).all()
    assert np.abs(out - ref)[valid].max() <= 5e-2 * np.abs(ref[valid]).max()


@pytest.mark.slow  # ~6 s: two more eager traces of the model with explicit masks
def test_gemma3_window_exact_in_packed_and_cp_layouts(checkpoint):
    """Sliding layers band by token positions, so the explicit-mask layouts keep the window:
    two sequences packed into one row (positions restarting) and a context-parallel column
    permutation give the logits of the plain rows."""
    model, cfg, _ = hf_mapping.from_pretrained(checkpoint("gemma3")[0])
    ids, mask = _batch(batch=2)
    lengths = mask.numpy().sum(1)
    assert min(lengths) > cfg.sliding_window
    ref = _jax_logits(model, ids, mask)
    # packed: row 0's tokens then row 1's in one row, positions restarting at 0
    packed = np.concatenate([ids[0, : lengths[0]].numpy(), ids[1, : lengths[1]].numpy()])[None]
    positions = np.concatenate([np.arange(lengths[0]), np.arange(lengths[1])])[None]
    segments = np.repeat([0, 1], lengths)[None]
    cols = np.arange(packed.shape[1])
    allowed = attention_allowed(cols, cols, segments)
    out = np.asarray(model(jnp.asarray(packed), None, jnp.asarray(positions), jnp.asarray(allowed)))[0]
    np.testing.assert_allclose(out[: lengths[0]], ref[0, : lengths[0]], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[lengths[0] :], ref[1, : lengths[1]], atol=1e-5, rtol=0)
    # context parallel (cp=2): columns in load-balanced order, the mask built from them
    order = load_balanced_columns(SEQ, 2).reshape(-1)
    segs = row_segments(lengths, SEQ)
    allowed = attention_allowed(order, order, segs)
    pos = np.broadcast_to(order, (2, SEQ))
    out = np.asarray(model(jnp.asarray(ids.numpy()[:, order]), None, jnp.asarray(pos), jnp.asarray(allowed)))
    valid = mask.numpy().astype(bool)
    np.testing.assert_allclose(out[:, np.argsort(order)][valid], ref[valid], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- KV cache


# The tiny Qwen3-MoE is a Qwen3 layer (the Llama decoder plus q/k norms) and a sparse one: the
# llama, qwen2 (its q/k/v bias is in the logits tests) and qwen3 cases add no fast-suite
# coverage of the cache beyond it (CI budget), so they run with the slow tests.
@pytest.mark.parametrize(
    "name", [*(pytest.param(n, marks=pytest.mark.slow) for n in ("llama", "qwen2", "qwen3")), "qwen3_moe", "gemma3"]
)
def test_kv_cache_decode_matches_full_forward(checkpoint, name):
    """Prefill a right-padded ragged prompt batch, then decode N tokens one at a time.

    Row b's prompt has length L_b inside a width-P prefill; its n-th new token sits in cache
    slot P + n with RoPE position L_b + n.  Every logit must equal the full forward over the
    contiguous sequence prompt_b + new tokens (gemma3: sequences up to 10 tokens, past its
    sliding window of 4, with a gap of prompt padding inside the window).
    """
    model, _, _ = hf_mapping.from_pretrained(checkpoint(name)[0])
    prompt_width, steps = 6, 4
    lengths = np.array([6, 3, 4])
    full_ids, _ = random_batch(len(lengths), prompt_width + steps, 256, seed=1)
    full_ids = full_ids.numpy()
    full_len = lengths + steps
    full_mask = (np.arange(prompt_width + steps)[None, :] < full_len[:, None]).astype(np.int32)
    full_ids = np.where(full_mask.astype(bool), full_ids, 0)
    full_logits = np.asarray(model(jnp.asarray(full_ids), jnp.asarray(full_mask)))

    graphdef, state = nnx.split(model)

    @jax.jit
    def decode(state, ids, positions, cache, index, mask):
        return nnx.merge(graphdef, state).decode(ids, positions, cache, index, mask)

    batch, max_len = len(lengths), prompt_width + steps
    rows = np.arange(batch)
    cache = model.init_cache(batch, max_len, jnp.float32)
    assert len(cache) == model.cfg.num_layers
    assert cache[0][0].shape == (batch, max_len, model.cfg.num_kv_heads, model.cfg.head_dim)
    slot_mask = np.zeros((batch, max_len), np.int32)
    slot_mask[:, :prompt_width] = np.arange(prompt_width)[None, :] < lengths[:, None]
    prompt = np.where(slot_mask[:, :prompt_width].astype(bool), full_ids[:, :prompt_width], 0)
    positions = np.broadcast_to(np.arange(prompt_width), (batch, prompt_width))
    logits, cache = decode(state, jnp.asarray(prompt), jnp.asarray(positions), cache, 0, jnp.asarray(slot_mask))
    valid = slot_mask[:, :prompt_width].astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[valid], full_logits[:, :prompt_width][valid], atol=1e-5, rtol=0)

    for n in range(steps):
        slot_mask[:, prompt_width + n] = 1
        token = full_ids[rows, lengths + n][:, None]  # (B, 1)
        pos = (lengths + n)[:, None]  # (B, 1)
        logits, cache = decode(
            state, jnp.asarray(token), jnp.asarray(pos), cache, prompt_width + n, jnp.asarray(slot_mask)
        )
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full_logits[rows, lengths + n], atol=1e-5, rtol=0)
    assert decode._cache_size() == 2  # one program for the prefill, one for every single-token step


# --------------------------------------------------------------------------- checkpoint round trips


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3_moe", "llama_tied", "gemma3"])
def test_export_loads_in_transformers(checkpoint, tmp_path, name):
    from transformers import AutoModelForCausalLM

    path, hf_model = checkpoint(name)
    model, _, hf_config = hf_mapping.from_pretrained(path)
    hf_mapping.save_hf_checkpoint(model, hf_config, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, mask = _batch(seed=2)
    np.testing.assert_allclose(_hf_logits(reloaded, ids, mask), _hf_logits(hf_model, ids, mask), atol=1e-6, rtol=0)
    original = hf_mapping.read_hf_safetensors(path)
    exported = hf_mapping.read_hf_safetensors(tmp_path)
    assert exported.keys() == original.keys()  # HF omits lm_head.weight from tied checkpoints too
    for key, value in exported.items():
        np.testing.assert_array_equal(value, original[key])


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3_moe", "llama_tied", "gemma3"])
def test_hf_jax_conversion_is_exact_inverse(checkpoint, name):
    path, _ = checkpoint(name)
    cfg = config_from_hf(checkpoint(name)[1].config)
    hf = hf_mapping.read_hf_safetensors(path)
    for tensors in (hf, {k: v.astype(ml_dtypes.bfloat16) for k, v in hf.items()}):
        state = hf_mapping.hf_to_jax_state(tensors, cfg)
        back = hf_mapping.jax_to_hf_tensors(state, cfg)
        assert back.keys() == tensors.keys()
        for key in tensors:
            assert back[key].dtype == tensors[key].dtype
            np.testing.assert_array_equal(back[key], tensors[key])
    # the pure state has exactly the model's params, in the model's layout
    pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    assert jax.tree.structure(pure) == jax.tree.structure(hf_mapping.hf_to_jax_state(hf, cfg))
    jax.tree.map(
        lambda a, b: (a.shape == b.shape) or pytest.fail(f"{a.shape} != {b.shape}"),
        pure,
        hf_mapping.hf_to_jax_state(hf, cfg),
    )
    streamed = list(hf_mapping.iter_hf_tensors(hf_mapping.hf_to_jax_state(hf, cfg), cfg))
    assert [name for name, _ in streamed] == [e.hf_name for e in hf_mapping.expected_entries(cfg)]


def test_reads_sharded_and_bf16_checkpoints(checkpoint, tmp_path):
    path, hf_model = checkpoint("qwen2")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    single = hf_mapping.read_hf_safetensors(path)
    sharded = hf_mapping.read_hf_safetensors(tmp_path / "sharded")
    assert sharded.keys() == single.keys()
    for key in single:
        np.testing.assert_array_equal(sharded[key], single[key])

    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    hf_model.to(torch.float32)
    bf16 = hf_mapping.read_hf_safetensors(tmp_path / "bf16")
    assert all(v.dtype == ml_dtypes.bfloat16 for v in bf16.values())
    model, _, _ = hf_mapping.from_pretrained(tmp_path / "bf16", param_dtype=jnp.bfloat16)
    kernel = nnx.state(model, nnx.Param)["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kernel).T, bf16["model.layers.0.mlp.up_proj.weight"])


# --------------------------------------------------------------------------- checkpoint errors


def _corrupt_dir(src, dst, edit) -> None:
    """Copy checkpoint ``src`` to ``dst`` with its tensors changed by ``edit(tensors)``."""
    from safetensors.numpy import save_file
    from transformers import AutoConfig

    tensors = hf_mapping.read_hf_safetensors(src)
    edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    AutoConfig.from_pretrained(src).save_pretrained(dst)


def test_wrong_shape_names_key_and_shapes(checkpoint, tmp_path):
    key = "model.layers.1.self_attn.k_proj.weight"

    def drop_row(t):
        t[key] = t[key][:-1]

    _corrupt_dir(checkpoint("llama")[0], tmp_path / "bad", drop_row)
    with pytest.raises(ValueError, match=rf"{key}.*\(31, 64\).*\(32, 64\)"):
        hf_mapping.from_pretrained(tmp_path / "bad")


def test_missing_and_unexpected_keys_are_named(checkpoint):
    path, _ = checkpoint("qwen2")
    model, cfg, _ = hf_mapping.from_pretrained(path)
    tensors = hf_mapping.read_hf_safetensors(path)
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.v_proj.bias"]
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.v_proj\.bias"):
        hf_mapping.load_hf_weights(model, missing)
    extra = dict(tensors, **{"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
        hf_mapping.load_hf_weights(model, extra)
    # rotary buffers are tolerated
    hf_mapping.load_hf_weights(model, dict(tensors, **{"model.rotary_emb.inv_freq": rope_inv_freq(cfg)}))


def test_tied_lm_head_must_equal_embedding(checkpoint):
    path, _ = checkpoint("llama_tied")
    model, _, _ = hf_mapping.from_pretrained(path)
    tensors = hf_mapping.read_hf_safetensors(path)
    embed = tensors["model.embed_tokens.weight"]
    hf_mapping.load_hf_weights(model, dict(tensors, **{"lm_head.weight": embed.copy()}))  # equal: ignored
    with pytest.raises(ValueError, match="lm_head.weight"):
        hf_mapping.load_hf_weights(model, dict(tensors, **{"lm_head.weight": embed + 1}))


# --------------------------------------------------------------------------- logical axes and sharding hooks


def test_logical_axes_tree_matches_params():
    cfg = config_from_hf(tiny_config("qwen2"))
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    axes = logical_axes_tree(model)

    def check(x, names):
        assert isinstance(names, tuple) and len(names) == x.ndim and set(names) <= set(PARAM_AXES)
        return names

    jax.tree.map(check, params, axes)
    pure = logical_axes_tree(params, pure=True)
    jax.tree.map(check, nnx.to_pure_dict(params), pure)
    q = pure["layers"][0]["self_attn"]
    assert q["q_proj"]["kernel"] == ("embed", "heads", "head_dim")
    assert q["k_proj"]["bias"] == ("kv_heads", "head_dim")
    assert q["o_proj"]["kernel"] == ("heads", "head_dim", "embed")
    assert pure["embed_tokens"]["embedding"] == ("vocab", "embed")
    assert pure["lm_head"]["kernel"] == ("embed", "vocab")
    assert pure["norm"]["scale"] == ("norm",)
    # flax's own reading of the same metadata, through the rules table
    with nnx.logical_axis_rules(RULES):
        specs = nnx.get_partition_spec(params)
    assert specs["layers"][0]["mlp"]["down_proj"]["kernel"].get_value() == PartitionSpec("tp", "fsdp")


def test_blocked_dispatch_matches_hf_past_its_threshold(checkpoint):
    """A batch past ``blocked_where_cheaper``'s threshold (8 x 128 tokens; 171 for 8 experts,
    top 2), so the tiny MoE's sparse layer runs the block scan: HF's logits (1e-5) on one device,
    and on the 4 x 2 (fsdp x tp) mesh with the worker's activation constraints, where each
    fsdp rank's two rows (256 tokens, still past it) dispatch alone.  (Its gradients against the
    dense dispatch: tests/jax_backend/test_moe_dispatch.py.)"""
    from backends.jax_pjit.sharding import activation_constraint as sharding_constraint

    path, hf_model = checkpoint("qwen3_moe")
    ids, mask = _batch(seed=3, batch=8, seq=128)
    model, cfg, _ = hf_mapping.from_pretrained(path, moe_dispatch="blocked")
    apply_fn, params = make_apply_fn(model)
    jids, jmask = jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy())
    assert "scan" in str(jax.make_jaxpr(apply_fn)(params, jids, jmask))
    valid = mask.numpy().astype(bool)
    logits = np.asarray(jax.jit(apply_fn)(params, jids, jmask))
    np.testing.assert_allclose(logits[valid], _hf_logits(hf_model, ids, mask)[valid], atol=1e-5, rtol=0)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    with nnx.logical_axis_rules(RULES):
        placed = jax.device_put(params, nnx.get_named_sharding(params, mesh))
    with activation_constraint(sharding_constraint(mesh)):
        program = str(jax.make_jaxpr(apply_fn)(placed, jids, jmask))
        sharded = np.asarray(jax.jit(apply_fn)(placed, jids, jmask))
    # each fsdp rank's 2 rows x 128 tokens dispatch alone (a shard_map over fsdp, the kernels
    # whole), through the scan
    assert "in_specs=(P('fsdp',), P('fsdp',), P('fsdp',), P(), P(), P())" in program
    assert "f32[256,64]" in program and "scan" in program
    np.testing.assert_allclose(sharded[valid], logits[valid], atol=1e-5, rtol=0)


def test_expert_parallel_matches_hf_and_the_one_device_gradients(checkpoint):
    """``expert_parallel=4`` on the 4 (fsdp) x 2 (tp) mesh with the worker's constraints: each
    fsdp rank runs its 2 of the 8 experts on every rank's tokens (a shard_map over fsdp; the
    kernels never gathered).  HF's logits at 1e-5, and the gradients of every parameter equal
    the one-device model's (dense dispatch)."""
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    from backends.jax_pjit.sharding import activation_constraint as sharding_constraint

    path, hf_model = checkpoint("qwen3_moe")
    ids, mask = _batch(seed=4, batch=8, seq=24)
    jids, jmask = jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy())
    valid = mask.numpy().astype(bool)

    def loss_and_grads(apply_fn, params):
        def loss(p):
            logits = apply_fn(p, jids, jmask)
            return jnp.sum(jnp.sin(logits) * jmask[..., None]), logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    dense, _, _ = hf_mapping.from_pretrained(path, moe_dispatch="dense")
    (_, ref_logits), ref_grads = loss_and_grads(*make_apply_fn(dense))
    model, cfg, _ = hf_mapping.from_pretrained(path, expert_parallel=4)
    apply_fn, params = make_apply_fn(model)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    with nnx.logical_axis_rules(RULES):
        placed = jax.device_put(params, nnx.get_named_sharding(params, mesh))
    with activation_constraint(sharding_constraint(mesh)):
        assert "shard_map" in str(jax.make_jaxpr(apply_fn)(placed, jids, jmask))
        (_, logits), grads = loss_and_grads(apply_fn, placed)
    np.testing.assert_allclose(np.asarray(logits)[valid], _hf_logits(hf_model, ids, mask)[valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(ref_logits)[valid], atol=1e-5, rtol=0)
    flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)
    for (where, g), ref in zip(flat, ref_flat, strict=True):
        scale = max(float(np.abs(np.asarray(ref)).max()), 1e-6)
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=1e-5 * scale, rtol=1e-5, err_msg=str(where))
    with pytest.raises(ValueError, match=r"expert_parallel_size=2: the experts are stored over the mesh axis 'fsdp'"):
        two, _, _ = hf_mapping.from_pretrained(path, expert_parallel=2)
        with activation_constraint(sharding_constraint(mesh)):
            jax.make_jaxpr(make_apply_fn(two)[0])(placed, jids, jmask)


# As the KV-cache test: qwen3_moe (a Qwen3 layer -- Llama + q/k norms, head_dim != hidden /
# heads -- and a sparse one, its experts sharded over fsdp) in the fast suite.
@pytest.mark.parametrize(
    "name", [*(pytest.param(n, marks=pytest.mark.slow) for n in ("llama", "qwen3", "gemma3")), "qwen3_moe"]
)
def test_sharded_forward_matches_unsharded(checkpoint, name):
    """Params placed by the rules table on a 4 (fsdp) x 2 (tp) CPU mesh, activations
    constrained through the hook: same logits as the single-device forward."""
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    model, _, _ = hf_mapping.from_pretrained(checkpoint(name)[0])
    ids, mask = _batch(batch=4)
    ref = _jax_logits(model, ids, mask)

    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    rules = dict(RULES)
    apply_fn, params = make_apply_fn(model)
    with nnx.logical_axis_rules(RULES):
        shardings = nnx.get_named_sharding(params, mesh)
    params = jax.device_put(params, shardings)
    constrained = []

    def constraint(x, axes):
        constrained.append(axes)
        # (the rules' "cp" -- the sequence under context parallelism -- is not an axis of this mesh)
        spec = PartitionSpec(*(rules[a] if rules[a] in mesh.axis_names else None for a in axes))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    with activation_constraint(constraint):
        logits = jax.jit(apply_fn)(params, jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy()), None)
    assert {
        ("batch", "seq", "act_embed"),
        ("batch", "seq", "act_heads", "head_dim"),
        ("batch", "seq", "act_mlp"),
        ("batch", "seq", "act_vocab"),
    } <= set(constrained)
    assert logits.sharding.spec == PartitionSpec("fsdp", None, "tp")
    valid = mask.numpy().astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[valid], ref[valid], atol=1e-5, rtol=0)
