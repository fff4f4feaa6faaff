"""Input a hostile client sends: values changed behind ``SamplingParams``' back, stop lists too
long to match, lone surrogates, bodies that never finish, forged Host headers. The server cases
run against a real server on loopback (the default model) or an in-process app over a stub."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from server_fixture import LiveServer, live_server
from stub_server import ExplodingRunner, StubEngine, serve

from twinserve.core.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from twinserve.gpu.engine.detokenizer import StopAutomaton


# ---- SamplingParams at the engine's door ---------------------------------------------------------
@pytest.mark.parametrize("field,value,message", [
    ("logprobs", 100_000, "logprobs must be at most 20"),
    ("n", 0, "n must be at least 1"),
    ("temperature", "hot", "temperature must be a number"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of integers"),
    ("skip_special_tokens", "no", "skip_special_tokens must be a boolean"),
    ("include_stop_str_in_output", "yes", "include_stop_str_in_output must be a boolean"),
])
def test_validate_rechecks_attributes_changed_after_construction(field, value, message):
    sp = SamplingParams()
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=message):
        sp.validate()


def test_stop_list_is_bounded_in_count_and_length():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS])
    with pytest.raises(ValueError, match=r"^stop may hold at most 64 strings, got 90000"):
        SamplingParams(stop=[f"s{i}" for i in range(90_000)])
    with pytest.raises(ValueError, match=r"^stop strings may be at most 256 characters"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    with pytest.raises(ValueError) as info:  # the message does not echo a huge list
        SamplingParams(stop=["ok"] * 10 + [7] + ["y" * 100] * 50)
    assert len(str(info.value)) < 200


def test_engine_add_request_validates_params(default_model_dir):
    from twinserve.entrypoints.llm import LLM
    llm = LLM(model=str(default_model_dir), max_model_len=128, max_num_seqs=4,
              kv_cache_memory_bytes=16 << 20, dtype="float32")
    sp = SamplingParams(max_tokens=2)
    sp.logprobs = 100_000
    with pytest.raises(ValueError, match="logprobs"):
        llm.engine.add_request([1, 2, 3], sp)
    sp = SamplingParams(max_tokens=2)
    sp.n = 0
    with pytest.raises(ValueError, match="^n must be at least 1"):
        llm.engine.add_request([1, 2, 3], sp)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError):
        llm.generate(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SamplingParams\(\*\*"):
        llm.generate(["Hi"], {"max_tokens": 2})  # type: ignore[arg-type]


# ---- stop strings: one automaton, work independent of their number -----------------------------
def _brute_first_stop(stops: list[str], text: str) -> tuple[int, str] | None:
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def test_stop_automaton_finds_the_first_stop_to_end():
    import random
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        automaton = StopAutomaton(stops)
        state, pos, found = 0, 0, None
        while pos < len(text):  # fed in pieces, as tokens arrive
            piece = text[pos:pos + rng.randint(1, 3)]
            state, end, index = automaton.feed(state, piece)
            if index != -1:
                found = (pos + end, automaton.stops[index])
                break
            pos += len(piece)
        assert found == _brute_first_stop(stops, text), (stops, text)


def test_64_stop_strings_cost_a_constant_factor_of_one():
    import random
    rng = random.Random(1)
    text = "".join(rng.choice("abcdefgh ") for _ in range(20_000))
    # adversarial stop strings: long shared prefixes that the text keeps almost matching
    many = ["abcdefgh"[:k] * 30 + "Z" for k in range(1, 9)] + \
        ["".join(rng.choice("abcdefgh ") for _ in range(MAX_STOP_STRING_CHARS - 1)) + "Z"
         for _ in range(MAX_STOP_STRINGS - 8)]
    one = StopAutomaton(["Z"]).count_steps(text)
    sixty_four = StopAutomaton(many).count_steps(text)
    assert one == len(text)
    assert sixty_four <= 2 * len(text)  # Aho-Corasick: at most 2 transitions per character
    # the scan it replaced: one str.find per stop string per new piece of text
    assert StopAutomaton(many).feed(0, text)[2] == -1


def test_detokenizer_stops_with_many_stop_strings(default_model_dir):
    from twinserve.gpu.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir)
    ids = tok.encode("one, two, three, four")
    stops = [f"never{i}" for i in range(MAX_STOP_STRINGS - 1)] + [" three"]
    detok = tok.detokenizer([], stop=stops)
    assert detok.add_tokens(ids) == " three"
    assert detok.get_delta(finished=True) == "one, two,"


# ---- the server: a bad request never closes a healthy connection -------------------------------

@pytest.fixture(scope="module")
def model_server() -> Iterator[LiveServer]:
    with live_server(["--max-num-seqs", "8"]) as srv:  # no API key: the Host check is on
        yield srv


class _Connection:
    """One HTTP/1.1 keep-alive connection (``http.client``): ``same_socket`` tells whether the
    server kept it open between requests."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        self.sock: socket.socket | None = None

    def post(self, path: str, raw: bytes, headers: dict[str, str] | None = None
             ) -> tuple[int, dict, dict[str, str]]:
        self.conn.request("POST", path, body=raw,
                          headers={"Content-Type": "application/json", **(headers or {})})
        r = self.conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if body else {}, dict(r.getheaders())

    def good(self) -> None:
        status, body, _ = self.post("/v1/completions",
                                    b'{"prompt": [1, 2], "max_tokens": 1, "temperature": 0}')
        assert status == 200, body

    def mark(self) -> None:
        assert self.conn.sock is not None
        self.sock = self.conn.sock

    @property
    def same_socket(self) -> bool:
        return self.conn.sock is not None and self.conn.sock is self.sock


SURROGATE = "\\ud800"  # as the raw JSON escape, which json.loads turns into a lone surrogate
def _raw(template: str) -> str:
    return template.replace("@", SURROGATE)


SURROGATE_CASES = [
    ("completion-prompt", "/v1/completions",
     _raw('{"prompt": "a@b", "max_tokens": 2}'), "prompt"),
    ("completion-prompt-list", "/v1/completions",
     _raw('{"prompt": ["ok", "@"], "max_tokens": 2}'), "prompt"),
    ("chat-message", "/v1/chat/completions",
     _raw('{"messages": [{"role": "user", "content": "x@"}]}'), "messages"),
    ("chat-content-part", "/v1/chat/completions",
     _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}]}'),
     "messages"),
    ("tokenize-prompt", "/tokenize", _raw('{"prompt": "@"}'), "prompt"),
    ("tokenize-messages", "/tokenize",
     _raw('{"messages": [{"role": "user", "content": "@"}]}'), "messages"),
    ("stop", "/v1/completions", _raw('{"prompt": "Hi", "stop": ["@"]}'), "stop"),
    ("model", "/v1/completions", _raw('{"prompt": "Hi", "model": "@"}'), "model"),
    ("user", "/v1/completions", _raw('{"prompt": "Hi", "user": "@"}'), "user"),
    ("key", "/v1/completions", _raw('{"prompt": "Hi", "@": 1}'), None),
]


def test_lone_surrogates_are_400s_naming_the_field_on_a_kept_connection(model_server) -> None:
    conn = _Connection(model_server.base_url)
    conn.good()
    conn.mark()
    for name, path, raw, param in SURROGATE_CASES:
        status, body, _ = conn.post(path, raw.encode())
        assert status == 400, (name, body)
        error = body["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400, name
        assert "surrogate" in error["message"], (name, error)
        if param is not None:
            assert error["param"] == param, (name, error)
        conn.good()  # the same connection answers the next, valid request
        assert conn.same_socket, name
    # a valid surrogate pair is ordinary text
    status, body, _ = conn.post("/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
    assert status == 200 and body["count"] >= 1
    assert "Traceback" not in model_server.log_tail(20_000)


def test_other_malformed_bodies_keep_the_connection(model_server) -> None:
    conn = _Connection(model_server.base_url)
    conn.good()
    conn.mark()
    for raw in (b"[" * 50_000, b'{"prompt": "\xff\xfe"}', b'{"prompt": 1e999999}',
                b'{"prompt": [' + b"1," * 30_000 + b'1], "max_tokens": 1}',
                b'{"prompt": "Hi", "max_tokens": 1, "n": 100000000000000000000}'):
        status, body, _ = conn.post("/v1/completions", raw)
        assert status == 400, (raw[:40], body)
        conn.good()
        assert conn.same_socket, raw[:40]


def test_host_header_is_checked_without_an_api_key(model_server) -> None:
    conn = _Connection(model_server.base_url)
    port = urlsplit(model_server.base_url).port
    for host, status in [("evil.example", 400), (f"evil.example:{port}", 400),
                         (f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200),
                         (f"[::1]:{port}", 200), ("LOCALHOST", 200)]:
        got, body, _ = conn.post("/v1/completions", b'{"prompt": [1], "max_tokens": 1}',
                                 headers={"Host": host})
        assert got == status, (host, body)
        if status == 400:
            assert body["error"]["param"] == "Host"


# ---- the HTTP layer over a stub engine ---------------------------------------------------------
def _exchange(port: int, parts: list[bytes], pause_s: float, timeout_s: float) -> bytes:
    """Sends ``parts`` with ``pause_s`` between them, then reads until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        for part in parts:
            s.sendall(part)
            time.sleep(pause_s)
        data = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_a_body_that_never_finishes_gets_408_and_the_connection_closes() -> None:
    with serve(StubEngine(), body_read_timeout_s=0.5) as url:
        port = int(urlsplit(url).port or 0)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        t0 = time.monotonic()
        reply = _exchange(port, [head, b'{"prompt": [1], '], 0.05, timeout_s=10)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"RequestTimeoutError" in reply and b"--body-read-timeout-s" in reply
        assert time.monotonic() - t0 < 5  # answered after ~0.5 s, then closed by the server
        # a slow but complete body within the limit is served
        body = b'{"prompt": [1], "max_tokens": 1}'
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        reply = _exchange(port, [head, body[:10], body[10:]], 0.1, timeout_s=10)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_an_internal_error_is_a_500_on_a_kept_connection() -> None:
    engine = StubEngine()

    engine.runner = ExplodingRunner()  # type: ignore[assignment]
    with serve(engine) as url:
        conn = _Connection(url)
        status, body, _ = conn.post("/v1/completions", b'{"prompt": [1], "max_tokens": 1}')
        assert status == 500 and body["error"]["type"] == "InternalServerError"
        assert "secret" not in json.dumps(body)
        conn.mark()
        conn.conn.request("GET", "/health")
        r = conn.conn.getresponse()
        r.read()
        assert r.status == 200 and conn.same_socket


def test_allowed_hosts_options() -> None:
    cases = [({}, {"evil.example": 400, "localhost": 200, "10.1.2.3": 400}),
             ({"allowed_hosts": "api.example, other.example"},
              {"api.example:443": 200, "other.example": 200, "localhost": 400}),
             ({"allowed_hosts": "*"}, {"evil.example": 200}),
             ({"api_key": "k"}, {"evil.example": 200}),
             ({"host": "0.0.0.0"}, {"10.1.2.3:8000": 200, "evil.example": 400,
                                    "localhost": 200})]
    for args, expected in cases:
        with serve(StubEngine(), **args) as url:
            conn = _Connection(url)
            for host, status in expected.items():
                got, body, _ = conn.post("/v1/completions", b'{"prompt": [1], "max_tokens": 1}',
                                         headers={"Host": host, "Authorization": "Bearer k"})
                assert got == status, (args, host, body)


def test_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    import argparse

    from twinserve.entrypoints.openai.server import add_serve_args, resolve_api_keys
    parser = add_serve_args(argparse.ArgumentParser())
    help_text = " ".join(parser.format_help().split())
    for phrase in ("process list", "--api-key-file", "$TWINSERVE_API_KEY", "$VLLM_API_KEY",
                   "--allowed-hosts", "--max-tenants", "--trust-tenant-header",
                   "--tenant-from-api-key", "--body-read-timeout-s", "--max-prompts-per-request"):
        assert phrase in help_text, phrase
    monkeypatch.delenv("TWINSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    def keys(*argv: str) -> dict[str, str]:
        return resolve_api_keys(parser.parse_args(list(argv)))
    assert keys() == {}
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert keys("--api-key-file", str(key_file)) == {"from-file": "key1"}
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert keys() == {"from-vllm": "key1"}
    monkeypatch.setenv("TWINSERVE_API_KEY", "from-twinserve")
    assert keys() == {"from-twinserve": "key1"}
    assert keys("--api-key", "flag") == {"flag": "key1"}
    assert keys("--api-key", "a", "b") == {"a": "key1", "b": "key2"}
    key_file.write_text("alice k-a\n\nbob k-b\n")
    assert keys("--api-key-file", str(key_file)) == {"k-a": "alice", "k-b": "bob"}
    for text, message in (("", "is empty"), ("a b c\n", "NAME KEY"),
                          ("x k\ny k\n", "repeats"), ("x k1\nx k2\n", "used twice")):
        key_file.write_text(text)
        with pytest.raises(ValueError, match=message):
            keys("--api-key-file", str(key_file))
    with pytest.raises(ValueError, match="--api-key-file"):
        keys("--api-key-file", str(tmp_path / "missing"))
    key_file.write_text("sekret\nother\n")
    with serve(StubEngine(), api_key_file=str(key_file)) as url:
        def post(headers: dict[str, str]) -> int:
            return httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1},
                              headers=headers, timeout=10).status_code
        assert post({}) == 401
        assert post({"Authorization": "Bearer sekret"}) == 200
        assert post({"Authorization": "Bearer other"}) == 200
        assert post({"Authorization": "Bearer sekretother"}) == 401


def test_tenants_tied_to_api_keys(tmp_path) -> None:
    """With --tenant-from-api-key the tenant is the key's name: a client cannot pick another
    tenant (user, X-Tenant) or create new ones, and the per-tenant limit holds per key."""
    key_file = tmp_path / "keys"
    key_file.write_text("alice ka\nbob kb\n")
    engine = StubEngine()
    with serve(engine, api_key_file=str(key_file), tenant_from_api_key=True,
               trust_tenant_header=True) as url:
        for key, user in (("ka", "mallory"), ("kb", None), ("ka", "x" * 10)):
            body = {"prompt": [1], "max_tokens": 1, **({"user": user} if user else {})}
            r = httpx.post(url + "/v1/completions", json=body, timeout=10,
                           headers={"Authorization": f"Bearer {key}", "X-Tenant": "eve"})
            assert r.status_code == 200, r.text
    assert [a["tenant"] for a in engine.added] == ["alice", "bob", "alice"]
    with pytest.raises(ValueError, match="--tenant-from-api-key needs API keys"):
        with serve(StubEngine(), tenant_from_api_key=True):
            pass
