"""How a benchmark runs a measurement in a child process of its own, and reads its results.

A child has its own threads and memory (a GPU child frees its device memory when it exits),
so a baseline (HF eager, TRL) or a peak-memory probe cannot disturb, or be disturbed by, the
driver and its Ray workers.  The protocol:

* the driver starts ``python -m benchmarks.lib.child MODULE:FUNCTION`` and writes the spec (a
  JSON object) as the first line of the child's stdin; the child calls ``FUNCTION(spec)``;
* the child answers with lines ``@@{json}`` on stdout (:func:`reply`); anything else it prints
  (library chatter) is ignored, and its stderr is kept for the error message if it dies;
* a long-lived child (:class:`Child`) reads one command per further stdin line and answers
  each; a one-shot child (:func:`run_child`) answers and exits.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

#: The lines a child answers with start with this.
REPLY = "@@"
#: The directory holding the ``benchmarks`` package: the child imports the driver's code.
ROOT = Path(__file__).resolve().parents[2]


def reply(payload: dict) -> None:
    """Child side: answer the driver."""
    print(REPLY + json.dumps(payload), flush=True)


def child_env(threads: int | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``threads`` OpenMP threads (None: inherited), quiet tokenizers,
    the driver's ``benchmarks`` first on the path, then ``env`` (a key set to None: removed)."""
    out = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        out["OMP_NUM_THREADS"] = str(threads)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


class Child:
    """A long-lived child: ``call(command)`` sends one line and returns the child's reply."""

    def __init__(self, target: str, spec: dict, threads: int | None, env: dict | None = None, what: str = "") -> None:
        self.what = what or target
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.lib.child", target],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=child_env(threads, env),
        )
        self.pid = self._proc.pid
        self._send(json.dumps(spec))

    def _send(self, line: str) -> None:
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()

    def reply(self) -> dict:
        """The child's next answer; raises with its stderr tail when it died instead."""
        for line in self._proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
        self._stderr.seek(0)
        raise RuntimeError(f"{self.what} child exited (rc {self._proc.wait()}):\n{self._stderr.read()[-8000:]}")

    def call(self, command: str) -> dict:
        self._send(command)
        return self.reply()

    def close(self) -> None:
        """``quit``, then wait for the child (a child that died already is just reaped)."""
        if self._proc.poll() is None:
            try:
                self._send("quit")
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
            self._proc.wait(timeout=60)
        self._stderr.close()


def run_child(
    target: str,
    spec: dict,
    threads: int | None,
    on_reply: Callable[[dict], None] = lambda r: None,
    env: dict | None = None,
) -> list[dict]:
    """A one-shot child: its replies in order (each also passed to ``on_reply`` as it arrives);
    raises with the child's stderr tail when it fails."""
    replies = []
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.lib.child", target],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=child_env(threads, env),
        )
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.close()
        for line in proc.stdout:
            if line.startswith(REPLY):
                replies.append(json.loads(line[len(REPLY) :]))
                on_reply(replies[-1])
        if proc.wait() != 0:
            err.seek(0)
            raise RuntimeError(
                f"{target} child exited with rc {proc.returncode} after {len(replies)} replies:\n{err.read()[-3000:]}"
            )
    return replies


def main(argv: list[str] | None = None) -> int:
    """Child side: ``MODULE:FUNCTION``; the spec is the first line of stdin."""
    module, _, function = (argv if argv is not None else sys.argv[1:])[0].partition(":")
    spec = json.loads(sys.stdin.readline())
    getattr(importlib.import_module(module), function)(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
