"""docs/SUPPORT.md's table is the matrix's (python -m tests.conformance.matrix --write regenerates it)."""

from __future__ import annotations

from tests.conformance.matrix import documented, render


def test_support_doc_is_the_matrix() -> None:
    assert documented() == render(), "docs/SUPPORT.md is stale: run python -m tests.conformance.matrix --write"
