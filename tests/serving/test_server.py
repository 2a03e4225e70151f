"""``python -m optimized.serve`` as a client sees it: the official ``openai`` client against a live server.

One server (the tiny model of conftest.py, adaptive verification, 8 slots, 40 waiting places, an API key) serves
the whole module; the last test drains it with SIGTERM. Greedy text is compared with ``python -m optimized.generate``
and with the target's own greedy decoding; every bad-input class checks the status, the OpenAI error body, that
``/health`` stays 200 and that no slot is held afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.conftest import LiveServer, tiny_server_args

# One torch thread in this process too: two threads on the shared 2-core CI machine make a tiny forward 10× slower.
pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["Hello there", "Name three planets.", "abc", "What is 2 + 2?", "Tell me a story about a cat",
           "x", "Why is the sky blue?", "List: 1, 2, 3"]


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    srv = LiveServer(tiny_server_args(tiny_dirs, "--api-key", KEY), cache, cache / "server.log")
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def gauge(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def assert_idle(url: str, timeout: float = 15.0) -> None:
    """``/health`` is 200 and, within ``timeout``, no request holds a slot or waits for one."""
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = gauge(m, "vllm:num_requests_running") + gauge(m, "vllm:num_requests_waiting")
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"{busy} requests still hold or wait for a slot"
        time.sleep(0.2)


def chat_stream(client, **kw) -> tuple[str, str | None, object]:
    text, reason, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            reason = c.finish_reason or reason
    return "".join(text), reason, usage


def completion_stream(client, **kw) -> tuple[str, str | None]:
    text, reason = [], None
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text.append(c.text)
            reason = c.finish_reason or reason
    return "".join(text), reason


def reference_greedy(tiny_dirs, prompts: list[str], max_tokens: int, chat: bool = True) -> list[str]:
    """The target alone, one prompt at a time, argmax after argmax until an end-of-reply token: what every mode
    must emit at T = 0 (plain forwards of the HF model; the reference loop is the textbook, not fast)."""
    import torch

    from reference.target import Target

    target = Target.load(str(tiny_dirs[0]))
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = target.encode(p, chat_template=chat)
            new = []
            while len(new) < max_tokens and not (new and new[-1] in target.eos_token_ids):
                logits = target.model(torch.tensor([ids + new])).logits[0, -1]
                new.append(int(logits.argmax()))
            out.append(target.decode(new))
    return out


# ------------------------------------------------------------------------------------------------------------
# Happy paths
# ------------------------------------------------------------------------------------------------------------


def test_health_models_and_startup_log(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    log = server.log.read_text()
    for stage in ("imports", "target weights", "drafter", "engine", "step-cost table", "kernel warm-up", "ready in"):
        assert f"start-up: {stage}" in log


def test_greedy_text_is_the_same_everywhere(server, client, tiny_dirs, tmp_path, capsys, monkeypatch):
    """Streamed == non-streamed == ``python -m optimized.generate`` == the target alone, chat and completions."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CLI on the torch kernels, as the server runs
    from optimized.generate import main as generate_main
    from reference.cost_model import CostTable

    prompts, n = PROMPTS[:3], 24
    chat, chat_streamed, raw, raw_streamed = [], [], [], []
    for p in prompts:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=n,
                                           temperature=0)
        chat.append(r.choices[0].message.content)
        assert r.usage.completion_tokens <= n
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        text, reason, usage = chat_stream(client, model="tiny", messages=[{"role": "user", "content": p}],
                                          max_tokens=n, temperature=0)
        chat_streamed.append(text)
        assert (reason, usage.completion_tokens, usage.prompt_tokens) == (r.choices[0].finish_reason,
                                                                          r.usage.completion_tokens,
                                                                          r.usage.prompt_tokens)
        r = client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
        raw.append(r.choices[0].text)
        raw_streamed.append(completion_stream(client, model="tiny", prompt=p, max_tokens=n, temperature=0)[0])
    assert chat_streamed == chat and raw_streamed == raw
    assert chat == reference_greedy(tiny_dirs, prompts, n)
    assert raw == reference_greedy(tiny_dirs, prompts, n, chat=False)
    # The command-line twin, same mode (adaptive; its cost table only changes verify lengths, never greedy tokens).
    table = tmp_path / "cost.json"
    CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, sizes=list(range(1, 65))).save(table)
    model_dir, drafter_dir = tiny_dirs
    argv = ["--model", str(model_dir), "--drafter", str(drafter_dir), "--max-new-tokens", str(n), "--json",
            "--cost-table", str(table), "--device", "cpu"]
    capsys.readouterr()
    assert generate_main([*argv, *sum((["--prompt", p] for p in prompts), [])]) == 0
    assert [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()] == chat
    assert generate_main([*argv, "--no-chat-template", *sum((["--prompt", p] for p in prompts), [])]) == 0
    assert [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()] == raw
    assert_idle(server.url)


def test_seeded_sampling_is_reproducible(server, client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Pick a word"}], max_tokens=20, temperature=1.5,
              top_p=0.95, extra_body={"top_k": 40})
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    streamed, _, _ = chat_stream(client, seed=1234, **kw)
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert a == b == streamed
    assert others != {a}, "different seeds all gave the seed-1234 text"


def test_logprobs_and_usage(server, client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for tok in content:  # greedy: the emitted token is the most likely one, and its logprob is the top one
        assert len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].token == tok.token and tok.top_logprobs[0].logprob == pytest.approx(tok.logprob)
        assert tok.logprob <= 0 and tok.bytes == list(tok.token.encode())
    c = client.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == c.choices[0].text  # character tokens, no special ones among the first five
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 3 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))


def test_stop_strings_cut_the_text(server, client):
    base = client.completions.create(model="tiny", prompt="Hello there", max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = text[5:7]  # two characters from the middle of the greedy text
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    assert completion_stream(client, model="tiny", prompt="Hello there", max_tokens=24, temperature=0,
                             stop=stop) == (r.choices[0].text, "stop")


def test_32_concurrent_streams_each_equal_alone(server, tiny_dirs):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(32)]
    n = 12

    async def one(c, p):
        text = []
        async for chunk in await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                           max_tokens=n, temperature=0, stream=True):
            for ch in chunk.choices:
                text.append(ch.delta.content or "")
        return "".join(text)

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(all_at_once()) == reference_greedy(tiny_dirs, prompts, n)
    assert_idle(server.url)


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "x"}]
BAD = {  # name: (path, headers, body (dict → JSON, bytes → raw), status, error code or None, param or None)
    "malformed JSON": (CHAT, HEADERS, b'{"messages": [', 400, None, None),
    "not an object": (CHAT, HEADERS, b"[1, 2]", 400, None, None),
    "empty body": (CHAT, HEADERS, b"", 400, None, None),
    "wrong type": (CHAT, HEADERS, {"messages": MSG, "max_tokens": "many"}, 400, None, "max_tokens"),
    "out of range": (CHAT, HEADERS, {"messages": MSG, "temperature": -0.5}, 400, None, "temperature"),
    "top_p zero": (CHAT, HEADERS, {"messages": MSG, "top_p": 0}, 400, None, "top_p"),
    "bad role": (CHAT, HEADERS, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None, None),
    "no messages": (CHAT, HEADERS, {"messages": []}, 400, None, "messages"),
    "n > 1": (CHAT, HEADERS, {"messages": MSG, "n": 3}, 400, None, "n"),
    "unsupported penalty": (CHAT, HEADERS, {"messages": MSG, "frequency_penalty": 0.5}, 400, None,
                            "frequency_penalty"),
    "prompt too long": ("/v1/completions", HEADERS, {"prompt": "y" * 200}, 400, "context_length_exceeded",
                        "prompt"),
    "completion too long": (CHAT, HEADERS, {"messages": MSG, "max_tokens": 500}, 400, "context_length_exceeded",
                            "max_tokens"),
    "token id out of vocab": ("/v1/completions", HEADERS, {"prompt": [5, 99999]}, 400, None, "prompt"),
    "empty prompt": ("/v1/completions", HEADERS, {"prompt": ""}, 400, None, "prompt"),
    "body too large": ("/v1/completions", HEADERS, {"prompt": "z" * 100_000}, 413, "request_too_large", None),
    "unknown model": (CHAT, HEADERS, {"messages": MSG, "model": "gpt-9"}, 404, "model_not_found", "model"),
    "unknown route": ("/v1/embeddings", HEADERS, {"input": "x"}, 404, None, None),
    "missing API key": (CHAT, {}, {"messages": MSG}, 401, "invalid_api_key", None),
    "wrong API key": (CHAT, {"Authorization": "Bearer nope"}, {"messages": MSG}, 401, "invalid_api_key", None),
    "no key, bad JSON": (CHAT, {}, b"{", 401, "invalid_api_key", None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(server, case):
    path, headers, body, status, code, param = BAD[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={**headers, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("authentication_error" if status == 401 else "invalid_request_error")
    if code:
        assert err["code"] == code
    if param:
        assert err["param"] == param
    assert_idle(server.url)


def test_the_openai_client_raises_its_own_errors(server, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MSG)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


# ------------------------------------------------------------------------------------------------------------
# Slots: disconnects, aborts, the waiting bound
# ------------------------------------------------------------------------------------------------------------


def test_disconnects_free_their_slots_and_the_queue_is_bounded(server):
    """48 long streams fill 8 slots and 40 waiting places; the 49th gets 429. Closing the streams — mid-stream
    for the running ones, before their first token for the waiting ones — aborts them, and every slot frees."""
    body = {"model": "tiny", "messages": MSG, "max_tokens": 60, "ignore_eos": True, "temperature": 0, "stream": True}
    before = gauge(scrape(server.url), "vllm:request_success_total")

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as c:
            streams = []
            for _ in range(48):
                cm = c.stream("POST", CHAT, json=body)
                r = await cm.__aenter__()
                assert r.status_code == 200
                streams.append((cm, r))
            over = await c.post(CHAT, json=body)
            assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_requests"
            assert over.headers["retry-after"] == "1", "a 429 says when to come back"
            lines = streams[0][1].aiter_lines()  # a running request: read a few events mid-stream
            got = 0
            while got < 3:
                got += (await lines.__anext__()).startswith("data:")
            m = scrape(server.url)
            assert gauge(m, "vllm:num_requests_running") == 8
            for cm, _ in streams:
                await cm.__aexit__(None, None, None)

    asyncio.run(run())
    assert_idle(server.url)
    m = scrape(server.url)
    aborted = m[("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "tiny")))]
    assert aborted >= 48 and gauge(m, "vllm:request_success_total") - before >= 48


def _finished(url: str) -> dict[str, float]:
    """``vllm:request_success_total`` by finish reason."""
    return {dict(labels).get("finished_reason"): v for (n, labels), v in scrape(url).items()
            if n == "vllm:request_success_total"}


def test_non_streaming_disconnect_frees_the_slot(server):
    before = _finished(server.url)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=60) as c:
            task = asyncio.create_task(c.post(CHAT, json={"messages": MSG, "max_tokens": 60, "ignore_eos": True}))
            deadline = time.monotonic() + 30
            while True:  # cancel as soon as the request holds a slot (a fixed sleep races a fast machine)
                text = (await c.get("/metrics")).text
                running = sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                              if s.name == "vllm:num_requests_running")
                if running >= 1:
                    break
                assert not task.done() and time.monotonic() < deadline, "the request never got a slot"
                await asyncio.sleep(0.005)
            task.cancel()  # closes the connection while the server generates
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())
    assert_idle(server.url)
    # Aborted, not finished: the disconnect (not the end of generation) freed the slot.
    after = _finished(server.url)
    assert after.get("abort", 0) == before.get("abort", 0) + 1
    assert {k: v for k, v in after.items() if k != "abort"} == {k: v for k, v in before.items() if k != "abort"}


# ------------------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------------------


def test_metrics_account_for_the_traffic(server, client):
    before = scrape(server.url)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=16,
                                       temperature=0, extra_body={"ignore_eos": True})
    after = scrape(server.url)

    def delta(name):
        return gauge(after, name) - gauge(before, name)

    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens == 16
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    # every token after the first came from a verifying request-step: one per step plus the accepted drafts
    assert delta("dspark:request_steps_total") + delta("vllm:spec_decode_num_accepted_tokens_total") == 15
    assert gauge(after, "dspark:mean_accepted_length") >= 1.0
    assert gauge(after, "dspark:step_time_seconds_count") > 0
    slots = {dict(labels)["slot"] for (name, labels), _ in after.items() if name == "dspark:calibration_error"}
    assert slots and slots <= {"1", "2", "3", "4"}
    for (name, _), v in after.items():
        if name in ("dspark:calibration_predicted_survival", "dspark:calibration_realised_survival"):
            assert 0.0 <= v <= 1.0


# ------------------------------------------------------------------------------------------------------------
# Fuzz
# ------------------------------------------------------------------------------------------------------------


def test_fuzzed_request_bodies_never_get_a_5xx(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
    json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.text(max_size=8), kids, max_size=3), max_leaves=8)
    fields = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
              "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos",
              "presence_penalty", "logit_bias", "echo", "tools", "response_format"]
    plausible = {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                             "content": st.text(max_size=20) | json_values}),
                                      max_size=3),
                 "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 200), max_size=8),
                 "max_tokens": st.integers(-2, 4), "stream": st.booleans(), "logprobs": st.integers(-1, 25),
                 "top_logprobs": st.integers(-1, 25), "temperature": st.floats(-1, 3), "model": st.just("tiny")}
    bodies = st.dictionaries(st.sampled_from(fields), json_values, max_size=6) | st.fixed_dictionaries(
        {}, optional={k: v | json_values for k, v in plausible.items()})

    @settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", CHAT]), body=bodies | json_values)
    def check(path, body):
        try:
            content = json.dumps(body).encode()  # NaN and Infinity included, as Python's json writes them
        except ValueError:
            return
        with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
            with c.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
                assert r.status_code < 500, r.read()
                r.read()
                if r.headers.get("content-type", "").startswith("text/event-stream"):
                    assert b'"error"' not in r.content

    check()
    assert_idle(server.url)


# ------------------------------------------------------------------------------------------------------------
# The serving benchmark against this server
# ------------------------------------------------------------------------------------------------------------


def test_bench_serving_reports_the_schema(server, tmp_path):
    from scripts import bench_serving

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    before = scrape(server.url)
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    report = bench_serving.main(["--base-url", server.url, "--api-key", KEY, "--label", "adaptive",
                                 "--concurrency", "1,2", "--output-len", "8", "--prompts-per-user", "2",
                                 "--min-requests", "3", "--prompts-file", str(prompts), "--drafter", "tiny",
                                 "--out", str(out), "--plot", str(png)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report)) and png.stat().st_size > 0
    assert {"hardware", "model", "drafter", "command", "results"} <= set(report)
    rows = report["results"]
    assert [(r["mode"], r["k"], r["concurrency"], r["requests"], r["errors"]) for r in rows] == [
        ("adaptive", None, 1, 3, 0), ("adaptive", None, 2, 4, 0)]
    for r in rows:
        assert r["output_tokens"] == 8 * r["requests"]
        assert r["output_tokens_per_s"] > 0 and r["per_user_tokens_per_s"] > 0
        assert 0 < r["ttft_ms_p50"] and 0 < r["tpot_ms_p50"] <= r["itl_ms_p99"] * 8
        assert r["mean_accepted_length"] >= 1.0
        # where the time went: the engine's steps and busy share from the server's counters, the server's own
        # TTFT (submit to first token) inside the client's, the client's CPU (no --server-pid: the server's unknown)
        assert r["engine_decode_steps"] <= r["engine_steps"] and r["engine_steps"] >= 7 * r["requests"] / 2
        assert 1.0 <= r["engine_requests_per_step"] <= r["concurrency"]
        assert 0 < r["engine_step_ms_mean"] and 0 < r["engine_busy_share"] < 1.5
        assert 0 < r["server_ttft_ms_mean"] < r["ttft_ms_mean"]
        assert r["client_cpu_share"] > 0 and r["server_cpu_share"] is None and r["engine_process_cpu_share"] is None
    # warm-up requests (one per user, 8 tokens each) + measured ones: every generated token is accounted for
    name = "vllm:generation_tokens_total"
    generated = gauge(scrape(server.url), name) - gauge(before, name)
    assert generated == 8 * (1 + 2) + sum(r["output_tokens"] for r in rows)


def test_bench_serving_client_processes_share_the_users(server, tmp_path):
    """``--client-processes 2``: the level's users split over two client processes that start together and share
    one request counter, so the level sends exactly its requests; the server's CPU is read through ``--server-pid``
    (this module's server runs its engine on a thread: no engine process)."""
    from scripts import bench_serving

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    report = bench_serving.main(["--base-url", server.url, "--api-key", KEY, "--label", "adaptive",
                                 "--concurrency", "3", "--output-len", "16", "--prompts-per-user", "2",
                                 "--min-requests", "1", "--prompts-file", str(prompts), "--client-processes", "2",
                                 "--server-pid", str(server.proc.pid)])
    (row,) = report["results"]
    assert report["settings"]["client_processes"] == 2
    assert (row["requests"], row["errors"], row["output_tokens"]) == (6, 0, 96)
    # /proc counts CPU in 10 ms ticks: about a hundred tokens keep the server's share of the level well above one
    assert row["client_cpu_share"] > 0 and row["server_cpu_share"] > 0 and row["engine_process_cpu_share"] == 0


def test_bench_serving_launch_sweeps_every_mode(server, tmp_path, monkeypatch):
    """``--launch``: one server per mode, its --speculative-config from the mode, the flags passed through and
    --max-num-seqs sized to the largest concurrency; stopped after its levels. (The launched process itself is
    exercised in test_smollm2.py; here a stand-in points at this module's server.)"""
    from scripts import bench_serving

    launched = []

    class StandIn:
        def __init__(self, mode, server_args, log_path):
            launched.append((mode.label, mode.speculative_config(), server_args, log_path.name))
            self.url = server.url

        def wait_ready(self):
            return 1.5 + len(launched)

        def stop(self):
            launched.append("stopped")

    monkeypatch.setattr(bench_serving, "LaunchedServer", StandIn)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    report = bench_serving.main(["--launch", "--modes", "none,fixed:2", "--server-args", "--model tiny-dir",
                                 "--concurrency", "1,2", "--output-len", "4", "--prompts-per-user", "1",
                                 "--min-requests", "1", "--prompts-file", str(prompts), "--api-key", KEY,
                                 "--log-dir", str(tmp_path)])
    args = ["--model", "tiny-dir", "--max-num-seqs", "2"]
    assert launched == [("none", '{"mode": "none"}', args, "serve-none.log"), "stopped",
                        ("fixed:2", '{"mode": "fixed", "num_speculative_tokens": 2}', args, "serve-fixed2.log"),
                        "stopped"]
    assert [(r["mode"], r["k"], r["concurrency"]) for r in report["results"]] == [
        ("none", None, 1), ("none", None, 2), ("fixed", 2, 1), ("fixed", 2, 2)]
    # Each launch's time to /health 200, in launch order (the first one is the cold start-up).
    assert report["startup"] == [{"mode": "none", "launch": 1, "ready_s": 2.5},
                                 {"mode": "fixed:2", "launch": 2, "ready_s": 4.5}]


# ------------------------------------------------------------------------------------------------------------
# Slow clients
# ------------------------------------------------------------------------------------------------------------


def test_slow_clients_are_timed_out_and_the_server_stays_healthy(tiny_dirs, tmp_path):
    """``--header-timeout 1 --body-timeout 1``, over raw sockets: half a body gets a 408 in OpenAI's shape, a
    connection that sends nothing is closed, each within about a second; then the server still serves."""
    import socket

    srv = LiveServer(tiny_server_args(tiny_dirs, "--header-timeout", "1", "--body-timeout", "1"), tmp_path,
                     tmp_path / "server.log")

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", srv.port), timeout=10)

    def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
        """(status line and headers, body) of one response with a Content-Length."""
        data = b""
        while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length:")))
        while len(rest) < length and (chunk := sock.recv(65536)):
            rest += chunk
        return head, rest

    try:
        srv.wait_ready()
        body = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 4}).encode()
        with connect() as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:len(body) // 2])
            t0 = time.monotonic()
            head, answer = read_response(sock)
            took = time.monotonic() - t0
        assert head.startswith(b"HTTP/1.1 408"), head
        assert 0.5 < took < 5, f"the 408 came after {took:.1f} s"
        err = json.loads(answer)["error"]
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
        with connect() as sock:
            t0 = time.monotonic()
            assert sock.recv(1024) == b"", "an idle connection got an answer"
            took = time.monotonic() - t0
        assert 0.5 < took < 5, f"an idle connection was closed after {took:.1f} s"
        r = httpx.post(srv.url + CHAT, json={"model": "tiny", "messages": MSG, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert_idle(srv.url)
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------------------
# Shutdown (last: it stops the module's server)
# ------------------------------------------------------------------------------------------------------------


def test_sigterm_drains_in_flight_requests_and_exits_0(server):
    import signal

    body = {"model": "tiny", "messages": MSG, "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        with c.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # the stream is under way
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # no new connections while draining
                httpx.get(server.url + "/health", timeout=5)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) == 0
    assert "drained" in server.log.read_text()


def test_requests_left_at_the_shutdown_timeout_end_with_an_error_event(tiny_dirs, tmp_path):
    """SIGTERM with ``--shutdown-timeout 0`` while a long stream and a long non-streamed request run: the stream ends
    with an OpenAI error event (``shutting_down``) and then ``[DONE]`` instead of a cut connection, the other request
    gets a 503 with the same error, the server exits 0, and its log counts the requests it ended instead of saying
    that it drained."""
    import signal

    srv = LiveServer(tiny_server_args(tiny_dirs, "--max-model-len", "500", "--shutdown-timeout", "0"), tmp_path,
                     tmp_path / "server.log")
    long = {"model": "tiny", "messages": MSG, "max_tokens": 450, "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            plain = asyncio.create_task(c.post(CHAT, json=long))
            async with c.stream("POST", CHAT, json={**long, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data:"):
                    pass
                while gauge(scrape(srv.url), "vllm:num_requests_running") < 2:  # both are in the engine
                    await asyncio.sleep(0.02)
                srv.proc.send_signal(signal.SIGTERM)
                events = [line.removeprefix("data: ") async for line in lines if line.startswith("data:")]
            return events, await plain

    try:
        srv.wait_ready()
        events, plain = asyncio.run(run())
        assert events[-1] == "[DONE]" and len(events) >= 2
        err = json.loads(events[-2]).get("error")
        assert err is not None, "the request finished before the timeout: make it longer"
        assert err["code"] == "shutting_down" and err["type"] == "server_error"
        assert "--shutdown-timeout" in err["message"]
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
        assert srv.proc.wait(30) == 0
        log = srv.log.read_text()
        assert "2 request(s) were ended by --shutdown-timeout" in log and "drained" not in log
    finally:
        srv.stop()
