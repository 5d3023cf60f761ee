"""A loopback HTTP server for the source and fault tests: serves files under a root, speaks HTTP Range
like S3 and web servers do, and can be told to ignore it, to fail once, or to never answer."""

from __future__ import annotations

import collections
import http.server
import re
import socket
import threading
from pathlib import Path


class Handler(http.server.BaseHTTPRequestHandler):
    """Files under server.root; /slow/<f> never answers while the server runs (a client can only time
    out: no race with the client's timeout); /flaky/<f> fails once with 503."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, body: bool):
        server = self.server
        path = self.path.split("?", 1)[0]
        server.requests[path] += 1
        if path.startswith("/slow/"):
            server.closing.wait()
            return
        if path.startswith("/flaky/"):
            path = path[len("/flaky"):]
            if server.requests["/flaky" + path] == 1:
                self.send_error(503)
                return
        file = server.root / path.lstrip("/")
        if not file.is_file():
            self.send_error(404)
            return
        data = file.read_bytes()
        wanted = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if wanted and not server.ignore_range:
            start = int(wanted.group(1))
            end = int(wanted.group(2)) + 1 if wanted.group(2) else len(data)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            data = data[start:end]
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "none" if server.ignore_range else "bytes")
        self.end_headers()
        if body:
            try:
                self.wfile.write(data)
            except OSError:  # the client gave up (a timeout test)
                pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass


def serving():
    started = []

    def start(root: Path, ignore_range: bool = False) -> Server:
        server = Server(("127.0.0.1", 0), Handler)
        server.root, server.ignore_range, server.requests = root, ignore_range, collections.Counter()
        server.closing = threading.Event()
        server.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return server

    return start, started


def stop(started) -> None:
    for server in started:
        server.closing.set()
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
