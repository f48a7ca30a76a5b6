"""Futures and the one thread that runs the policy's work, in the order requests arrived.

Every Tinker call that computes (create a model, forward, forward_backward, optim_step,
save, load, sample) answers at once with a request id and runs as a job on one runner
thread: the policy is used by one caller at a time, in the order the SDK sent its requests
(its ``seq_id`` order: the SDK sends a training client's requests one after another).
``retrieve_future`` waits for the job's result (up to ``serve.poll_s``, then "try again").

Sample jobs that follow one another in the queue run as one batch (one ``generate`` call).
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.reporting import get_logger
from core.tinker_api.errors import RequestError

logger = get_logger(__name__)

#: How long a finished future's result is kept for retrieval.
RESULT_TTL_S = 30 * 60


@dataclass(frozen=True)
class Payload:
    """A job's result: a JSON body, or protobuf bytes (``ForwardBackwardOutput``, ``SampleResponse``)."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None


@dataclass
class _Future:
    created: float
    loop: asyncio.AbstractEventLoop | None
    done: asyncio.Event | None
    payload: Payload | None = None
    error: dict[str, str] | None = None
    finished_at: float | None = None


class FutureStore:
    """Request id -> the job's outcome; ``wait`` is awaited on the server's event loop, the
    outcome is set from the runner thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, _Future] = {}

    def new(self) -> str:
        request_id = uuid.uuid4().hex
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._evict()
            self._futures[request_id] = _Future(time.monotonic(), loop, asyncio.Event() if loop else None)
        return request_id

    def finish(self, request_id: str, payload: Payload | None = None, error: dict[str, str] | None = None) -> None:
        with self._lock:
            future = self._futures.get(request_id)
            if future is None:
                return
            future.payload, future.error, future.finished_at = payload, error, time.monotonic()
        if future.loop is not None and future.done is not None:
            try:
                future.loop.call_soon_threadsafe(future.done.set)
            except RuntimeError:  # the server's loop has closed (shutting down)
                pass

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._futures

    async def wait(self, request_id: str, timeout: float) -> _Future:
        """The future once finished, or as it is after ``timeout`` seconds (KeyError: unknown id)."""
        with self._lock:
            future = self._futures[request_id]
        if future.finished_at is None and future.done is not None:
            try:
                await asyncio.wait_for(future.done.wait(), timeout)
            except TimeoutError:
                pass
        return future

    def _evict(self) -> None:
        now = time.monotonic()
        old = [k for k, f in self._futures.items() if f.finished_at is not None and now - f.finished_at > RESULT_TTL_S]
        for key in old:
            del self._futures[key]


@dataclass
class Job:
    """Work for the runner thread: ``run()`` gives the result of future ``request_id``.

    A job with a ``batch_key`` runs together with the jobs right behind it in the queue that
    have the same key: ``run_batch`` gets all of them and returns one result per job (an
    exception: that job's error)."""

    request_id: str
    run: Callable[[], Payload] | None = None
    batch_key: Any = None
    run_batch: Callable[[Sequence[Job]], Sequence[Payload | Exception]] | None = None
    args: Any = None
    what: str = ""


@dataclass
class JobRunner:
    """One thread running jobs in submission order; a job's exception fails its future (a
    :class:`RequestError` as the user's error, anything else as the server's)."""

    futures: FutureStore
    _queue: deque[Job] = field(default_factory=deque)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _stopped: bool = False
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tinker-api-jobs", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the queued jobs, then end the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _next(self) -> list[Job] | None:
        with self._cond:
            while not self._queue and not self._stopped:
                self._cond.wait()
            if not self._queue:
                return None
            batch = [self._queue.popleft()]
            key = batch[0].batch_key
            while key is not None and self._queue and self._queue[0].batch_key == key:
                batch.append(self._queue.popleft())
            return batch

    def _loop(self) -> None:
        while (batch := self._next()) is not None:
            try:
                if batch[0].run_batch is not None:
                    outcomes = list(batch[0].run_batch(batch))
                elif batch[0].run is not None:
                    outcomes = [batch[0].run()]
                else:
                    raise RuntimeError(f"job {batch[0].what!r} has nothing to run")
            except Exception as err:  # noqa: BLE001 -- every failure becomes the futures' error
                outcomes = [err] * len(batch)
            for job, outcome in zip(batch, outcomes, strict=True):
                self._settle(job, outcome)

    def _settle(self, job: Job, outcome: Payload | Exception) -> None:
        if isinstance(outcome, Payload):
            self.futures.finish(job.request_id, payload=outcome)
        elif isinstance(outcome, (RequestError, ValueError)):  # bad input: the client's to fix
            message = outcome.message if isinstance(outcome, RequestError) else str(outcome)
            self.futures.finish(job.request_id, error={"error": f"{job.what}: {message}", "category": "user"})
        else:
            detail = "".join(traceback.format_exception_only(type(outcome), outcome)).strip()
            logger.error("%s failed:\n%s", job.what, "".join(traceback.format_exception(outcome)))
            self.futures.finish(job.request_id, error={"error": f"{job.what} failed: {detail}", "category": "server"})
