"""An S3-compatible server with faults: a real HTTP proxy on 127.0.0.1 in front of moto's server
(conftest.py's ``s3_endpoint``) that forwards every request, or, as a test switches it:

* ``ignore_conditions``: drops ``If-None-Match`` and ``If-Match`` before moto sees them, as a store
  that takes conditional writes without enforcing them does;
* ``hang``: holds each request unanswered until the proxy is closed, as a store that stopped
  answering does;
* ``refuse_writes``: answers every PUT and DELETE 403 AccessDenied (credentials that expired
  mid-run), and forwards the rest.

It records each request's method and path, and can pause a client's chosen request for a test
to act while it waits (``hold``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import s3fs

from expansion_dag_tests.ports import free_port

MODES = ("forward", "ignore_conditions", "hang", "refuse_writes")
#: Headers of one hop, which the proxy sets itself on each side.
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "expect"}
ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                 b"<Message>Access Denied (the proxy's fault)</Message></Error>")


class S3Proxy:
    """``with S3Proxy(upstream) as proxy``: ``proxy.url`` is the endpoint to give the client."""

    def __init__(self, upstream: str, mode: str = "forward"):
        self.upstream = upstream
        self.mode = mode
        self.requests: list[tuple[str, str]] = []
        self.held: Callable[[str, str], bool] | None = None  # a request to pause until ``release_held``
        self._release_held = threading.Event()
        self.holding = threading.Event()  # set while a held request waits
        self._closed = threading.Event()
        self._client = httpx.Client(base_url=upstream, timeout=30.0)
        port = free_port()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def switch(self, mode: str) -> None:
        assert mode in MODES, mode
        self.mode = mode

    def hold(self, which: Callable[[str, str], bool]) -> None:
        """Pause the first request ``which(method, path)`` picks, until ``release_held``."""
        self._release_held.clear()
        self.held = which

    def release_held(self) -> None:
        self._release_held.set()

    def __enter__(self) -> S3Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        self._release_held.set()
        self._server.shutdown()
        self._server.server_close()
        self._client.close()

    def answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes] | None:
        """What to answer, or None to answer nothing (the connection is then closed)."""
        self.requests.append((method, path))
        if self.held is not None and self.held(method, path):
            self.held = None
            self.holding.set()
            self._release_held.wait()
            self.holding.clear()
            if self._closed.is_set():
                return None  # its client is gone: the request never reaches moto
        if self.mode == "hang":
            self._closed.wait()
            return None
        if self.mode == "refuse_writes" and method in ("PUT", "DELETE"):
            return 403, [("Content-Type", "application/xml")], ACCESS_DENIED
        if self.mode == "ignore_conditions":
            headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
        answer = self._client.request(method, path, headers=headers, content=body)
        # A HEAD's Content-Length is the object's size: passed on as moto says it.
        dropped = HOP - {"content-length"} if method == "HEAD" else HOP | {"content-encoding"}
        kept = [(k, v) for k, v in answer.headers.multi_items() if k.lower() not in dropped]
        return answer.status_code, kept, answer.content


def _handler(proxy: S3Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, and "100 Continue" for botocore's uploads

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(chunks)

        def _any(self) -> None:
            body = self._body()
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            answer = proxy.answer(self.command, self.path, headers, body)
            if answer is None:
                self.close_connection = True
                return
            status, kept, content = answer
            self.send_response(status)
            for name, value in kept:
                self.send_header(name, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(content)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the test reads ``proxy.requests``

    return Handler


@pytest.fixture
def proxy(s3_endpoint, bucket, monkeypatch):
    """moto behind the fault proxy; the bucket is made on moto itself, and every client (children
    included) reaches it through the proxy."""
    with S3Proxy(s3_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        # s3fs keeps a filesystem per set of arguments, whatever the environment says since.
        s3fs.S3FileSystem.clear_instance_cache()
        yield proxy
    s3fs.S3FileSystem.clear_instance_cache()
