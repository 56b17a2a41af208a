"""The Prometheus series the engine exports."""


def test_metrics_have_no_created_series():
    from kvserve.engine.metrics import EngineMetrics

    m = EngineMetrics("m")
    m.prompt_tokens.inc(3)
    m.ttft.observe(0.1)
    text = m.render()[0].decode()
    assert "kvserve:prompt_tokens_total" in text and "_created" not in text


def test_the_series_vllm_dashboards_read_exist():
    from kvserve.engine.metrics import EngineMetrics
    from kvserve.outputs import RequestMetrics

    m = EngineMetrics("m")
    m.record_finished(
        RequestMetrics(
            arrival_time=0.0,
            first_token_time=0.1,
            last_token_time=0.5,
            finished_time=0.5,
            num_generation_tokens=5,
        ),
        "stop",
        prompt_tokens=12,
    )
    m.iteration_tokens.observe(64)
    m.tpot_token.observe(0.02)
    text = m.render()[0].decode()
    for name in (
        "kvserve:time_per_output_token_seconds_bucket",
        "kvserve:request_prompt_tokens_sum",
        "kvserve:request_generation_tokens_sum",
        "kvserve:iteration_tokens_total_bucket",
        "process_resident_memory_bytes",
    ):
        assert name in text, name
    assert 'kvserve:request_prompt_tokens_sum{model_name="m"} 12.0' in text


def test_spec_decode_counters_follow_the_core_stats():
    from kvserve.engine.metrics import EngineMetrics

    m = EngineMetrics("m")
    m.record_stats(
        {
            "spec_decode_num_drafts": 3,
            "spec_decode_num_draft_tokens": 10,
            "spec_decode_num_accepted_tokens": 6,
            "spec_decode_num_accepted_tokens_per_pos": [3, 2, 1, 0],
        }
    )
    m.record_stats(
        {
            "spec_decode_num_drafts": 4,
            "spec_decode_num_draft_tokens": 14,
            "spec_decode_num_accepted_tokens": 9,
            "spec_decode_num_accepted_tokens_per_pos": [4, 3, 2, 0],
            "spec_decode_draft_seconds": 0.25,
            "spec_decode_verify_seconds": 1.5,
        }
    )
    text = m.render()[0].decode()
    assert 'kvserve:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'kvserve:spec_decode_num_draft_tokens_total{model_name="m"} 14.0' in text
    assert 'kvserve:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert 'kvserve:spec_decode_draft_seconds_total{model_name="m"} 0.25' in text
    assert 'kvserve:spec_decode_verify_seconds_total{model_name="m"} 1.5' in text
    for pos, value in enumerate([4, 3, 2, 0]):
        assert (
            "kvserve:spec_decode_num_accepted_tokens_per_pos_total"
            f'{{model_name="m",position="{pos}"}} '
            f"{value:.1f}"
        ) in text
