"""Benchmarks (figures in docs/benchmarks.md), run from a checkout as ``python -m bench.<name>``.

This checkout's ``src`` goes first on the path: a second worktree sharing the venv (an A/B run)
would otherwise import the venv's editable install, another checkout's code. Child processes
take what ``PYTHONPATH`` says (``bench.outbox_drain``'s workers are given this checkout's; for
``bench.http_commands``' servers, set ``PYTHONPATH=<checkout>/src:<checkout>``)."""

import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parent.parent / "src")
if _SRC not in sys.path[:1]:
    sys.path.insert(0, _SRC)
