"""Sliding-window KV groups end to end, on a tiny random-weight Llama-family model whose layers mix
windows ([8, None, 8, None], block size 4): the scheduler and the runner free the window layers'
blocks as requests advance, and what comes out must not change.

References: Hugging Face Qwen2 with the same weights and layer_types (its sliding mask: key j
visible to query i iff i - j < W), run on the whole final sequence at once; and the same engine
with every layer in one KV group, where nothing is freed (bit-identical tokens and logits).
"""

import random
from types import SimpleNamespace

import pytest
import torch

from kvserve.config import KVGroup, group_layers_by_window, make_engine_config
from kvserve.core.scheduler import Scheduler
from kvserve.core.sequence import Sequence
from kvserve.model.arch import ModelArch
from kvserve.model.llama import LlamaForCausalLM
from kvserve.runner.model_runner import ModelRunner
from kvserve.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

WINDOWS = [8, None, 8, None]
BS = 4
VOCAB = 96


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        layer_types=["sliding_attention" if w else "full_attention" for w in WINDOWS],
        sliding_window=8,
        use_sliding_window=True,
        max_window_layers=0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    hf = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random init leaves biases at 0 and norms at 1: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    arch = ModelArch(
        name="qwen2",
        num_layers=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=192,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rope_theta=rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)),
        rms_norm_eps=1e-6,
        attention_bias=True,
        sliding_window=8,
        layer_windows=list(WINDOWS),
    )
    ours = LlamaForCausalLM(arch)
    for name, w in hf.state_dict().items():
        ours.load_weight(name, w)
    return SimpleNamespace(model=ours, arch=arch), hf


class Run:
    """The scheduler and the runner stepped together, as EngineCore does, recording every
    sampled row's logits and whether window blocks were freed."""

    def __init__(self, loaded, groups, kv_dtype="float32", budget=12, caching=True, spec=False):
        cfg = make_engine_config(
            block_size=BS,
            kv_cache_dtype=kv_dtype,
            max_num_batched_tokens=budget,
            enable_prefix_caching=caching,
            max_num_seqs=4,
            device="cpu",
        ).on_device(False)
        self.sched = Scheduler(cfg.scheduler, cfg.cache, groups, max_model_len=200)
        verifier = None
        if spec:
            from kvserve.spec.rejection import RejectionSampler

            verifier = RejectionSampler()
        self.runner = ModelRunner(loaded, cfg, groups, max_model_len=200, verifier=verifier)
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.freed = 0
        model = loaded.model
        self._compute = model.compute_logits
        self._rows: list[str] = []

        def record(hidden):
            out = self._compute(hidden)
            for rid, row in zip(self._rows, out):
                self.logits.setdefault(rid, []).append(row.clone())
            return out

        self.record = record

    def generate(
        self, prompts: dict[str, list[int]], max_tokens: int, drafts=None, add_at=None
    ) -> dict:
        """Greedy outputs by request id. `add_at`: request id -> step at which it is added (default
        0). `drafts(req) -> list[int]`: draft tokens to propose after each sampled step."""
        add_at = add_at or {}
        rng = random.Random(0)
        step, pending = 0, dict(prompts)
        reqs = {}
        model = self.runner.model
        model.compute_logits = self.record
        try:
            while pending or self.sched.has_unfinished_requests():
                for rid in [r for r in pending if add_at.get(r, 0) <= step]:
                    reqs[rid] = Sequence(
                        rid,
                        pending.pop(rid),
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                    )
                    self.sched.add_sequence(reqs[rid])
                step += 1
                if not self.sched.has_unfinished_requests():
                    continue
                out = self.sched.schedule()
                self._rows = [
                    c.seq.seq_id
                    for c in out.chunks
                    if c.sample
                    for _ in range(1 + len(c.draft_token_ids))
                ]
                kv = self.sched.kv_cache_manager
                self.freed += sum(
                    kv.num_dropped[c.seq.seq_id][g]
                    for c in out.chunks
                    for g, grp in enumerate(kv.groups)
                    if grp.window
                )
                result = self.runner.execute(out)
                self.sched.update_from_output(
                    out, {k: [t.token_id for t in v] for k, v in result.sampled.items()}
                )
                if drafts is not None:
                    for c in out.chunks:
                        if c.sample and c.seq.seq_id in self.sched.sequences:
                            c.seq.spec_token_ids = drafts(c.seq, rng)
        finally:
            model.compute_logits = self._compute
        assert self.sched.num_used_blocks == 0
        return {rid: list(r.output_token_ids) for rid, r in reqs.items()}


def grouped(num_blocks=64):
    return [KVGroup(g.window, g.layers, num_blocks) for g in group_layers_by_window(WINDOWS)]


def one_group(num_blocks=64):
    return [KVGroup(None, (0, 1, 2, 3), num_blocks)]


def prompts():
    rng = random.Random(7)
    shared = [rng.randrange(VOCAB) for _ in range(21)]
    return {
        "a": shared + [rng.randrange(VOCAB) for _ in range(6)],
        "b": [rng.randrange(VOCAB) for _ in range(5)],
        "c": shared + [rng.randrange(VOCAB) for _ in range(9)],
    }


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_freeing_window_blocks_matches_hf_and_the_unfreed_engine(models):
    loaded, hf = models
    ps = prompts()
    freeing = Run(loaded, grouped())
    out = freeing.generate(
        ps, max_tokens=24, add_at={"c": 40}
    )  # c arrives after a is done: a prefix hit
    assert freeing.freed > 0, "no window block was ever freed: the test proves nothing"
    assert freeing.sched.stats.prefix_cache_hits > 0
    kept = Run(loaded, one_group())
    assert kept.generate(ps, max_tokens=24, add_at={"c": 40}) == out
    for rid in ps:
        assert len(freeing.logits[rid]) == len(kept.logits[rid]) == 24
        for x, y in zip(freeing.logits[rid], kept.logits[rid]):
            assert torch.equal(x, y), rid
    for rid, prompt in ps.items():
        seq = prompt + out[rid]
        ref = hf_logits(hf, seq)[len(prompt) - 1 : len(seq) - 1]
        assert out[rid] == ref.argmax(-1).tolist(), rid
        torch.testing.assert_close(torch.stack(freeing.logits[rid]), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_reduced_precision_pools_give_the_same_outputs_freed_or_not(models, kv_dtype):
    loaded, _ = models
    ps = prompts()
    freeing = Run(loaded, grouped(), kv_dtype=kv_dtype, budget=7)
    out = freeing.generate(ps, max_tokens=20)
    assert freeing.freed > 0
    kept = Run(loaded, one_group(), kv_dtype=kv_dtype, budget=7)
    assert kept.generate(ps, max_tokens=20) == out
    for rid in ps:
        for x, y in zip(freeing.logits[rid], kept.logits[rid]):
            assert torch.equal(x, y), rid


def test_speculative_rollback_never_needs_a_freed_block(models):
    """Drafts that are partly right, partly wrong: rejected drafts roll back while the window
    group frees behind the chunk's first query; greedy outputs stay the target's own."""
    loaded, hf = models
    ps = prompts()
    plain = Run(loaded, one_group()).generate(ps, max_tokens=24)

    def drafts(req, rng):
        truth = plain[req.seq_id][req.num_output_tokens : req.num_output_tokens + 4]
        return [t if rng.random() < 0.6 else (t + 1) % VOCAB for t in truth]

    spec = Run(loaded, grouped(), spec=True)
    assert spec.generate(ps, max_tokens=24, drafts=drafts) == plain
    assert spec.freed > 0
    for rid, prompt in ps.items():
        assert (
            plain[rid]
            == hf_logits(hf, prompt + plain[rid])[len(prompt) - 1 : -1].argmax(-1).tolist()
        )


def test_preemption_from_small_pools_recomputes_to_the_same_outputs(models):
    loaded, _ = models
    ps = prompts()
    small = Run(loaded, [KVGroup(None, (1, 3), 16), KVGroup(8, (0, 2), 9)])
    out = small.generate(ps, max_tokens=24)
    assert small.sched.stats.num_preemptions > 0 and small.freed > 0
    assert Run(loaded, one_group()).generate(ps, max_tokens=24) == out
