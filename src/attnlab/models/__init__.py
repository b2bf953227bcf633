"""Language models built on attnlab's attention layer."""

from __future__ import annotations

from attnlab.models.gpt import PRESETS, GPTConfig, GPTModel, parameter_report

__all__ = ["PRESETS", "GPTConfig", "GPTModel", "parameter_report"]
