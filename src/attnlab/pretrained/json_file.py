"""JSON files from a model directory, read as untrusted input: size-capped, an object.

Its own module, below both the Hugging Face loader and the tokenizers that read the same
directories.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attnlab.pretrained.errors import ModelFileError

__all__ = ["MAX_JSON_BYTES", "read_json"]

MAX_JSON_BYTES = 64 * 1024 * 1024


def read_json(path: Path, *, what: str) -> dict[str, Any]:
    """A JSON object from ``path``, size-capped.

    Raises:
        ModelFileError: missing, too big, not JSON, not an object.
    """
    if not path.is_file():
        raise ModelFileError(path, f"is missing ({what})")
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ModelFileError(path, f"is {size} bytes, more than the {MAX_JSON_BYTES} allowed")
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelFileError(path, f"is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ModelFileError(path, f"must hold a JSON object, got {type(data).__name__}")
    return data
