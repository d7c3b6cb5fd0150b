"""A small, bounded parser for the loose JSON RakNet's MasterServer2 clients post.

RakNet's own samples post bodies such as
``{'__gameId': 'mygame', '__timeoutSec': '30', '__rowId': 1234, 'routerIsOpen': 1}``
(single-quoted strings, sometimes bare words; reference §2.3: "the samples even
post non-strict single-quoted JSON"). :func:`loads` first tries strict JSON and
falls back to this grammar:

- strings in double or single quotes, with the JSON escapes;
- bare words ``[A-Za-z_][A-Za-z0-9_.-]*`` other than true/false/null are strings;
- numbers, objects, arrays, true, false, null as in JSON; a trailing comma is allowed.

Nesting is limited to :data:`MAX_DEPTH` and input to the caller's size limit;
anything else raises :class:`DecodeError`.
"""

from __future__ import annotations

import re
from typing import Any

from crossroads.errors import DecodeError
from crossroads.proto import jsontext

#: Listing rows are flat; 16 levels is generous and keeps recursion shallow.
MAX_DEPTH = 16

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_SPACE = re.compile(r"\s*")
_ESCAPES = {
    '"': '"',
    "'": "'",
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}


def loads(text: str) -> Any:
    """Parse strict JSON, else the lenient grammar above."""
    try:
        return jsontext.loads(text)
    except DecodeError as exc:
        if exc.reason == "too-deep":
            raise
    parser = _Parser(text)
    value = parser.value(0)
    parser.space()
    if parser.pos != len(text):
        raise DecodeError(f"unexpected text at offset {parser.pos}", "bad-json")
    return value


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def space(self) -> None:
        match = _SPACE.match(self.text, self.pos)
        assert match is not None
        self.pos = match.end()

    def fail(self, what: str) -> DecodeError:
        return DecodeError(f"{what} at offset {self.pos}", "bad-json")

    def peek(self) -> str:
        self.space()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise DecodeError("JSON nests too deeply", "too-deep")
        c = self.peek()
        if c == "{":
            return self.obj(depth)
        if c == "[":
            return self.arr(depth)
        if c in ("'", '"'):
            return self.string()
        number = _NUMBER.match(self.text, self.pos)
        if number:
            self.pos = number.end()
            token = number.group()
            try:
                return float(token) if any(ch in token for ch in ".eE") else int(token)
            except ValueError:
                # More digits than CPython converts (4,300): not a listing value.
                raise self.fail("number too long") from None
        word = _WORD.match(self.text, self.pos)
        if word:
            self.pos = word.end()
            return {"true": True, "false": False, "null": None}.get(
                word.group(), word.group()
            )
        raise self.fail("expected a value")

    def string(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        out: list[str] = []
        while True:
            if self.pos >= len(self.text):
                raise self.fail("unterminated string")
            c = self.text[self.pos]
            self.pos += 1
            if c == quote:
                return "".join(out)
            if c != "\\":
                out.append(c)
                continue
            if self.pos >= len(self.text):
                raise self.fail("unterminated escape")
            e = self.text[self.pos]
            self.pos += 1
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
            elif e == "u":
                digits = self.text[self.pos : self.pos + 4]
                if len(digits) != 4 or not all(
                    d in "0123456789abcdefABCDEF" for d in digits
                ):
                    raise self.fail("bad \\u escape")
                out.append(chr(int(digits, 16)))
                self.pos += 4
            else:
                raise self.fail("bad escape")

    def obj(self, depth: int) -> dict[str, Any]:
        self.pos += 1
        result: dict[str, Any] = {}
        while True:
            c = self.peek()
            if c == "}":
                self.pos += 1
                return result
            if c in ("'", '"'):
                key = self.string()
            else:
                word = _WORD.match(self.text, self.pos)
                if not word:
                    raise self.fail("expected a key")
                self.pos = word.end()
                key = word.group()
            if self.peek() != ":":
                raise self.fail("expected ':'")
            self.pos += 1
            result[key] = self.value(depth + 1)
            c = self.peek()
            if c == ",":
                self.pos += 1
            elif c != "}":
                raise self.fail("expected ',' or '}'")

    def arr(self, depth: int) -> list[Any]:
        self.pos += 1
        result: list[Any] = []
        while True:
            if self.peek() == "]":
                self.pos += 1
                return result
            result.append(self.value(depth + 1))
            c = self.peek()
            if c == ",":
                self.pos += 1
            elif c != "]":
                raise self.fail("expected ',' or ']'")
