"""bench/sync.py's delta-link row: two network namespaces, a shaped veth pair, gloo full vs delta."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                                reason="network namespaces and tc need root and iproute2")


def test_delta_link_row_measures_delta_against_full_gloo_and_cleans_up() -> None:
    done = subprocess.run([sys.executable, "bench/sync.py", "--tiny", "--engines", "delta-link"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    # the bench exits non-zero when the receiver's bits differ from the sender's
    assert re.search(r"link delta .*bytes \d+\.\d% of full", done.stdout)
    ratio = re.search(r"^DELTA_RATIO (\S+) delta / full gloo, 1% changed, 4 MB, 1gbit", done.stdout,
                      flags=re.M)
    assert ratio and 0 < float(ratio.group(1))
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tsync-" not in namespaces
