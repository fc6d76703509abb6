"""The HTTP server of every metrics endpoint: /metrics, /health (HTTP 503 when training stalled) and /.

The exposition is prometheus_client's (`generate_latest`, inside the `metrics` function the server is
given); the HTTP server around it (`_serve`) is http.server's, not prometheus_client's
`start_http_server`/`make_wsgi_app`, because those serve one registry on every path: a liveness probe needs
`/health` answering 503 when training stalled, and a scrape endpoint on a training node needs a
per-connection timeout (an idle client must not hold a thread); both are a few lines on http.server and
would be a WSGI dispatcher plus a patched server class on the library's.

A local client must not be able to hurt the run through this port (docs/security.md): at most
`MAX_CONNECTIONS` connections are served at once (more are closed as soon as they are accepted: a flood costs
no thread and holds no file descriptor), every connection is cut `REQUEST_DEADLINE_S` after it was accepted
however slowly it trickles its request in (a per-read timeout alone lets a client that sends a byte every few
seconds hold its thread for ever), and one request is served per connection.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

log = logging.getLogger("job.telemetry")
HTTP_TIMEOUT_S = 10.0  # a /metrics or /health client idle this long is disconnected
REQUEST_DEADLINE_S = 10.0  # a connection is cut this long after it was accepted, whatever it is doing
MAX_CONNECTIONS = 32  # served at once; more are closed at once (Prometheus and a probe need one or two)


def _serve(host: str, port: int, metrics, health) -> tuple[Any, threading.Thread]:
    """A threaded HTTP server for /metrics (metrics() -> bytes) and /health (health() -> dict; HTTP 200
    when its "status" is "ok", else 503).

    Raises OSError when the address cannot be bound.
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    body, ctype, code = metrics(), CONTENT_TYPE_LATEST, 200
                elif path == "/health":  # 503 unless the status is "ok": what a liveness probe checks
                    h = health()
                    code = 200 if h.get("status") == "ok" else 503
                    body, ctype = (json.dumps(h) + "\n").encode(), "application/json"
                elif path == "/":
                    body, ctype, code = b"trainjob telemetry: /metrics /health\n", "text/plain", 200
                else:
                    body, ctype, code = b"not found: try /metrics or /health\n", "text/plain", 404
            except Exception:  # a bug costs one scrape, not the server thread; details stay in the log
                log.exception("serving %s failed", path)
                body, ctype, code = b"internal error: see the trainer's log\n", "text/plain", 500
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        # An idle or slow client is dropped after this many seconds instead of holding a thread forever.
        timeout = HTTP_TIMEOUT_S

        def log_message(self, *args):  # one line per scrape would drown the training log
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        request_queue_size = 128

        def server_activate(self):
            self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
            self._deadlines: dict[Any, float] = {}
            self._lock = threading.Lock()
            super().server_activate()

        def process_request(self, request, client_address):
            if not self._slots.acquire(blocking=False):  # full: no thread, no descriptor kept
                self.shutdown_request(request)
                return
            with self._lock:
                self._deadlines[request] = time.monotonic() + REQUEST_DEADLINE_S
            try:
                super().process_request(request, client_address)
            except Exception:  # no thread could be started
                self._done(request)
                self.shutdown_request(request)

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._done(request)

        def _done(self, request) -> None:
            with self._lock:
                if self._deadlines.pop(request, None) is not None:
                    self._slots.release()

        def service_actions(self):
            """serve_forever calls this every poll interval: cut the connections past their deadline (a
            shutdown wakes the thread blocked reading or writing it, which then closes it)."""
            now = time.monotonic()
            with self._lock:
                late = [r for r, t in self._deadlines.items() if t < now]
            for request in late:
                try:
                    request.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        def handle_error(self, request, client_address):  # a client that went away: not worth a traceback
            log.debug("metrics client %s: connection ended early", client_address, exc_info=True)

    httpd = Server((host, port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                              name=f"metrics-{httpd.server_address[1]}", daemon=True)
    thread.start()
    return httpd, thread


def _stop(httpd) -> None:
    httpd.shutdown()
    httpd.server_close()


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
