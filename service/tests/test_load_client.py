"""The load tests' verdict on a stream: complete means finish_reason and a final [DONE], parsed as SSE is."""

from __future__ import annotations

import json

from hotswap_stack import complete


def chunk(content: str, finish: str | None = None) -> str:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    # As vLLM writes it: UTF-8, with U+2028 and U+0085 left unescaped (JSON allows them raw).
    return "data: " + json.dumps({"choices": [choice]}, ensure_ascii=False) + "\n\n"


def test_a_stream_whose_text_holds_unicode_line_separators_is_complete() -> None:
    # A tiny random model emits any token; str.splitlines() would cut these events in two.
    stream = chunk("a\u2028b") + chunk("c\x85") + chunk("d", "length") + "data: [DONE]\n\n"
    assert complete(stream, True)
    assert len(stream.splitlines()) > len(stream.split("\n"))  # what the old parser tripped on


def test_a_stream_without_done_or_finish_reason_is_truncated() -> None:
    assert not complete(chunk("a") + chunk("b", "length"), True)
    assert not complete(chunk("a") + "data: [DONE]\n\n", True)
    assert complete(chunk("a", "stop").replace("\n", "\r\n") + "data: [DONE]\r\n\r\n", True)
