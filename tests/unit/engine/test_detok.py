from __future__ import annotations

from cobali.engine.detok import TextStream


def feed(stream: TextStream, pieces: list[bytes]) -> tuple[list[str], bool]:
    out, hit = [], False
    for n_tokens, piece in enumerate(pieces, 1):
        hit = stream.push(piece)
        out.append(stream.close(stopped=True) if hit else stream.take(n_tokens))
        if hit:
            break
    return out, hit


def test_split_utf8_character_is_joined() -> None:
    stream = TextStream()
    euro = "€".encode()
    out, _ = feed(stream, [euro[:1], euro[1:], b"!"])
    assert out == ["", "€", "!"] and stream.text == "€!"


def test_stop_string_across_tokens_is_held_back_then_cut() -> None:
    stream = TextStream(("END",))
    out, hit = feed(stream, [b"ab", b"E", b"N", b"Dxyz"])
    assert hit and out == ["ab", "", "", ""] and stream.text == "ab"


def test_held_back_prefix_is_released_when_it_turns_out_not_to_stop() -> None:
    stream = TextStream(("END",))
    out, hit = feed(stream, [b"ab", b"EN", b"x"])
    assert not hit and out == ["ab", "", "ENx"]


def test_flush_releases_what_was_held() -> None:
    stream = TextStream(("END",))
    feed(stream, [b"abE"])
    assert stream.close(stopped=False) == "E" and stream.text == "abE"


def test_earliest_of_several_stops_wins() -> None:
    stream = TextStream(("zz", "b"))
    out, hit = feed(stream, [b"azzb"])
    assert hit and stream.text == "a" and out == ["a"]


def test_text_is_due_at_once_until_some_is_taken_then_every_interval_tokens() -> None:
    stream = TextStream(interval=4)
    assert stream.is_due(1)
    stream.push(b"\xe2")  # the first byte of a character: nothing to take yet, so the text stays due
    assert stream.take(1) == "" and stream.is_due(2)
    stream.push(b"\x82\xac")
    assert stream.take(2) == "€"
    assert [stream.is_due(n) for n in (3, 4, 5, 6)] == [False, False, False, True]
