"""A CSV row: a dataclass whose fields, in order, are a results file's columns."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


class CsvRow:
    """Base of the row dataclasses a run folder's CSV files hold; `columns()` is the header, field by field."""

    @classmethod
    def columns(cls) -> list[str]:
        klass: Any = cls  # a dataclass once subclassed with @dataclass
        return [f.name for f in fields(klass)]
