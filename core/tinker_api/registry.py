"""Sessions, models and samplers the server knows, and the one policy slot.

Bookkeeping only (no policy calls): the request handlers read and change it under ``lock``
on the event loop, the runner thread's jobs under the same lock.  Lookups refuse unknown
ids (404) and closed sessions (410) with a message naming the id.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from core.tinker_api.errors import gone, not_found
from core.tinker_api.model import ModelSpec, ServedModel


@dataclass
class Session:
    session_id: str
    last_seen: float = field(default_factory=time.monotonic)
    closed: str | None = None
    """Why the session ended (its finish reason, or the heartbeat timeout); None while open."""
    labels: dict[str, Any] = field(default_factory=dict)
    """What the client named the session with (tags, user metadata, project, display name)."""


@dataclass
class ModelRecord:
    model_id: str
    session_id: str
    spec: ModelSpec
    served: ServedModel | None = None
    """Set by the job that builds the policy."""
    user_metadata: dict[str, Any] = field(default_factory=dict)
    """The client's metadata of the training run (written with its saved states)."""
    queued_datums: int = 0
    """forward_backward datums sent since the last optim_step was sent."""
    released: bool = False


@dataclass
class SamplerRecord:
    sampler_id: str
    session_id: str
    model_id: str | None
    """None: the base model (sampled from a model that has not stepped yet)."""
    step: int
    """The weights it samples: the model after this many optimizer steps."""
    model_path: str | None = None


@dataclass
class Registry:
    lock: threading.RLock = field(default_factory=threading.RLock)
    sessions: dict[str, Session] = field(default_factory=dict)
    models: dict[str, ModelRecord] = field(default_factory=dict)
    samplers: dict[str, SamplerRecord] = field(default_factory=dict)
    sampler_paths: dict[str, SamplerRecord] = field(default_factory=dict)
    live: str | None = None
    """The model holding the policy slot (one model at a time)."""

    def session(self, session_id: str, what: str) -> Session:
        """An open session (404 unknown, 410 closed)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise not_found(f"{what}: unknown session {session_id!r}")
        if session.closed is not None:
            raise gone(f"{what}: session {session_id!r} is closed ({session.closed}); create a new ServiceClient")
        return session

    def model(self, model_id: str, what: str) -> ModelRecord:
        """A model of an open session that still holds its policy (404 unknown, 410 released)."""
        record = self.models.get(model_id)
        if record is None:
            raise not_found(f"{what}: unknown model_id {model_id!r}")
        self.session(record.session_id, what)
        if record.released:
            raise gone(f"{what}: model {model_id!r} was released")
        return record

    def sampler(self, sampler_id: str, what: str) -> SamplerRecord:
        record = self.samplers.get(sampler_id)
        if record is None:
            raise not_found(f"{what}: unknown sampling_session_id {sampler_id!r}")
        self.session(record.session_id, what)
        return record

    def close(self, session_id: str, reason: str) -> list[ModelRecord]:
        """Mark the session closed; its models leave the slot (returned, for release)."""
        session = self.sessions[session_id]
        if session.closed is None:
            session.closed = reason
        released = [r for r in self.models.values() if r.session_id == session_id and not r.released]
        for record in released:
            record.released = True
            if self.live == record.model_id:
                self.live = None
        return released

    def expired(self, timeout_s: float) -> list[str]:
        """Open sessions without a heartbeat for ``timeout_s``."""
        now = time.monotonic()
        return [s.session_id for s in self.sessions.values() if s.closed is None and now - s.last_seen > timeout_s]
