"""`mars-hf serve` on the real step-level decoder: outputs equal `model.generate`, row by row.

A float64 tiny model (exact token equality is meaningful) served by a real uvicorn server on
loopback; concurrent requests with different τ / verify share the batch and must each produce what
``model.generate`` produces for that request alone. The synthetic model checks the load controller.
"""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest
import torch

from mars_hf.decoding.generation import enable_mars
from mars_hf.serving import BackgroundServer, ControllerConfig, ServerConfig, build_server
from tests.tiny import tiny_model, tiny_tokenizer

HANG_GUARD_S = 120.0  # client timeouts that only catch a hang
PROMPTS = ["the cat sat on the mat", "a dog is red", "one two three", "hello world print", "x y z and"]


def reference(model, tok, prompt, max_new_tokens, **kwargs):
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
    )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def served():
    tok = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    config = ServerConfig(
        model_id="tiny",
        max_rows=3,
        max_length=96,
        controller=ControllerConfig(tau_min=1.0, tau_max=1.0, enabled=False),
    )
    app, scheduler = build_server(model, tok, config)
    with BackgroundServer(app) as server:
        yield server, model, tok, scheduler


def test_mixed_tau_and_verify_in_one_batch_equal_generate(served):
    server, model, tok, scheduler = served
    cases = [(p, setting) for p in PROMPTS for setting in (None, 0.0, 0.6, "verify")][:12]

    async def one(ac, prompt, setting, stream):
        extra = (
            {"mars_acceptance": "verify"}
            if setting == "verify"
            else ({} if setting is None else {"mars_threshold": setting})
        )
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=10, extra_body=extra)
        if not stream:
            out = await ac.completions.create(**kwargs)
            return out.choices[0].text, out.usage.model_dump()
        text, usage = "", None
        async for chunk in await ac.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        ):
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        return text, usage

    async def main():
        ac = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S
        )
        return await asyncio.gather(*(one(ac, p, s, i % 2 == 0) for i, (p, s) in enumerate(cases)))

    results = asyncio.run(main())
    for (prompt, setting), (text, usage) in zip(cases, results):
        greedy = reference(model, tok, prompt, 10)
        if setting in (None, "verify"):  # τ = 1 (server default here) and verify are lossless
            assert text == greedy, (prompt, setting)
        else:
            assert text == reference(model, tok, prompt, 10, mars_threshold=setting), (prompt, setting)
        if setting == 0.0:
            assert usage["mars_tokens_per_forward"] > 1.0  # τ = 0 accepts the whole window
        if setting is None:
            assert usage["mars_threshold"] == 1.0 and usage["mars_tokens_per_forward"] == 1.0
    assert scheduler.engine.num_rows == 0  # every finished row gave its slot back
    # no autograd graph through the KV cache (with one, every step's tensors stay alive: memory grows)
    assert not any(layer.keys.requires_grad for layer in scheduler.engine.decoder.kv.layers)


def test_chat_stream_equals_non_stream_and_a_seed_reproduces_samples(served):
    server, model, tok, _ = served
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
    messages = [{"role": "user", "content": "the cat sat"}]
    plain = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, extra_body={"mars_threshold": 0.5}
    )
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, stream=True, extra_body={"mars_threshold": 0.5}
        )
        if ch.choices
    )
    assert streamed == plain.choices[0].message.content

    def sample(seed: int, extra: dict) -> str:
        out = c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, seed=seed, temperature=2.0, extra_body=extra
        )
        return out.choices[0].message.content

    # A row's seed drives its own generator: the same seed draws the same sample, another seed another one
    # (which greedy decoding, ignoring the seed, could not do), for verified and τ rows alike.
    for extra in ({"mars_acceptance": "verify"}, {"mars_threshold": 0.5}):
        first = sample(3, extra)
        assert sample(3, extra) == first, extra
        assert sample(4, extra) != first, extra


@pytest.mark.slow
def test_synthetic_controller_lowers_tau_under_load_and_keeps_tau_max_at_low_load():
    from mars_hf.tools.synthetic import load_synthetic_model, synthetic_prompts

    model, tok = load_synthetic_model()
    model = enable_mars(model)
    controller = ControllerConfig(tau_min=0.5, tau_max=0.95, raise_per_second=50.0)
    app, scheduler = build_server(
        model, tok, ServerConfig(model_id="syn", max_rows=4, max_length=192, controller=controller)
    )
    prompts = synthetic_prompts(16, seed=7)

    async def burst(ac):
        return await asyncio.gather(
            *(
                ac.chat.completions.create(
                    model="syn", messages=[{"role": "user", "content": p}], max_tokens=40
                )
                for p in prompts
            )
        )

    with BackgroundServer(app) as server:
        c = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S
        )
        alone = c.chat.completions.create(
            model="syn", messages=[{"role": "user", "content": prompts[0]}], max_tokens=40
        )
        assert alone.usage.model_dump()["mars_threshold"] == 0.95  # low load: τ_max
        # The burst's queue is arranged, not hoped for: no step ends before all 16 requests are in.
        release, submit, step = threading.Event(), scheduler.submit, scheduler.engine.step
        submitted = []

        def counted(request):
            submit(request)
            submitted.append(request)
            if len(submitted) == len(prompts):
                release.set()

        def held():
            if not release.wait(HANG_GUARD_S):  # a hang guard
                raise RuntimeError("the burst never reached the server")
            return step()

        scheduler.submit, scheduler.engine.step = counted, held
        results = asyncio.run(
            burst(
                openai.AsyncOpenAI(
                    base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S
                )
            )
        )
    taus = [r.usage.model_dump()["mars_threshold"] for r in results]
    assert min(taus) < 0.95  # 16 requests on 4 slots: the queue pushed τ down
    tpf = [r.usage.model_dump()["mars_tokens_per_forward"] for r in results]
    assert sum(tpf) / len(tpf) > 2.0  # high acceptance: several tokens per forward


def test_the_scheduler_routes_the_decoders_kernels_once_for_its_whole_loop(monkeypatch):
    """A served float32 model on packed kernels: the scheduler's thread routes the linears once, not at every
    step (each step's own block then costs nothing), serves the same tokens as `generate`, and restores the
    model's stock kernels when it stops."""
    from mars_hf.decoding import cpu_kernels
    from mars_hf.decoding.decoder import RowSettings
    from mars_hf.serving import TauController
    from mars_hf.serving.engine import DecoderEngine
    from mars_hf.serving.request import GenerationRequest, Tokens
    from mars_hf.serving.scheduler import Scheduler

    tok = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tok, dtype=torch.float32))
    installs, install = [], cpu_kernels._install
    monkeypatch.setattr(
        cpu_kernels, "_install", lambda linear, *rest: (installs.append(linear), install(linear, *rest))[1]
    )
    monkeypatch.setattr(cpu_kernels, "use_packed", lambda model, mode="auto": True)
    prompt = tok(PROMPTS[0])["input_ids"]
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    engine = DecoderEngine(model, max_rows=2, max_length=96)  # measures its cost curves on packed kernels
    installs.clear()
    scheduler = Scheduler(
        engine, TauController(ControllerConfig(tau_min=1.0, tau_max=1.0, enabled=False), slots=2)
    )
    settings = RowSettings(threshold=1.0, max_new_tokens=12, eos_token_ids=(tok.eos_token_id,))
    request = GenerationRequest(list(prompt), settings, pinned=True)
    served = []
    monkeypatch.setattr(request, "deliver", lambda event: served.append(event), raising=False)
    scheduler.start()
    scheduler.submit(request)
    deadline = time.monotonic() + HANG_GUARD_S
    while request.finished_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.shutdown(grace_s=0.0)
    assert request.finished_at is not None, "the request never finished (a hang guard)"
    assert engine.num_forwards > 2 and len(installs) == len(cpu_kernels._linears(model))
    assert not cpu_kernels.active(model)
    tokens = [token for event in served if isinstance(event, Tokens) for token in event.tokens]
    assert tokens == expected[0, ids.shape[1] :].tolist()


def test_the_engine_measures_every_batch_size_at_start_and_never_while_serving(monkeypatch):
    """A server's batch grows and shrinks as requests come and go: the engine measures the planner's cost
    curve of every batch bucket up to ``max_rows`` when it is built, and none while serving (a probe there
    would stall every request in the batch). Verify rows of different lengths served together, joining
    and leaving, decode what `generate` decodes for each alone."""
    from mars_hf.decoding import cost_model
    from mars_hf.decoding.cost_model import CostTable
    from mars_hf.decoding.decoder import RowSettings
    from mars_hf.serving.engine import DecoderEngine

    tok = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    measured = []

    def reading(model, *, batch, **_):
        measured.append(batch)
        return CostTable.from_mapping({1: 1.0, 9: 1.2, 10: 3.0}, "measured", batch)

    monkeypatch.setattr(cost_model, "measure", reading)
    engine = DecoderEngine(model, max_rows=4, max_length=96)
    assert sorted(measured) == [1, 2, 4]
    lengths = {PROMPTS[0]: 3, PROMPTS[1]: 11, PROMPTS[2]: 6, PROMPTS[3]: 9, PROMPTS[4]: 2}
    waiting, served, ids = list(lengths), {}, {}
    while waiting or ids:
        while waiting and engine.free_slots:
            prompt = waiting.pop(0)
            settings = RowSettings(
                acceptance="verify", max_new_tokens=lengths[prompt], eos_token_ids=(tok.eos_token_id,)
            )
            ids[engine.add_row(tok(prompt)["input_ids"], settings)] = prompt
            served[prompt] = []
        for update in engine.step():
            served[ids[update.row_id]] += list(update.tokens)
            if update.finished:
                engine.drop_row(update.row_id)
                del ids[update.row_id]
    assert sorted(measured) == [1, 2, 4] and len(engine.planner_memory.cost_tables) == 3  # the engine's own
    for prompt, tokens in served.items():
        assert tok.decode(tokens, skip_special_tokens=True) == reference(model, tok, prompt, lengths[prompt])


def test_a_cost_curve_given_after_start_up_replaces_the_measured_ones(monkeypatch):
    """The engine measures every bucket's curve at start-up; a curve given afterwards (``decoder.cost_given``,
    "settable between steps") is the one the next step plans on, for every bucket, not the start-up probe's."""
    from mars_hf.decoding import cost_model
    from mars_hf.decoding.cost_model import CostTable
    from mars_hf.serving.engine import DecoderEngine

    tok = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    steep = {1: 1.0, 2: 5.0, 10: 9.0}
    monkeypatch.setattr(
        cost_model, "measure", lambda model, *, batch, **_: CostTable.from_mapping(steep, "measured", batch)
    )
    engine = DecoderEngine(model, max_rows=4, max_length=96)
    planner = engine.decoder.planner
    assert {planner.cost_table(rows).source for rows in (1, 2, 4)} == {"measured"}
    engine.decoder.cost_given = {1: 1.0, 12: 1.1, 40: 1.6}
    for rows in (1, 2, 4):
        table = planner.cost_table(rows)
        assert table.source == "given" and table.batch == rows
        assert table.as_dict() == CostTable.from_mapping({1: 1.0, 12: 1.1, 40: 1.6}, "given", rows).as_dict()


@pytest.mark.parametrize("flag, expected", [([], "auto"), (["--cpu-kernels", "stock"], "stock")])
def test_the_servers_kernels_come_from_its_flag(flag, expected):
    """`mars-hf serve` is our own command: it picks the measured-faster kernels by default ("auto"), unlike
    generate's stock default, and `--cpu-kernels` reaches the decoder."""
    from mars_hf.cli import build_parser
    from mars_hf.commands.serve import server_config

    args = build_parser().parse_args(["serve", "some-model", *flag])
    config = server_config(args)
    tok = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tok, dtype=torch.float32))
    _, scheduler = build_server(model, tok, config)
    assert config.cpu_kernels == expected and scheduler.engine.decoder.cpu_kernels == expected


@pytest.mark.parametrize("flag, planned", [([], False), (["--tau-window", "planned"], True)])
def test_the_servers_tau_window_comes_from_its_flag(flag, planned):
    """`mars-hf serve` feeds τ rows the paper's W masks at every step by default (a request that pins τ gets the
    same text whatever is served beside it), and `--tau-window planned` lets the planner size them
    (mars_planner=True): a served τ = 0 row's plan counts say which ran."""
    from mars_hf.cli import build_parser
    from mars_hf.commands.serve import server_config
    from mars_hf.decoding.decoder import RowSettings

    config = server_config(build_parser().parse_args(["serve", "some-model", *flag]))
    tok = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", tokenizer=tok, dtype=torch.float32))
    _, scheduler = build_server(model, tok, config)
    engine = scheduler.engine
    row = engine.add_row(tok(PROMPTS[0])["input_ids"], RowSettings(threshold=0.0, max_new_tokens=6))
    finished = False
    while not finished:
        finished = any(update.finished for update in engine.step() if update.row_id == row)
    counts = engine.decoder.plan_counts
    assert config.tau_window == ("planned" if planned else "fixed")
    assert ("fixed" not in counts) if planned else (set(counts) == {"fixed"}), counts
    with pytest.raises(ValueError, match="tau_window"):
        ServerConfig(tau_window="sometimes")
