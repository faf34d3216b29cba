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
    from mars_hf.commands.serve import CONTROLLER_FLAGS, SERVER_FLAGS, config_kwargs
    from mars_hf.serving import ControllerConfig, ServerConfig

    assert set(SERVER_FLAGS.values()) == {f.name for f in fields(ServerConfig)} - {"model_id", "controller"}
    assert set(CONTROLLER_FLAGS.values()) <= {f.name for f in fields(ControllerConfig)}
    parser = build_parser()
    args = parser.parse_args(["serve", "m"])
    assert config_kwargs(args, SERVER_FLAGS) == {} and config_kwargs(args, CONTROLLER_FLAGS) == {}
    args = parser.parse_args(["serve", "m", "--max-rows", "3", "--request-timeout", "5", "--tau-min", "0.5"])
    assert config_kwargs(args, SERVER_FLAGS) == {"max_rows": 3, "request_timeout_s": 5.0}
    assert config_kwargs(args, CONTROLLER_FLAGS) == {"tau_min": 0.5}
