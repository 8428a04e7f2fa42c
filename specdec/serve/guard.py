"""What a request must pass before any route runs: a key, a loopback Host, a JSON body of bounded size.

An ASGI middleware, so it answers before FastAPI reads the body: a 2 MiB upload is refused from its
Content-Length (413) without being read, a body sent without one is cut off at the limit.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any, Callable

from specdec.serve.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/"})  # a load balancer's probe; the page, which asks for the key itself
OPEN_PREFIXES = ("/static/",)  # the page's script and style
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """Return whether `host` (an address or name a server binds) is a loopback one."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def key_matches(authorization: str | None, keys: tuple[str, ...]) -> bool:
    """Return whether an Authorization header carries one of `keys` as a Bearer token (constant time per key)."""
    if not authorization or not authorization.startswith("Bearer "):
        return False
    token = authorization[len("Bearer "):].strip().encode()
    # Compare against every key, whatever matched: the time does not tell which prefix was right.
    return sum(hmac.compare_digest(token, key.encode()) for key in keys) > 0


def host_name(host_header: str) -> str:
    """Return the host part of a Host header ("[::1]:8000" -> "::1", "localhost:80" -> "localhost")."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class RequestGuard:
    """ASGI middleware: keys on every route but /health (and /metrics when public), Host on loopback,
    `Content-Type: application/json` and at most `max_body_bytes` on every POST."""

    def __init__(self, app: Callable, keys: tuple[str, ...], public_metrics: bool, check_host: bool,
                 max_body_bytes: int):
        self.app, self.keys, self.check_host, self.max_body_bytes = app, keys, check_host, max_body_bytes
        self.open_paths = OPEN_PATHS | ({"/metrics"} if public_metrics else set())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self.refusal(scope["method"], scope["path"], headers)
        if refusal is not None:
            return await _answer(send, *refusal)
        if scope["method"] == "POST":
            receive = self._bounded(receive)
        await self.app(scope, receive, send)

    def refusal(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any], dict] | None:
        """Return (status, error body, headers) for a request to refuse before it runs, else None."""
        if self.check_host and host_name(headers.get("host", "")) not in LOOPBACK_NAMES:
            # DNS rebinding: a page on another name reaching a loopback server through the browser.
            return 421, error_body("this server answers only to its loopback names (Host header)",
                                   "invalid_request_error", code="misdirected_request"), {}
        open_path = path in self.open_paths or path.startswith(OPEN_PREFIXES)
        if self.keys and not open_path and not key_matches(headers.get("authorization"), self.keys):
            return 401, error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   "invalid_request_error", code="invalid_api_key"), {"www-authenticate": "Bearer"}
        if method == "POST":
            content_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if content_type != "application/json":
                return 415, error_body("POST bodies must be JSON (Content-Type: application/json)",
                                       "invalid_request_error", code="unsupported_media_type"), {}
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                return 413, self._too_large(), {}
        return None

    def _too_large(self) -> dict[str, Any]:
        return error_body(f"request body larger than {self.max_body_bytes} bytes", "invalid_request_error",
                          code="request_too_large")

    def _bounded(self, receive: Callable) -> Callable:
        """Return a receive that fails the request once the body passes the limit (a body without a length)."""
        seen = 0

        async def bounded_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self._too_large())
            return message

        return bounded_receive


class BodyTooLarge(Exception):
    """A body without Content-Length passed the limit while it was read (answered 413 by the app)."""

    def __init__(self, body: dict[str, Any]):
        super().__init__(body["error"]["message"])
        self.body = body


async def _answer(send: Callable, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
