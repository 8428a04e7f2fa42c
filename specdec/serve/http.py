"""The HTTP server's own limits: uvicorn configured from ServeConfig, with a header timeout uvicorn lacks.

uvicorn times out idle keep-alive connections but not a client that sends its headers a byte a minute
(slowloris): such connections would pile up until the process runs out of file descriptors.
"""

from __future__ import annotations

from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from specdec.serve.config import ServeConfig


def header_timeout_protocol(seconds: float) -> type[HttpToolsProtocol]:
    """Return uvicorn's httptools protocol class, closing a connection whose request headers are not complete
    within `seconds` of its first byte (or of the connection, for a client that sends nothing)."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:  # idle from here on: keep-alive's own timer applies
            self._disarm()
            super().on_response_complete()

    return HeaderTimeoutProtocol


def uvicorn_config(app: Any, config: ServeConfig, log_level: str = "info", access_log: bool = False) -> uvicorn.Config:
    """Return the uvicorn.Config that serves `app` with `config`'s timeouts (header, keep-alive, shutdown)."""
    return uvicorn.Config(app, log_level=log_level, access_log=access_log, http=header_timeout_protocol(
        config.header_timeout), timeout_keep_alive=config.keep_alive_timeout,
        timeout_graceful_shutdown=config.shutdown_grace)
