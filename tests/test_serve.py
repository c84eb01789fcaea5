"""``specstore serve``: the official ``openai`` client against a live server (chat, completions,
streaming, the ``specstore`` vendor field), OpenAI-shaped errors for malformed requests, 503 when
the queue is full, a client that disconnects (waiting or mid-stream) cancels its request and the
server keeps serving, the response names the version after a tag moves, and the command itself.
Every server is started by its test on 127.0.0.1 (a free port) and stopped by it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import openai
import pytest

from specstore.runtime import Engine
from specstore.runtime.serve import Defaults, ServerThread, create_app
from tests.datastore_helpers import PROMPTS, TEXTS, model_hidden, own_output_datastore, write_datastore

N = 24


class GatedEngine(Engine):
    """An engine whose requests wait for ``gate`` and commit slowly (``delay_s`` per piece of text)."""

    gate: threading.Event | None = None
    delay_s = 0.0

    def generate(self, prompt, *, stream=None, **options):
        if self.gate is not None:
            assert self.gate.wait(60)
        slow = stream
        if stream is not None and self.delay_s:
            def slow(text):
                time.sleep(self.delay_s)
                stream(text)
        return super().generate(prompt, stream=slow, **options)


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    store, loaded, outputs = own_output_datastore(folder, max_new_tokens=N)
    store.set_tag("own@1", "prod")
    docs = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    write_datastore(store, "own", docs, model_hidden(loaded.model, docs), loaded.info)
    return folder, store, loaded, outputs


def _engine(own, **options) -> GatedEngine:
    _, store, loaded, _ = own
    return GatedEngine(loaded, store, "own@prod", method="rest", **options)


def _request(url: str, path: str, body=None, method: str = "POST") -> tuple[int, dict, dict]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, json.loads(payload), dict(resp.getheaders())


def _health(url: str) -> dict:
    return _request(url, "/health", method="GET")[1]


def _wait(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_openai_client_against_a_live_server(own):
    engine = _engine(own)
    with ServerThread(create_app(engine, defaults=Defaults(max_new_tokens=N))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["model", "own@prod"]
        for prompt in PROMPTS[:2]:
            expected = engine.generate(prompt, max_new_tokens=N)
            reply = client.chat.completions.create(model="own@prod", messages=_chat(prompt))
            assert reply.choices[0].message.content == expected.text and reply.choices[0].finish_reason == "length"
            assert reply.usage.completion_tokens == N and reply.usage.prompt_tokens == len(expected.prompt_ids)
            vendor = reply.model_extra["specstore"]
            assert vendor["datastore"] == "own@1" and vendor["method"] == "rest" and vendor["mat"] == expected.stats.mat > 1

            chunks = list(client.chat.completions.create(model="model", messages=_chat(prompt), stream=True,
                                                         stream_options={"include_usage": True}))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
            last = chunks[-2]
            assert last.choices[0].finish_reason == "length" and last.model_extra["specstore"]["datastore"] == "own@1"
            assert chunks[-1].usage.completion_tokens == N

        raw = engine.generate(PROMPTS[0], template=False, max_new_tokens=8)
        done = client.completions.create(model="model", prompt=PROMPTS[0], max_tokens=8)
        assert done.choices[0].text == raw.text and done.model_extra["specstore"]["datastore"] == "own@1"
        pieces = list(client.completions.create(model="model", prompt=PROMPTS[0], max_tokens=8, stream=True))
        assert "".join(p.choices[0].text for p in pieces) == raw.text
        assert pieces[-1].choices[0].finish_reason == "length" and pieces[-1].model_extra["specstore"]["mat"] == raw.stats.mat

        # another method through the vendor field; seeded sampling is reproducible
        pld = client.chat.completions.create(model="model", messages=_chat(PROMPTS[1]), extra_body={"specstore": {"method": "pld"}})
        assert pld.model_extra["specstore"]["method"] == "pld" and pld.model_extra["specstore"]["datastore"] is None
        a, b = (client.chat.completions.create(model="model", messages=_chat(PROMPTS[2]), temperature=0.9, seed=7, max_tokens=8)
                for _ in range(2))
        assert a.choices[0].message.content == b.choices[0].message.content
        with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
            client.chat.completions.create(model="gpt-4o", messages=_chat("hi"))
        assert _health(server.url)["queue"]["served"] == 9


def test_the_response_names_the_version_after_the_tag_moves(own):
    _, store, _, _ = own
    engine = _engine(own, refresh_seconds=None)
    try:
        with ServerThread(create_app(engine, idle_refresh_seconds=0.1)) as server:
            body = {"model": "model", "messages": _chat(PROMPTS[0]), "max_tokens": 4}
            assert _request(server.url, "/v1/chat/completions", body)[1]["specstore"]["datastore"] == "own@1"
            store.set_tag("own@2", "prod")
            _wait(lambda: _health(server.url)["datastores"] == {"own@prod": "own@2"})  # the idle worker noticed
            assert _request(server.url, "/v1/chat/completions", body)[1]["specstore"]["datastore"] == "own@2"
            models = _request(server.url, "/v1/models", method="GET")[1]["data"]
            assert models[1]["id"] == "own@prod" and models[1]["specstore"]["datastore"] == "own@2"
    finally:
        store.set_tag("own@1", "prod")


BAD = [
    (b'{"model": "model", "messages": [', 400, None),
    (b'["a list"]', 400, None),
    ({"model": "model"}, 400, "messages"),
    ({"model": "model", "messages": []}, 400, "messages"),
    ({"model": "model", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "model", "messages": _chat("x"), "temperature": -1}, 400, "temperature"),
    ({"model": "model", "messages": _chat("x"), "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "model", "messages": _chat("x"), "stop": ["\n"]}, 400, "stop"),
    ({"model": "model", "messages": _chat("x"), "logprobs": True}, 400, "logprobs"),
    ({"model": "model", "messages": _chat("x"), "n": 3}, 400, "n"),
    ({"model": "model", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content"),
    ({"model": "model", "messages": _chat("x"), "specstore": {"method": "nope"}}, 400, None),
    ({"model": "model", "messages": _chat("x"), "specstore": {"method": "nope"}, "stream": True}, 400, None),
    ({"model": "nope", "messages": _chat("x")}, 404, "model"),
]


def test_malformed_requests_get_openai_errors(own):
    with ServerThread(create_app(_engine(own))) as server:
        for body, status, param in BAD:
            code, payload, _ = _request(server.url, "/v1/chat/completions", body)
            assert code == status and set(payload["error"]) == {"message", "type", "param", "code"}, (body, payload)
            assert payload["error"]["param"] == param and payload["error"]["message"], body
        assert "unknown drafting method 'nope'" in _request(server.url, "/v1/chat/completions", BAD[11][0])[1]["error"]["message"]
        code, payload, _ = _request(server.url, "/v1/completions", {"model": "model", "prompt": ["a", "b"]})
        assert code == 400 and payload["error"]["param"] == "prompt"
        code, payload, _ = _request(server.url, "/v1/completions", {"model": "model", "prompt": "a", "echo": True})
        assert code == 400 and payload["error"]["param"] == "echo"
        code, payload, _ = _request(server.url, "/v1/nothing", {})
        assert code == 404 and payload["error"]["code"] == "not_found"
        code, payload, _ = _request(server.url, "/v1/chat/completions", method="GET")
        assert code == 405 and "error" in payload
        ok = _request(server.url, "/v1/chat/completions", {"model": "model", "messages": _chat("x"), "max_tokens": 2})
        assert ok[0] == 200 and _health(server.url)["queue"]["failed"] == 3  # the unknown methods


def test_a_full_queue_answers_503(own):
    engine = _engine(own)
    engine.gate = threading.Event()
    body = {"model": "model", "messages": _chat(PROMPTS[0]), "max_tokens": 4}
    with ServerThread(create_app(engine, max_queue=1)) as server:
        answers: list[int] = []
        clients = [threading.Thread(target=lambda: answers.append(_request(server.url, "/v1/chat/completions", body)[0]))
                   for _ in range(2)]
        clients[0].start()
        _wait(lambda: _health(server.url)["queue"]["busy"])
        clients[1].start()
        _wait(lambda: _health(server.url)["queue"]["waiting"] == 1)
        code, payload, headers = _request(server.url, "/v1/chat/completions", body)
        assert code == 503 and payload["error"]["code"] == "queue_full" and headers["retry-after"] == "1"
        engine.gate.set()
        for c in clients:
            c.join(60)
        assert answers == [200, 200]
        _wait(lambda: not _health(server.url)["queue"]["busy"])  # the worker clears it just after the answer goes out
        queue = _health(server.url)["queue"]
        assert (queue["served"], queue["refused"], queue["waiting"], queue["busy"]) == (2, 1, 0, False)


def _send(url: str, body: dict) -> http.client.HTTPConnection:
    """POST a chat request without reading the answer."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return conn


def _hang_up(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_a_client_that_disconnects_cancels_its_request(own):
    engine = _engine(own)
    engine.delay_s = 0.05  # 400 pieces would take 20 s
    long = {"model": "model", "messages": _chat(PROMPTS[0]), "max_tokens": 400, "specstore": {"method": "ar"}, "stream": True}
    with ServerThread(create_app(engine)) as server:
        conn = _send(server.url, long)
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        started = time.monotonic()
        _hang_up(conn)
        _wait(lambda: _health(server.url)["queue"]["cancelled"] == 1, timeout=10)
        assert time.monotonic() - started < 10 and not _health(server.url)["queue"]["busy"]
        # a request that waits in the queue and whose client leaves is dropped without decoding
        engine.gate = threading.Event()
        blocker = threading.Thread(target=_request, args=(server.url, "/v1/chat/completions", {**long, "stream": False, "max_tokens": 2}))
        blocker.start()
        _wait(lambda: _health(server.url)["queue"]["busy"])
        conn = _send(server.url, {**long, "stream": False})
        _wait(lambda: _health(server.url)["queue"]["waiting"] == 1)
        _hang_up(conn)
        time.sleep(0.5)  # longer than the server's disconnect poll
        engine.gate.set()
        blocker.join(60)
        _wait(lambda: _health(server.url)["queue"]["cancelled"] == 2)
        engine.gate, engine.delay_s = None, 0.0
        code, payload, _ = _request(server.url, "/v1/chat/completions", {"model": "model", "messages": _chat(PROMPTS[1]), "max_tokens": 4})
        assert code == 200 and payload["choices"][0]["message"]["content"]
        assert _health(server.url)["queue"]["served"] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_serve_command(own, tmp_path):
    folder, store, loaded, outputs = own
    cli = [sys.executable, "-m", "specstore.runtime.cli"]
    bad = subprocess.run([*cli, "serve", "--store", str(store.root), "--datastore", "own@nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("specstore: error: datastore 'own' has no tag 'nope'") and "Traceback" not in bad.stderr
    port, log = _free_port(), tmp_path / "served.jsonl"
    argv = [*cli, "serve", "--store", str(store.root), "--datastore", "own@prod", "--method", "rest", "--model", str(folder / "model"),
            "--dtype", "float32", "--port", str(port), "--log", str(log), "--max-new-tokens", str(N)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                return _health(url)["status"] == "ok"
            except OSError:
                return False

        _wait(up, timeout=180)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="own@prod", messages=_chat(PROMPTS[0]))
        assert reply.choices[0].message.content == loaded.tokenizer.decode(outputs[PROMPTS[0]], skip_special_tokens=True)
        assert reply.model_extra["specstore"]["datastore"] == "own@1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0 and "specstore serve: stopped" in proc.stderr.read()
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["specstore"]["datastore"] == "own@1" and record["messages"][-1]["content"] == reply.choices[0].message.content


def test_runtime_imports_neither_the_server_nor_beam():
    code = ("import sys, specstore.runtime as rt; rt.Engine; from specstore.runtime import cli; cli._build_parser(); "
            "bad = [m for m in ('starlette', 'uvicorn', 'apache_beam') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
