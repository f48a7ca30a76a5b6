"""``core.refit`` without Ray or vLLM: the shm and gloo transports, the engine-side receiver
rules and the policy-side sender mixin.

Every test checks exact values (bit-exact tensors, the tensor named in each error), so a
broken rule fails instead of passing silently.
"""

from __future__ import annotations

import errno
import os
import socket
import threading

import ml_dtypes  # noqa: F401 -- registers the "bfloat16" name with numpy (the JAX-like sender)
import numpy as np
import pytest
import torch

import core.refit.shm as shm_module
from core.refit import collective
from core.refit.buckets import GB
from core.refit.manifest import (
    RefitError,
    RefitManifest,
    manifest_for_hf_config,
)
from core.refit.packing import plan_layout
from core.refit.receiver import RefitReceiver
from core.refit.sender import RefitSender
from core.refit.shm import ShmBucketWriter, open_bucket
from core.testing.tiny_models import tiny_config
from tests.unit.refit_values import assert_bit_equal, policy_config, special_values, vllm_generation

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
        ("d", special_values((6, 4), torch.float32, 3).t()),  # not contiguous
    ]
    handle = writer.write(items)
    assert handle["kind"] == "shm"
    assert os.path.exists(handle["path"])
    assert os.path.getsize(handle["path"]) == handle["nbytes"] == plan_layout(items)[1]
    assert [s[0] for s in handle["slots"]] == ["a", "b", "c", "d"]
    opened = open_bucket(handle)
    assert [n for n, _ in opened] == ["a", "b", "c", "d"]
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


def test_shm_full_directory_is_a_refit_error_and_leaves_no_segment(writer, monkeypatch):
    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm_module.os, "pwrite", no_space)
    with pytest.raises(RefitError, match=r"refit bucket of \d+ bytes does not fit .*policy.refit_buffer_size_gb"):
        writer.write([("a", torch.ones(4))])
    monkeypatch.undo()
    prefix = f"dualrl-refit-test-{os.getpid()}-"
    assert [n for n in os.listdir(shm_module._shm_dir()) if n.startswith(prefix)] == []


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
        self.cfg = policy_config("float32", vllm_generation(precision="bfloat16"))  # the worker's typed policy section
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
