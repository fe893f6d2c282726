"""The OpenAI-compatible backend against a stub server on 127.0.0.1 (stdlib http.server) that
answers a bounded number of requests and stops by itself."""

import http.server
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from megatron_specdec.data import load_tokenizer, read_conversations
from megatron_specdec.cli.data import main
from megatron_specdec.data.openai_backend import BackendError, OpenAIBackend

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "sources"
EOS = 2


class StubServer:
    """Serves at most `max_requests` requests or for `lifetime` seconds. `fail_with` lists HTTP
    statuses to answer first, one per request."""

    def __init__(self, fail_with=(), max_requests=50, lifetime=60.0):
        self.requests = []
        self.fail_with = list(fail_with)
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, body))
                if stub.fail_with:
                    self._send(stub.fail_with.pop(0), {"error": {"message": "stub says no"}})
                elif self.path == "/v1/completions":
                    self._send(
                        200,
                        {
                            "choices": [
                                {
                                    "index": i,
                                    "text": f" answer {len(p)}",
                                    "finish_reason": "stop" if len(p) % 2 else "length",
                                }
                                for i, p in reversed(list(enumerate(body["prompt"])))
                            ]
                        },
                    )
                elif self.path == "/v1/chat/completions":
                    last = body["messages"][-1]["content"]
                    self._send(
                        200,
                        {
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": f"re: {last}"},
                                }
                            ]
                        },
                    )
                else:
                    self._send(404, {"error": "no such path"})

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.timeout = 0.2
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        deadline = time.monotonic() + lifetime
        self.stop = threading.Event()

        def serve():
            while (
                len(self.requests) < max_requests
                and time.monotonic() < deadline
                and not self.stop.is_set()
            ):
                self.httpd.handle_request()
            self.httpd.server_close()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)


@pytest.fixture
def stub():
    servers = []

    def make(**kwargs):
        servers.append(StubServer(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_completions_endpoint_sends_token_ids_in_one_request(stub, tokenizer):
    server = stub()
    backend = OpenAIBackend(server.url + "/v1", "smol", tokenizer)
    out = backend.generate([[5, 6, 7], [8, 9]], max_new_tokens=16)
    assert out == [_ids(tokenizer, " answer 3") + [EOS], _ids(tokenizer, " answer 2")]
    [(path, body)] = server.requests
    assert path == "/v1/completions"
    assert body == {
        "model": "smol",
        "max_tokens": 16,
        "temperature": 0.0,
        "prompt": [[5, 6, 7], [8, 9]],
    }


def test_chat_endpoint_sends_messages(stub, tokenizer):
    server = stub()
    backend = OpenAIBackend(server.url, "smol", tokenizer, endpoint="chat")
    messages = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    out = backend.generate([[1], [2]], 8, messages=messages)
    assert out == [_ids(tokenizer, "re: a") + [EOS], _ids(tokenizer, "re: b") + [EOS]]
    assert sorted(b["messages"][0]["content"] for _, b in server.requests) == ["a", "b"]
    assert {p for p, _ in server.requests} == {"/v1/chat/completions"}


def test_transient_errors_are_retried(stub, tokenizer, caplog):
    server = stub(fail_with=[503, 429])
    backend = OpenAIBackend(server.url, "smol", tokenizer, retry_delay=0.01)
    with caplog.at_level(logging.WARNING):
        assert backend.generate([[1, 2]], 4) == [_ids(tokenizer, " answer 2")]
    assert len(server.requests) == 3 and "HTTP 503" in caplog.text and "retry 2/5" in caplog.text


def test_client_errors_fail_at_once_with_the_servers_message(stub, tokenizer):
    server = stub(fail_with=[400])
    backend = OpenAIBackend(server.url, "smol", tokenizer, retry_delay=0.01)
    with pytest.raises(BackendError, match="HTTP 400.*stub says no"):
        backend.generate([[1]], 4)
    assert len(server.requests) == 1


def test_unreachable_server_fails_after_retries(tokenizer):
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = OpenAIBackend(
        f"http://127.0.0.1:{port}", "smol", tokenizer, max_retries=2, retry_delay=0.01
    )
    with pytest.raises(BackendError, match="failed after 3 attempts"):
        backend.generate([[1]], 4)


def test_cli_regenerate_through_the_server_then_calibrate(stub, tmp_path):
    server = stub()
    args = [
        "regenerate",
        "--data-dir",
        str(DATA_DIR),
        "--out",
        str(tmp_path / "regen.jsonl"),
        "--backend",
        "openai",
        "--url",
        server.url,
        "--model",
        "smol",
        "--batch-size",
        "4",
        "--limit",
        "6",
        "--num-shards",
        "2",
        "--shard-index",
        "1",
        "--no-progress",
    ]
    assert main(args) == 0
    out = tmp_path / "regen.shard00001-of-00002.jsonl"
    rows = read_conversations(out, on_error="fail")
    assert len(rows) == 6 and len(server.requests) == 2
    assert all(
        r["id"].split(":")[0] in {"gsm8k", "self_instruct_seed", "self_instruct_user"} for r in rows
    )
    assert main(args) == 0 and len(server.requests) == 2  # resumed: nothing left to do
    assert (
        main(
            [
                "calibrate",
                "--data",
                str(out),
                "--draft-vocab-size",
                "32",
                "--out",
                str(tmp_path / "d2t.safetensors"),
            ]
        )
        == 0
    )
    assert (tmp_path / "d2t.safetensors").is_file()


def test_cli_regenerate_exclude_takes_the_prompts_not_yet_answered(stub, tmp_path, caplog):
    server = stub()

    def regenerate(out, *extra):
        return main(["regenerate", "--data-dir", str(DATA_DIR), "--out", str(out), "--backend",
                     "openai", "--url", server.url, "--model", "smol", "--batch-size", "4",
                     "--no-progress", *extra])

    first, second, both = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ab.jsonl"
    assert regenerate(first, "--limit", "3") == 0
    assert regenerate(second, "--limit", "3", "--exclude", str(first)) == 0
    assert regenerate(both, "--limit", "6") == 0
    ids = [[r["id"] for r in read_conversations(p, on_error="fail")] for p in (first, second, both)]
    # The next three in shard order, not the same three again.
    assert ids[0] + ids[1] == ids[2] and not set(ids[0]) & set(ids[1])
    with caplog.at_level(logging.ERROR):
        assert regenerate(tmp_path / "c.jsonl", "--exclude", str(tmp_path / "missing.jsonl")) == 1
    assert f"data file {tmp_path / 'missing.jsonl'} does not exist" in caplog.text
