"""``dualrl serve``: the Tinker API over HTTP, training with the configured backend.

    dualrl serve [--config FILE] [--backend NAME] [key.path=value ...]

Loads and checks the config (exit 2 naming the field), builds or finds the base model,
starts Ray and the training cluster, then serves on ``serve.host:serve.port`` until
interrupted.  A host other than the loopback needs the API key in ``$serve.api_key_env``.
:class:`ServerThread` runs the same server in a thread of the calling process (tests).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from typing import Any

from core.config import ConfigError
from core.policy.registry import backend_names
from core.tinker_api.config import API_KEY_PREFIX, SERVE_DEFAULT_CONFIG_PATH, ServeRunConfig, load_serve_config


def api_key_of(cfg: ServeRunConfig) -> str | None:
    """The key every request must carry: ``$serve.api_key_env``; required off the loopback."""
    key = os.environ.get(cfg.serve.api_key_env) or None
    if key is None and not cfg.serve.is_loopback:
        raise ConfigError(
            f"serve.host: {cfg.serve.host!r} is reachable from other machines: set an API key in "
            f"${cfg.serve.api_key_env} (clients pass it as the SDK's api_key / TINKER_API_KEY)"
        )
    if key is not None and not key.startswith(API_KEY_PREFIX):
        raise ConfigError(
            f"serve.api_key_env: ${cfg.serve.api_key_env} must start with {API_KEY_PREFIX!r} "
            "(the tinker SDK refuses other keys before sending them)"
        )
    return key


def build_server(cfg: ServeRunConfig) -> tuple[Any, Any]:
    """``(service, app)``: the base model loaded, Ray and the cluster up, no model yet."""
    from core.tinker_api.app import build_app
    from core.tinker_api.runtime import PolicyRuntime
    from core.tinker_api.service import TinkerService

    key = api_key_of(cfg)  # before anything starts
    service = TinkerService(cfg, PolicyRuntime(cfg))
    return service, build_app(service, key)


class ServerThread:
    """The server on a free port of 127.0.0.1 (``cfg.serve.port`` 0) in a daemon thread;
    ``close()`` stops it and releases the models and the cluster."""

    def __init__(self, cfg: ServeRunConfig, timeout_s: float = 600.0):
        import uvicorn

        self.service, app = build_server(cfg)
        sock = _bind(cfg.serve.host, cfg.serve.port)
        self.port = sock.getsockname()[1]
        self.base_url = f"http://{cfg.serve.host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("dualrl serve: the HTTP server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.service.shutdown()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve the Tinker API (the tinker SDK's ServiceClient / TrainingClient / SamplingClient) "
        "with a dualrl backend; docs/tinker.md",
    )
    parser.add_argument("--config", help=f"YAML file (default: {SERVE_DEFAULT_CONFIG_PATH})")
    parser.add_argument("--backend", choices=backend_names(), help="training backend; sets policy.backend")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. serve.port=8001")
    return parser


def main(argv: list[str] | None = None, prog: str = "dualrl serve") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        cfg = load_serve_config(args.config, list(args.overrides), args.backend)
        api_key_of(cfg)
    except (ConfigError, FileNotFoundError) as err:
        print(f"{prog}: invalid config {args.config or SERVE_DEFAULT_CONFIG_PATH}:\n{err}", file=sys.stderr)
        return 2
    import uvicorn

    from core.reporting import show_logs_above_progress

    show_logs_above_progress()  # the base model's build (a warm start), the policies' starts
    service, app = build_server(cfg)
    sock = _bind(cfg.serve.host, cfg.serve.port)
    host, port = sock.getsockname()[:2]
    print(f"{prog}: {cfg.policy.backend} training {service.base.name} ({service.base.path})")
    print(f"{prog}: Tinker API at http://{host}:{port} (TINKER_BASE_URL); Ctrl-C stops it")
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="info", lifespan="on")).run(sockets=[sock])
    finally:
        service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
