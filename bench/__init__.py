"""Benchmarks (figures in docs/benchmarks.md), run from a checkout as ``python -m bench.<name>``.

This checkout's ``src`` goes first on the path: a second worktree sharing the venv (an A/B run)
would otherwise import the venv's editable install, another checkout's code. Child processes
take what ``PYTHONPATH`` says (``bench.outbox_drain``'s workers are given this checkout's; for
``bench.http_commands``' servers, set ``PYTHONPATH=<checkout>/src:<checkout>``).

So an A/B runs each side from its own checkout's directory. ``PYTHONPATH`` naming another
checkout's ``src`` is refused at import, with what to do instead: from main's directory,
``PYTHONPATH=<other>/src python -m bench.<name>`` ran main's code, not the other's (issue 12,
stop 32: three comparisons whose two sides ran the same code)."""

import os
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "src"


def _other_checkouts(pythonpath: str) -> list[str]:
    """The entries of ``pythonpath`` holding a ``roomservice`` package that is not this checkout's."""
    return [
        entry
        for entry in pythonpath.split(os.pathsep)
        if entry and (Path(entry) / "roomservice").is_dir() and Path(entry).resolve() != _SRC
    ]


if _other := _other_checkouts(os.environ.get("PYTHONPATH", "")):
    raise SystemExit(
        f"bench: PYTHONPATH names {_other[0]}, another checkout's code, but the benchmarks of {_SRC.parent} "
        f"run that checkout's own src; run `python -m bench.<name>` from the directory of the checkout to measure"
    )
if str(_SRC) not in sys.path[:1]:
    sys.path.insert(0, str(_SRC))
