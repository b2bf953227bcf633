"""docs/reference/families.md is the families data written out: regenerate it with
``python -m attnlab.pretrained.reference > docs/reference/families.md``."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("gguf") is None:
    pytest.skip("needs gguf (the GGUF types section)", allow_module_level=True)

from attnlab.models.families import FAMILIES
from attnlab.pretrained.reference import families_page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "families.md"


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


def test_every_page_of_the_families_package_is_registered():
    """Adding a family is adding a module to attnlab.models.families and listing its page
    in FAMILIES: a page left out of the list would never be found."""
    import pkgutil

    import attnlab.models.families as package
    from attnlab.models.families.base import Family

    pages = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        pages.update({f.name: f for f in vars(module).values() if isinstance(f, Family)})
    assert pages, "no Family found in the package's modules"
    assert set(pages) == set(FAMILIES)
    assert all(FAMILIES[name] is page for name, page in pages.items())
