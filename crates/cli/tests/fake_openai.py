"""An OpenAI-style model server for the front door's tests.

POST /v1/chat/completions (any POST) answers a chat completion whose last
token is the secret given on the command line (only this server can give
it); with "stream": true, as server-sent events, one chunk per token, then
"data: [DONE]". GET /count says how many completions it served; any other
GET echoes the path and Host it was asked with. --delay-start waits before
listening (a model loading); --fail exits at once (a start that fails).
"""
import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--model", required=True)
p.add_argument("--secret", required=True)
p.add_argument("--delay-start", type=float, default=0.0)
p.add_argument("--fail", action="store_true")
args = p.parse_args()
if args.fail:
    sys.exit("fake_openai: asked to fail at its start")
time.sleep(args.delay_start)

served = 0
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, code, body):
        b = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def chunk(self, text):
        b = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
        self.wfile.flush()

    def do_GET(self):
        if self.path == "/count":
            self.reply(200, json.dumps({"served": served}))
        else:
            self.reply(200, json.dumps({"model": args.model, "path": self.path, "host": self.headers.get("Host")}))

    def do_POST(self):
        global served
        n = int(self.headers.get("Content-Length", "0"))
        req = json.loads(self.rfile.read(n) or b"{}")
        with lock:
            served += 1
        tokens = ["Hello", " from ", args.secret]
        if req.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for t in tokens:
                ev = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "model": args.model,
                    "choices": [{"index": 0, "delta": {"content": t}}],
                }
                self.chunk("data: %s\n\n" % json.dumps(ev))
                time.sleep(0.02)
            self.chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        else:
            msg = {"role": "assistant", "content": "".join(tokens)}
            self.reply(200, json.dumps({"object": "chat.completion", "model": args.model,
                                        "choices": [{"index": 0, "message": msg}]}))


ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
