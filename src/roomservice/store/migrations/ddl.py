"""DDL helpers shared by the migrations: column types exactly as each revision wrote them.

Keep these stable: a migration must create the same schema forever, so a change
of type belongs in a new revision with its own helper, never here.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

MYSQL_TABLE: dict[str, Any] = {
    "mysql_engine": "InnoDB",
    "mysql_charset": "utf8mb4",
    "mariadb_engine": "InnoDB",
    "mariadb_charset": "utf8mb4",
}


def ascii_id(length: int) -> sa.types.TypeEngine[str]:
    """ASCII, compared case-sensitively on MySQL/MariaDB (ascii_bin)."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def json_text() -> sa.types.TypeEngine[str]:
    return sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def blob() -> sa.types.TypeEngine[bytes]:
    return sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")


def pk_id() -> sa.Column[int]:
    return sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True)


def ms(name: str, *, nullable: bool = False) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), nullable=nullable)
