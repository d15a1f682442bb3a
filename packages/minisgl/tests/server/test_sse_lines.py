"""An SSE event stays one line for every client's line splitter (CI at 790bd42: a tiny model's
U+0085 in a streamed chunk cut the event in two under httpx's `iter_lines`)."""

from __future__ import annotations

import json

import pytest
from httpx._decoders import LineDecoder

from minisgl.server.sse import sse

# Characters Python's `str.splitlines` (and so httpx's LineDecoder) or JavaScript treat as a line
# end, though JSON lets them stand raw inside a string.
LINE_ENDS = ["\x85", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\r", "\n"]


@pytest.mark.parametrize("ch", LINE_ENDS, ids=[f"U+{ord(c):04X}" for c in LINE_ENDS])
def test_an_event_with_a_line_end_in_its_text_is_one_line(ch):
    text = f"a{ch}b é{ch}"
    event = sse({"choices": [{"text": text}]})
    lines = [x for x in LineDecoder().decode(event.decode()) if x]
    assert len(lines) == 1 and event.decode().splitlines()[0] == lines[0], lines
    assert json.loads(lines[0][len("data: ") :]) == {"choices": [{"text": text}]}
    assert event.endswith(b"\n\n") and event.count(b"\n") == 2


def test_text_without_line_ends_stays_utf8():
    assert sse({"t": "é, 中"}) == 'data: {"t":"é, 中"}\n\n'.encode()
