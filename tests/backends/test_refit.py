"""The source side of a refit, on every backend: HF export, refit info and the weight stream.

After a training step (weights no checkpoint on disk has): the HF export loads in
``transformers`` with the policy's logprobs; ``prepare_refit_info`` names every tensor the
stream carries with its HF shape and the generation dtype (``generation.vllm_cfg.precision``:
bfloat16 here, over float32 training weights); the stream read through the CPU transport
(shared memory, bucket by bucket) is exactly the export cast to that dtype, passes the
engine-side receiver's checks against the HF config, and leaves out a tied ``lm_head``.
The offload round trip around a refit keeps the weights.  The engine side (vLLM):
tests/generation.
"""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from core.losses import ClippedPGLossFn
from core.refit.manifest import manifest_for_hf_config
from core.refit.receiver import RefitReceiver
from tests.backends.conftest import ragged, read_refit_stream
from tests.hf_reference import PG_CFG
from tests.torch_backends.conftest import hf_logprobs, pg_batch


def test_export_refit_info_and_stream_after_a_step(fresh_policy, tmp_path):
    lp = fresh_policy
    policy = lp.policy
    assert policy.train(pg_batch(4, seed=50), ClippedPGLossFn(PG_CFG)).skipped_steps == 0
    policy.save_hf_checkpoint(str(tmp_path / "hf"))

    # The export: an HF checkpoint of the current weights.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = AutoConfig.from_pretrained(lp.model_dir)
    assert config["vocab_size"] == original.vocab_size
    assert config["tie_word_embeddings"] == original.tie_word_embeddings
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    if original.tie_word_embeddings:
        assert exported.lm_head.weight is exported.model.embed_tokens.weight
    probe = ragged(5, seed=51)
    torch.testing.assert_close(
        policy.get_logprobs(probe)["logprobs"],
        hf_logprobs(exported, probe["input_ids"], probe["input_lengths"]),
        rtol=0,
        atol=1e-5,
    )
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in tensors.values())

    # Refit info: HF names, HF shapes, the generation dtype; a tied lm_head is not sent.
    info = policy.prepare_refit_info()
    sent = {k: v for k, v in tensors.items() if not (original.tie_word_embeddings and k == "lm_head.weight")}
    assert list(info) == [k for k in info if k in sent] and set(info) == set(sent)
    assert {k: tuple(shape) for k, (shape, _) in info.items()} == {k: tuple(v.shape) for k, v in sent.items()}
    assert {str(dtype).removeprefix("torch.") for _, dtype in info.values()} == {"bfloat16"}

    # The stream: refit-info order, the export cast to bfloat16 bit for bit, and what the
    # engine-side receiver accepts for this HF config.
    stream = read_refit_stream(policy)
    assert [name for name, _ in stream] == list(info)
    for name, tensor in stream:
        expected = sent[name].to(torch.bfloat16)
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected), name
    receiver = RefitReceiver(manifest_for_hf_config(original, "bfloat16"), weights_valid=False)
    receiver.begin(info)
    receiver.check_bucket(stream)
    receiver.mark_loaded(receiver.with_tied_aliases(stream))
    assert receiver.finish() == len(manifest_for_hf_config(original, "bfloat16"))


def test_offload_round_trip_keeps_the_weights(layout_policy):
    """offload_before_refit / offload_after_refit (training state to host memory, as for a
    colocated engine), then prepare_for_training: the same logprobs, and training goes on."""
    policy = layout_policy.policy
    probe = ragged(4, seed=55)
    before = policy.get_logprobs(probe)["logprobs"]
    policy.offload_before_refit()
    policy.offload_after_refit()
    policy.prepare_for_training()
    torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], before, rtol=0, atol=0)
    assert math.isfinite(float(policy.train(pg_batch(4, seed=56), ClippedPGLossFn(PG_CFG)).loss[0]))
