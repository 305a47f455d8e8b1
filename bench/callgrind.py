"""Instruction counts of a process, phase by phase, from valgrind's callgrind (``--instructions``).

A rate or a CPU time on this project's shared machine moves by 20–50 % between
two runs minutes apart; a change worth 3 % of a command cannot be seen in it.
callgrind counts the instructions a process executes in user space (the
kernel's share, socket and file I/O, is not counted), the same count for the same
work whatever else the machine is doing. So a benchmark can start its server
under callgrind with instrumentation off (start-up at about a fifth of native
speed), switch it on for each phase it measures, and read instructions per
request: a figure for comparing two versions of the code, not a time.

    prefix = callgrind_prefix(out_dir)          # put before the server's command line
    counter = PhaseCounter(pid, out_dir)
    counter.phase("join"); ...; counter.phase("healthz"); ...; counter.phase("done")
    counter.totals()                             # {"join": instructions, "healthz": ...}

Phases are switched with ``callgrind_control`` (``-i on``, ``-z`` at a phase's
start; ``-d NAME``, ``-i off`` at its end); each dump is a file in ``out_dir``
whose ``summary:`` line is the instructions since the phase started.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
from pathlib import Path

_TRIGGER = re.compile(r"^desc: Trigger: dump (\S+)$", re.MULTILINE)
_SUMMARY = re.compile(r"^summary: (\d+)$", re.MULTILINE)


def available() -> str | None:
    """None when valgrind and callgrind_control are on the PATH, else what is missing."""
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    return ", ".join(missing) or None


def callgrind_prefix(out_dir: Path) -> list[str]:
    """The command line to start a process under callgrind, instrumentation off until a phase starts."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=no",
            f"--callgrind-out-file={out_dir / 'callgrind.out'}"]


class PhaseCounter:
    """Switches callgrind on for one named phase at a time in process ``pid`` (started with
    :func:`callgrind_prefix`) and sums the instructions of each phase name over its dumps."""

    def __init__(self, pid: int, out_dir: Path) -> None:
        self.pid, self.out_dir = pid, out_dir
        self.current: str | None = None
        self.dumps = 0
        self._names: dict[str, str] = {}  # a dump's token (no spaces) -> the phase's name

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.pid)], check=True, capture_output=True, timeout=120)

    def phase(self, phase: str) -> None:
        """End the phase running (if any); start ``phase`` unless it is ``"done"``."""
        if self.current is not None:
            self.dumps += 1
            token = re.sub(r"\W", "_", self.current)
            self._names[token] = self.current
            self._control("-d", f"{token}#{self.dumps}")
            self._control("-i", "off")
            self.current = None
        if phase == "done":
            return
        self._control("-i", "on")
        self._control("-z")
        self.current = phase

    def totals(self) -> dict[str, int]:
        """Instructions of each phase, summed over its dumps (read from the dump files)."""
        sums: collections.Counter[str] = collections.Counter()
        for path in self.out_dir.glob("callgrind.out.*"):
            head = path.read_text(errors="replace")[:4096]
            trigger, summary = _TRIGGER.search(head), _SUMMARY.search(head)
            if trigger is None or summary is None:
                continue
            token = trigger.group(1).split("#", 1)[0]
            sums[self._names.get(token, token)] += int(summary.group(1))
        return dict(sums)
