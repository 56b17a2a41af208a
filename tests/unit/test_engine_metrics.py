"""The Prometheus series the engine exports."""


def test_metrics_have_no_created_series():
    from kvserve.engine.metrics import EngineMetrics
    m = EngineMetrics("m")
    m.prompt_tokens.inc(3)
    m.ttft.observe(0.1)
    text = m.render()[0].decode()
    assert "kvserve:prompt_tokens_total" in text and "_created" not in text
