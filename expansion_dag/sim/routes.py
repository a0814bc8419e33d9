"""Which paths a simulated server answers, for its backend and version, and the API-key check in
front of them.

Apart from the server's lifecycle so that the path table, read from the real servers'
``http_server`` modules, stands in one place.
"""

from __future__ import annotations

from packaging.version import Version

from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.dialects import Dialect
from expansion_dag.sim.endpoints import Endpoints
from expansion_dag.sim.http import Handler, HttpConnection, HttpRequest
from expansion_dag.sim.intake import ChatIntake

_NOT_FOUND = b'{"detail":"Not Found"}'
_METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_UNAUTHORIZED = b'{"error":"Unauthorized"}'
#: SGLang paths that appeared or went away between versions, read from the 0.5.4 to 0.5.23 wheels'
#: entrypoints/http_server.py: (path, first version serving it, first version without it).
_SGLANG_ROUTE_VERSIONS = (
    ("/server_info", "0.5.6", None),
    ("/model_info", "0.5.6", None),
    ("/v1/loads", "0.5.8", None),
    ("/get_load", None, "0.5.21"),
    ("/ready", "0.5.21", None),  # absent in 0.5.8, present in 0.5.21; versions between were not read
)


class Router:
    """Sends each request to its handler, or answers 401 (no key where one is needed), 404 or 405."""

    def __init__(
        self,
        config: SimServerConfig,
        dialect: Dialect,
        *,
        health: Handler,
        sim_stats: Handler,
        intake: ChatIntake,
        endpoints: Endpoints,
    ) -> None:
        self._dialect = dialect
        self._bearer = None if config.api_key is None else f"Bearer {config.api_key}".encode()
        self._routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": health},
            "/health_generate": {"GET": health},
            "/v1/models": {"GET": endpoints.models},
            "/v1/chat/completions": {"POST": intake.chat_completions},
            "/sim/stats": {"GET": sim_stats},
        }
        if config.backend == "vllm":
            self._routes["/tokenize"] = {"POST": intake.tokenize}
            self._routes["/version"] = {"GET": endpoints.vllm_version}
            return
        self._routes |= {
            "/ready": {"GET": health},
            "/server_info": {"GET": endpoints.server_info},
            "/get_server_info": {"GET": endpoints.server_info},
            "/model_info": {"GET": endpoints.model_info},
            "/get_model_info": {"GET": endpoints.model_info},
            "/v1/loads": {"GET": endpoints.loads},
            "/get_load": {"GET": endpoints.get_load},
        }
        version = Version(config.server_version)
        for path, since, until in _SGLANG_ROUTE_VERSIONS:
            if (since and version < Version(since)) or (until and version >= Version(until)):
                del self._routes[path]

    def dispatch(self, request: HttpRequest, conn: HttpConnection) -> None:
        path = request.path
        if (
            self._bearer is not None
            and self._dialect.requires_key(path)
            and request.headers.get(b"authorization") != self._bearer
        ):
            conn.respond(401, _UNAUTHORIZED)
            return
        methods = self._routes.get(path)
        if methods is None:
            conn.respond(404, _NOT_FOUND)
            return
        handler = methods.get(request.method)
        if handler is None:
            conn.respond(405, _METHOD_NOT_ALLOWED)
            return
        handler(request, conn)
