"""A fake OpenAI-compatible streaming server on 127.0.0.1 for serve_load's tests: the handler base and the server's
life; each test module's handler says what it streams."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


class SSEHandler(BaseHTTPRequestHandler):
    """A quiet handler that streams server-sent events; the stream ends when the connection closes (HTTP/1.0: no
    length, no chunking)."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, event: dict) -> None:
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.flush()


@contextmanager
def loopback_server(handler: type[SSEHandler], **state) -> Iterator[ThreadingHTTPServer]:
    """Yield a ThreadingHTTPServer of `handler` on a free 127.0.0.1 port, serving on a thread, with `state` set on it
    and its `url`; shut it down after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    for name, value in state.items():
        setattr(server, name, value)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
