"""`mars-hf serve` as a user starts it: a real process on loopback, driven by the `openai` client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest
import torch

from mars_hf import hub
from mars_hf.decoding.generation import enable_mars
from tests.tiny import tiny_model, tiny_tokenizer


@pytest.mark.slow
def test_serve_command_answers_verify_and_tau_requests_and_shuts_down(tmp_path, free_port):
    tok = tiny_tokenizer()
    model = tiny_model("llama", tokenizer=tok, dtype=torch.float32)
    folder = tmp_path / "mars-checkpoint"
    hub.save_pretrained(model, tok, folder, base_model="tiny")
    port = free_port
    process = subprocess.Popen(
        [sys.executable, "-m", "mars_hf.cli", "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
         "--max-rows", "4", "--tau-min", "0.7", "--tau-max", "0.95"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        deadline = time.time() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert process.poll() is None and time.time() < deadline, "server did not come up"
                time.sleep(0.5)
        prompt = "the cat sat on"
        verified = client.completions.create(
            model="mars-checkpoint", prompt=prompt, max_tokens=8, extra_body={"mars_acceptance": "verify"}
        )
        reference = enable_mars(model)
        ids = torch.tensor([tok(prompt).input_ids])
        greedy = reference.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id)
        assert verified.choices[0].text == tok.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True)
        pinned = client.completions.create(
            model="mars-checkpoint", prompt=prompt, max_tokens=8, extra_body={"mars_threshold": 0.9}
        )
        assert pinned.usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError):
            client.completions.create(
                model="mars-checkpoint", prompt=prompt, max_tokens=8, extra_body={"mars_threshold": 2}
            )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode in (0, -signal.SIGTERM)


def test_serve_flags_leave_their_defaults_to_the_config_dataclasses():
    """Every ServerConfig setting has a flag; a flag not given leaves the dataclass default (no copy of it
    in argparse to drift), a given one reaches its field."""
    from dataclasses import fields

    from mars_hf.cli import build_parser
    from mars_hf.commands.serve import CONTROLLER_FLAGS, SECURITY_FLAGS, SERVER_FLAGS, config_kwargs
    from mars_hf.serving import ControllerConfig, SecurityConfig, ServerConfig

    nested = {"model_id", "controller", "security"}
    assert set(SERVER_FLAGS.values()) == {f.name for f in fields(ServerConfig)} - nested
    assert set(CONTROLLER_FLAGS.values()) <= {f.name for f in fields(ControllerConfig)}
    assert set(SECURITY_FLAGS.values()) == {f.name for f in fields(SecurityConfig)}
    parser = build_parser()
    args = parser.parse_args(["serve", "m"])
    assert config_kwargs(args, SERVER_FLAGS) == {} and config_kwargs(args, CONTROLLER_FLAGS) == {}
    assert config_kwargs(args, SECURITY_FLAGS) == {}
    args = parser.parse_args(["serve", "m", "--max-rows", "3", "--request-timeout", "5", "--tau-min", "0.5"])
    assert config_kwargs(args, SERVER_FLAGS) == {"max_rows": 3, "request_timeout_s": 5.0}
    assert config_kwargs(args, CONTROLLER_FLAGS) == {"tau_min": 0.5}


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_request_timeout_that_would_504_every_request_is_refused_at_startup(value):
    """Issue 52, fault 13: ``--request-timeout 0`` (or negative) was accepted and every request then got a 504."""
    from mars_hf.serving import ServerConfig

    process = subprocess.run(
        [sys.executable, "-m", "mars_hf.cli", "serve", "synthetic", f"--request-timeout={value}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert process.returncode == 2, process.stderr  # argparse's usage error, before any model is loaded
    assert "--request-timeout" in process.stderr and "> 0" in process.stderr, process.stderr
    with pytest.raises(ValueError, match="request_timeout_s.*--request-timeout"):
        ServerConfig(request_timeout_s=float(value))
    with pytest.raises(ValueError, match="--shutdown-grace"):
        ServerConfig(shutdown_grace_s=-1.0)
    assert ServerConfig(request_timeout_s=None).request_timeout_s is None  # the library's "no timeout"


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from mars_hf.cli import build_parser
    from mars_hf.commands.serve import server_config

    parser = build_parser()
    monkeypatch.delenv("MARS_HF_API_KEY", raising=False)
    assert server_config(parser.parse_args(["serve", "m"])).security.api_key is None
    monkeypatch.setenv("MARS_HF_API_KEY", "from-env")
    assert server_config(parser.parse_args(["serve", "m"])).security.api_key == "from-env"
    args = parser.parse_args(
        [
            "serve",
            "m",
            "--api-key",
            "flag",
            "--allowed-hosts",
            "a.lan, b.lan",
            "--allowed-origins",
            "http://x:3",
        ]
    )
    security = server_config(args).security
    assert security.api_key == "flag" and security.allowed_hosts == ("a.lan", "b.lan")
    assert security.allowed_origins == ("http://x:3",)
