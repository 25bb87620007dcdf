"""Where the tests find things, whatever their folder's depth: the repository's root and the test fixtures."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
