"""lm-evaluation-harness as its docs show it for a served model: `local-completions` against
/v1/completions with the server's own tokenizer (`tokenizer_backend=remote`, /tokenizer_info),
on local YAML tasks over a local jsonl, one of each request kind: multiple_choice (loglikelihood
of each choice after the question), loglikelihood_rolling (the perplexity of whole texts) and
generate_until."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("lm_eval")  # light: it imports `datasets` (and its settings) only when used

from tests.server.conftest import API_KEY  # noqa: E402

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0,
     "text": "Paris is the capital and largest city of France."},
    {"question": "Two plus two equals", "choices": ["three", "four", "five"], "answer": 1,
     "text": "The sun rises in the east and sets in the west."},
    {"question": "The color of the sky on a clear day is", "choices": ["green", "blue", "red"],
     "answer": 1, "text": "Water boils at one hundred degrees Celsius at sea level."},
]  # fmt: skip
TASKS = {
    "kvserve_mc": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    },
    "kvserve_rolling": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
    },
    "kvserve_gen": {
        "output_type": "generate_until",
        "doc_to_text": "Q: {{question}}\nA:",
        "doc_to_target": "{{choices[answer]}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    },
}


def test_local_completions_on_local_tasks(server, model_name, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # read when `datasets` is first imported
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, task in TASKS.items():
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path)},
            "test_split": "test",
            **task,
        }
        (tmp_path / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": model_name,
            "base_url": f"{server}/v1/completions",
            "tokenizer_backend": "remote",
            "auth_token": API_KEY,
            "num_concurrent": 1,
            "max_retries": 1,
            "max_length": 512,
        },
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        limit=len(DOCS),
        log_samples=True,
    )
    results = out["results"]
    assert 0 <= results["kvserve_mc"]["acc,none"] <= 1
    assert 1 < results["kvserve_rolling"]["word_perplexity,none"] < math.inf
    assert 0 < results["kvserve_rolling"]["bits_per_byte,none"] < math.inf
    assert 0 <= results["kvserve_gen"]["exact_match,none"] <= 1
    samples = out["samples"]
    assert all(len(samples[name]) == len(DOCS) for name in TASKS)
    for s in samples["kvserve_mc"]:  # one finite loglikelihood per choice
        lls = [r[0][0] for r in s["resps"]]
        assert len(lls) == 3 and all(-math.inf < ll < 0 for ll in lls)
    assert all(isinstance(s["resps"][0][0], str) for s in samples["kvserve_gen"])
