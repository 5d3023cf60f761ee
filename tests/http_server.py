"""A loopback HTTP server for the source and fault tests: serves files under a root, speaks HTTP Range
like S3 and web servers do, and can be told to ignore it, to fail once, to never answer, or to answer
every request only after a fixed latency (as an object store far away does)."""

from __future__ import annotations

import collections
import http.server
import re
import socket
import threading
import time
import urllib.parse
from pathlib import Path


class Handler(http.server.BaseHTTPRequestHandler):
    """Files under server.root; /slow/<f> never answers while the server runs (a client can only time
    out: no race with the client's timeout); /trickle/<f> sends <f> a byte at a time; /flaky/<f> fails
    once with 503, and so does the first request for a (path, first byte) listed in server.fail_once.
    server.latency_s delays every answer; server.ranges records every (path, Range header) asked for,
    server.max_in_flight the most requests served at once."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes: without this, 40 ms stalls

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, body: bool):
        server = self.server
        path = urllib.parse.unquote(self.path.split("?", 1)[0])
        with server.lock:
            server.requests[path] += 1
            server.ranges.append((path, self.headers.get("Range")))
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            time.sleep(server.latency_s)
            self._answer(path, body)
        finally:
            with server.lock:
                server.in_flight -= 1

    def _answer(self, path: str, body: bool):
        server = self.server
        if path.startswith("/slow/"):
            server.closing.wait()
            return
        if path.startswith("/trickle/"):
            self._trickle(server.root / path[len("/trickle/"):])
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
        size = file.stat().st_size
        wanted = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if wanted and self._fails_once(path, int(wanted.group(1))):
            self.send_error(503)
            return
        start, end = 0, size
        if wanted and not server.ignore_range:
            start = int(wanted.group(1))
            end = min(int(wanted.group(2)) + 1 if wanted.group(2) else size, size)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        else:
            self.send_response(200)
        with open(file, "rb") as f:  # only the bytes asked for: shards may be large
            f.seek(start)
            data = f.read(end - start)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "none" if server.ignore_range else "bytes")
        stat = file.stat()
        self.send_header("ETag", f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"')  # as nginx forms it
        self.end_headers()
        if body:
            try:
                self.wfile.write(data)
            except OSError:  # the client gave up (a timeout test)
                pass

    def _trickle(self, file: Path):
        """The file, one byte every server.trickle_s: each byte comes well inside a socket timeout."""
        data = file.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            for i in range(len(data)):
                if self.server.closing.wait(self.server.trickle_s):
                    return
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
        except OSError:  # the client gave up
            pass

    def _fails_once(self, path: str, start: int) -> bool:
        with self.server.lock:
            if (path, start) in self.server.fail_once:
                self.server.fail_once.discard((path, start))
                return True
        return False


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # concurrent clients open many connections at once (the default backlog is 5)

    def handle_error(self, request, client_address):
        pass


def serving():
    started = []

    def start(root: Path, ignore_range: bool = False, latency_s: float = 0.0) -> Server:
        server = Server(("127.0.0.1", 0), Handler)
        server.root, server.ignore_range, server.latency_s = root, ignore_range, latency_s
        server.requests, server.ranges, server.fail_once = collections.Counter(), [], set()
        server.lock, server.in_flight, server.max_in_flight = threading.Lock(), 0, 0
        server.closing, server.trickle_s = threading.Event(), 0.05
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
