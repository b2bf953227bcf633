"""Language models built on attnlab's attention layer."""

from __future__ import annotations
