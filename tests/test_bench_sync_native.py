"""bench/sync.py's shm-db-native row: the double-buffered handoff into a generating native engine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~25 s: two engines, two sender processes
def test_native_row_measures_the_engines_pause_for_both_in_flight_policies() -> None:
    done = subprocess.run([sys.executable, "bench/sync.py", "--tiny", "--engines",
                           "shm-db,shm-db-native"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"generating native engine, .* in_flight_kv=(\w+): .* flip \(step lock\) "
                      r"(\S+) ms; .* pause (\d+) ms", done.stdout)
    assert [policy for policy, _, _ in rows] == ["recompute", "keep"], done.stdout
    assert all(float(flip) > 0 for _, flip, _ in rows)
    lines = done.stdout.splitlines()
    assert re.match(r"PAUSE_RATIO \d+\.\d{4} .* native engine .* in_flight_kv=keep, cpu$", lines[-2])
    assert lines[-1].startswith("RATIO ") and "shm-db cross-process" in lines[-1]
