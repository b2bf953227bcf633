"""Language models built on attnlab's attention layer.

``gpt`` (GPT-2 layout), ``bert`` (BERT encoder) and ``llama`` (Llama decoder); the last
two are what :mod:`attnlab.pretrained` loads real weights into.
"""

from __future__ import annotations

from attnlab.models.gpt import PRESETS, GPTConfig, GPTModel, parameter_report

__all__ = ["PRESETS", "GPTConfig", "GPTModel", "parameter_report"]
