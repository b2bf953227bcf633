"""What a request to ``attnlab serve`` may ask for, and its body's fields.

The limits (each with its flag), the one error type the routes answer with, and every
field of a JSON body read as untrusted input: its type, its range and its size, a refusal
naming the field (and the flag of a limit it exceeds).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from attnlab.explain.i18n import LANGS, normalize_lang
from attnlab.serve.models import ModelRegistry, UnknownModelError

__all__ = [
    "FLAGS",
    "MAX_TOKEN_CHARS",
    "ApiError",
    "ServeLimits",
    "error_response",
    "float_field",
    "head_pairs_field",
    "ids_field",
    "int_field",
    "lang_field",
    "model_field",
    "named_text_field",
    "read_body",
    "text_field",
    "token_field",
    "user_errors",
]


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for (each has a ``attnlab serve`` flag).

    Attributes:
        max_chars: characters of text (``--max-chars``).
        max_tokens: tokens of text (``--max-tokens``; also the model's context).
        max_new_tokens: tokens one generation may produce (``--max-new-tokens``).
        max_top_k: ``top_k`` of a trace or of sampling (``--max-top-k``).
    """

    max_chars: int = 20_000
    max_tokens: int = 1024
    max_new_tokens: int = 256
    max_top_k: int = 100

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")

    @property
    def max_body(self) -> int:
        """Bytes of a request body: the text at 4 UTF-8 bytes a character, plus fields."""
        return self.max_chars * 6 + 4096  # JSON may escape a character as \\uXXXX


FLAGS = {
    "max_chars": "--max-chars",
    "max_tokens": "--max-tokens",
    "max_new_tokens": "--max-new-tokens",
    "max_top_k": "--max-top-k",
}


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


async def read_body(request: Request, limits: ServeLimits) -> dict[str, Any]:
    """The JSON object of the body, read at most ``limits.max_body`` bytes far."""
    cap = limits.max_body
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise ApiError(
            413,
            f"request body of {int(declared):,} bytes exceeds {cap:,} bytes "
            f"(--max-chars {limits.max_chars:,})",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise ApiError(
                413, f"request body exceeds {cap:,} bytes (--max-chars {limits.max_chars:,})"
            )
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"the body must be a JSON object (UTF-8): {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def int_field(
    body: dict[str, Any],
    name: str,
    default: int | None,
    low: int,
    high: int | None,
    limit: str | None = None,
) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(422, f"`{name}` must be an integer, got {type(value).__name__}")
    if value < low:
        raise ApiError(422, f"`{name}` must be >= {low}, got {value}")
    if high is not None and value > high:
        if limit is not None:
            raise ApiError(413, f"`{name}` = {value} exceeds the limit {high} ({FLAGS[limit]})")
        raise ApiError(422, f"`{name}` must be <= {high}, got {value}")
    return value


def float_field(
    body: dict[str, Any],
    name: str,
    default: float | None,
    low: float,
    high: float,
    low_open: bool = False,
) -> float | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(422, f"`{name}` must be a finite number, got {value!r}"[:200])
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError(422, f"`{name}` must be in {bound}, got {value}")
    return float(value)


def text_field(body: dict[str, Any], limits: ServeLimits, *, required: bool = True) -> str:
    text = body.get("text", "" if not required else None)
    if not isinstance(text, str):
        raise ApiError(422, f"`text` must be a string, got {type(text).__name__}")
    if len(text) > limits.max_chars:
        raise ApiError(
            413,
            f"`text` has {len(text):,} characters; the limit is {limits.max_chars:,} (--max-chars)",
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            422,
            "`text` contains an unpaired surrogate (invalid Unicode); "
            "send valid UTF-16 pairs or UTF-8",
        ) from None
    if required and not text.strip():
        raise ApiError(422, "`text` must not be empty")
    return text


def lang_field(body: dict[str, Any]) -> str:
    lang = body.get("lang", "en")
    try:
        return normalize_lang(lang)
    except (TypeError, ValueError):
        raise ApiError(422, f"`lang` must be one of {', '.join(LANGS)}") from None


def model_field(body: dict[str, Any], registry: ModelRegistry) -> str:
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError(
            422,
            f"`model` must be a string (a name from GET /api/models), got {type(name).__name__}",
        )
    try:
        registry.spec(name)
    except UnknownModelError as e:
        raise ApiError(404, str(e)) from None
    return name


def head_pairs_field(body: dict[str, Any]) -> list[tuple[int, int]]:
    raw = body.get("heads")
    if not isinstance(raw, list) or len(raw) > 4096:
        raise ApiError(422, "`heads` must be a list of [layer, head] pairs (at most 4096)")
    pairs = []
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)
        ):
            raise ApiError(
                422,
                f"`heads` must hold [layer, head] pairs of ints >= 0, got {json.dumps(item)[:60]}",
            )
        pairs.append((item[0], item[1]))
    return pairs


MAX_TOKEN_CHARS = 200  # a target/contrast given as text: one token is never longer


def token_field(body: dict[str, Any], name: str) -> int | str | None:
    """A token given as an id (int >= 0) or as text that must be exactly one token."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ApiError(
            422, f"`{name}` must be a token id or the text of one token, got {type(value).__name__}"
        )
    if isinstance(value, int) and value < 0:
        raise ApiError(422, f"`{name}` must be a token id >= 0, got {value}")
    if isinstance(value, str) and not 0 < len(value) <= MAX_TOKEN_CHARS:
        raise ApiError(422, f"`{name}` must be the text of one token (1..{MAX_TOKEN_CHARS} chars)")
    return value


def ids_field(body: dict[str, Any], limits: ServeLimits) -> list[int] | None:
    """Token ids sent instead of text (e.g. a prompt and the tokens generated after it)."""
    raw = body.get("ids")
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise ApiError(422, "`ids` must be a non-empty list of token ids")
    if len(raw) > limits.max_tokens:
        raise ApiError(
            413, f"`ids` has {len(raw):,} tokens; the limit is {limits.max_tokens:,} (--max-tokens)"
        )
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in raw):
        raise ApiError(422, "`ids` must hold token ids (ints >= 0)")
    return list(raw)


def named_text_field(body: dict[str, Any], name: str, limits: ServeLimits) -> str:
    """A required text field other than ``text``, bounded as ``text`` is."""
    try:
        return text_field({"text": body.get(name)}, limits)
    except ApiError as e:
        raise ApiError(e.status, e.message.replace("`text`", f"`{name}`")) from None


@contextmanager
def user_errors() -> Iterator[None]:
    """Library ValueError/TypeError (checked arguments) -> 422."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise ApiError(422, str(e)[:500]) from e
