"""Faults with timings: a process dies in the middle of the work, and what survives.

* a training rank dies in the middle of ``train``: the driver gets a fatal error naming the
  rank within ``KILL_DEADLINE_S`` (its peer, blocked in a collective, is killed with it), and
  a new Policy on the same cluster trains;
* the vLLM engine dies in the middle of a refit (``ipc`` and ``collective``): the driver gets
  ``EngineDeadError``; the *policy* is untouched (same logprobs, still trains) and a new
  engine refits from it and generates what the policy's own generate does.

(Kills during ``save_checkpoint`` are in tests/torch_backends/test_checkpoint_trust.py.)
Each death is a real ``os._exit`` inside the actor process, placed by patching the actor's
code through ``__ray_call__``, so the moment is deterministic.  The measured seconds are
printed (``-s``) for the reliability notes.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import ray
import torch

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster, WorkerGroupError
from core.generation import EngineDeadError, VllmGeneration
from core.losses import ClippedPGLossFn
from core.policy import Policy
from core.refit import refit_policy_generation
from tests.generation.conftest import prompts, refit_config
from tests.torch_backends.conftest import pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG

KILL_DEADLINE_S = 30.0
SMALL_BUCKET = 48 * 1024  # several buckets per refit, so a death can land in the middle

pytestmark = pytest.mark.slow


def _shut_down(*parts) -> None:
    """Engines, policies, then clusters; parts never built are None."""
    for part in parts:
        if part is not None:
            part.shutdown()


def _report(what: str, seconds: float) -> None:
    print(f"\n[fault timing] {what}: {seconds:.2f} s")


def _die_on_rank(policy: Policy, rank: int, method: str, after_calls: int = 0) -> None:
    """Rank ``rank``'s worker exits hard on its ``after_calls + 1``-th call of ``method``."""

    def patch(worker, rank=rank, method=method, after_calls=after_calls):
        if worker.rank != rank:
            return
        original = getattr(worker, method)
        calls = {"n": 0}

        def dying(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > after_calls:
                os._exit(1)
            return original(*args, **kwargs)

        setattr(worker, method, dying)

    ray.get([w.__ray_call__.remote(patch) for w in policy.worker_group.workers])


def test_rank_killed_mid_train_fails_fast_and_a_new_policy_trains(ray_session, model_dirs, tokenizer):
    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    cluster = RayVirtualCluster([2], use_gpus=False, name="fault-train")
    try:
        policy = Policy(cluster, cfg, tokenizer, name_prefix="fault_train")
        policy.train(pg_batch(4, seed=1), ClippedPGLossFn(BASE_CFG))
        # rank 1 dies in its micro batch's loss, after the forward's all-gathers: rank 0 goes
        # on into the backward's reduce-scatter, waiting for a rank that will never come
        _die_on_rank(policy, 1, "_micro_batch_loss")
        start = time.monotonic()
        with pytest.raises(
            WorkerGroupError, match=r"(?s)'train' failed on rank\(s\) \[1\].*Fatal \(a worker process died\)"
        ):
            policy.train(pg_batch(4, seed=2), ClippedPGLossFn(BASE_CFG))
        took = time.monotonic() - start
        _report("rank 1 killed mid-train -> WorkerGroupError", took)
        assert took < KILL_DEADLINE_S
        with pytest.raises(WorkerGroupError, match="actors were killed"):
            policy.get_logprobs(pg_batch(4, seed=3))
        policy.shutdown()

        start = time.monotonic()
        fresh = Policy(cluster, cfg, tokenizer, name_prefix="fault_train_new")
        result = fresh.train(pg_batch(4, seed=2), ClippedPGLossFn(BASE_CFG))
        _report("new Policy on the same cluster, first train step", time.monotonic() - start)
        assert all(math.isfinite(x) for x in result.loss) and result.skipped_steps == 0
        fresh.shutdown()
    finally:
        cluster.shutdown()


def _engine_dies_in(engine: VllmGeneration, transport: str) -> None:
    """The engine's process exits hard after loading its first bucket of the next refit."""

    def patch(actor, transport=transport):
        if transport == "ipc":  # Ray dispatches by class: patch what the method calls
            original = actor.llm.collective_rpc
            calls = {"n": 0}

            def dying(method, *args, **kwargs):
                if method == "dualrl_load_ipc":
                    calls["n"] += 1
                    if calls["n"] > 1:
                        os._exit(1)
                return original(method, *args, **kwargs)

            actor.llm.collective_rpc = dying
        else:
            from core.refit import collective

            original = collective.receive_buckets

            def dying(group):
                for i, bucket in enumerate(original(group)):
                    if i == 1:
                        os._exit(1)
                    yield bucket

            collective.receive_buckets = dying

    ray.get([e.__ray_call__.remote(patch) for e in engine.engines])


@pytest.mark.parametrize("transport", ["ipc", "collective"])
def test_engine_killed_mid_refit_leaves_the_policy_intact(transport, ray_session, gen_model_dirs, tokenizer):
    cfg = refit_config(gen_model_dirs["llama_gen"], "torch_fsdp", bucket_bytes=SMALL_BUCKET)
    policy_cluster = RayVirtualCluster([2], use_gpus=False, name=f"fault-refit-policy-{transport}")
    engine_cluster = RayVirtualCluster([1], use_gpus=False, name=f"fault-refit-engine-{transport}")
    policy = engine = None
    try:
        policy = Policy(policy_cluster, cfg, tokenizer, name_prefix=f"fault_refit_{transport}")
        engine = VllmGeneration(engine_cluster, cfg, tokenizer, name_prefix=f"fault_engine_{transport}")
        refit_policy_generation(policy, engine, transport)
        probe = BatchedDataDict(input_ids=prompts()["input_ids"], input_lengths=prompts()["input_lengths"])
        before = policy.get_logprobs(probe)["logprobs"]

        _engine_dies_in(engine, transport)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine 0 is dead"):
            refit_policy_generation(policy, engine, transport)
        _report(f"engine killed mid-refit ({transport}) -> EngineDeadError", time.monotonic() - start)
        assert time.monotonic() - start < KILL_DEADLINE_S
        with pytest.raises(EngineDeadError, match="create a new VllmGeneration"):
            engine.generate(prompts(), greedy=True)

        # the policy serves and trains as before
        assert torch.equal(policy.get_logprobs(probe)["logprobs"], before)
        assert policy.train(pg_batch(4, seed=5), ClippedPGLossFn(BASE_CFG)).skipped_steps == 0
        engine.shutdown()

        start = time.monotonic()
        engine = VllmGeneration(engine_cluster, cfg, tokenizer, name_prefix=f"fault_engine2_{transport}")
        refit_policy_generation(policy, engine, transport)
        _report(f"new engine started and refit ({transport})", time.monotonic() - start)
        out = engine.generate(prompts(), greedy=True)
        assert torch.equal(out["output_ids"], policy.generate(prompts(), greedy=True)["output_ids"])
    finally:
        _shut_down(engine, policy, engine_cluster, policy_cluster)


def _kill_sender_mid_broadcast(policy: Policy) -> None:
    """Training rank 0 exits hard while broadcasting the second bucket of the next refit."""

    def patch(worker):
        from core.refit import collective

        if worker.rank != 0:
            return
        original, calls = collective._send_bucket, {"n": 0}

        def dying(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 1:
                os._exit(1)
            return original(*args, **kwargs)

        collective._send_bucket = dying

    ray.get([w.__ray_call__.remote(patch) for w in policy.worker_group.workers])


def test_engine_survives_the_policy_dying_mid_refit(ray_session, gen_model_dirs, tokenizer):
    cfg = refit_config(gen_model_dirs["llama_gen"], "torch_fsdp", bucket_bytes=SMALL_BUCKET)
    policy_cluster = RayVirtualCluster([2], use_gpus=False, name="fault-sender-policy")
    engine_cluster = RayVirtualCluster([1], use_gpus=False, name="fault-sender-engine")
    policy = engine = None
    try:
        policy = Policy(policy_cluster, cfg, tokenizer, name_prefix="fault_sender")
        engine = VllmGeneration(engine_cluster, cfg, tokenizer, name_prefix="fault_sender_engine")
        refit_policy_generation(policy, engine, "collective")
        expected = engine.generate(prompts(), greedy=True)["output_ids"]
        _kill_sender_mid_broadcast(policy)
        start = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"(?s)rank\(s\) \[0\].*Fatal \(a worker process died\)"):
            refit_policy_generation(policy, engine, "collective")
        _report("policy rank 0 killed mid-broadcast -> WorkerGroupError", time.monotonic() - start)
        assert time.monotonic() - start < KILL_DEADLINE_S
        engine.check_alive()  # the engine is alive, and knows its weights are half-updated
        assert not engine.weights_valid()
        policy.shutdown()

        policy = Policy(policy_cluster, cfg, tokenizer, name_prefix="fault_sender_new")  # same seed, same weights
        refit_policy_generation(policy, engine, "collective")  # a new group with the same engine
        assert torch.equal(engine.generate(prompts(), greedy=True)["output_ids"], expected)
    finally:
        _shut_down(engine, policy, engine_cluster, policy_cluster)


def test_a_wedged_engine_is_declared_dead_not_waited_for(ray_session, gen_model_dirs, tokenizer):
    """vLLM's in-process engine can be left mid-step by an exception and then block every
    request.  Simulated: generate raises once, then the engine blocks (the probe too)."""
    cfg = refit_config(gen_model_dirs["llama_gen"], "torch_fsdp")
    cfg["generation"]["vllm_cfg"]["load_format"] = "auto"
    cluster = RayVirtualCluster([1], use_gpus=False, name="fault-wedge")
    engine = None
    try:
        engine = VllmGeneration(cluster, cfg, tokenizer, name_prefix="fault_wedge", probe_timeout_s=5)
        expected = engine.generate(prompts(), greedy=True)["output_ids"]

        def fail_once(actor):  # an engine error that leaves the engine healthy
            original, calls = actor.llm.generate, {"n": 0}

            def generate(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise IndexError("index 300 is out of bounds (simulated engine error)")
                return original(*args, **kwargs)

            actor.llm.generate = generate

        ray.get(engine.engines[0].__ray_call__.remote(fail_once))
        with pytest.raises(IndexError, match="simulated engine error"):
            engine.generate(prompts(), greedy=True)
        assert torch.equal(engine.generate(prompts(), greedy=True)["output_ids"], expected)  # probe said healthy

        def wedge(actor):
            def generate(*args, **kwargs):
                if not getattr(actor, "_wedged", False):
                    actor._wedged = True
                    raise IndexError("simulated engine error that wedges the engine")
                time.sleep(3600)

            actor.llm.generate = generate

        ray.get(engine.engines[0].__ray_call__.remote(wedge))
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"health probe then did not answer within 5 s"):
            engine.generate(prompts(), greedy=True)
        _report("wedged engine -> EngineDeadError (probe deadline 5 s)", time.monotonic() - start)
        assert time.monotonic() - start < KILL_DEADLINE_S
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine 0 is dead"):
            engine.check_alive()
        assert time.monotonic() - start < 1.0  # known dead: no call is even sent
    finally:
        if engine is not None:
            engine.shutdown()
        cluster.shutdown()


def test_a_call_past_the_configured_timeout_kills_the_engine(ray_session, gen_model_dirs, tokenizer):
    """``policy.generation.vllm_cfg.call_timeout_s`` is the driver's deadline for an engine call:
    a generate call that runs past it (simulated: the engine sleeps) is declared dead, within
    that deadline rather than the default hour."""
    cfg = refit_config(gen_model_dirs["llama_gen"], "torch_fsdp")
    cfg["generation"]["vllm_cfg"].update(load_format="auto", call_timeout_s=5)
    cluster = RayVirtualCluster([1], use_gpus=False, name="fault-timeout")
    engine = None
    try:
        engine = VllmGeneration(cluster, cfg, tokenizer, name_prefix="fault_timeout", probe_timeout_s=5)
        assert engine.call_timeout_s == 5

        def hang(actor):
            actor.llm.generate = lambda *args, **kwargs: time.sleep(3600)

        ray.get(engine.engines[0].__ray_call__.remote(hang))
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"did not answer generate within 5 s"):
            engine.generate(prompts(), greedy=True)
        assert time.monotonic() - start < KILL_DEADLINE_S
    finally:
        if engine is not None:
            engine.shutdown()
        cluster.shutdown()
