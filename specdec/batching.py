"""Calls of several sessions batched into one forward pass: the target's Verify calls
(target_service.verifier.Job) and the draft's drafting steps (draft_service.drafters.Step).

A model runs on one worker thread (serving.ModelWorker), one pass at a time. A job that finds
the worker idle starts at once, alone: batching adds no wait. Jobs that arrive while a pass
runs queue up, and the next pass takes the first of them and every other one waiting that can
share it (its `batchable`), up to max_batch: one forward over all their rows
(kvcache.forward_batch), which reads the weights once where separate passes read them once
each. A job that is not batchable (a Verify that decodes plain steps after its pass) runs
alone, so that its steps do not hold up the others.

Terms:
    job     what one call asks of one pass: `batchable` and `rows` (the tokens it feeds) attributes,
            the rest is run_batch's.
    batch   the jobs of one pass: at most max_batch sessions, in their order of arrival.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from specdec.errors import WorkerWedged
from specdec.kvcache import PREFILL_CHUNK, crop_cache
from specdec.ranges import DEFAULT_MAX_BATCH
from specdec.serving import ModelWorker, wait_out

Waiting = tuple[Any, asyncio.Future]  # (job, its result to come)


class Batcher:
    """Runs jobs through `run_batch` (jobs -> a result or an exception for each, in order) on
    `worker`, several at a time (module doc)."""

    def __init__(self, worker: ModelWorker, run_batch: Callable[[Sequence[Any]], list[Any]],
                 max_batch: int = DEFAULT_MAX_BATCH,
                 observe: Callable[[int, float], None] = lambda size, seconds: None):  # fmt: skip
        self.worker = worker
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.observe = observe  # called with each pass's batch size and seconds on the worker (metrics)
        self.queue: list[Waiting] = []
        self.draining: asyncio.Task | None = None

    async def run(self, job) -> Any:
        """The job's result, from the next pass that takes it (its exception raised). Cancelled
        while queued, the job leaves the queue untouched; cancelled while its pass runs, it waits
        for the pass (which changes its session) before the cancellation goes on, as
        ModelWorker.run does, or until the worker is wedged: then WorkerWedged, as ModelWorker.run
        raises."""
        waiting = (job, asyncio.get_running_loop().create_future())
        self.queue.append(waiting)
        if self.draining is None:
            self.draining = asyncio.get_running_loop().create_task(self.drain())
        try:
            return await asyncio.shield(waiting[1])
        except asyncio.CancelledError:
            if waiting in self.queue:
                self.queue.remove(waiting)
                raise
            await wait_out(waiting[1])
            if not waiting[1].cancelled() and isinstance(error := waiting[1].exception(), WorkerWedged):
                # Its pass may still write the session: the caller must drop it, not undo the call's work.
                raise error from None
            raise

    async def drain(self) -> None:
        """Run passes until no job waits."""
        batch: list[Waiting] = []
        try:
            while self.queue:
                batch = self.next_batch()
                started = time.perf_counter()
                try:
                    jobs = [job for job, _ in batch]
                    results = await self.worker.run(self.run_batch, jobs, chunks=chunks_of(jobs))
                except Exception as exc:  # the pass itself failed: every job in it did
                    results = [exc] * len(batch)
                self.observe(len(batch), time.perf_counter() - started)
                for (_, future), result in zip(batch, results):
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
                batch = []
        finally:  # cancelled (the service stopping): nobody waits for ever
            for _, future in batch + self.queue:
                if not future.done():
                    future.cancel()
            self.draining = None

    def next_batch(self) -> list[Waiting]:
        """The first job waiting and, if it can share a pass, the others that can (module doc)."""
        first = self.queue.pop(0)
        if not first[0].batchable:
            return [first]
        batch = [first] + [waiting for waiting in self.queue if waiting[0].batchable][: self.max_batch - 1]
        self.queue = [waiting for waiting in self.queue if waiting not in batch]
        return batch


def chunks_of(jobs: Sequence[Any]) -> int:
    """A pass's size for its time limit (serving.ModelWorker): its jobs' rows in prefill chunks."""
    return max(1, math.ceil(sum(job.rows for job in jobs) / PREFILL_CHUNK))


def rerun_alone(jobs: Sequence[Any], results: list, run_batch: Callable[[Sequence[Any]], list[Any]]) -> list:
    """After a pass over several sessions failed (out of memory, say, where one session's rows
    fit): each job still without a result (None in `results`) gets its session's KV cache cropped
    back to what it held before the pass (the failed pass may have appended to some of its
    layers: job.state is a kvcache.SessionState), then runs in a pass of its own through
    `run_batch`, so only a job that fails alone fails. Returns `results`, filled in."""
    for i, job in enumerate(jobs):
        if results[i] is None:
            crop_cache(job.state.cache, len(job.state.held))
            try:
                results[i] = run_batch([job])[0]
            except Exception as exc:  # noqa: BLE001 - this job's own error, for it alone
                results[i] = exc
    return results
