"""Named SQL statements, one file per dialect: ``sql/sqlite.sql`` and ``sql/postgres.sql``.

A file is a series of ``-- name: <name>`` headers, each followed by one statement. The
same name means the same operation, with the same numbered parameters, in both files
(``?1`` in SQLite, ``$1`` in Postgres). A few names exist in one dialect only, where the
database itself differs; ``DIALECT_ONLY`` lists them and docs/architecture.md says why.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent / "sql"
DIALECT_ONLY = {
    "sqlite": frozenset({"next_fence", "trim_fences"}),
    "postgres": frozenset({"lock_migrations", "try_job_lock", "unlock_job"}),
}
_HEADER_RE = re.compile(r"^-- name: ([a-z_]+)\s*$", re.MULTILINE)


class Queries:
    """Statements by name: ``queries["claim_lease"]``."""

    def __init__(self, dialect: str, statements: dict[str, str]) -> None:
        self.dialect = dialect
        self._statements = statements

    def __getitem__(self, name: str) -> str:
        try:
            return self._statements[name]
        except KeyError:
            raise KeyError(f"no statement named {name!r} in {self.dialect}.sql") from None

    def names(self) -> frozenset[str]:
        return frozenset(self._statements)


@functools.cache
def load(dialect: str) -> Queries:
    return Queries(dialect, parse((SQL_DIR / f"{dialect}.sql").read_text(encoding="utf-8")))


def parse(text: str) -> dict[str, str]:
    """``{name: statement}``; comment lines inside a statement are dropped."""
    parts = _HEADER_RE.split(text)
    statements: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in statements:
            raise ValueError(f"statement {name!r} is defined twice")
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        statement = "\n".join(lines).strip().rstrip(";")
        if not statement:
            raise ValueError(f"statement {name!r} is empty")
        statements[name] = statement
    return statements
