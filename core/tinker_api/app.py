"""The HTTP routes the tinker SDK calls (``/api/v1/...``), on FastAPI.

Every request first passes :class:`Guard` (the API key, the body size, the encoding: before
the body is read), then its route parses the body with the SDK's own request types and hands
it to :class:`~core.tinker_api.service.TinkerService`.  A refusal is a 4xx with
``{"detail": message}``; a route the server does not implement answers 404 naming the SDK
call that uses it (never a 5xx, which the SDK would retry for minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from core.reporting import get_logger
from core.tinker_api.config import ServeConfig
from core.tinker_api.datums import decode_forward_backward
from core.tinker_api.errors import RequestError, bad_request, not_found
from core.tinker_api.service import TinkerService
from core.tinker_api.wire import PROTOBUF

logger = get_logger(__name__)

#: The client config the server hands the SDK: API keys (no JWT exchange), plain httpx,
#: uncompressed and one-after-another forward_backward chunks, per-request sample futures,
#: custom losses computed in the client.  (The chunk sizes: :func:`client_config`.)
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "sample_no_retries": False,
}
#: Routes of the SDK dualrl serve does not implement -> the SDK calls that use them.
UNSUPPORTED_ROUTES = {
    "/api/v1/create_custom_loss": "server-side upload of ServiceClient.create_custom_loss (losses run in the client)",
    "/api/v1/join_sampling_session": "a pickled SamplingClient's join (off: sample_join_sampling_session)",
    "/api/v1/retrieve_futures": "the session futures poller (off: sample_use_retrieve_futures)",
    "/api/v1/cancel_future": "sampling cancellation (off: sample_cancel_enabled)",
    "/api/v1/save_weights_external": "TrainingClient.save_weights_external",
    "/api/v1/copy_weights": "ServiceClient.copy_weights / RestClient.copy_weights",
    "/api/v1/auth": "JWT credential exchange (this server takes API keys)",
    "/api/v1/weights_info": "RestClient.get_weights_info_by_tinker_path",
    "/api/v1/training_runs": "RestClient training-run and checkpoint listing / publishing / deletion",
    "/api/v1/checkpoints": "RestClient.list_user_checkpoints",
    "/api/v1/sessions": "RestClient session listing / search (finishing a session is supported)",
    "/api/v1/billing": "RestClient billing usage",
    "/api/v1/audit": "AdminClient audit log",
}


def client_config(serve: ServeConfig) -> dict[str, Any]:
    """:data:`CLIENT_CONFIG` with the server's request limits: the SDK cuts a larger
    forward_backward into requests of at most ``max_datums_per_request`` datums and (its own
    estimate of the protobuf) half of ``max_request_mb``, so that no chunk is refused."""
    return {
        **CLIENT_CONFIG,
        "fwdbwd_max_chunk_len": serve.max_datums_per_request,
        "fwdbwd_max_chunk_bytes_count": serve.max_request_bytes // 2,
    }


class _TooLarge(Exception):
    pass


class Guard:
    """ASGI middleware run before any route: the API key (``X-API-Key``, when the server has
    one), the body size (``Content-Length``, and the bytes actually read) and the encoding."""

    def __init__(self, app: Any, api_key: str | None, max_bytes: int):
        self.app, self.api_key, self.max_bytes = app, api_key, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        what = f"{scope['method']} {scope['path']}"
        refusal = self._refusal(headers, what)
        if refusal is not None:
            await _error(refusal)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await _error(RequestError(413, self._too_large(what)))(scope, receive, send)

    def _refusal(self, headers: dict[bytes, bytes], what: str) -> RequestError | None:
        if self.api_key is not None and not hmac.compare_digest(headers.get(b"x-api-key", b""), self.api_key.encode()):
            return RequestError(
                401, f"{what}: missing or wrong API key (X-API-Key; the SDK's api_key / TINKER_API_KEY)"
            )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return RequestError(413, self._too_large(what))
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").lower()
        if encoding not in ("identity", ""):
            return RequestError(415, f"{what}: Content-Encoding {encoding!r} is not supported (send the body as is)")
        return None

    def _too_large(self, what: str) -> str:
        return f"{what}: the body is larger than serve.max_request_mb ({self.max_bytes / 2**20:g} MiB)"


def _error(err: RequestError) -> JSONResponse:
    return JSONResponse({"detail": err.message}, status_code=err.status)


async def _parse(request: Request, cls: type[pydantic.BaseModel]) -> Any:
    """The JSON body as the SDK's request type ``cls`` (400 naming the field otherwise)."""
    what = f"{request.method} {request.url.path}"
    body = await request.body()
    try:
        raw = json.loads(body or b"{}")
    except ValueError as err:
        raise bad_request(f"{what}: the body is not JSON ({err})") from None
    try:
        return cls.model_validate(raw)
    except pydantic.ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors()[:5])
        raise bad_request(f"{what}: invalid {cls.__name__}: {problems}") from None


def build_app(service: TinkerService, api_key: str | None) -> FastAPI:
    """The app; with ``api_key`` every request must carry it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_expire_sessions(service))
        yield
        task.cancel()

    app = FastAPI(title="dualrl Tinker API", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(Guard, api_key=api_key, max_bytes=service.cfg.serve.max_request_bytes)

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        return _error(err)

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception) -> JSONResponse:
        # A 4xx, not a 5xx: the SDK retries a 5xx for minutes, and this request would fail again.
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error(bad_request(f"{request.method} {request.url.path}: dualrl serve failed: {err!r}"))

    _service_routes(app, service)
    _training_routes(app, service)
    _sampling_routes(app, service)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def unsupported(request: Request, path: str) -> JSONResponse:
        route = "/" + path
        uses = next((sdk for prefix, sdk in UNSUPPORTED_ROUTES.items() if route.startswith(prefix)), None)
        hint = f" (used by {uses})" if uses else ""
        raise not_found(f"{request.method} {route} is not supported by dualrl serve{hint}; see docs/tinker.md")

    return app


def _service_routes(app: FastAPI, service: TinkerService) -> None:
    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        base, limit = service.base, service.cfg.policy.max_total_sequence_length
        model = {"model_name": base.path, "max_context_length": limit, "trainable": True, "sampleable": True}
        return {"supported_models": [model]}

    @app.post("/api/v1/client/config")
    async def config(request: Request) -> dict[str, Any]:
        await _parse(request, types.ClientConfigRequest)
        return client_config(service.cfg.serve)

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict[str, Any]:
        await _parse(request, types.ClientConfigRequest)
        return {"sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}  # the SDK's own usage events: not kept

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        return service.create_session(await _parse(request, types.CreateSessionRequest))

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        return service.heartbeat((await _parse(request, types.SessionHeartbeatRequest)).session_id)

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(request: Request, session_id: str) -> dict[str, Any]:
        body = json.loads(await request.body() or b"{}")
        reason = (body.get("reason") or {}).get("type", "finished") if isinstance(body, dict) else "finished"
        service.finish_session(session_id, f"finished: {reason}")
        return {}


def _training_routes(app: FastAPI, service: TinkerService) -> None:
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        return service.create_model(await _parse(request, types.CreateModelRequest))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return service.get_info(await _parse(request, types.GetInfoRequest))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        kind = request.headers.get("content-type", "")
        if PROTOBUF not in kind:
            raise RequestError(415, f"forward_backward: Content-Type {kind!r}; the SDK sends {PROTOBUF}")
        body = await request.body()
        decoded = await asyncio.to_thread(decode_forward_backward, body, service.datum_limits)
        return service.forward_backward(decoded)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return service.optim_step(await _parse(request, types.OptimStepRequest))

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return service.save_weights(await _parse(request, types.SaveWeightsRequest))

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        return service.load_weights(await _parse(request, types.LoadWeightsRequest))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        return service.save_weights_for_sampler(await _parse(request, types.SaveWeightsForSamplerRequest))

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req = await _parse(request, types.FutureRetrieveRequest)
        if not service.futures.known(req.request_id):
            raise not_found(f"retrieve_future: unknown request_id {req.request_id!r}")
        future = await service.futures.wait(req.request_id, service.cfg.serve.poll_s)
        if future.error is not None:
            return JSONResponse(future.error)
        if future.payload is None:
            return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"})
        if future.payload.proto is not None:
            return Response(future.payload.proto, media_type=PROTOBUF)
        return JSONResponse(future.payload.json)


def _sampling_routes(app: FastAPI, service: TinkerService) -> None:
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        return service.create_sampling_session(await _parse(request, types.CreateSamplingSessionRequest))

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        return service.get_sampler(sampler_id)

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        return service.sample(await _parse(request, types.SampleRequest))


async def _expire_sessions(service: TinkerService) -> None:
    """Close the sessions whose client stopped sending heartbeats (every 10 s)."""
    while True:
        await asyncio.sleep(10)
        try:
            service.expire_sessions()
        except Exception:  # noqa: BLE001 -- the monitor must outlive one bad pass
            logger.exception("expiring sessions failed")
