"""Refusals: a request the server will not run gets an HTTP status and a message that names
the request and the field at fault, before any work (the model, its optimizer state and other
sessions are untouched).

Every refusal is a 4xx the tinker SDK does not retry: it retries 408, 409, 429 and every 5xx
for minutes (``InternalClientHolder.execute_with_retries``), which for a request that can
never succeed would look like a hang.
"""

from __future__ import annotations


class RequestError(Exception):
    """A refused request: ``status`` (400, 401, 404, 410, 413 or 415) and the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message: str) -> RequestError:
    return RequestError(400, message)


def not_found(message: str) -> RequestError:
    return RequestError(404, message)


def gone(message: str) -> RequestError:
    return RequestError(410, message)
