"""docs/fields.md is generated (python -m tests.fixtures.fields_table) from the registry the
dialects read their ignored fields from: it must match it."""

from __future__ import annotations

from tests.fixtures import fields_table

STALE = "docs/fields.md is stale: run python -m tests.fixtures.fields_table"


def test_fields_doc_is_current() -> None:
    assert fields_table.DOC.read_text() == fields_table.render(), STALE
