"""Every benchmark script runs end to end with tiny sizes, so bench/ does not rot (no figures are checked).

Each script prints its figure beside the bare-driver baseline of the same run;
here only that it runs, that its self-checks pass (a bench asserts every row was
delivered, every answer was 200) and that the ratio line is printed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench import plot

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout_s: float = 120) -> str:
    proc, out, err = _bench(args, timeout_s)
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def _bench(
    args: tuple[str, ...], timeout_s: float, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str, str]:
    """Run ``python -m *args`` in a session of its own: past ``timeout_s`` the whole session is killed,
    the bench and every server it started (one under valgrind outlives a killed parent), then the
    test fails."""
    with subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{args[0]} ran past {timeout_s} s (its session killed):\n{out[-3000:]}\n{err[-3000:]}")
    return proc, out, err


def _processes_with(marker: str) -> list[int]:
    """The processes whose environment holds ``marker`` (from /proc; a zombie has none)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{marker}=1".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_a_bench_past_its_timeout_leaves_no_server_running() -> None:
    marker = f"ROOMBENCH_SMOKE_{os.getpid()}_{time.monotonic_ns()}"  # inherited by the bench's servers
    # a server under valgrind takes far longer than 8 s to answer its first requests
    args = ("bench.http_commands", "--servers", "worker-off", "--commands", "50", "--instructions")
    with pytest.raises(pytest.fail.Exception, match="ran past 8 s"):
        _bench(args, 8, env={marker: "1"})
    deadline = time.monotonic() + 10
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []


def test_command_path_prints_the_bare_driver_ratio() -> None:
    out = run_bench("bench.command_path", "--backend", "sqlite", "--commands", "200", "--rooms", "200")
    assert "baseline (bare sqlite3, one writer)" in out and "ratio" in out
    assert "through SQLAlchemy" in out and "Room Cell load" in out and "[memory]" in out


def test_command_path_sweep_draws_the_plot(tmp_path: Path) -> None:
    svg = tmp_path / "sweep.svg"
    out = run_bench("bench.command_path", "--backend", "sqlite", "--sweep", "1,4", "--sweep-commands", "100",
                    "--plot", str(svg))
    assert "concurrency    4" in out
    root = ET.fromstring(svg.read_text())
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 4  # rate + p99, ours + bare


def test_outbox_drain_runs() -> None:
    out = run_bench("bench.outbox_drain", "--backend", "sqlite", "--rows", "300", "--workers", "1",
                    "--rate", "50", "--seconds", "1", "--idle-seconds", "0", "--rounds", "2")
    assert "(bare driver)" in out and "bare claim+finish cycle" in out and "us a row" in out
    assert out.count(" publisher: ") == 2 * 3  # each round's three shapes...
    assert out.count("over 2 round(s): median ratio") == 4  # ...then each shape's median, and the floor's
    assert "a row may cost" in out  # what 0.9x leaves the worker above the bare loop's CPU a row
    # the floor (the bare loop + the least a row needs) drained every row in each round, each shape read against it
    assert out.count("floor (the bare loop + each row's envelope check and an instant publish):") == 2
    assert out.count("x the floor") == 2 * 3 + 3


def test_outbox_drain_counts_each_kind_of_process_under_callgrind() -> None:
    out = run_bench("bench.outbox_drain", "--instructions", "--backend", "sqlite", "--rows", "400", timeout_s=300)
    lines = re.findall(
        r"^\[sqlite\] one process, (direct|mq|direct-2) +publisher: +([\d.]+)k instructions a row"
        r" +bare loop: +([\d.]+)k +bare / worker ([\d.]+)x",
        out,
        re.MULTILINE,
    )
    assert {shape for shape, *_ in lines} == {"direct", "mq", "direct-2"}, out
    floor = re.search(r"^\[sqlite\] one process, floor: +([\d.]+)k instructions a row +bare loop: +([\d.]+)k", out,
                      re.MULTILINE)
    assert floor is not None, out
    # the floor runs the bare loop's statements and more; every worker shape does more still
    assert float(floor[2]) < float(floor[1]) < min(float(worker) for _, worker, _, _ in lines)
    for _, worker, bare, ratio in lines:
        # the worker issues the bare loop's statements and does more besides: a count, the same for the same code
        assert 0 < float(bare) < float(worker)
        assert float(ratio) == pytest.approx(float(bare) / float(worker), abs=0.01)


def test_drain_allowance_is_what_the_target_leaves_above_the_bare_cpu() -> None:
    from bench.outbox_drain import allowance

    assert "may cost 1.0 us" in allowance(9.0)  # 9.0 / 0.9 = 10.0 us a row: 1.0 above the bare loop's
    assert "may cost 9.0 us" in allowance(9.0, target=0.5)


def test_http_commands_runs() -> None:
    out = run_bench("bench.http_commands", "--servers", "worker-off", "--commands", "200", "--concurrency", "8")
    assert "x healthz" in out and "FAILURES" not in out


def test_direct_mode_runs() -> None:
    out = run_bench("bench.direct_mode", "--backend", "sqlite", "--events", "100")
    assert "ratio worker/raw" in out


def test_mq_drain_runs(require_service) -> None:  # type: ignore[no-untyped-def]
    require_service("NATS", "127.0.0.1", 4222, hint="nats-server -js")
    out = run_bench("bench.mq_drain", "--backend", "sqlite", "--rows", "300", "--rounds", "1", "--rate", "50",
                    "--seconds", "1")
    assert "ratio" in out and "bare cycle" in out and "us a row" in out
    assert "over 50/50 events" in out  # the perf_counter timeline joined every command to its row's finish
    assert "finish transaction" in out and "created_at_ms -> delivered_at_ms" in out


def test_group_commit_latency_times_every_event_from_its_commit() -> None:
    out = run_bench("bench.group_commit", "--latency", "--backend", "sqlite", "--rate", "50", "--seconds", "1")
    assert "from the command's commit notification" in out and "over 50/50 events" in out
    assert "published -> finish starts" in out and "created_at_ms -> delivered_at_ms" in out


def test_consumers_runs_on_the_embedded_broker() -> None:
    out = run_bench("bench.consumers", "--brokers", "embedded", "--rate", "50", "--seconds", "1",
                    "--messages", "200")
    assert "activity" in out
    throughput = next(line for line in out.splitlines() if "throughput over 200 messages" in line)
    for group in ("activity-room-outbox", "notice-room-outbox", "room-im-bridge", "bench-noop"):
        assert f"{group} " in throughput and "msgs/s" in throughput, throughput


@pytest.mark.parametrize("backends", [("sqlite",), ("sqlite", "mariadb")])
def test_plot_is_well_formed_svg(backends: tuple[str, ...]) -> None:
    points = {b: [{"concurrency": float(n), "cps": 100.0 * n, "p99": 1.0 + n, "bare_cps": 200.0 * n,
                   "bare_p99": 0.5 + n} for n in (1, 2, 4)] for b in backends}
    root = ET.fromstring(plot.concurrency_svg(points, note="test"))
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 4 * len(backends)


def test_http_commands_counts_instructions_under_callgrind() -> None:
    """--instructions: the server runs under valgrind's callgrind, instructions counted per phase."""
    out = run_bench("bench.http_commands", "--servers", "worker-off", "--commands", "48", "--concurrency", "8",
                    "--slices", "2", "--instructions", timeout_s=300)
    (line,) = [line for line in out.splitlines() if line.startswith("[http/worker-off instructions] round 1")]
    assert "FAILURES" not in line
    figures = dict(re.findall(r"(healthz|join|gift) +([\d.]+)k", line))
    assert set(figures) == {"healthz", "join", "gift"}
    # a command does the healthz's HTTP work and more: its count is larger, and none is nothing
    assert 0 < float(figures["healthz"]) < float(figures["join"]) and float(figures["healthz"]) < float(figures["gift"])


def test_command_pieces_times_and_counts_every_piece() -> None:
    timed = run_bench("bench.command_pieces", "--loops", "20", "--members", "5")
    counted = run_bench("bench.command_pieces", "--loops", "20", "--members", "5", "--instructions", timeout_s=300)
    for out, unit in ((timed, "us"), (counted, "k instructions")):
        figures = re.findall(rf"^  +(\S.*?) +([\d.]+) ?{unit}$", out, re.MULTILINE)
        assert len(figures) == 15, out  # every piece, each with a figure
        assert all(float(value) > 0 for _, value in figures)
        by_piece = {name.strip(): float(value) for name, value in figures}
        assert by_piece["answer (view + encoding)"] > by_piece["room view"]  # the answer holds the view
    assert "room view" in counted and "body: parse + validate" in counted


def test_worker_rows_times_and_counts_both_shapes() -> None:
    timed = run_bench("bench.worker_rows", "--rows", "400")
    counted = run_bench("bench.worker_rows", "--rows", "400", "--instructions", timeout_s=300)
    for out, unit in ((timed, "us of CPU a row"), (counted, "k instructions a row")):
        figures = dict(re.findall(rf"^  (direct|mq) +([\d.]+) ?{unit}$", out, re.MULTILINE))
        assert set(figures) == {"direct", "mq"}, out
        assert all(float(value) > 0 for value in figures.values())
    counts = dict(re.findall(r"^  (direct|mq) +([\d.]+)k instructions a row$", counted, re.MULTILINE))
    # the direct shape decodes every row and publishes it row after row: more than the pipeline's (a count,
    # the same for the same code, unlike the CPU times of 400 rows)
    assert float(counts["mq"]) < float(counts["direct"])


def test_a_bench_refuses_another_checkouts_code_on_pythonpath(tmp_path: Path) -> None:
    """From main's directory, ``PYTHONPATH=<other>/src python -m bench.<name>`` would measure main's code:
    refused, naming the path, before anything runs. This checkout's own src on the path is fine."""
    other = tmp_path / "other" / "src"
    (other / "roomservice").mkdir(parents=True)
    refused = subprocess.run(
        [sys.executable, "-c", "import bench"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(other), str(ROOT)])},
    )
    assert refused.returncode != 0
    assert str(other) in refused.stderr and "from the directory of the checkout" in refused.stderr
    accepted = subprocess.run(
        [sys.executable, "-c", "import bench"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
    )
    assert accepted.returncode == 0, accepted.stderr
