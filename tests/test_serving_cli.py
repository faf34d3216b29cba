"""`mars-hf serve` as a user starts it: a real process on loopback, driven by the `openai` client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
import torch

from mars_hf import hub
from mars_hf.decoding.generation import enable_mars
from tests.tiny import tiny_model, tiny_tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_command_answers_verify_and_tau_requests_and_shuts_down(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model("llama", tokenizer=tok, dtype=torch.float32)
    folder = tmp_path / "mars-checkpoint"
    hub.save_pretrained(model, tok, folder, base_model="tiny")
    port = _free_port()
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
