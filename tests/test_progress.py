"""Progress bars in a redirected log: whole lines, a bounded number, no carriage returns; and no
transformers "Loading weights" bar from a rollout server's model load."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import textwrap

from tqdm import tqdm

from tandem.progress import LogLineBar, progress_bar

# The shape of a trainer mode's loop (trainer/sync.py): a kept steps bar whose description
# changes at every phase, a postfix per step, and a short-lived (leave=False) bar per step.
TRAINER_SHAPED_LOOP = textwrap.dedent("""
    import tandem.progress
    from tandem.progress import progress_bar

    tandem.progress.LOG_INTERVAL_S = float(__import__("sys").argv[1])
    bar = progress_bar(range(200), desc="GRPO steps", total=200, disable=False)
    for step in bar:
        for phase in ("generate", "reward", "old_log_prob", "update", "sync"):
            bar.set_description(f"GRPO [{phase}]")
        with progress_bar(total=8, desc="generate", unit="traj", leave=False) as inner:
            for _ in range(8):
                inner.update()
        bar.set_postfix(reward=f"{step / 200:.2f}")
""")


def run_redirected(tmp_path, interval_s: float) -> str:
    """Run the loop in a fresh process with stderr redirected to a file; the file's text."""
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        subprocess.run([sys.executable, "-c", TRAINER_SHAPED_LOOP, str(interval_s)], stderr=stderr,
                       check=True, timeout=120)
    return log.read_text()


def test_redirected_trainer_loop_writes_two_lines(tmp_path):
    """With the throttle far away, a 200-step loop (1,000 description changes, 200 inner bars)
    writes its first state and its final state, nothing else (plain tqdm wrote 2,003 lines and
    400 cursor-movement escapes for it into a file)."""
    text = run_redirected(tmp_path, 1e9)
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("GRPO steps:") and " 0/200" in lines[0]
    assert lines[1].startswith("GRPO [sync]:") and "200/200" in lines[1] and "reward=0.99" in lines[1]


def test_log_lines_follow_the_interval():
    """interval 0 (and tqdm's own mininterval 0): one whole line per refresh, each update and
    each description change; a leave=False bar adds no final line when it closes."""
    stream = io.StringIO()
    with progress_bar(total=3, desc="a", file=stream, mininterval=0, leave=False,
                      interval_s=0) as bar:
        assert isinstance(bar, LogLineBar)
        for _ in range(3):
            bar.update()
        bar.set_description("b")
    lines = stream.getvalue().split("\n")
    assert lines[-1] == "" and "\r" not in stream.getvalue()
    assert [line.split(":")[0] for line in lines[:-1]] == ["a", "a", "a", "a", "b"]
    assert [line.split("|")[-1].split()[0] for line in lines[:-1]] == ["0/3", "1/3", "2/3", "3/3",
                                                                        "3/3"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_live_tqdm_bar():
    bar = progress_bar(range(2), file=Terminal(), desc="x", interval_s=5)
    assert type(bar) is tqdm
    bar.close()
    bar = progress_bar(range(2), file=io.StringIO(), desc="x")
    assert type(bar) is LogLineBar
    bar.close()


def test_rollout_server_loads_its_model_without_a_progress_bar(capfd):
    """A rollout server's process (Ray forwards its stderr to the driver's log) loads the model
    with transformers' progress bars off, even where nothing else turned them off."""
    from transformers.utils import logging as hf_logging

    from tandem.config.schema import RolloutConfig
    from tandem.models import build_tiny_model
    from tandem.rollout.native import NativeRollout
    from tandem.serving.server import RolloutServer

    path = build_tiny_model()
    hf_logging.enable_progress_bar()
    try:
        server = RolloutServer("quiet")
        asyncio.run(server.start(NativeRollout, path, RolloutConfig(kv_cache_memory_bytes=1 << 20)))
        asyncio.run(server.shutdown())
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.disable_progress_bar()
    assert "Loading weights" not in capfd.readouterr().err
