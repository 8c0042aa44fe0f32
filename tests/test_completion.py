"""Streaming completions: the pure SSE parser and the HTTP client against real servers on 127.0.0.1."""

import threading
import time

import pytest
from standins import chunk, closed_port_url, serve, usage_chunk

from tdutils.serving.completion import (
    CompletionConnectionError,
    CompletionError,
    CompletionHTTPError,
    CompletionTimeoutError,
    StreamResult,
    TokenEvent,
    TokenFormatError,
    iter_token_events,
    make_post_completion,
)

# ---------------------------------------------------------------- iter_token_events (pure)


def test_every_token_of_a_multi_token_chunk_counts_and_text_is_not_duplicated():
    lines = [chunk([11], "a"), "", chunk([12, 13, 14], "bcd"), "", chunk([15], "", "length"), "",
             usage_chunk(7, 5), "", "data: [DONE]", ""]
    res = StreamResult()
    events = list(iter_token_events(lines, result=res))
    assert [e.token_id for e in events] == [11, 12, 13, 14, 15]
    assert [e.text for e in events] == ["a", "bcd", "", "", ""]
    assert "".join(e.text for e in events) == "abcd"
    assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])
    assert res.usage["completion_tokens"] == 5 and res.done and res.finish_reason == "length" and res.tokens == 5


def test_keepalives_comments_other_fields_crlf_and_bytes():
    lines = [b": keep-alive\r\n", "event: message", "id: 3", "retry: 10", "", chunk([1], "x").encode() + b"\r\n",
             ":", "", "data:" + chunk([2], "y")[len("data: "):], "data: [DONE]"]
    assert [(e.token_id, e.text) for e in iter_token_events(lines)] == [(1, "x"), (2, "y")]


def test_nothing_after_done_is_read():
    def lines():
        yield chunk([5], "z")
        yield "data: [DONE]"
        raise AssertionError("read past [DONE]")

    assert [e.token_id for e in iter_token_events(lines())] == [5]


def test_empty_text_tokens_and_bare_finish_chunk():
    lines = [chunk([3], ""), chunk([], "", "stop"), usage_chunk(2, 1), "data: [DONE]"]
    res = StreamResult()
    events = list(iter_token_events(lines, result=res))
    assert events == [TokenEvent(3, "", None)] and res.finish_reason == "stop"


def test_text_tokens_say_to_start_vllm_with_the_flag():
    with pytest.raises(TokenFormatError, match="--return-tokens-as-token-ids"):
        list(iter_token_events([chunk([1], "a", as_text=True)]))
    with pytest.raises(TokenFormatError, match="token_id:<int>"):
        list(iter_token_events([chunk([1], "a").replace("token_id:1", "token_id:-1")]))


def test_text_without_logprobs_is_refused():
    line = 'data: {"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}'
    with pytest.raises(TokenFormatError, match="--return-tokens-as-token-ids"):
        list(iter_token_events([line]))


def test_malformed_json_quotes_the_line():
    with pytest.raises(TokenFormatError, match=r"data: \{not json"):
        list(iter_token_events(["data: {not json}"]))
    with pytest.raises(TokenFormatError, match="malformed JSON"):
        list(iter_token_events(['data: {"choices": [', "", "data: [DONE]"]))


def test_event_split_over_several_data_lines():
    full = chunk([8, 9], "ab")[len("data: "):]
    cut = full.index('"choices"')
    lines = ["data: " + full[:cut], "data: " + full[cut:], "", "data: [DONE]"]
    assert [e.token_id for e in iter_token_events(lines)] == [8, 9]


def test_usage_mismatch_and_missing_done_and_inband_error():
    with pytest.raises(CompletionError, match="completion_tokens=3 but the stream carried 2"):
        list(iter_token_events([chunk([1, 2], "ab"), usage_chunk(1, 3), "data: [DONE]"]))
    with pytest.raises(CompletionError, match=r"without 'data: \[DONE\]'"):
        list(iter_token_events([chunk([1], "a")], require_done=True))
    with pytest.raises(CompletionError, match="out of memory"):
        list(iter_token_events(['data: {"error": {"message": "out of memory", "code": 500}}']))


def test_more_than_one_choice_is_refused():
    line = 'data: {"choices": [{"index": 1, "text": "", "logprobs": {"tokens": ["token_id:1"]}}]}'
    with pytest.raises(TokenFormatError, match="one choice"):
        list(iter_token_events([line]))


# ---------------------------------------------------------------- make_post_completion over HTTP


def _stream(lines, delay=0.0):
    def fn(h, body):
        h.start_sse()
        for line in lines:
            h.write_line(line)
            h.write_line("")
            if delay:
                time.sleep(delay)
    return fn


def test_streams_every_token_over_http_and_sends_the_right_request():
    lines = [": ping", chunk([101], "He"), chunk([102, 103], "llo!"), ": ping", chunk([104], " ok", "length"),
             usage_chunk(3, 4), "data: [DONE]", chunk([999], "never read")]
    with serve({("POST", "/v1/completions"): _stream(lines)}) as (url, log), \
            make_post_completion(url, "qwen", timeout=5, event_type=TokenEvent) as post:
        events = list(post([1, 2, 3], {"max_tokens": 4, "temperature": 0}, "salt-1"))
    assert [e.token_id for e in events] == [101, 102, 103, 104]
    assert "".join(e.text for e in events) == "Hello! ok"
    body = log[0][2]
    assert body["prompt"] == [1, 2, 3] and body["model"] == "qwen" and body["stream"] is True
    assert body["cache_salt"] == "salt-1" and body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 4
    assert post.last_result.usage["completion_tokens"] == 4


def test_no_cache_salt_field_when_salt_is_empty():
    lines = [chunk([1], "a"), usage_chunk(1, 1), "data: [DONE]"]
    with serve({("POST", "/v1/completions"): _stream(lines)}) as (url, log), \
            make_post_completion(url + "/v1/", "m", timeout=5) as post:
        assert len(list(post([5], {"max_tokens": 1}, ""))) == 1
    assert "cache_salt" not in log[0][2]


def test_http_500_raises_with_status_and_body():
    def fail(h, body):
        h.send_json(500, {"error": {"message": "engine dead"}})

    with serve({("POST", "/v1/completions"): fail}) as (url, _), make_post_completion(url, "m", timeout=5) as post, \
            pytest.raises(CompletionHTTPError, match="HTTP 500.*engine dead") as info:
        list(post([1], {"max_tokens": 1}, ""))
    assert info.value.status == 500


def test_a_server_that_stalls_past_the_read_timeout():
    release = threading.Event()

    def stall(h, body):
        h.start_sse()
        h.write_line(chunk([1], "a"))
        h.write_line("")
        release.wait(5)  # silence, far longer than the client's read timeout

    with serve({("POST", "/v1/completions"): stall}) as (url, _):
        with make_post_completion(url, "m", timeout=0.3) as post:
            t0 = time.perf_counter()
            got = []
            with pytest.raises(CompletionTimeoutError, match=r"sent nothing for 0.3s .* after 1 tokens"):
                for ev in post([1], {"max_tokens": 2}, ""):
                    got.append(ev.token_id)
            assert time.perf_counter() - t0 < 3
            assert got == [1]
        release.set()


def test_connection_refused_names_the_url_and_how_to_start_vllm():
    url = closed_port_url()
    with make_post_completion(url, "m", timeout=1, connect_timeout=1) as post, \
            pytest.raises(CompletionConnectionError, match=rf"{url}/v1/completions.*vllm serve") as info:
        list(post([1], {"max_tokens": 1}, ""))
    assert isinstance(info.value, ConnectionError)


def test_stream_closed_before_done_and_lost_tokens_are_errors():
    with serve({("POST", "/v1/completions"): _stream([chunk([1], "a")]),
                ("POST", "/lost/v1/completions"): _stream([chunk([1], "a"), usage_chunk(1, 2), "data: [DONE]"])}) \
            as (url, _):
        with make_post_completion(url, "m", timeout=5) as post, \
                pytest.raises(CompletionError, match="without 'data: \\[DONE\\]'"):
            list(post([1], {"max_tokens": 2}, ""))
        with make_post_completion(url + "/lost", "m", timeout=5) as post, \
                pytest.raises(CompletionError, match="completion_tokens=2"):
            list(post([1], {"max_tokens": 2}, ""))


def test_bad_arguments_fail_before_sending():
    with pytest.raises(ValueError, match="http"):
        make_post_completion("localhost:8000", "m")
    with pytest.raises(ValueError, match="finite"):
        make_post_completion("http://127.0.0.1:1", "m", timeout=float("inf"))
    with pytest.raises(ValueError, match="model"):
        make_post_completion("http://127.0.0.1:1", "")
    post = make_post_completion("http://127.0.0.1:1", "m")
    with pytest.raises(ValueError, match="empty"):
        post([], {}, "")
    with pytest.raises(ValueError, match="stream"):
        post([1], {"stream": False}, "")
    post.close()


def test_default_event_type_is_ours_without_lmcache():
    post = make_post_completion("http://127.0.0.1:1", "m")
    try:
        import lmcache  # noqa: F401
    except ImportError:
        assert post.event_type is TokenEvent
    post.close()
