"""Refit shared-memory segments do not outlive their writer: failure, exit, hard kill.

Every test works in a temporary directory, never in the real /dev/shm, where other runs'
live segments are.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.refit import shm
from core.refit.shm import ShmBucketWriter, segment_name, sweep_stale_segments

REPO = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    """A pid that existed a moment ago and has been reaped (reuse within the test: ~never)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def live_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def _touch(directory, name: str, age_s: float = 0.0) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    if age_s:
        past = time.time() - age_s
        os.utime(path, (past, past))
    return path


def test_sweep_removes_only_segments_of_dead_pids(tmp_path, live_child):
    dead = _touch(tmp_path, segment_name(pid=_dead_pid()))
    legacy_dead = _touch(tmp_path, f"dualrl-refit-{_dead_pid()}-0123456789ab")  # pre-namespace name
    live = _touch(tmp_path, segment_name(pid=live_child.pid))
    mine = _touch(tmp_path, segment_name())
    other_namespace = _touch(tmp_path, segment_name(pid=_dead_pid(), namespace=shm._pid_namespace() + 1))
    unrelated = _touch(tmp_path, f"dualrl-refit-test-{_dead_pid()}-0123456789ab")

    removed = sweep_stale_segments(str(tmp_path))

    assert sorted(removed) == sorted([dead, legacy_dead])
    for kept in (live, mine, other_namespace, unrelated):
        assert os.path.exists(kept), kept


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="pid reuse is detected through /proc start times")
def test_a_reused_pid_does_not_keep_an_old_segment_alive(tmp_path, live_child):
    # Written an hour before the live process started: its pid was reused, the writer is gone.
    old = _touch(tmp_path, segment_name(pid=live_child.pid), age_s=3600)
    fresh = _touch(tmp_path, segment_name(pid=live_child.pid))
    assert sweep_stale_segments(str(tmp_path)) == [old]
    assert os.path.exists(fresh)


def test_creating_a_writer_sweeps(tmp_path):
    stale = _touch(tmp_path, segment_name(pid=_dead_pid()))
    ShmBucketWriter(directory=str(tmp_path))
    assert not os.path.exists(stale)


class _Unpackable(torch.Tensor):
    """Plans like a tensor, fails when packed (a gather that died mid-bucket)."""

    def detach(self):
        raise RuntimeError("boom while packing")


def test_writer_releases_its_segment_when_packing_raises(tmp_path):
    writer = ShmBucketWriter(directory=str(tmp_path))
    bad = torch.ones(8).as_subclass(_Unpackable)
    with pytest.raises(RuntimeError, match="boom while packing"):
        writer.write([("w", bad)])
    assert os.listdir(tmp_path) == []
    assert not shm._LIVE_SEGMENTS
    handle = writer.write([("w", torch.ones(8))])  # still usable afterwards
    assert os.listdir(tmp_path) == [os.path.basename(handle["path"])]
    writer.release()
    assert os.listdir(tmp_path) == []


def test_a_process_that_exits_without_releasing_leaves_no_segment(tmp_path):
    code = (
        "import sys, torch; from core.refit.shm import ShmBucketWriter; "
        "w = ShmBucketWriter(directory=sys.argv[1]); w.write([('w', torch.ones(4))]); "
        "import os; assert len(os.listdir(sys.argv[1])) == 1; sys.exit(3)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert os.listdir(tmp_path) == []


def test_a_killed_writer_is_cleaned_up_by_the_next_writer(tmp_path):
    code = (
        "import sys, os, signal, torch; from core.refit.shm import ShmBucketWriter; "
        "w = ShmBucketWriter(directory=sys.argv[1]); w.write([('w', torch.ones(4))]); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -9, done.stderr
    assert len(os.listdir(tmp_path)) == 1  # SIGKILL: no atexit, the segment is left behind
    ShmBucketWriter(directory=str(tmp_path))
    assert os.listdir(tmp_path) == []
