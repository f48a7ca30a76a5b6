"""A vocabulary that tensor parallelism does not divide (301 over tp=2), or that
``make_vocab_size_divisible_by`` asks to pad (301 -> 320 on tp=1): the backend pads its
training copy (embedding, lm_head) with zero rows, masks the padded logits and never lets the
padding out -- HF export, refit info and stream, generate and the logprobs keep [301, H].

One padded policy per layout serves every check of that layout, in order (logprobs on fresh
weights, the full-logits loss in eval mode, two AdamW steps against a single-process HF
reference on the unpadded model, export / refit, reference logprobs and generate, the saved
checkpoint's zero padded rows and its round trip).  FSDP1 has no tensor parallelism and does
not pad: it refuses ``make_vocab_size_divisible_by > 1`` by name.  The refit into vLLM:
tests/generation/test_refit_padded_vocab.py; the engines' own padding helpers:
tests/torch_backends/test_vocab_padding.py, tests/jax_backend/test_padded_vocab.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

from core.config import ConfigError
from core.losses import ClippedPGLossFn
from core.policy.config import PolicyConfig
from core.policy.worker_protocol import PolicyWorker
from tests.backends.conftest import (
    LAYOUTS,
    SLOW_LAYOUTS,
    layout_config,
    layout_params,
    read_refit_stream,
    refused_on_driver,
    started_policy,
)
from tests.hf_reference import PG_CFG, reference_adamw
from tests.padded_vocab import V, hf_model, pg_batch_301, ragged_301, save_v301_model
from tests.torch_backends.conftest import SEQ, hf_logprobs

#: layout -> (model, make_vocab_size_divisible_by, padded rows); a layout missing here pads
#: nothing and must refuse to (FSDP1).
PADDED = {
    "dtensor-dp2": ("llama", 64, 320),  # tp=1: padded only because the config asks
    "dtensor-tp2": ("llama", 1, 302),
    "dtensor-tp2-sp": ("qwen2_tied", 1, 302),
    "dtensor-dp2-tp2-sp": ("qwen2_tied", 1, 302),
    "jax-fsdp8": ("llama", 64, 320),
    "jax-fsdp4-tp2": ("qwen2_tied", 1, 302),
}
#: Padding is a tensor-parallel matter (the vocabulary is sharded over tp; dp shards nothing of
#: it), so CI runs the torch padded policy on dtensor-tp2-sp (2 workers) rather than the
#: contract suite's 4-worker layout, which pads the same way in ``make test-all``.
PADDED_FAST_TORCH = "dtensor-tp2-sp"
PADDED_PARAMS = layout_params(
    [n for n in LAYOUTS if n in PADDED], slow=(SLOW_LAYOUTS - {PADDED_FAST_TORCH}) | {"dtensor-dp2-tp2-sp"}
)


class FullLogitsPG:
    """ClippedPG computed from the full logits (no ``loss_from_logprobs``): the torch workers'
    full-logits path, which must hand the loss exactly the original V columns."""

    def __init__(self, cfg):
        self.inner = ClippedPGLossFn(cfg)
        self.loss_type = self.inner.loss_type

    def __call__(self, logits, data, global_valid_seqs, global_valid_toks):
        if logits.shape[-1] != V:
            raise AssertionError(f"the loss saw {logits.shape[-1]} vocab columns, not {V}")
        return self.inner(logits, data, global_valid_seqs, global_valid_toks)


@pytest.fixture(scope="module")
def v301_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("v301")
    return {
        "llama": save_v301_model("llama", root / "llama"),
        "qwen2_tied": save_v301_model("qwen2", root / "qwen2_tied", tie=True),
    }


class Padded:
    """A padded policy and what its checks hand each other (the probe after training, the export)."""

    def __init__(self, layout, policy, cfg, model_dir, padded, tied):
        self.layout, self.policy, self.cfg, self.model_dir = layout, policy, cfg, model_dir
        self.padded, self.tied = padded, tied
        self.state: dict = {}


@pytest.fixture
def padded(layout, policies, v301_dirs, tokenizer):
    model, multiple, rows = PADDED[layout.name]
    cfg = layout_config(layout, v301_dirs[model], make_vocab_size_divisible_by=multiple)

    def start(stack, root):
        policy = stack.enter_context(started_policy(layout, cfg, tokenizer, f"padded_{layout.name}"))
        return Padded(layout, policy, cfg, v301_dirs[model], rows, model == "qwen2_tied")

    return policies.get(("padded", layout.name), start)


def stored_vocab_rows(layout, weights_path, tmp_path) -> dict[str, np.ndarray]:
    """The embedding / lm_head rows as a policy checkpoint stores them ([padded rows, H]):
    the training copy, padding included."""
    if layout.backend == "jax_pjit":
        import orbax.checkpoint as ocp

        with ocp.PyTreeCheckpointer() as ckptr:
            tree = ckptr.restore(weights_path)

        def leaf(x):
            return np.asarray(x["value"] if isinstance(x, dict) else x)

        rows = {"model.embed_tokens.weight": leaf(tree["embed_tokens"]["embedding"])}
        if "lm_head" in tree:
            rows["lm_head.weight"] = leaf(tree["lm_head"]["kernel"]).T
        return rows
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(weights_path, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    return {n: state[n].numpy() for n in names if n in state}


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("layout", layout_params(slow=set()), indirect=True)
def test_vocab_padding_is_configured_or_refused_by_name(layout, model_dirs, tokenizer):
    """Every backend that pads accepts ``make_vocab_size_divisible_by``; FSDP1 refuses a value
    above 1 by name, before any worker starts; a value that is not a positive int is refused
    everywhere."""
    model_dir = model_dirs["llama"]
    cfg = layout_config(layout, model_dir, make_vocab_size_divisible_by=64)
    if layout.name in PADDED:
        PolicyConfig.checked(cfg)
    else:
        with pytest.raises(
            ConfigError,
            match=rf"make_vocab_size_divisible_by: 64: the {layout.backend} backend does not support vocabulary "
            "padding",
        ):
            refused_on_driver(layout, cfg, tokenizer)
    PolicyConfig.checked(layout_config(layout, model_dir, make_vocab_size_divisible_by=1))
    for bad in (0, -8):
        with pytest.raises(ConfigError, match=r"make_vocab_size_divisible_by: must be > 0"):
            PolicyConfig.checked(layout_config(layout, model_dir, make_vocab_size_divisible_by=bad))
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by"):
        PolicyConfig.checked(layout_config(layout, model_dir, make_vocab_size_divisible_by="8"))


# ----------------------------------------------------------------------------- one padded policy per layout, in order


@pytest.mark.parametrize("layout", PADDED_PARAMS, indirect=True)
def test_padded_logprobs_match_hf(padded):
    data = ragged_301(5, seed=1)
    out = padded.policy.get_logprobs(data)["logprobs"]
    ref = hf_logprobs(hf_model(padded.model_dir), data["input_ids"], data["input_lengths"])
    assert out.shape == (5, SEQ) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", PADDED_PARAMS, indirect=True)
def test_padded_full_logits_loss_sees_the_original_vocab(padded):
    """eval mode: the logprob path and (torch) the full-logits path ([..., :301] of the
    gathered logits) give the single-process loss.  The JAX backend has no full-logits path:
    such a loss is refused, naming the method it lacks."""
    data = pg_batch_301(4, seed=3)
    ref = reference_adamw(padded.model_dir, padded.cfg, [data], ClippedPGLossFn(PG_CFG), steps=False)[0][0]
    kernel = float(padded.policy.train(data, ClippedPGLossFn(PG_CFG), eval_mode=True).loss[0])
    assert math.isclose(kernel, ref, rel_tol=1e-5, abs_tol=1e-6), (kernel, ref)
    if padded.layout.backend == "jax_pjit":
        with pytest.raises(Exception, match="FullLogitsPG has no loss_from_logprobs: the jax_pjit backend"):
            padded.policy.train(data, FullLogitsPG(PG_CFG), eval_mode=True)
        # refused before any work: the policy goes on
        assert float(padded.policy.train(data, ClippedPGLossFn(PG_CFG), eval_mode=True).loss[0]) == kernel
        return
    full = float(padded.policy.train(data, FullLogitsPG(PG_CFG), eval_mode=True).loss[0])
    assert math.isclose(full, ref, rel_tol=1e-5, abs_tol=1e-6), (full, ref)


@pytest.mark.parametrize("layout", PADDED_PARAMS, indirect=True)
def test_padded_two_adamw_steps_match_single_process(padded):
    """Step 1 through the logprob path, step 2 through the full-logits path (torch); the
    reference is plain single-process HF on the unpadded model (tp=1, dp=1)."""
    policy, cfg = padded.policy, padded.cfg
    batches = [pg_batch_301(4, seed=10 + i) for i in range(2)]
    second = ClippedPGLossFn(PG_CFG) if padded.layout.backend == "jax_pjit" else FullLogitsPG(PG_CFG)
    ours = [policy.train(batches[0], ClippedPGLossFn(PG_CFG)), policy.train(batches[1], second)]
    ref_losses, ref_norms, ref_model = reference_adamw(padded.model_dir, cfg, batches, ClippedPGLossFn(PG_CFG))
    for step, (r, loss, norm) in enumerate(zip(ours, ref_losses, ref_norms, strict=True)):
        tol = 1e-5 if step == 0 else 1e-4
        assert math.isclose(float(r.loss[0]), loss, rel_tol=tol, abs_tol=tol / 10), (step, r.loss, loss)
        assert math.isclose(float(r.grad_norm[0]), norm, rel_tol=tol), (step, r.grad_norm, norm)
    probe = ragged_301(4, seed=20)
    after = policy.get_logprobs(probe)["logprobs"]
    torch.testing.assert_close(
        after, hf_logprobs(ref_model, probe["input_ids"], probe["input_lengths"]), rtol=0, atol=1e-4
    )
    padded.state["probe"] = probe


@pytest.mark.parametrize("layout", PADDED_PARAMS, indirect=True)
def test_padded_export_and_refit_have_the_original_vocab(padded, tmp_path):
    policy = padded.policy
    policy.save_hf_checkpoint(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == V
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}
    hidden = config["hidden_size"]
    assert exported["model.embed_tokens.weight"].shape == (V, hidden)
    assert ("lm_head.weight" in exported) != padded.tied or exported["lm_head.weight"].shape == (V, hidden)
    if not padded.tied:
        assert exported["lm_head.weight"].shape == (V, hidden)
    model = hf_model(tmp_path)
    assert model.config.tie_word_embeddings == padded.tied
    if padded.tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    probe = padded.state.get("probe", ragged_301(4, seed=20))
    torch.testing.assert_close(
        policy.get_logprobs(probe)["logprobs"],
        hf_logprobs(model, probe["input_ids"], probe["input_lengths"]),
        rtol=0,
        atol=1e-5,
    )
    padded.state["export"] = tmp_path

    # The refit manifest (the engine checks it against its own config) and stream: HF shapes.
    info = policy.prepare_refit_info()
    assert tuple(info["model.embed_tokens.weight"][0]) == (V, hidden)
    if padded.tied:  # a tied lm_head is not sent: the engine's receiver loads it from the embedding
        assert "lm_head.weight" not in info
    else:
        assert tuple(info["lm_head.weight"][0]) == (V, hidden)
    stream = dict(read_refit_stream(policy))
    assert stream.keys() == info.keys()
    for name, tensor in stream.items():
        assert torch.equal(tensor, exported[name].to(tensor.dtype)), name


@pytest.mark.parametrize("layout", PADDED_PARAMS, indirect=True)
def test_padded_reference_logprobs_and_generate(padded, tmp_path):
    from tests.generation.conftest import generated_rows, hf_greedy

    policy = padded.policy
    data = ragged_301(4, seed=30)
    ref = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    initial = hf_logprobs(hf_model(padded.model_dir), data["input_ids"], data["input_lengths"])
    torch.testing.assert_close(ref, initial, rtol=0, atol=1e-5)
    assert (policy.get_logprobs(data)["logprobs"] - ref).abs().max() > 1e-3  # the policy did move

    # Generation on the current weights: the greedy tokens of their (unpadded) HF export.
    if "export" not in padded.state:
        policy.save_hf_checkpoint(str(tmp_path / "hf"))
        padded.state["export"] = tmp_path / "hf"
    prompts = ragged_301(3, seed=31)
    out = policy.generate(prompts, greedy=True)
    assert int(out["output_ids"].max()) < V
    assert generated_rows(out, prompts) == hf_greedy(
        hf_model(padded.state["export"]), prompts, padded.cfg["generation"]["max_new_tokens"]
    )


@pytest.mark.parametrize("layout", PADDED_PARAMS, indirect=True)
def test_padded_rows_stay_zero_and_checkpoint_round_trip(padded, tmp_path):
    """The checkpoint holds the padded training copy: its padded rows are exactly zero after
    training (no gradient, AdamW's decay of 0 is 0); loading it back restores the state."""
    policy = padded.policy
    policy.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optim"))
    for name, rows in stored_vocab_rows(padded.layout, tmp_path / "weights", tmp_path).items():
        assert rows.shape[0] == padded.padded, (name, rows.shape)
        assert not rows[V:].any(), name
        assert rows[:V].any(), name

    probe = ragged_301(4, seed=40)
    saved = policy.get_logprobs(probe)["logprobs"]
    policy.train(pg_batch_301(4, seed=50), ClippedPGLossFn(PG_CFG))
    assert float((policy.get_logprobs(probe)["logprobs"] - saved).abs().max()) > 1e-4
    policy.workers.all(PolicyWorker.load_checkpoint, str(tmp_path / "weights"), str(tmp_path / "optim"))  # same layout
    torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], saved, rtol=0, atol=1e-6)
