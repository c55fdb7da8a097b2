"""The HYBRID layout's weight sync: every training worker loads its actor's weights into the
engine in its own process (the `naive` checkpoint engine hands the stream over, no copy in
between), all workers at once, each within the deadline. Waking the engine's memory first is
the mode's business (its phase order shows it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from tandem.serving.remote import NoAnswerError, call
from tandem.trainer.sync_seam import SyncReport
from tandem.weight_sync.base import WeightSyncError


class InProcessSync:
    """Syncs `workers` (HybridWorker handles or local objects, rank order); server ids name
    the engines in the report."""

    def __init__(self, workers: Sequence[Any], server_ids: Sequence[str], timeout_s: float) -> None:
        if len(workers) != len(server_ids):
            raise ValueError(f"{len(workers)} workers for {len(server_ids)} server ids")
        self.workers, self.server_ids = list(workers), list(server_ids)
        self.timeout_s = timeout_s

    async def sync(self, version: int) -> SyncReport:
        """Every worker's load_actor_weights(version) at once; WeightSyncError("load", worker)
        when one gives no answer within timeout_s (rollout.checkpoint_engine.timeout_s)."""
        start = time.perf_counter()
        await asyncio.gather(*(self._load(rank, worker, version)
                               for rank, worker in enumerate(self.workers)))
        seconds = time.perf_counter() - start
        return SyncReport(version, {"sync/load_s": seconds, "sync/total_s": seconds},
                          {sid: version for sid in self.server_ids})

    async def _load(self, rank: int, worker: Any, version: int) -> None:
        try:
            await call(worker, "load_actor_weights", version, timeout_s=self.timeout_s)
        except NoAnswerError:
            raise WeightSyncError("load", f"hybrid worker {rank} ({self.server_ids[rank]})",
                                  f"no answer within {self.timeout_s} s "
                                  "(rollout.checkpoint_engine.timeout_s)") from None
