"""Who may drive `mars-hf serve` (issue 52, fault 10): real uvicorn servers on loopback, the `openai` client and
raw HTTP. A web page must not reach a loopback server (a cross-site ``text/plain`` POST, DNS rebinding: a foreign
Host and Origin), and a server with an API key answers only those who send it."""

from __future__ import annotations

import logging

import httpx2 as httpx
import openai
import pytest

from mars_hf.serving import ControllerConfig, SecurityConfig, ServerConfig, build_server
from tests.test_serving import ScriptedEngine, client, expected_text, metric, start
from tests.tiny import tiny_tokenizer

KEY = "sk-test-3f9a"
BODY = {"prompt": "the cat", "max_tokens": 4}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _post(server, headers: dict, body: bytes | None = None, path: str = "/v1/completions"):
    content = body if body is not None else b'{"prompt": "the cat", "max_tokens": 4}'
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=60)


def _error(response, status: int, code: str) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error", error
    return error["message"]


def test_a_web_page_cannot_drive_a_loopback_server(tok):
    """The issue's repro (text/plain, Host attacker.example, a foreign Origin: a 200) and each part of it alone:
    refused before the engine sees anything; the server's own names and its own origin still work."""
    server, engine, _ = start(tok)
    with server:
        json_type = {"content-type": "application/json"}
        repro = _post(
            server,
            {"content-type": "text/plain", "host": "attacker.example", "origin": "http://attacker.example"},
        )
        assert repro.status_code in (400, 403, 415, 421), repro.text
        assert "--allowed-hosts" in _error(
            _post(server, {**json_type, "host": "attacker.example"}), 421, "invalid_host"
        )
        rebinding = _post(server, {**json_type, "host": f"attacker.example:{server.port}"})
        assert rebinding.status_code == 421
        assert "--allowed-origins" in _error(
            _post(server, {**json_type, "origin": "http://attacker.example"}), 403, "forbidden_origin"
        )
        assert _post(server, {**json_type, "origin": "null"}).status_code == 403  # a sandboxed page
        assert "application/json" in _error(
            _post(server, {"content-type": "text/plain"}), 415, "unsupported_media_type"
        )
        assert _post(server, {"content-type": "application/x-www-form-urlencoded"}).status_code == 415
        assert _post(server, {}).status_code == 415
        assert engine.added == []  # nothing refused reached the engine
        for host in ("localhost", "127.0.0.1", "[::1]", "LOCALHOST"):
            ok = _post(server, {**json_type, "host": f"{host}:{server.port}"})
            assert ok.status_code == 200, (host, ok.text)
        own = _post(server, {"content-type": "application/json; charset=utf-8", "origin": server.base_url})
        assert own.status_code == 200, own.text
        assert own.json()["choices"][0]["text"] == expected_text(tok, tok("the cat")["input_ids"], 4)
        metrics = httpx.get(server.base_url + "/metrics").text
        assert metric(metrics, 'mars_requests_total{outcome="refused"}') == 5


def test_an_api_key_is_required_from_every_client_but_the_health_probe(tok):
    server, engine, _ = start(tok, security=SecurityConfig(api_key=KEY))
    with server:
        with pytest.raises(openai.AuthenticationError) as refused:
            client(server).completions.create(model="tiny", **BODY)  # the client sends "Bearer unused"
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        keyed = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        out = keyed.completions.create(model="tiny", **BODY)
        assert out.choices[0].text == expected_text(tok, tok("the cat")["input_ids"], 4)
        assert [m.id for m in keyed.models.list().data] == ["tiny"]
        json_type = {"content-type": "application/json"}
        missing = _post(server, json_type)
        assert "Authorization: Bearer" in _error(missing, 401, "invalid_api_key")
        assert missing.headers["www-authenticate"] == "Bearer"
        for authorization in (f"Bearer {KEY}x", KEY, f"Basic {KEY}", f"Bearer {KEY[:-1]}"):
            assert _post(server, {**json_type, "authorization": authorization}).status_code == 401
        assert httpx.get(server.base_url + "/v1/models").status_code == 401
        assert httpx.get(server.base_url + "/metrics").status_code == 401
        assert httpx.get(server.base_url + "/health").status_code == 200  # load balancers' probe stays open
        # the key does not let a foreign page through
        foreign = _post(server, {**json_type, "authorization": f"Bearer {KEY}", "host": "attacker.example"})
        assert foreign.status_code == 421
        text = httpx.get(server.base_url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
        assert metric(text, 'mars_requests_total{outcome="unauthorized"}') == 8
        assert len(engine.added) == 1
    assert KEY not in repr(SecurityConfig(api_key=KEY))


def test_allowed_hosts_and_origins_let_named_clients_in(tok):
    """``--allowed-hosts`` adds names (``*``: any); ``--allowed-origins`` lets pages of that origin call the
    server, with CORS (a JSON POST's preflight is answered for them only)."""
    security = SecurityConfig(allowed_hosts=("Models.LAN:8000",), allowed_origins=("http://localhost:3000/",))
    server, engine, _ = start(tok, security=security)
    page = "http://localhost:3000"
    with server:
        json_type = {"content-type": "application/json"}
        assert _post(server, {**json_type, "host": "models.lan"}).status_code == 200
        assert _post(server, {**json_type, "host": "other.lan"}).status_code == 421
        called = _post(server, {**json_type, "origin": page})
        assert called.status_code == 200 and called.headers["access-control-allow-origin"] == page
        preflight = httpx.options(
            server.base_url + "/v1/completions",
            headers={
                "origin": page,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == page
        other = httpx.options(
            server.base_url + "/v1/completions",
            headers={"origin": "http://attacker.example", "access-control-request-method": "POST"},
        )
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    server, _, _ = start(tok, security=SecurityConfig(allowed_hosts=("*",)))
    with server:
        assert _post(server, {"content-type": "application/json", "host": "any.example"}).status_code == 200
    with pytest.raises(ValueError, match="scheme://host"):
        SecurityConfig(allowed_origins=("localhost:3000",))
    with pytest.raises(ValueError, match="empty"):
        SecurityConfig(api_key=" ")


def test_a_public_bind_without_a_key_is_logged_and_the_bound_address_is_a_host_name(tok, caplog):
    def build(host, security=None):
        config = ServerConfig(
            model_id="tiny",
            max_length=256,
            controller=ControllerConfig(tau_min=1.0, tau_max=1.0, enabled=False),
            security=security or SecurityConfig(),
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mars_hf.serving.server"):
            build_server(ScriptedEngine(), tok, config, host=host)
        return caplog.text

    public = build("0.0.0.0")
    assert "without an API key" in public and "--api-key" in public and "--allowed-hosts" in public
    assert "without an API key" in build("192.168.7.9")
    keyed = build("0.0.0.0", SecurityConfig(api_key=KEY, allowed_hosts=("models.lan",)))
    assert keyed == ""
    assert build("127.0.0.1") == "" and build("::1") == "" and build("localhost") == ""

    # the bound address is one of the names the server answers to
    from mars_hf.serving import BackgroundServer

    config = ServerConfig(model_id="tiny", max_length=256)
    app, _ = build_server(ScriptedEngine(), tok, config, host="127.0.0.2")
    with BackgroundServer(app, host="127.0.0.2") as server:  # the Host header is 127.0.0.2:PORT
        out = client(server).completions.create(model="tiny", **BODY)
        assert out.choices[0].text == expected_text(tok, tok("the cat")["input_ids"], 4)
