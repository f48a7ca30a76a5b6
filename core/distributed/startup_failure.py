"""Why an actor died in its constructor, read off the error Ray raises for it.

Ray reports a constructor that raised as "the actor died because of an error raised in its
creation task", with the cause somewhere in a remote traceback.  :func:`startup_failure`
turns that into a :class:`StartupFailure`: the exception's type and message, the project
line that raised it, the first exception of its chain and where the actor ran, which
:class:`~core.distributed.errors.WorkerStartupError` puts on its first line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ray.exceptions import RayActorError, RayError, RayTaskError

__all__ = ["StartupFailure", "startup_failure", "plain_indent"]

#: The project's root directory (frames under it, outside a venv, are "project code").
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_CHAIN_MARKERS = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
_THIRD_PARTY = ("site-packages", "dist-packages", ".venv", "venv")
_HEADER_ONLY = re.compile(r"^\d+ validation errors? for \S+$")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class StartupFailure:
    """Why an actor died in its constructor, from Ray's creation-task error.

    ``exc_type`` / ``message``: the exception the constructor raised (message in full);
    ``location``: ``"path:line in function"`` of the innermost frame of project code that
    raised it ("" if the traceback has none); ``caused_by``: the first exception of its
    chain (``raise ... from err``), "" if it has none; ``traceback``: the remote traceback.
    """

    exc_type: str
    message: str
    location: str = ""
    caused_by: str = ""
    actor: str = ""
    ip: str = ""
    pid: int = 0
    traceback: str = ""

    @property
    def first_line(self) -> str:
        """The message's first line; when that is only a header ("...:", pydantic's "1
        validation error for ModelConfig"), the first line of its body joined to it."""
        lines = [line.strip() for line in self.message.strip().splitlines() if line.strip()]
        if not lines:
            return ""
        if len(lines) > 1 and (lines[0].endswith(":") or _HEADER_ONLY.match(lines[0])):
            return f"{lines[0].rstrip(':')}: {lines[1]}"
        return lines[0]

    def summary(self) -> str:
        """``"ValueError: <first line> (at path:line in f)"``: one line."""
        text = f"{self.exc_type}: {self.first_line}" if self.first_line else self.exc_type
        return f"{text} (at {self.location})" if self.location else text

    def describe(self) -> str:
        """The summary, the chain's original exception and the remote traceback."""
        actor = f" ({self.actor})" if self.actor else ""
        out = f"died in its constructor{actor} with {self.summary()}"
        if self.caused_by:
            out += f"\n    caused by {self.caused_by}"
        if self.traceback:
            out += f"\n    remote traceback:\n{plain_indent(self.traceback, 6)}"
        return out


def startup_failure(err: BaseException) -> StartupFailure | None:
    """The :class:`StartupFailure` in ``err`` if it says an actor died because its constructor
    raised (Ray's ``ActorDiedError`` wrapping the creation task's ``RayTaskError``), else None.

    Works on what ``ray.get`` raises for any call on such an actor, and on a
    :class:`WorkerGroupError` / ``RuntimeError`` chained (``from``) to one.
    """
    seen = 0
    current: BaseException | None = err
    while current is not None and seen < 8:
        task_err = _creation_task_error(current)
        if task_err is not None:
            return _parse_task_error(task_err)
        current = current.__cause__
        seen += 1
    return None


def _creation_task_error(err: BaseException) -> RayTaskError | None:
    if not isinstance(err, RayActorError) or not getattr(err, "actor_init_failed", False):
        return None
    for arg in getattr(err, "args", ()):
        if isinstance(arg, RayTaskError):
            return arg
    return None


def _parse_task_error(task_err: RayTaskError) -> StartupFailure:
    tb = _ANSI_ESCAPE.sub("", getattr(task_err, "traceback_str", "") or "")
    blocks = _split_chain(tb)
    cause = getattr(task_err, "cause", None)
    if cause is not None and not isinstance(cause, RayError):
        exc_type, message = type(cause).__name__, str(cause)
    else:  # the exception could not travel (unpicklable): read it off the traceback
        exc_type, _, message = _exception_text(blocks[-1] if blocks else "").partition(": ")
        # "pydantic_core._pydantic_core.ValidationError" -> "ValidationError", like type().__name__
        exc_type = exc_type.rpartition(".")[2] or type(task_err).__name__
    caused_by = _exception_line(blocks[0]) if len(blocks) > 1 else ""
    if caused_by and caused_by.partition(": ")[2] in message:
        caused_by = ""  # the message already says it
    # "ray::lm_policy-0:SomePolicyWorker.__init__()" -> "SomePolicyWorker.__init__"
    actor = _ANSI_ESCAPE.sub("", str(getattr(task_err, "proctitle", "") or ""))
    actor = actor.rpartition(":")[2].removesuffix("()") if "__init__" in actor else ""
    return StartupFailure(
        exc_type=exc_type,
        message=message,
        location=_project_location(blocks[-1] if blocks else ""),
        caused_by=caused_by,
        actor=actor,
        ip=str(getattr(task_err, "ip", "") or ""),
        pid=int(getattr(task_err, "pid", 0) or 0),
        traceback=tb.strip(),
    )


def _split_chain(tb: str) -> list[str]:
    """A formatted traceback split at the chain markers: the first block is the original
    exception, the last the one that was finally raised."""
    blocks = [tb]
    for marker in _CHAIN_MARKERS:
        blocks = [part for block in blocks for part in block.split(marker)]
    return [b for b in blocks if b.strip()]


def _exception_text(block: str) -> str:
    """The ``Type: message`` text at the end of one traceback block: from the first line
    after the header that is not indented (frames, source lines and carets are) to the end."""
    lines = block.strip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("Traceback (most recent call last)", "ray::")) or not line.strip():
            continue
        if not line[0].isspace():
            return "\n".join(lines[i:]).strip()
    return ""


def _exception_line(block: str) -> str:
    """The first line of :func:`_exception_text`."""
    text = _exception_text(block)
    return text.splitlines()[0].strip() if text else ""


def _project_location(block: str) -> str:
    """``"path:line in func"`` of the innermost frame under the project root (not in a
    venv); failing that, of the innermost frame outside third-party code and Ray."""
    frames = [m.groupdict() for line in block.splitlines() if (m := _FRAME.match(line))]

    def third_party(path: str) -> bool:
        parts = path.replace("\\", "/").split("/")
        return any(p in _THIRD_PARTY for p in parts) or path.startswith(("python/ray", "<"))

    root = _PROJECT_ROOT + os.sep
    mine = [f for f in frames if f["file"].startswith(root) and not third_party(f["file"][len(root) :])]
    if not mine:
        mine = [f for f in frames if not third_party(f["file"]) and "/lib/python" not in f["file"]]
    if not mine:
        return ""
    f = mine[-1]
    path = f["file"][len(root) :] if f["file"].startswith(root) else f["file"]
    return f"{path}:{f['line']} in {f['func'].strip()}"


def plain_indent(text: str, n: int) -> str:
    """``text`` indented by ``n`` spaces, without the colour codes Ray puts in tracebacks
    (they end up in log files and CI output, where they are noise)."""
    pad = " " * n
    return "\n".join(pad + line for line in _ANSI_ESCAPE.sub("", text).splitlines())
