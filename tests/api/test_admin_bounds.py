"""The admin operations bound their numeric arguments themselves (the CLI reaches them without the HTTP schema)."""

from __future__ import annotations

import pytest

from roomservice import errors
from roomservice.admin.operations import OutboxAdmin
from roomservice.bootstrap import Process
from roomservice.clock import wall_clock_ms
from roomservice.domain.limits import MAX_ID_VALUE


async def test_list_takes_after_id_up_to_a_signed_64_bit_integer(api_runtime: Process) -> None:
    admin = OutboxAdmin(api_runtime.db, clock=wall_clock_ms)
    assert await admin.list(after_id=MAX_ID_VALUE) == []
    for after_id in (MAX_ID_VALUE + 1, 2**64, -1):
        with pytest.raises(errors.InvalidArgument, match="after_id"):  # not SQLite's OverflowError
            await admin.list(after_id=after_id)
