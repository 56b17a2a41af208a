"""The OpenAI API of a real `kvserve serve`, through the official `openai` client."""

import json

import httpx
import pytest

MAX_MODEL_LEN = 1024  # conftest.SERVER_ARGS

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_utility_endpoints(server, client, model_name, auth, metrics):
    assert httpx.get(f"{server}/health").json() == {"status": "ok", "engine_restarts": 0}
    assert "version" in httpx.get(f"{server}/version", headers=auth).json()
    models = client.models.list().data
    assert [m.id for m in models] == [model_name] and models[0].max_model_len == MAX_MODEL_LEN
    assert client.models.retrieve(model_name).id == model_name
    tok = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}, headers=auth).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"]}, headers=auth).json()
    assert detok["prompt"].endswith(PROMPT)
    chat_tok = httpx.post(f"{server}/tokenize", json={"messages": CHAT}, headers=auth).json()
    non_stream = httpx.post(
        f"{server}/v1/chat/completions", headers=auth, json={"messages": CHAT, "max_tokens": 1}
    ).json()
    assert non_stream["usage"]["prompt_tokens"] == chat_tok["count"]
    names = metrics()
    for name in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_count",
        "request_time_per_output_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
    ):
        assert any(k.startswith(f"kvserve:{name}") for k in names), name
    assert names["kvserve:request_success_total{finished_reason=length}"] >= 1


def test_completion(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and r.model == model_name and r.id.startswith("cmpl-")
    assert c.text and c.finish_reason in ("stop", "length")
    assert (
        r.usage.completion_tokens <= 8
        and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    )


def test_completion_streaming_matches_non_streaming(client, model_name):
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=10, temperature=0
    )
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length") and 0 < r.usage.completion_tokens <= 10


def test_chat_streaming_with_usage(client, model_name):
    full = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=10, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=CHAT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == full.choices[0].message.content
    )
    assert all(c.usage is None for c in chunks[:-1])
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n2(client, model_name):
    r = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_tokens=6,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == 12
    assert finished == {0, 1} and all(texts.values())


def test_logprobs(client, model_name):
    r = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    )
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely
    chat = client.chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert (
        len(content) == 4 and "".join(t.token for t in content) == chat.choices[0].message.content
    )
    for t in content:
        assert len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode())
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
    stream = client.chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_stop_strings(client, model_name):
    base = (
        client.completions.create(
            model=model_name,
            prompt="1, 2, 3, 4,",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    mid = len(base) // 2
    stop = base[mid : mid + 2]  # a string the greedy output is known to contain
    cut = base.index(stop)
    r = client.completions.create(
        model=model_name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == base[:cut] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=model_name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == base[:cut]


def test_seed_reproducible(client, model_name):
    def sample(seed):
        return (
            client.chat.completions.create(
                model=model_name,
                messages=CHAT,
                max_tokens=12,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .message.content
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_echo(client, model_name):
    r = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)
    streamed = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_prompt_list_and_token_ids(client, model_name, server, auth):
    ids = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}, headers=auth).json()["tokens"]
    by_text = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=5, temperature=0
    )
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(
        model=model_name, prompt=[PROMPT, "Once upon a time"], max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == by_text.choices[0].text
    streamed = client.completions.create(
        model=model_name, prompt=[ids, ids], max_tokens=5, temperature=0, stream=True
    )
    texts = {0: "", 1: ""}
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: by_text.choices[0].text, 1: by_text.choices[0].text}


def test_prefix_cache_reported(client, model_name):
    long_prompt = "Here is a long shared context about cats and dogs. " * 12
    client.completions.create(model=model_name, prompt=long_prompt, max_tokens=1)
    again = client.completions.create(model=model_name, prompt=long_prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_greedy_matches_offline(client, model_name):
    """Greedy output through the server equals the offline LLM API's for the same prompts."""
    from kvserve import LLM, SamplingParams

    llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=24)
    offline = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    offline_chat = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    del llm
    served = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0
    )
    served_chat = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=24, temperature=0
    )
    assert served.choices[0].text == offline
    assert served_chat.choices[0].message.content == offline_chat


def test_prompt_scoring_as_lm_evaluation_harness_sends_it(client, model_name, server, auth):
    """echo + logprobs + max_tokens 0: the legacy logprobs of every prompt token (the first one
    null). The logprob of a prompt's last token equals the logprob the same model gave it when it
    generated that token greedily (the C kernels compute a row the same way in a prompt or a
    decode)."""
    context = "The capital of France is"
    gen = client.completions.create(
        model=model_name, prompt=context, max_tokens=1, temperature=0, logprobs=1
    )
    generated = gen.choices[0].logprobs.token_logprobs[0]
    full = context + gen.choices[0].text
    ids = httpx.post(f"{server}/tokenize", json={"prompt": full}, headers=auth).json()["tokens"]
    r = client.completions.create(
        model=model_name, prompt=[ids], echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    lp = r.choices[0].logprobs
    assert (
        len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    )
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[-1] == pytest.approx(generated, abs=1e-5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    assert r.id and r.model == model_name and r.object == "text_completion"
    # lm-eval's is_greedy: the token's logprob is the max of its top-1 alternatives
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-6)
    # vLLM's prompt_logprobs field, streamed too
    body = {
        "model": model_name,
        "prompt": [ids],
        "max_tokens": 1,
        "prompt_logprobs": 2,
        "stream": True,
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=auth, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    plp = chunks[0]["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[-1][str(ids[-1])]["logprob"] == pytest.approx(generated, abs=1e-5)


def test_tokenizer_info_serves_what_lm_eval_reads(server, auth):
    """lm-eval's tokenizer_backend=remote: special tokens and the chat template from
    /tokenizer_info, token ids through /tokenize without special tokens."""
    assert httpx.get(f"{server}/tokenizer_info").status_code == 401  # the API key applies
    info = httpx.get(f"{server}/tokenizer_info", headers=auth).json()
    assert info["tokenizer_class"] and info["model_max_length"] == MAX_MODEL_LEN
    assert info["chat_template"] and info["eos_token"]
    body = {"prompt": info["eos_token"], "add_special_tokens": False}
    (eos,) = httpx.post(f"{server}/tokenize", json=body, headers=auth).json()["tokens"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": [eos]}, headers=auth).json()
    assert text["prompt"] == info["eos_token"]


def test_tokenize_renders_tools_as_a_chat_request_does(server, auth):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    plain = httpx.post(f"{server}/tokenize", json={"messages": CHAT}, headers=auth).json()
    body = {"messages": CHAT, "tools": tools}
    with_tools = httpx.post(f"{server}/tokenize", json=body, headers=auth).json()
    assert with_tools["count"] > plain["count"]
    chat = httpx.post(
        f"{server}/v1/chat/completions", headers=auth, json={**body, "max_tokens": 1}
    ).json()
    assert chat["usage"]["prompt_tokens"] == with_tools["count"]
    bad = httpx.post(f"{server}/tokenize", json={"prompt": "x", "tools": tools}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    bad = httpx.post(
        f"{server}/tokenize", json={"messages": CHAT, "tools": [{"type": "x"}]}, headers=auth
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
