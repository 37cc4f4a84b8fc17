"""A fake model API that real agent CLIs complete turns against, logging every request.

Speaks the minimal streaming shapes: Anthropic Messages SSE (claude), OpenAI Responses SSE
(codex, including one `exec_command` tool call on request), Gemini streamGenerateContent
SSE, and the same wrapped in Google's Code Assist API (`/v1internal:*`, gemini's Google login),
with OAuth refreshes at `/oauth/token` (JSON) and Google's `/token` (a form). Runs on 127.0.0.1 on the host; the box reaches it only through the proxy, via a pinned
`--allow-host fake-api.test:PORT=127.0.0.1:PORT` entry.
"""

from __future__ import annotations

import http.server
import json
import socketserver
import ssl
import threading
import urllib.parse

ANSWER = "HIVE-RELAY-FAKE-ANSWER"


def sse(event: str | None, data: dict) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data) + "\n\n").encode()


class FakeAPI(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, *args: object) -> None:
        pass

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            return self.rfile.read(length)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return b""

    def _record(self, body: bytes) -> None:
        self.server.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
        self.server.requests.append({
            "method": self.command, "path": self.path, "host": self.headers.get("Host"),
            "auth": bool(self.headers.get("Authorization") or self.headers.get("x-api-key")
                         or self.headers.get("x-goog-api-key") or "key=" in self.path),
            "body": body.decode(errors="replace")[:4_000_000],
        })

    def _json(self, data: dict, status: int = 200) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _stream(self, chunks: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk)
            self.wfile.flush()
        self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802
        self._record(b"")
        self._json({"data": [], "models": []})

    def do_HEAD(self) -> None:  # noqa: N802
        self._record(b"")
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        body = self._body()
        self._record(body)
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            req = {}
        path = self.path.split("?")[0]
        # Google's token endpoint takes a form; elsewhere curl's `-d '{json}'` is labelled a form too.
        if path == "/token" and self.headers.get("Content-Type", "").startswith("application/x-www-form-urlencoded"):
            req = dict(urllib.parse.parse_qsl(body.decode()))
        if path.endswith("/oauth/token") or path == "/token":  # an OAuth refresh: a known refresh token -> a new pair
            answer = self.server.oauth_tokens.pop(str(req.get("refresh_token")), None)  # single use, as rotated
            return self._json(answer or {"error": "invalid_grant"}, 200 if answer else 400)
        if path.startswith("/v1internal:"):
            return self._code_assist(path.removeprefix("/v1internal:"), req)
        if "/messages" in self.path:
            return self._anthropic(req)
        if "/responses" in self.path:
            return self._openai(req, body)
        if "generateContent" in self.path or "streamGenerateContent" in self.path:
            return self._gemini(req)
        if "countTokens" in self.path:
            return self._json({"totalTokens": 1})
        self._json({})

    def _anthropic(self, req: dict) -> None:
        if "count_tokens" in self.path:
            return self._json({"input_tokens": 1})
        message = {"id": "msg_fake", "type": "message", "role": "assistant", "model": req.get("model", "claude"),
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 1, "output_tokens": 1}}
        if not req.get("stream"):
            message.update(content=[{"type": "text", "text": ANSWER}], stop_reason="end_turn")
            return self._json(message)
        tool = self.server.tool_command
        if tool is not None and '"tool_result"' not in json.dumps(req):
            args = json.dumps({"command": tool, "description": "run the probe"})
            return self._stream([
                sse("message_start", {"type": "message_start", "message": message}),
                sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
                    "type": "tool_use", "id": "toolu_fake", "name": self.server.tool_name, "input": {}}}),
                sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "input_json_delta", "partial_json": args}}),
                sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                      "usage": {"output_tokens": 1}}),
                sse("message_stop", {"type": "message_stop"}),
            ])
        self._stream([
            sse("message_start", {"type": "message_start", "message": message}),
            sse("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}}),
            sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": ANSWER}}),
            sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                  "usage": {"output_tokens": 1}}),
            sse("message_stop", {"type": "message_stop"}),
        ])

    def _openai(self, req: dict, body: bytes) -> None:
        usage = {"input_tokens": 1, "input_tokens_details": None, "output_tokens": 1,
                 "output_tokens_details": None, "total_tokens": 2}
        tool = self.server.tool_command
        wants_tool = tool is not None and b"function_call_output" not in body
        if wants_tool and self.server.tool_name == "bash":  # opencode's shell tool (its ChatGPT login's provider)
            item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "bash", "status": "completed",
                    "arguments": json.dumps({"command": tool, "description": "run the probe"})}
        elif wants_tool:
            item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
                    "arguments": json.dumps({"cmd": tool})}
        else:
            item = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                    "content": [{"type": "output_text", "text": ANSWER, "annotations": []}]}
        events = [sse("response.created", {"type": "response.created", "response": {"id": "resp_1"}})]
        if self.server.tool_name == "bash":  # the AI SDK (opencode) builds its parts from the item's start and deltas
            start = {**item, "status": "in_progress"}
            if item["type"] == "message":
                start["content"] = []
            events.append(sse("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                                             "item": start}))
            if item["type"] == "message":
                events.append(sse("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1",
                                                                 "output_index": 0, "content_index": 0, "delta": ANSWER}))
        events += [
            sse("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
            sse("response.completed", {"type": "response.completed", "response": {"id": "resp_1", "usage": usage}}),
        ]
        self._stream(events)

    def _code_assist(self, method: str, req: dict) -> None:
        """Google's Code Assist API as gemini's Google login uses it: an onboarded free-tier user, and
        the Gemini answers wrapped in `{"response": ...}`."""
        if method == "loadCodeAssist":
            return self._json({"currentTier": {"id": "free-tier", "name": "Gemini Code Assist for individuals"},
                               "allowedTiers": [{"id": "free-tier", "isDefault": True}],
                               "cloudaicompanionProject": "fake-project-1"})
        if method in ("generateContent", "streamGenerateContent"):
            return self._gemini(req.get("request") or {}, wrap=True)
        if method == "countTokens":
            return self._json({"totalTokens": 1})
        self._json({})  # listExperiments, fetchAdminControls, retrieveUserQuota, recordCodeAssistMetrics, ...

    def _gemini(self, req: dict, wrap: bool = False) -> None:
        # Non-streaming calls are gemini's JSON helpers (its model router); answer with valid JSON.
        text = ANSWER if "alt=sse" in self.path else json.dumps(
            {"reasoning": "simple", "model_choice": "flash", "complexity_reasoning": "simple", "complexity_score": 1})
        part: dict = {"text": text}
        tool = self.server.tool_command
        answered = any("functionResponse" in piece for content in req.get("contents", []) for piece in content.get("parts", []))
        if tool is not None and "alt=sse" in self.path and not answered:  # gemini's shell tool, then the answer
            part = {"functionCall": {"name": "run_shell_command", "args": {"command": tool}}}
        chunk = {"candidates": [{"content": {"parts": [part], "role": "model"}, "finishReason": "STOP",
                                 "index": 0}],
                 "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1, "totalTokenCount": 2}}
        if wrap:
            chunk = {"response": chunk, "traceId": "trace-1"}
        if "alt=sse" in self.path:
            return self._stream([sse(None, chunk)])
        self._json(chunk)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), FakeAPI)
        self.tls = tls
        self.requests: list[dict] = []
        self.headers_seen: list[dict[str, str]] = []
        self.tool_command: str | None = None
        self.tool_name = "Bash"  # the shell tool's name in an Anthropic tool_use: claude's; opencode's is "bash"
        self.oauth_tokens: dict[str, dict] = {}  # refresh token -> the token endpoint's answer to it

    def get_request(self):  # noqa: ANN201 - (socket, address)
        conn, addr = self.socket.accept()
        if self.tls is not None:  # the handshake in the handler's thread, not in the accept loop
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, addr

    def finish_request(self, request, client_address) -> None:  # noqa: ANN001
        if self.tls is not None:
            try:
                request.do_handshake()
            except OSError:
                return
        super().finish_request(request, client_address)


def start(tls: ssl.SSLContext | None = None) -> tuple[Server, int]:
    """The fake API on 127.0.0.1; with `tls`, it speaks HTTPS with that server context (a real API
    name's certificate from a throwaway CA: tests/servers.make_ca)."""
    server = Server(tls)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, server.server_address[1]
