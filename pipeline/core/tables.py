"""Plain-text tables for the human forms of `status` and `audit`."""

from __future__ import annotations

from collections.abc import Sequence


def align(table: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Rows of cells padded to their column's width; columns in `right` right-aligned."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [
        "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in table
    ]
