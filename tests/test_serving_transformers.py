"""`transformers serve` runs MARS: a checkpoint from `mars_hf.hub.save_pretrained`, `--trust-remote-code`.

With ``trust_remote_code`` transformers replaces the loaded model's ``generate`` by the checkpoint's
``custom_generate/generate.py``, and ``transformers serve`` builds each request's
``GenerationConfig(**json.loads(body["generation_config"]))``. So τ travels in the request's generation
config. The check that MARS really ran: at τ = 0 (every mask prediction accepted) the served text
equals mars_hf's own ``generate(mars_threshold=0.0)`` and differs from greedy decoding, which is what
τ = 1 and a request without τ return.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from mars_hf import hub
from mars_hf.serving.server import free_port
from tests.tiny import tiny_model, tiny_tokenizer

PROMPT = "the cat sat on"
CHAT_PROMPT = "the cat"
MAX_TOKENS = 8


def _wait_for(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    import httpx2

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(
                f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            if httpx2.get(url, timeout=2).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"transformers serve did not come up:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_transformers_serve_decodes_with_mars_from_the_request_generation_config(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model("llama", dtype=torch.float32, tokenizer=tok)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    checkpoint = tmp_path / "ckpt"
    hub.save_pretrained(model, tok, checkpoint, base_model="tiny-random-llama")

    from mars_hf.models.modeling import load_mars_model

    local, local_tok = load_mars_model(str(checkpoint), dtype=torch.float32)
    ids = local_tok(PROMPT, return_tensors="pt")
    mars_text = local_tok.decode(
        local.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False, mars_threshold=0.0)[
            0, ids.input_ids.shape[1] :
        ],
        skip_special_tokens=True,
    )
    greedy_text = local_tok.decode(
        local.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.input_ids.shape[1] :],
        skip_special_tokens=True,
    )
    assert mars_text != greedy_text  # otherwise this test could not tell MARS from greedy
    chat_ids = local_tok.apply_chat_template(
        [{"role": "user", "content": CHAT_PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )

    def chat_reply(**mars) -> str:
        out = local.generate(**chat_ids, max_new_tokens=MAX_TOKENS, do_sample=False, **mars)
        return local_tok.decode(out[0, chat_ids["input_ids"].shape[1] :], skip_special_tokens=True)

    chat_text = chat_reply(mars_threshold=0.0)
    assert chat_text != chat_reply()  # the chat reply, too, tells MARS from greedy

    port = free_port()
    log = tmp_path / "serve.log"
    command = [
        str(Path(sys.executable).with_name("transformers")), "serve", str(checkpoint),
        "--host", "127.0.0.1", "--port", str(port), "--trust-remote-code", "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(f"http://127.0.0.1:{port}/health", proc, log)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )

        def served(generation_config: dict | None) -> str:
            extra = {} if generation_config is None else {"generation_config": json.dumps(generation_config)}
            out = client.completions.create(
                model=str(checkpoint), prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body=extra
            )
            return out.choices[0].text

        assert served({"mars_threshold": 0.0, "do_sample": False}) == mars_text
        assert served({"mars_threshold": 1.0, "do_sample": False}) == greedy_text
        assert (
            served(None) == greedy_text
        )  # the checkpoint's generation_config.json sets no τ: stock decoding
        assert served({"mars_acceptance": "verify", "do_sample": False}) == greedy_text  # lossless
        chat = client.chat.completions.create(
            model=str(checkpoint),
            messages=[{"role": "user", "content": CHAT_PROMPT}],
            max_tokens=MAX_TOKENS,
            extra_body={"generation_config": json.dumps({"mars_threshold": 0.0, "do_sample": False})},
        )
        assert chat.choices[0].message.content == chat_text  # the chat route decodes with MARS too
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
