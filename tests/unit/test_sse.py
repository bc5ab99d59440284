"""The SSE decoder the streaming adapters share: every line ending the format allows,
and a byte order mark at the start, however the bytes are cut into chunks."""

from __future__ import annotations

import pytest

from turnkeeper.providers.sse import SSEDecoder

BOM = b"\xef\xbb\xbf"
STREAM = (b": a comment\n"
          b"event: message\n"
          b"data: {\"n\": 1}\n"
          b"\n"
          b"data: two\n"
          b"data:lines\n"
          b"id: 7\n"
          b"\n"
          b"data: [DONE]\n"
          b"\n")
EXPECTED = [b'{"n": 1}', b"two\nlines", b"[DONE]"]


def _with_ending(stream: bytes, ending: bytes) -> bytes:
    return stream.replace(b"\n", ending)


def _decode(stream: bytes, size: int) -> list[bytes]:
    decoder = SSEDecoder()
    out: list[bytes] = []
    for i in range(0, len(stream), size):
        out += decoder.feed(stream[i:i + size])
    return out + decoder.flush()


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
@pytest.mark.parametrize("bom", [b"", BOM], ids=["plain", "BOM"])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
def test_every_line_ending_and_a_bom_give_the_same_events(ending: bytes, bom: bytes,
                                                          size: int) -> None:
    assert _decode(bom + _with_ending(STREAM, ending), size) == EXPECTED


def test_a_crlf_cut_between_its_cr_and_lf_is_one_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []  # the second half of the CRLF, not a blank line
    assert decoder.feed(b"data: b\r") == []
    assert decoder.feed(b"\n\r\n") == [b"a\nb"]


def test_an_event_ending_in_cr_is_delivered_at_once() -> None:
    # A lone CR ends the line now: the event does not wait for the next chunk.
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r\r") == [b"a"]
    assert decoder.feed(b"\ndata: b\r\r") == [b"b"]


def test_only_a_bom_at_the_start_is_dropped() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(BOM[:1]) == []
    assert decoder.feed(BOM[1:] + b"data: a\n\n") == [b"a"]
    # Later, the same bytes are part of a line, which is then not a data line.
    assert decoder.feed(BOM + b"data: b\n\n") == []


def test_a_last_event_without_its_blank_line_counts_at_the_end() -> None:
    for ending in (b"\n", b"\r\n", b"\r"):
        decoder = SSEDecoder()
        assert decoder.feed(b"data: last" + ending) == []
        assert decoder.flush() == [b"last"]
