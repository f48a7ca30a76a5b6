"""The driver -> worker contract (``core.policy.worker_protocol.PolicyWorker``) is code.

Every worker class has every method the protocol lists, with its parameters; the driver's
dispatcher refuses anything that is not a protocol method; and the type checker catches a
misspelt method, a mistyped argument or a wrong keyword in a call the driver makes (the last
runs mypy on a probe module: a few seconds with ``--follow-imports=skip``).
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core.policy.worker_dispatch import protocol_method_name
from core.policy.worker_protocol import PolicyWorker

ROOT = Path(__file__).resolve().parents[2]


def protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(PolicyWorker, name))
        for name in vars(PolicyWorker)
        if not name.startswith("_") and callable(getattr(PolicyWorker, name))
    }


def worker_classes() -> list[type]:
    from backends.jax_pjit.worker import JaxPolicyWorker
    from backends.torch_dtensor.worker import DTensorPolicyWorker
    from backends.torch_fsdp.worker import FSDP1PolicyWorker

    return [FSDP1PolicyWorker, DTensorPolicyWorker, JaxPolicyWorker]


def test_the_protocol_lists_every_method_the_policy_calls():
    # What core.policy.Policy calls on its workers (its facade methods' worker calls).
    called = {
        "logits_loss_refusal", "is_alive",
        "get_logprobs", "get_reference_policy_logprobs", "get_logprobs_and_reference", "generate",
        "train", "prepare_for_training", "prepare_for_lp_inference", "finish_training", "offload_before_refit",
        "offload_after_refit", "save_checkpoint", "load_checkpoint", "save_hf_checkpoint", "set_refit_part",
        "refit_manifest", "prepare_weights_for_ipc", "get_weights_ipc_handles", "finish_refit_stream",
        "init_collective", "broadcast_weights_for_collective", "start_gpu_profiling", "stop_gpu_profiling",
        "get_gpu_info", "report_device_id", "reset_peak_memory_stats", "shutdown",
    }  # fmt: skip
    assert called <= set(protocol_methods())
    for name in protocol_methods():
        assert (getattr(PolicyWorker, name).__doc__ or "").strip(), f"PolicyWorker.{name} says nothing it promises"


@pytest.mark.parametrize("cls", worker_classes(), ids=lambda c: c.__name__)
def test_every_worker_has_every_protocol_method_with_its_parameters(cls):
    for name, signature in protocol_methods().items():
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} has no {name}"
        theirs = inspect.signature(method).parameters
        for param in signature.parameters.values():
            if param.name in ("self", "cls"):
                continue
            assert param.name in theirs or any(p.kind == p.VAR_KEYWORD for p in theirs.values()), (
                f"{cls.__name__}.{name} lacks parameter {param.name!r}"
            )


def test_the_dispatcher_takes_protocol_methods_only():
    from backends.jax_pjit.worker import JaxPolicyWorker

    assert protocol_method_name(PolicyWorker.train) == "train"
    for not_protocol in (JaxPolicyWorker.get_compile_counts, JaxPolicyWorker.train, print, lambda: None):
        with pytest.raises(TypeError, match="is not a method of core.policy.worker_protocol.PolicyWorker"):
            protocol_method_name(not_protocol)


PROBE = """
from core.data import BatchedDataDict
from core.policy.worker_dispatch import WorkerCalls
from core.policy.worker_protocol import PolicyWorker


def calls(workers: WorkerCalls, data: BatchedDataDict) -> None:
    workers.all(PolicyWorker.save_hf_checkpoint, "/tmp/x", save_tokenizer=True)
    workers.sharded(PolicyWorker.get_logprobs, [data], micro_batch_size=2)
    workers.futures(PolicyWorker.init_collective, "10.0.0.1", 29500, 2)
    workers.all(PolicyWorker.save_hf_chekpoint, "/tmp/x")  # line 11: misspelt
    workers.all(PolicyWorker.save_hf_checkpoint, 3)  # line 12: an int for a path
    workers.sharded(PolicyWorker.get_logprobs, [data], micro_batch_sz=2)  # line 13: wrong keyword
"""


def test_mypy_catches_a_misspelt_or_mistyped_worker_call(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(PROBE))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=skip", "--cache-dir", str(tmp_path / "cache"),
         str(probe), "core/policy/worker_dispatch.py", "core/policy/worker_protocol.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["11", "12", "13"], out.stdout
    assert 'has no attribute "save_hf_chekpoint"' in errors[0]
    assert 'incompatible type "int"; expected "str"' in errors[1]
    assert 'Unexpected keyword argument "micro_batch_sz"' in errors[2]
