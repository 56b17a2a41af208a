"""The server's streams on the default model (AsyncEngine): a reader that keeps up and one that
falls behind (it waits for the other to finish after its first output) get the same text,
tokens and logprobs as the offline API; the slow one gets all it missed as one merged output."""

import asyncio

from kvserve.sampling_params import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper."
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)


def test_a_slow_reader_gets_the_same_tokens_in_fewer_outputs(default_gguf):
    from kvserve import LLM
    from kvserve.engine.async_engine import AsyncEngine

    llm = LLM(default_gguf, num_threads=1, kv_cache_memory="64MiB", max_model_len=256)
    (offline,) = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    ids = llm.tokenizer.encode(PROMPT)
    engine = AsyncEngine(llm.engine)

    async def fast_reader(done: asyncio.Event):
        outs = [out async for out in engine.generate(ids, PARAMS, "fast")]
        done.set()
        return outs

    async def slow_reader(done: asyncio.Event):
        outs = []
        async for out in engine.generate(ids, PARAMS, "slow"):
            outs.append(out)
            await done.wait()  # behind by every step after its first output
        return outs

    async def both():
        done = asyncio.Event()
        return await asyncio.gather(fast_reader(done), slow_reader(done))

    try:
        fast, slow = asyncio.run(both())
    finally:
        asyncio.run(engine.shutdown(timeout=5))
    want = offline.outputs[0]
    for outs in (fast, slow):
        final = outs[-1].outputs[0]
        assert final.token_ids == want.token_ids and final.text == want.text
        assert [lp.token_id for lp in final.logprobs] == want.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs if o.outputs) == want.text
        streamed = [t for o in outs if o.outputs for t in o.outputs[0].delta_token_ids]
        assert streamed == want.token_ids
    assert len(slow) == 2 < len(fast)  # its first output, then the rest as one
