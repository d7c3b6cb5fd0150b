"""JSON text from the network, decoded so that every failure is a DecodeError.

``json.loads`` raises more than ``JSONDecodeError`` on hostile input: a number
of more than 4,300 digits raises a plain ``ValueError`` (CPython's limit on
int/str conversion, CVE-2020-10735), a few thousand nested brackets raise
``RecursionError``, and bytes that are not UTF-8 raise ``UnicodeDecodeError``.
Each of those would escape to the HTTP layer as a 500 with a traceback, where
the client's fault must be a 4xx. Every JSON body or frame crossroads reads goes through :func:`loads`.
"""

from __future__ import annotations

import json
from typing import Any

from crossroads.errors import DecodeError


def loads(text: str | bytes) -> Any:
    """Decode ``text``; raises :class:`DecodeError` (reason ``too-deep``,
    ``not-utf8`` or ``bad-json``) and nothing else."""
    try:
        return json.loads(text)
    except RecursionError:
        raise DecodeError("JSON nests too deeply", "too-deep") from None
    except UnicodeDecodeError:
        raise DecodeError("the text is not UTF-8", "not-utf8") from None
    except json.JSONDecodeError as exc:
        raise DecodeError(f"not JSON: {exc.msg}", "bad-json") from None
    except ValueError:
        # The int/str conversion limit: the only other ValueError json raises.
        raise DecodeError("a number in the JSON is too long", "bad-json") from None
