"""JSON and Markdown helpers shared by `specjax bench` and the studies in experiments/: one
JSON-safe conversion, one number format, one table."""

from __future__ import annotations

import math


def clean(x):
    """JSON-safe: mappings to dicts, numpy values to Python, NaN / inf to None (JSON has neither)."""
    if hasattr(x, "items"):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return clean(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return x


def fmt(x, digits: int = 2, pct: bool = False) -> str:
    """A number for a table: ``digits`` decimals (a percentage with ``pct``), ints as they are,
    booleans as yes / no, None and NaN as '–'."""
    if x is None or isinstance(x, bool) or (isinstance(x, float) and not math.isfinite(x)):
        return "–" if x is None or not isinstance(x, bool) else ("yes" if x else "no")
    if isinstance(x, int):
        return str(x)
    return f"{100 * x:.{digits}f}%" if pct else f"{x:.{digits}f}"


def table_lines(header, rows) -> list[str]:
    """A Markdown table as lines."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def table(header, rows) -> str:
    return "\n".join(table_lines(header, rows))
