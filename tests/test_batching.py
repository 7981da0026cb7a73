"""The target verifies the cycles of several sessions in one forward pass (specdec.batching,
Verifier.verify_batch), and a model draft drafts a token of each of several sessions in one
(ModelDrafter.draft_batch): calls that wait while a pass runs share the next one, each
session gets the verdict or the draft it would have had alone, and through the services the
tokens are those of one request at a time."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import specdec
from conftest import scrape, start_stack
from draft_service.drafters import ModelDrafter, Step
from specdec.draft_wire import Draft
from specdec.errors import OutOfRange, UnusableLogits, WorkerWedged
from specdec.kvcache import PREFILL_CHUNK, SessionState, new_cache
from specdec.model_service import prefill
from specdec.models import LoadedModel, build_tiny_model, build_tiny_tokenizer
from specdec.plain_forward import enable_plain_forward
from specdec.redis_server import free_port
from specdec.serving import ModelWorker
from specdec.wire import Sampling
from specdec.batching import Batcher
from target_service.verifier import Job, Verifier


# ---------------------------------------------------------------- the batcher alone


class Passes:
    """A run_batch that records each pass's jobs and holds each pass until released."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.gate = threading.Semaphore(0)

    def __call__(self, jobs):
        self.gate.acquire(timeout=5)
        self.batches.append([job.name for job in jobs])
        return [ValueError(job.name) if job.name.startswith("bad") else f"verdict {job.name}" for job in jobs]


def job(name: str, batchable: bool = True, rows: int = 1):
    return SimpleNamespace(name=name, batchable=batchable, rows=rows)


def test_calls_that_wait_while_a_pass_runs_share_the_next_one_in_order_up_to_max_batch():
    """The first call runs alone at once; the six that arrive during its pass share the next
    passes, three at most each (max_batch), in their order of arrival; one that decodes plain
    steps (not batchable) runs alone in its turn; each call gets its own verdict, and a job's
    own error reaches only that job."""
    passes = Passes()

    async def run():
        worker = ModelWorker("test-target")
        sizes = []
        batcher = Batcher(worker, passes, max_batch=3, observe=lambda size, seconds: sizes.append((size, seconds)))
        first = asyncio.create_task(batcher.run(job("a")))
        await asyncio.sleep(0.05)  # the first pass has started, and waits on the gate
        names = ["b", "c", "steps", "bad-d", "e", "f"]
        rest = [asyncio.create_task(batcher.run(job(n, batchable=n != "steps"))) for n in names]
        await asyncio.sleep(0.05)
        for _ in range(5):
            passes.gate.release()
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        worker.shutdown()
        return results, sizes

    results, sizes = asyncio.run(run())
    assert passes.batches == [["a"], ["b", "c", "bad-d"], ["steps"], ["e", "f"]]
    assert [size for size, _ in sizes] == [1, 3, 1, 2]
    assert sizes[0][1] >= 0.05, "a pass is timed on the worker: the first waited for its gate over 0.05 s"
    assert results[:4] == ["verdict a", "verdict b", "verdict c", "verdict steps"]
    assert isinstance(results[4], ValueError) and results[5:] == ["verdict e", "verdict f"]


def test_a_call_cancelled_while_queued_leaves_the_queue_and_one_cancelled_in_its_pass_waits_for_it():
    """Cancelled before its pass, a call is taken out (its session untouched: no pass sees
    it); cancelled during its pass, it returns only once the pass is over (the pass changes
    its session, which the caller holds until then)."""
    passes = Passes()

    async def run():
        worker = ModelWorker("test-target")
        batcher = Batcher(worker, passes, max_batch=8)
        running = asyncio.create_task(batcher.run(job("running")))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(batcher.run(job("queued")))
        kept = asyncio.create_task(batcher.run(job("kept")))
        await asyncio.sleep(0.05)
        queued.cancel()
        running.cancel()
        await asyncio.sleep(0.05)
        cancelled_before_pass_ended = running.done()
        passes.gate.release()
        passes.gate.release()
        outcome = await asyncio.gather(running, queued, kept, return_exceptions=True)
        worker.shutdown()
        return cancelled_before_pass_ended, outcome

    cancelled_before_pass_ended, (running, queued, kept) = asyncio.run(run())
    assert not cancelled_before_pass_ended, "a call in a running pass waits for the pass"
    assert isinstance(running, asyncio.CancelledError) and isinstance(queued, asyncio.CancelledError)
    assert kept == "verdict kept"
    assert passes.batches == [["running"], ["kept"]]


def test_a_call_cancelled_twice_during_its_pass_still_returns_only_once_the_pass_is_over():
    """A second cancellation while a call waited for its running pass ended the wait at once:
    the caller then released (and rolled back) the session the pass was still writing, and a
    retry of the call verified after the wrong context (a verdict (0, 25) where the clean one
    is (3, 20), in the audit's script). The Batcher's calls and the worker's both wait it out."""
    passes = Passes()

    async def cancel_twice(task):
        await asyncio.sleep(0.05)  # its pass has started, and waits on the gate
        task.cancel()
        await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.sleep(0.05)
        return task.done()

    async def run():
        worker = ModelWorker("test-target")
        batched = asyncio.create_task(Batcher(worker, passes, max_batch=8).run(job("running")))
        batched_done_early = await cancel_twice(batched)
        passes.gate.release()
        results = await asyncio.gather(batched, return_exceptions=True)
        gate = threading.Event()
        alone = asyncio.create_task(worker.run(gate.wait, 5))
        alone_done_early = await cancel_twice(alone)
        gate.set()
        results += await asyncio.gather(alone, return_exceptions=True)
        worker.shutdown()
        return batched_done_early, alone_done_early, results

    batched_done_early, alone_done_early, results = asyncio.run(run())
    assert not batched_done_early and not alone_done_early, "a call in a running pass waits for the pass"
    assert all(isinstance(result, asyncio.CancelledError) for result in results) and passes.batches == [["running"]]


def test_a_pass_past_the_pass_timeout_wedges_the_worker_until_it_ends_and_every_waiting_job_ends_unavailable():
    """A pass that runs past pass_timeout_s (a hung device) ends its own caller's wait and the
    waits of the jobs queued behind it in WorkerWedged (UNAVAILABLE: the coordinator asks another
    replica), within about the timeout; a job queued behind it never runs; a new job is refused
    at once while it lasts, and `wedged()` says why. Once the pass ends, the worker serves again.
    Before, every call waited for the pass, for ever if it never ended."""
    hang, ran = threading.Event(), []

    async def run():
        worker = ModelWorker("test-target", pass_timeout_s=0.3)
        started = time.monotonic()
        hung = asyncio.create_task(worker.run(hang.wait, 30))
        queued = asyncio.create_task(worker.run(ran.append, "queued"))
        outcome = await asyncio.gather(hung, queued, return_exceptions=True)
        waited = time.monotonic() - started
        reason = worker.wedged()
        with pytest.raises(WorkerWedged):
            await worker.run(ran.append, "refused")
        hang.set()
        while worker.wedged() is not None:
            await asyncio.sleep(0.01)
        after = await worker.run(lambda: "served")
        worker.shutdown()
        return outcome, waited, reason, after

    outcome, waited, reason, after = asyncio.run(run())
    assert all(isinstance(result, WorkerWedged) for result in outcome), outcome
    assert "model worker is wedged" in str(outcome[0]) and "--pass-timeout 0.3 s" in str(outcome[0])
    assert 0.3 <= waited < 5, waited
    assert reason is not None and "past --pass-timeout 0.3 s" in reason
    assert ran == [] and after == "served"


def test_a_worker_without_a_pass_timeout_or_with_passes_shorter_than_it_never_wedges():
    """pass_timeout_s 0 (as while the model loads) waits for any pass; passes shorter than the
    timeout, however many, never wedge the worker; a pass the size of several prefill chunks
    (a batch of 8 prompts' last chunks, say) may take the timeout once per chunk."""

    async def run():
        never = ModelWorker("test-target")
        slow = await never.run(time.sleep, 0.2)
        short = ModelWorker("test-target", pass_timeout_s=0.2)
        results = [await short.run(time.sleep, 0.05) for _ in range(8)]
        batch = await short.run(time.sleep, 0.4, chunks=3)
        never.shutdown()
        short.shutdown()
        return slow, results, batch, short.wedged()

    slow, results, batch, wedged = asyncio.run(run())
    assert slow is None and results == [None] * 8 and batch is None and wedged is None


def test_a_call_cancelled_while_its_pass_hangs_ends_wedged_once_the_pass_passes_its_timeout():
    """A call cancelled during its pass waits for the pass (test above), but a pass that hangs
    past its timeout (2 prefill chunks' rows here: twice pass_timeout_s) ends the wait in WorkerWedged,
    not CancelledError, so that the caller drops the session the pass may still write instead
    of undoing its work under it; through the Batcher and on the worker alike. The Batcher's
    caller used to leave with CancelledError as soon as the worker was wedged."""
    passes, hang = Passes(), threading.Event()

    async def cancelled_during(task, worker):
        await asyncio.sleep(0.05)  # its pass has begun and hangs
        began = worker.running[0]
        task.cancel()
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        return outcome, time.monotonic() - began, worker.wedged()

    async def run():
        worker = ModelWorker("test-target", pass_timeout_s=0.2)
        batcher = Batcher(worker, passes, max_batch=8)
        first = asyncio.create_task(batcher.run(job("first")))
        await asyncio.sleep(0.05)  # the first pass hangs on the gate; the next two share a pass
        pair = [asyncio.create_task(batcher.run(job(name, rows=PREFILL_CHUNK))) for name in ("second", "third")]
        passes.gate.release()
        await first
        batched = await cancelled_during(pair[0], worker)
        passes.gate.release()
        await asyncio.gather(pair[1], return_exceptions=True)
        while worker.wedged() is not None:
            await asyncio.sleep(0.01)
        alone = await cancelled_during(asyncio.create_task(worker.run(hang.wait, 30)), worker)
        hang.set()
        worker.shutdown()
        return batched, alone

    batched, alone = asyncio.run(run())
    for (outcome, since_pass_began, wedged), limit in ((batched, 0.4), (alone, 0.2)):
        assert isinstance(outcome, WorkerWedged), outcome
        assert wedged is not None and since_pass_began >= limit, (since_pass_began, wedged)  # not sooner
    assert "the size of 2 prefill chunks" in str(batched[0]) and "past 2 × --pass-timeout 0.2 s" in str(batched[0])
    assert passes.batches[1] == ["second", "third"]


def test_a_call_queued_behind_a_long_pass_hears_of_its_own_hung_pass_within_the_timeout():
    """A call queued behind a pass with a long limit (8 prefill chunks' worth) whose own pass then
    hangs ends WorkerWedged about pass_timeout_s after its pass began: it used to sleep until the
    long pass's limit before it looked again."""
    hang = threading.Event()

    async def run():
        worker = ModelWorker("test-target", pass_timeout_s=0.2)
        long = asyncio.create_task(worker.run(time.sleep, 0.1, chunks=8))  # a healthy pass, limit 1.6 s
        started = time.monotonic()
        hung = await asyncio.gather(worker.run(hang.wait, 10), return_exceptions=True)
        waited = time.monotonic() - started
        await long
        hang.set()
        worker.shutdown()
        return hung[0], waited

    hung, waited = asyncio.run(run())
    assert isinstance(hung, WorkerWedged) and waited < 1.0, (hung, waited)


def test_a_pass_is_timed_by_its_size_in_prefill_chunks_and_each_plain_step_counts_as_one():
    """The limit of a pass (serving.ModelWorker) grows with the tokens it feeds, a prefill chunk's
    worth at a time: decoding steps of 8 sessions are one chunk, their last prompt chunks eight,
    and a Verify's plain steps after its pass (each a forward of its own) one chunk each."""
    from specdec.batching import chunks_of

    pending = lambda n: SessionState("s", pending=list(range(n)))  # noqa: E731
    steps = [Step(pending(1), Sampling(), None) for _ in range(8)]
    cycles = [Job(pending(1), [Draft(5, None)] * 4, Sampling(), None) for _ in range(8)]
    prompts = [Job(pending(PREFILL_CHUNK), [], Sampling(), None) for _ in range(8)]
    plain = Job(pending(1), [], Sampling(), None, steps=17)
    assert [chunks_of(steps), chunks_of(cycles), chunks_of(prompts), chunks_of([plain])] == [1, 1, 8, 17]
    assert chunks_of([Job(pending(1), [Draft(5, None)], Sampling(), None, steps=17)]) == 1  # steps only without drafts


# ---------------------------------------------------------------- real verification


@pytest.fixture(scope="module")
def verifier():
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=1).eval()
    assert enable_plain_forward(model)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name="tiny", path="", vocab_fingerprint="",
                         vocab_size=model.config.vocab_size, max_context=0)  # fmt: skip
    return Verifier(loaded)


def greedy_continuation(model, tokens: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        for _ in range(n):
            tokens = tokens + [int(model(torch.tensor([tokens])).logits[0, -1].argmax())]
    return tokens[-n:] if n else []


def peaked(token: int, vocab: int) -> torch.Tensor:
    q = torch.full((vocab,), 0.1 / (vocab - 1))  # [V]
    q[token] = 0.9
    return q


def sessions_and_jobs(verifier, temperature: float):
    """Four sessions (contexts of 5 to 40 tokens) with 3, 0, 1 and 2 drafts, the first and
    third the target's own greedy tokens, the last random (so verdicts both accept and
    reject); where sampled, q puts 0.9 on its token and spreads the rest."""
    vocab = verifier.loaded.vocab_size
    generator = torch.Generator().manual_seed(11)
    jobs = []
    for i, (context, k) in enumerate(((5, 3), (40, 0), (17, 1), (9, 2))):
        tokens = torch.randint(4, vocab, (context + k,), generator=generator).tolist()
        if i in (0, 2):
            tokens[context:] = greedy_continuation(verifier.model, tokens[:context], k)
        state = SessionState(f"s{i}", held=[], pending=tokens[:context], cache=new_cache(verifier.model.config))
        drafts = [Draft(t, None if temperature == 0 else peaked(t, vocab)) for t in tokens[context:]]
        sampling = Sampling(temperature, 0, 1.0, seed=i)
        jobs.append(Job(state, drafts, sampling, torch.Generator().manual_seed(100 + i)))
    return jobs


def test_the_target_runs_once_per_cycle_whatever_k_and_wherever_the_first_rejection_falls(verifier):
    """Seed bank: the target verifies all K drafts in ONE forward pass over the pending context
    and the drafts (K + 1 rows of logits), not once per draft, and no more after a rejection:
    the recovered or bonus token comes from those rows. Counted by the passes through the
    model's embedding (every forward path runs it once)."""
    vocab = verifier.loaded.vocab_size
    passes: list[int] = []  # tokens fed by each pass
    hook = verifier.model.get_input_embeddings().register_forward_hook(lambda module, args, out: passes.append(out.shape[1]))
    generator = torch.Generator().manual_seed(21)
    accepted = set()
    try:
        for k in (1, 4, 8):
            for trial in range(6):
                context = torch.randint(4, vocab, (12,), generator=generator).tolist()
                state = SessionState(f"once-{k}-{trial}", held=[], pending=context, cache=new_cache(verifier.model.config))
                tokens = torch.randint(4, vocab, (k,), generator=generator).tolist()
                greedy = trial % 2 == 0  # greedy: the target's own tokens up to a wrong one at `trial // 2`
                if greedy:
                    tokens = greedy_continuation(verifier.model, context, k)
                    tokens[min(trial // 2, k - 1)] = (tokens[min(trial // 2, k - 1)] + 1) % vocab
                drafts = [Draft(t, None if greedy else peaked(t, vocab)) for t in tokens]
                passes.clear()
                with torch.inference_mode():
                    verdict = verifier.verify(state, drafts, Sampling(0.0 if greedy else 1.0, 0, 1.0, seed=trial),
                                              torch.Generator().manual_seed(trial))  # fmt: skip
                assert passes == [12 + k], (k, trial, passes)  # one pass: the context and the K drafts
                accepted.add((k, verdict.num_accepted < k))
        # The count sees every pass: plain decoding of 3 tokens (no drafts) is three.
        state = SessionState("plain", held=[], pending=context, cache=new_cache(verifier.model.config))
        passes.clear()
        with torch.inference_mode():
            verifier.verify(state, [], Sampling(0.0, 0, 1.0, seed=0), torch.Generator(), steps=3)
        assert passes == [12, 1, 1]
    finally:
        hook.remove()
    assert {(k, True) for k in (1, 4, 8)} <= accepted  # a rejection in every K's cycles


def test_a_long_prompt_is_prefilled_a_chunk_a_pass_and_another_sessions_pass_runs_between_its_chunks(verifier):
    """A session's pending context longer than PREFILL_CHUNK is fed a chunk a pass, each queued
    behind the passes waiting: another session's call that arrives during the first chunk is
    verified before the long prompt's other chunks run (it used to wait for the whole prompt's
    one pass), and the long prompt's verdict and tokens afterwards are those of one pass."""
    vocab = verifier.loaded.vocab_size
    prompt = torch.randint(4, vocab, (3 * PREFILL_CHUNK + 10,), generator=torch.Generator().manual_seed(3)).tolist()
    drafts = [Draft(t, None) for t in greedy_continuation(verifier.model, prompt, 2)]
    greedy = Sampling(0.0, 0, 1.0, seed=0)

    def fresh(name: str, tokens: list[int]) -> SessionState:
        return SessionState(name, held=[], pending=list(tokens), cache=new_cache(verifier.model.config))

    one_pass = fresh("one-pass", prompt)
    with torch.inference_mode():
        whole = verifier.verify(one_pass, drafts, greedy, torch.Generator())
    finished = []

    async def run():
        worker = ModelWorker("test-target")
        batcher = Batcher(worker, verifier.verify_batch)
        gate = threading.Event()
        busy = asyncio.ensure_future(worker.run(gate.wait, 5))  # what comes next queues behind it
        long = fresh("long", prompt)

        async def long_call():
            chunks = []
            await prefill(worker, verifier.model, long, lambda: chunks.append(len(long.held)))
            finished.append(f"long prefilled in chunks ending at {chunks}")
            return await batcher.run(Job(long, drafts, greedy, torch.Generator()))

        long_task = asyncio.create_task(long_call())
        await asyncio.sleep(0.05)  # its first chunk is queued
        short_task = asyncio.create_task(batcher.run(Job(fresh("short", prompt[:7]), [], greedy, torch.Generator())))
        short_task.add_done_callback(lambda _: finished.append("short"))
        await asyncio.sleep(0.05)
        gate.set()
        verdict = await long_task
        await short_task
        await busy
        worker.shutdown()
        return verdict, long

    verdict, long = asyncio.run(run())
    assert finished == ["short", f"long prefilled in chunks ending at {[PREFILL_CHUNK, 2 * PREFILL_CHUNK, 3 * PREFILL_CHUNK]}"]
    assert (verdict.num_accepted, verdict.next_token, verdict.bonus) == (whole.num_accepted, whole.next_token, True)
    assert (long.held, long.pending) == (one_pass.held, one_pass.pending)
    assert long.cache.get_seq_length() == len(long.held) == len(prompt) + 2


def test_a_prefill_cancelled_stops_after_its_current_chunk_and_the_session_keeps_what_was_fed(verifier):
    """A client that gives up during a long prompt's prefill frees the model after the chunk
    that runs (it used to hold it for the whole prompt's pass); the session keeps the chunks
    fed, with a cache that covers them, for a later call to go on from. A chunk that has not
    begun is not fed at all: here the second, queued behind another job when the call is
    cancelled (the worker ran it before the cancellation went on)."""
    prompt = torch.randint(4, verifier.loaded.vocab_size, (4 * PREFILL_CHUNK + 10,),
                           generator=torch.Generator().manual_seed(4)).tolist()  # fmt: skip
    state = SessionState("given-up", held=[], pending=list(prompt), cache=new_cache(verifier.model.config))

    async def run():
        worker = ModelWorker("test-target")
        gate = threading.Event()
        busy = []
        # After the first chunk, another job takes the worker before the second chunk is queued.
        fed = lambda: busy or busy.append(worker.executor.submit(gate.wait, 5))  # noqa: E731
        task = asyncio.create_task(prefill(worker, verifier.model, state, fed))
        while not busy:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the second chunk waits behind it
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await asyncio.wrap_future(busy[0])
        worker.shutdown()

    asyncio.run(run())
    assert (state.held, state.pending) == (prompt[:PREFILL_CHUNK], prompt[PREFILL_CHUNK:])
    assert state.cache.get_seq_length() == PREFILL_CHUNK


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_one_pass_over_several_sessions_gives_each_the_verdict_and_state_of_its_own_pass(verifier, temperature):
    """The same four cycles verified one at a time and in one pass, twice over (a prefill,
    then a cycle on the cached context): the same verdicts (accepted count, next token, bonus)
    and the same session tokens afterwards."""
    alone, together = sessions_and_jobs(verifier, temperature), sessions_and_jobs(verifier, temperature)
    accepted, rejected = 0, 0
    with torch.inference_mode():
        for _ in range(2):
            separate = [verifier.verify(j.state, j.drafts, j.sampling, j.generator) for j in alone]
            batched = verifier.verify_batch(together)
            accepted += sum(v.num_accepted for v in separate)
            rejected += sum(not v.bonus for v in separate)
            assert [(v.num_accepted, v.next_token, v.bonus) for v in batched] == [
                (v.num_accepted, v.next_token, v.bonus) for v in separate
            ]
            for a, b in zip(alone, together):
                assert (a.state.held, a.state.pending) == (b.state.held, b.state.pending)
                assert a.state.cache.get_seq_length() == b.state.cache.get_seq_length() == len(a.state.held)
                b.drafts, a.drafts = list(a.drafts[:1]), list(a.drafts[:1])  # the next cycle: one draft each
    assert accepted > 0 and rejected > 0


def test_a_session_past_the_context_gets_its_error_and_the_others_in_its_pass_their_verdicts(verifier):
    jobs = sessions_and_jobs(verifier, 0.0)
    verifier.loaded.max_context = 20
    try:
        with torch.inference_mode():
            results = verifier.verify_batch(jobs)
    finally:
        verifier.loaded.max_context = 0
    assert isinstance(results[1], OutOfRange) and "exceed the target's context of 20" in str(results[1])
    assert [type(r).__name__ for r in results] == ["Verdict", "OutOfRange", "Verdict", "Verdict"]
    assert jobs[1].state.held == [] and jobs[1].state.cache.get_seq_length() == 0, "the refused session is untouched"


def test_a_session_whose_logits_are_unusable_gets_its_error_and_the_others_in_its_pass_their_verdicts(
    verifier, monkeypatch
):
    """One session's rows of the shared pass come out NaN (its own text past its dtype's range,
    say): that session's call gets UnusableLogits with its session as it was before the pass,
    and the other three get the verdicts they get alone. It used to fail all four."""
    import target_service.verifier as verifier_module

    real = verifier_module.forward_batch

    def nan_for_the_third(model, caches, token_lists, keeps):
        logits = real(model, caches, token_lists, keeps)
        return [rows.fill_(float("nan")) if i == 2 and len(caches) > 1 else rows for i, rows in enumerate(logits)]

    alone, together = sessions_and_jobs(verifier, 1.0), sessions_and_jobs(verifier, 1.0)
    context = list(together[2].state.pending)
    monkeypatch.setattr(verifier_module, "forward_batch", nan_for_the_third)
    with torch.inference_mode():
        separate = [verifier.verify(j.state, j.drafts, j.sampling, j.generator) for j in alone]
        batched = verifier.verify_batch(together)
    assert isinstance(batched[2], UnusableLogits) and "NaN" in str(batched[2])
    assert [type(r).__name__ for r in batched] == ["Verdict", "Verdict", "UnusableLogits", "Verdict"]
    for i in (0, 1, 3):
        assert (batched[i].num_accepted, batched[i].next_token) == (separate[i].num_accepted, separate[i].next_token)
        assert (together[i].state.held, together[i].state.pending) == (alone[i].state.held, alone[i].state.pending)
    failed = together[2].state
    assert (failed.held, failed.pending, failed.cache.get_seq_length()) == ([], context, 0), "as before the pass"


def failing_forward_batch(real, doomed, solo_starts: list[int]):
    """A kvcache.forward_batch that, over several sessions, appends to the first two sessions'
    caches and then fails (out of memory, simulated); over one, records the cache length it
    starts from in `solo_starts` and fails again for the cache `doomed` alone."""

    def out_of_memory(model, caches, token_lists, keeps):
        if len(caches) > 1:
            real(model, caches[:2], token_lists[:2], keeps[:2])  # some rows in, then the failure
            raise RuntimeError("CUDA out of memory (simulated)")
        solo_starts.append(caches[0].get_seq_length())
        if caches[0] is doomed:
            raise RuntimeError("this session fails on its own too")
        return real(model, caches, token_lists, keeps)

    return out_of_memory


def test_a_pass_that_fails_over_several_sessions_is_rerun_one_session_at_a_time_and_only_a_failing_one_fails(
    verifier, monkeypatch
):
    """The batched forward runs out of memory after it has appended to two sessions' caches
    (simulated); each session is then verified alone, from the cache it had: the verdicts and
    states of one pass each, except the session whose own pass fails too, which gets that error."""
    from target_service import verifier as verifier_module

    jobs, reference = sessions_and_jobs(verifier, 1.0), sessions_and_jobs(verifier, 1.0)
    solo_starts = []  # the cached length each pass of one session starts from
    out_of_memory = failing_forward_batch(verifier_module.forward_batch, jobs[3].state.cache, solo_starts)
    with torch.inference_mode():
        expected = [verifier.verify(j.state, j.drafts, j.sampling, j.generator) for j in reference[:3]]
        monkeypatch.setattr(verifier_module, "forward_batch", out_of_memory)
        results = verifier.verify_batch(jobs)
    assert solo_starts == [0, 0, 0, 0], "a session's own pass must start from the cache it had before the failed one"
    assert isinstance(results[3], RuntimeError) and "on its own" in str(results[3])
    assert [(v.num_accepted, v.next_token, v.batch) for v in results[:3]] == [
        (v.num_accepted, v.next_token, 1) for v in expected
    ]
    for a, b in zip(jobs[:3], reference[:3]):
        assert (a.state.held, a.state.pending) == (b.state.held, b.state.pending)
        assert a.state.cache.get_seq_length() == len(a.state.held)
    assert jobs[3].state.held == [] and jobs[3].state.cache.get_seq_length() == 0


# ---------------------------------------------------------------- real drafting


def drafting_sessions(drafter: ModelDrafter, temperature: float) -> list[Step]:
    """Four sessions (contexts of 5 to 40 tokens, not yet fed) each with its own sampling and
    generator."""
    vocab = drafter.model.config.vocab_size
    generator = torch.Generator().manual_seed(5)
    steps = []
    for i, context in enumerate((5, 40, 17, 9)):
        tokens = torch.randint(4, vocab, (context,), generator=generator).tolist()
        state = SessionState(f"d{i}", held=[], pending=tokens, cache=new_cache(drafter.model.config))
        steps.append(Step(state, Sampling(temperature, 0, 1.0, seed=i), torch.Generator().manual_seed(200 + i)))
    return steps


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_one_drafting_pass_over_several_sessions_gives_each_the_tokens_and_q_of_its_own_passes(verifier, temperature):
    """Four sessions drafting six tokens each, one session a pass (propose, as before) and all
    four in each pass (draft_batch): the same tokens, the same q up to float rounding, the
    same session states and cache lengths."""
    drafter = ModelDrafter(verifier.loaded)
    alone, together = drafting_sessions(drafter, temperature), drafting_sessions(drafter, temperature)
    with torch.inference_mode():
        separate = [list(drafter.propose(s.state, 6, s.sampling, s.generator)) for s in alone]
        batched = [drafter.draft_batch(together) for _ in range(6)]  # [step][session]
    for i, (a, b) in enumerate(zip(alone, together)):
        assert [p[0] for p in separate[i]] == [step[i][0] for step in batched], f"session {i}"
        for (_, q_alone, _), (_, q_batched, _) in ((separate[i][n], batched[n][i]) for n in range(6)):
            if temperature == 0:
                assert q_alone is None and q_batched is None
            else:
                assert torch.allclose(q_alone.probs(), q_batched.probs(), atol=1e-4)
        assert (a.state.held, a.state.pending) == (b.state.held, b.state.pending)
        assert a.state.cache.get_seq_length() == b.state.cache.get_seq_length() == len(a.state.held)
    assert len({tuple(p[0] for p in tokens) for tokens in separate}) == 4, "four different drafts"


def test_a_drafting_pass_that_fails_over_several_sessions_is_rerun_one_session_at_a_time(verifier, monkeypatch):
    """The batched forward fails after appending to two sessions' caches (simulated): each
    session then drafts alone from the cache it had, and gets the token of a pass of its own,
    but the one whose own pass fails too, which gets that error and nothing else."""
    from draft_service import drafters as drafters_module

    drafter = ModelDrafter(verifier.loaded)
    steps, reference = drafting_sessions(drafter, 1.0), drafting_sessions(drafter, 1.0)
    solo_starts = []
    out_of_memory = failing_forward_batch(drafters_module.forward_batch, steps[3].state.cache, solo_starts)
    with torch.inference_mode():
        expected = [drafter.draft_batch([step])[0] for step in reference[:3]]
        monkeypatch.setattr(drafters_module, "forward_batch", out_of_memory)
        results = drafter.draft_batch(steps)
    assert solo_starts == [0, 0, 0, 0], "a session's own pass must start from the cache it had"
    assert isinstance(results[3], RuntimeError) and "on its own" in str(results[3])
    assert [r[0] for r in results[:3]] == [e[0] for e in expected]
    for a, b in zip(steps[:3], reference[:3]):
        assert (a.state.held, a.state.pending) == (b.state.held, b.state.pending)
    assert steps[3].state.held == [] and steps[3].state.cache.get_seq_length() == 0


# ---------------------------------------------------------------- through the services


def test_concurrent_requests_share_verify_and_drafting_passes_and_get_the_tokens_of_one_request_at_a_time(redis_url, tiny_models):
    """Eight greedy requests on different prompts at once through a stack whose target and
    draft serve /metrics: every one gets the tokens it gets alone, and both the target's and
    the draft's passes served more sessions than there were passes. Each service times each
    pass once (specdec:forward_latency_seconds): it used to time each session of a pass, the
    draft from when its step began to wait, and add up to 2-3 times the wall time."""
    port = free_port()
    draft_port = free_port()
    stack = start_stack(redis_url, tiny_models.target, tiny_models.draft, target_args=["--metrics-port", str(port)],
                        draft_args=["--metrics-port", str(draft_port)])  # fmt: skip
    try:
        prompts = [tiny_models.tokenizer.encode(f"{word} world, {word}!") for word in
                   ("hello", "small", "brave", "quiet", "green", "round", "plain", "swift")]  # fmt: skip
        options = dict(max_new_tokens=40, ignore_eos=True, num_speculative_tokens=3)
        with specdec.Client(stack.address) as client:
            alone = [client.generate(prompt_token_ids=p, **options).token_ids for p in prompts]
        before, draft_before = batch_metrics(port), batch_metrics(draft_port, "draft")

        async def at_once():
            async with specdec.AsyncClient(stack.address) as aclient:
                replies = await asyncio.gather(*[aclient.generate(prompt_token_ids=p, **options) for p in prompts])
                return [r.token_ids for r in replies]

        started = time.perf_counter()
        together = asyncio.run(at_once())
        elapsed = time.perf_counter() - started
        after, draft_after = batch_metrics(port), batch_metrics(draft_port, "draft")
    finally:
        stack.stop()
    assert together == alone
    passes, sessions = after[0] - before[0], after[1] - before[1]
    print(f"\n8 requests at once: {passes:.0f} verify passes for {sessions:.0f} session cycles, {elapsed:.2f} s")
    assert sessions > passes, "some passes should have served several sessions"
    draft_passes, drafted = draft_after[0] - draft_before[0], draft_after[1] - draft_before[1]
    print(f"the draft: {draft_passes:.0f} passes for {drafted:.0f} drafted tokens")
    assert drafted > draft_passes, "some drafting passes should have served several sessions"
    for end, start, counted in ((after, before, passes), (draft_after, draft_before, draft_passes)):
        assert end[2] - start[2] == counted and end[3] - start[3] < elapsed + 1


def batch_metrics(port: int, service: str = "target") -> tuple[float, float, float, float]:
    """(passes, sessions served) so far, from a service's specdec:batch_size histogram, then
    (passes timed, their seconds) from its specdec:forward_latency_seconds."""
    samples = scrape(port)
    return tuple(samples.get((f"specdec:{name}", (("service", service),)), 0.0)
                 for name in ("batch_size_count", "batch_size_sum", "forward_latency_seconds_count",
                              "forward_latency_seconds_sum"))  # fmt: skip
