"""Stand-in HTTP servers for the serving-path tests (test-only code).

`serve(routes)` runs a real HTTP server on 127.0.0.1 (stdlib `http.server`, one thread per connection)
whose behaviour each test supplies as functions. It replaces the real vLLM OpenAI-compatible server and
the LMCache server's HTTP API in tests on machines without a GPU; the helpers below write responses in
vLLM's streaming format (`data: {json}` lines, `token_id:N` entries in `logprobs.tokens`, a final
usage-only chunk, `data: [DONE]`).
"""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar


class Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict] = {}  # replaced per server by `serve`
    log: ClassVar[list] = []

    def log_message(self, *args):  # keep test output quiet
        pass

    def _dispatch(self, method):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.log.append((method, self.path, body))
        fn = self.routes.get((method, self.path))
        if fn is None:
            self.send_json(404, {"error": {"message": f"no route {method} {self.path}"}})
            return
        try:
            fn(self, body)
        except (BrokenPipeError, ConnectionResetError):  # the client went away (timeouts in tests)
            pass

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def send_json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_sse(self) -> None:
        # HTTP/1.0 without Content-Length: the body ends when the connection closes, as a stream does.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

    def write_line(self, text: str) -> None:
        self.wfile.write(text.encode() + b"\n")
        self.wfile.flush()


@contextmanager
def serve(routes: dict):
    """Run a server for `routes` ({(method, path): fn(handler, json_body)}); yields (base_url, request log)."""
    handler = type("RouteHandler", (Handler,), {"routes": routes, "log": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.log
    finally:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def chunk(ids, text: str = "", finish=None, *, as_text: bool = False) -> str:
    """One vLLM completion stream chunk carrying the tokens `ids` (several per chunk allowed)."""
    tokens = [f"tok{i}" if as_text else f"token_id:{i}" for i in ids]
    return "data: " + json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "stop_reason": None,
                     "logprobs": {"text_offset": [0] * len(ids), "token_logprobs": [-0.1] * len(ids),
                                  "tokens": tokens, "top_logprobs": [{t: -0.1} for t in tokens]}}]})


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> str:
    return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                                  "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                           "completion_tokens": completion_tokens,
                                                           "total_tokens": prompt_tokens + completion_tokens}})


def models_route(model: str, max_model_len: int = 4096, root: str | None = None):
    """`GET /v1/models` as vLLM answers it."""
    def fn(h, body):
        h.send_json(200, {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm",
                                                      "root": root or model, "max_model_len": max_model_len}]})
    return fn
