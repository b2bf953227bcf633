"""docs/reference/families.md is the families data written out: regenerate it with
``python -m attnlab.pretrained.reference > docs/reference/families.md``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("gguf") is None:
    pytest.skip("needs gguf (the GGUF types section)", allow_module_level=True)

from attnlab.models.families import FAMILIES
from attnlab.pretrained.reference import families_page

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "families.md"


def test_the_families_page_is_the_data_written_out():
    assert PAGE.read_text() == families_page(), (
        "docs/reference/families.md is out of date: run "
        "python -m attnlab.pretrained.reference > docs/reference/families.md"
    )


def test_the_page_names_every_family_and_model_type():
    text = PAGE.read_text()
    for family in FAMILIES.values():
        assert f"### {family.name}\n" in text
        for model_type in (family.name, *family.model_types):
            assert f"`{model_type}`" in text
