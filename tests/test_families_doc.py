"""docs/families.md is generated (python -m tests.fixtures.families_table): its structure
(families, parity variants and what they cover, refusals, GGUF, kernels) must match the code.

Only text is compared, from the sources: no fixture is generated and no model loaded. The
parity figures are refreshed by rerunning the script; here only their rows are checked to name
every variant."""

from __future__ import annotations

from tests.fixtures import families_table, parity

STALE = "docs/families.md is stale: run python -m tests.fixtures.families_table"


def test_structure_is_current() -> None:
    doc = families_table.DOC.read_text()
    assert families_table.structure_of(doc) == families_table.render_structure().strip("\n"), STALE


def test_figures_name_every_variant() -> None:
    doc = families_table.DOC.read_text()
    assert families_table.figure_variants(doc) == list(parity.VARIANTS), STALE


def test_every_registered_family_is_listed() -> None:
    structure = families_table.render_structure()
    for family in families_table.families():
        assert f"| `{family}` |" in structure
