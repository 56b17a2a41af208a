"""kvserve eval-quality on a small cut of its varied text: the default weight format keeps the
quality bound against float32 weights (perplexity within 1%; top-1 agreement >= 97% over the cut
and on English prose; each kind's 96 tokens >= CUT_TOP1_BOUND, a short cut agreeing less often
than a whole kind, whose 97% is measured in docs/methodology.md), and the varied text holds every
kind it names with more than 20k tokens in all."""

import pytest

from kvserve import eval_quality

CUT_TOP1_BOUND = 0.95


@pytest.fixture(scope="module")
def kinds(kv_model):
    texts = eval_quality.varied_texts(kv_model.tokenizer)
    return eval_quality.tokenize_kinds(kv_model.tokenizer, texts)


def test_varied_text_covers_its_kinds(kinds):
    assert {"code", "prose", "chat", "de", "fr", "es", "ru", "zh", "ja"} <= set(kinds)
    assert all(len(ids) > 200 for ids in kinds.values())
    assert sum(len(ids) - 1 for ids in kinds.values()) >= 20_000


def test_default_format_keeps_the_quality_bound(kv_model, default_gguf, kinds):
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    default = load_model(ModelConfig(model=default_gguf))  # the loader's default format
    fmt = default.quantization
    assert fmt != "none"
    cut = {k: kinds[k][: 2 * 96 + 1] for k in ("code", "prose")}
    cut |= {k: kinds[k][:97] for k in ("chat", "de", "fr", "ru", "zh", "ja")}
    res = eval_quality.evaluate({"none": kv_model, fmt: default}, cut, window=96, progress=False)
    m = res[fmt]
    assert m["tokens"] == 4 * 96 + 6 * 96 and set(m["kinds"]) == set(cut)
    assert res["none"]["ppl_ratio"] == 1.0 and res["none"]["dlogp_max"] == 0.0
    assert abs(m["ppl_ratio"] - 1) <= eval_quality.PPL_BOUND, m
    assert m["top1"] >= eval_quality.TOP1_BOUND, m
    assert all(k["top1"] >= CUT_TOP1_BOUND for k in m["kinds"].values()), m["kinds"]
    # English prose (the standard-library docstrings eval-quality measures by default)
    assert m["kinds"]["prose"]["top1"] >= eval_quality.TOP1_BOUND, m["kinds"]["prose"]


def test_a_reference_checkpoint_replaces_the_models_own(tmp_path, default_gguf):
    """--reference: the fp32 reference comes from another checkpoint of the same vocabulary (a
    GPTQ model against its float model); the model's own file as reference gives the plain
    run's figures, another model's weights other ones."""
    import json

    from kvserve.bench.gguf_presets import write_model

    own, other = str(tmp_path / "own.gguf"), str(tmp_path / "other.gguf")
    write_model(own, "tiny", "q8_0", seed=0, tokenizer_from=default_gguf)
    write_model(other, "tiny", "q8_0", seed=1, tokenizer_from=default_gguf)
    common = ["--model", own, "--formats", "gguf", "--max-tokens", "96", "--window", "48"]

    def run(*extra):
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
        eval_quality.main([*common, *extra, "--no-progress", "--json", str(out)])
        return json.loads(out.read_text())

    plain, same, diff = run(), run("--reference", own), run("--reference", other)

    def figures(res):
        return {k: v for k, v in res["results"]["gguf"].items() if "second" not in k}

    assert figures(same) == figures(plain)
    assert same["reference"] == f"fp32 weights of {own}" and diff["model"] == own
    assert diff["results"]["gguf"]["top1"] < plain["results"]["gguf"]["top1"]
