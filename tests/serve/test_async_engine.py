"""AsyncEngine: streams equal the offline engine's results, cancelling a consumer aborts its request
and frees its blocks, a step that raises reaches the consumers as an error while the loop keeps
serving, the waiting queue is bounded, shutdown ends open streams and leaves the engine usable."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest

from atom_core.engine import SamplingParams
from atom_core.engine.async_engine import AsyncEngine, EngineClosedError, EngineStepError, QueueFullError
from atom_core.engine.request_stream import StreamOutput
from tests.serve.conftest import demo_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
PROMPTS = ["Return the number of", "This module provides", "If the file does not exist,", "Create a new"]


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


def assert_idle_and_clean(engine):
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def collect(async_engine, prompt, params, **kwargs) -> list[StreamOutput]:
    return [out async for out in async_engine.generate(prompt, params, **kwargs)]


class FailingForward:
    """Replaces a model's forward; raises on every call until ``fail`` is cleared."""

    def __init__(self, model):
        self.model, self.fail = model, True

    def __call__(self, *args, **kwargs):
        if self.fail:
            raise RuntimeError("injected failure")
        return type(self.model).forward(self.model, *args, **kwargs)


def test_concurrent_streams_equal_offline_generate_and_new_text_adds_up_to_text(engine):
    want = engine.generate(PROMPTS, GREEDY, use_tqdm=False)

    async def main():
        async with AsyncEngine(engine) as async_engine:
            return await asyncio.gather(*(collect(async_engine, p, GREEDY) for p in PROMPTS))

    results = asyncio.run(main())
    for outs, ref in zip(results, want):
        assert "".join(o.new_text for o in outs) == outs[-1].text == ref.text
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == ref.token_ids
        assert outs[-1].finish_reason == ref.finish_reason and all(not o.finished for o in outs[:-1])
        assert outs[-1].prompt_token_ids == ref.prompt_token_ids
    assert_idle_and_clean(engine)


def test_n_sequences_with_a_seed_equal_offline_generate_by_index(engine):
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=10, logprobs=2, prompt_logprobs=1)
    want = engine.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs

    async def main():
        async with AsyncEngine(engine) as async_engine:
            return await collect(async_engine, PROMPTS[0], params, request_id="mine")

    outs = asyncio.run(main())
    finals = {o.index: o for o in outs if o.finished}
    assert sorted(finals) == [0, 1, 2] and all(o.request_id == "mine" for o in outs)
    for ref in want:
        got = finals[ref.index]
        assert (got.text, got.token_ids) == (ref.text, ref.token_ids)
        assert got.logprobs == pytest.approx(ref.logprobs) and got.top_logprobs == ref.top_logprobs
        pieces = [o for o in outs if o.index == ref.index]
        assert [lp for o in pieces for lp in o.new_logprobs] == got.logprobs
        assert got.logprob_ranks == ref.logprob_ranks and got.prompt_logprob_ranks == ref.prompt_logprob_ranks
        assert [rank for o in pieces for rank in o.new_logprob_ranks] == got.logprob_ranks
    assert_idle_and_clean(engine)


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_blocks(engine):
    async def main():
        async with AsyncEngine(engine) as async_engine:
            first = asyncio.Event()

            async def consume():
                async for _ in async_engine.generate(PROMPTS[0], LONG):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            assert async_engine.stats().num_running == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            state = await async_engine.run_on_engine(
                lambda e: (e.has_unfinished_requests(), e.block_manager.num_free_blocks, e.block_manager.num_blocks))
            return state, async_engine.stats()

    (unfinished, free, total), stats = asyncio.run(main())
    assert not unfinished and free == total
    assert stats.num_running == stats.num_waiting == 0
    assert_idle_and_clean(engine)


def test_leaving_the_loop_early_aborts_the_request(engine):
    async def main():
        async with AsyncEngine(engine) as async_engine:
            stream = await async_engine.add_request(PROMPTS[1], LONG)
            async for _ in stream:
                break
            stream.abort()
            assert stream.finished and stream.aborted
            assert [o async for o in stream] == []  # an aborted stream ends
            return await async_engine.run_on_engine(lambda e: e.has_unfinished_requests())

    assert asyncio.run(main()) is False
    assert_idle_and_clean(engine)


def test_abort_drops_the_outputs_delivered_but_not_yet_read(engine):
    async def main():
        async with AsyncEngine(engine) as async_engine:
            stream = await async_engine.add_request(PROMPTS[1], LONG)
            while stream.num_ready < 3:  # steps delivered, none read
                await asyncio.sleep(0.01)
            stream.abort()
            return [o async for o in stream]

    assert asyncio.run(main()) == []
    assert_idle_and_clean(engine)


def test_a_step_that_raises_reaches_the_consumers_and_the_loop_keeps_serving(engine):
    want = engine.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].text

    async def main():
        async with AsyncEngine(engine) as async_engine:
            failing = await async_engine.run_on_engine(lambda e: setattr(e.model, "forward", FailingForward(e.model))
                                                       or e.model.forward)
            results = await asyncio.gather(*(collect(async_engine, p, GREEDY) for p in PROMPTS[:2]),
                                           return_exceptions=True)
            failing.fail = False
            await async_engine.run_on_engine(lambda e: delattr(e.model, "forward"))
            after = await collect(async_engine, PROMPTS[2], GREEDY)
            return results, after, async_engine.stats()

    results, after, stats = asyncio.run(main())
    assert all(isinstance(r, EngineStepError) for r in results), results
    assert all(isinstance(r.__cause__, RuntimeError) and "injected failure" in str(r) for r in results)
    assert after[-1].text == want and after[-1].finished
    assert stats.num_step_errors >= 1 and stats.num_running == stats.num_waiting == 0
    assert_idle_and_clean(engine)


def test_the_waiting_queue_is_bounded_and_refuses_with_queue_full(engine):
    async def main():
        async with AsyncEngine(engine, max_waiting_requests=2) as async_engine:
            release = threading.Event()
            blocked = async_engine.submit(lambda e: release.wait())  # no step runs until released
            adds = [asyncio.create_task(async_engine.add_request(p, GREEDY)) for p in PROMPTS[:2]]
            await asyncio.sleep(0)
            assert async_engine.stats().num_waiting == 2
            with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
                await async_engine.add_request(PROMPTS[2], GREEDY)
            release.set()
            await asyncio.wrap_future(blocked)
            streams = await asyncio.gather(*adds)
            texts = []
            for stream in streams:
                texts.append([o async for o in stream][-1].text)
            # room again once they run
            return texts, [o async for o in async_engine.generate(PROMPTS[2], GREEDY)][-1].text

    texts, third = asyncio.run(main())
    want = engine.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert texts + [third] == [o.text for o in want]
    assert_idle_and_clean(engine)


def test_refused_requests_raise_at_add_and_leave_nothing_behind(engine):
    async def main():
        async with AsyncEngine(engine) as async_engine:
            with pytest.raises(ValueError, match="outside|must be in"):
                await async_engine.add_request([1, 2, 10**6], GREEDY)
            with pytest.raises(ValueError, match="max_model_len"):
                await async_engine.add_request([1] * 512, GREEDY)
            with pytest.raises(TypeError, match="SamplingParams"):
                await async_engine.add_request("x", {"max_tokens": 3})
            stream = await async_engine.add_request("x", GREEDY, request_id="a")
            with pytest.raises(ValueError, match="already in use"):
                await async_engine.add_request("x", GREEDY, request_id="a")
            outs = [o async for o in stream]
            return outs, async_engine.stats()

    outs, stats = asyncio.run(main())
    assert outs[-1].finished and stats.num_waiting == stats.num_running == 0
    assert_idle_and_clean(engine)


def test_shutdown_ends_open_streams_and_leaves_the_engine_usable(engine):
    async def main():
        async_engine = AsyncEngine(engine)
        stream = await async_engine.add_request(PROMPTS[0], LONG)
        await stream.__anext__()
        await async_engine.shutdown()
        with pytest.raises(EngineClosedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineClosedError):
            await async_engine.add_request(PROMPTS[0], GREEDY)
        assert not async_engine.is_running

    asyncio.run(main())
    assert_idle_and_clean(engine)
    assert engine.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].text  # used directly again


def test_default_params_are_the_engines_and_stats_see_the_pool_in_use(engine):
    async def main():
        async with AsyncEngine(engine) as async_engine:
            stream = await async_engine.add_request(PROMPTS[0], replace(LONG, max_tokens=200))
            await stream.__anext__()
            during = async_engine.stats()
            stream.abort()
            outs = await collect(async_engine, PROMPTS[0], None)
            return during, outs

    during, outs = asyncio.run(main())
    assert during.num_running == 1 and during.kv_cache_usage > 0 and during.num_steps >= 1
    assert outs[-1].num_output_tokens <= engine.default_sampling_params.max_tokens
    assert_idle_and_clean(engine)


def test_a_grammar_compiles_off_the_step_thread_while_running_streams_keep_their_tokens(engine, monkeypatch):
    """The compile of a new request's grammar (held here until the running stream has read three more
    tokens) runs beside the steps, once, and a constraint that does not compile is still refused at add."""
    pytest.importorskip("xgrammar")
    from atom_core import ops

    compiler = engine.grammar_compiler
    real_compile = compiler.compile
    started, release = threading.Event(), threading.Event()
    calls = []  # (thread name, monotonic time at start, at end) of each compile

    def held_compile(spec):
        start = time.monotonic()
        started.set()
        release.wait(timeout=5)  # (only a broken build gets here without the release: its steps wait)
        calls.append((threading.current_thread().name, start, time.monotonic()))
        return real_compile(spec)

    monkeypatch.setattr(compiler, "compile", held_compile)
    structured = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["yes", "no"]})

    async def main():
        with ops.use_backend("torch"):
            async_engine = AsyncEngine(engine)
        async with async_engine:
            running = await async_engine.add_request(PROMPTS[0], LONG)
            adding = asyncio.create_task(async_engine.add_request(PROMPTS[1], structured))
            await asyncio.to_thread(started.wait, 5)
            compile_start = time.monotonic()
            during = []
            async for out in running:
                if out.time > compile_start:
                    during.append(out)
                if len(during) == 3:
                    break
            release.set()
            stream = await adding
            text = [o async for o in stream][-1].text
            running.abort()
            with pytest.raises(ValueError, match=r"structured_outputs\.regex: .*Unclosed"):
                await async_engine.add_request(PROMPTS[1], replace(structured, structured_outputs={"regex": "[a-"}))
            return during, text, async_engine.stats()

    during, text, stats = asyncio.run(main())
    (thread, start, end), *more = calls
    assert len(during) == 3 and all(start < out.time < end for out in during)  # steps ran while it compiled
    # on the async engine's own compile threads: not the step thread, nor asyncio's default executor (which a
    # server's tokenization shares: a slow schema there held up every request)
    assert thread.startswith("atom_core-compile")
    assert len(more) == 1 and more[0][0].startswith("atom_core-compile")  # the refused one; add compiled nothing
    assert text in ("yes", "no")
    assert stats.num_waiting == stats.num_running == 0
    assert_idle_and_clean(engine)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_step_thread_serves_an_engine_built_on_plain_cuda_with_the_offline_tokens():
    """device="cuda" (no index): the engine resolves it to the constructing thread's device, which the
    step thread (a fresh thread, on device 0 otherwise) selects before its first step."""
    import torch

    from atom_core import ops
    from atom_core.engine import Engine

    with ops.use_backend(None):  # the GPU's kernels (this package prefers the reference ops), captured in graphs
        # not 90% of the GPU (tests follow); float32: streams arrive at other steps than the offline batch's,
        # and bf16 kernels round differently across batch shapes
        engine = Engine.from_pretrained(device="cuda", dtype=torch.float32, num_kv_blocks=1024)
        assert engine.device == torch.device("cuda", torch.cuda.current_device())
        want = engine.generate(PROMPTS, GREEDY, use_tqdm=False)

        async def main():
            async with AsyncEngine(engine) as async_engine:  # (its step thread runs in this context)
                return await asyncio.gather(*(collect(async_engine, p, GREEDY) for p in PROMPTS))

        results = asyncio.run(main())
    for outs, ref in zip(results, want):
        assert outs[-1].token_ids == ref.token_ids and outs[-1].finish_reason is not None
    assert_idle_and_clean(engine)
    engine.shutdown()


def test_a_finished_stream_has_no_outputs_ready_though_its_end_stays_queued(engine):
    async def main():
        async with AsyncEngine(engine) as async_engine:
            stream = await async_engine.add_request(PROMPTS[0], GREEDY)
            outs = [o async for o in stream]
            ready_after_end = stream.num_ready
            again = [o async for o in stream]  # the end stays queued: iterating again ends again
            return outs, ready_after_end, again

    outs, ready_after_end, again = asyncio.run(main())
    assert outs[-1].finished
    assert ready_after_end == 0
    assert again == []
    assert_idle_and_clean(engine)


def test_requests_a_function_on_the_engine_aborted_end_with_reason_abort_instead_of_hanging(engine):
    """``load_weights(..., unfinished="abort")`` run on the step thread aborts every request; the engine gives them no
    further output, so their streams end here with finish reason "abort" (one running, one waiting, n = 2)."""
    async def main():
        async with AsyncEngine(engine) as async_engine:
            first = asyncio.Event()
            ends = {}

            async def consume(prompt, params):
                outs = []
                async for out in async_engine.generate(prompt, params):
                    outs.append(out)
                    first.set()
                ends[prompt] = sorted((out.index, out.finish_reason) for out in outs if out.finished)

            running = asyncio.create_task(consume(PROMPTS[0], LONG))
            await first.wait()
            waiting = asyncio.create_task(consume(PROMPTS[1], replace(LONG, n=2, temperature=1.0, seed=0)))
            await asyncio.sleep(0)
            pairs = list(engine.model.state_dict().items())
            await async_engine.run_on_engine(lambda e: e.load_weights(pairs, unfinished="abort"))
            await asyncio.wait_for(asyncio.gather(running, waiting), timeout=60)
            return ends, async_engine.stats()

    ends, stats = asyncio.run(main())
    assert ends == {PROMPTS[0]: [(0, "abort")], PROMPTS[1]: [(0, "abort"), (1, "abort")]}
    assert stats.num_running == stats.num_waiting == 0
    assert_idle_and_clean(engine)


def test_a_request_a_function_aborted_ends_while_another_request_keeps_running(engine):
    """Only the function's request is dropped: its stream ends with "abort" while the other one runs on (the
    streams used to end only once the engine had nothing unfinished, so this one waited forever)."""
    async def main():
        async with AsyncEngine(engine) as async_engine:
            aborted = await async_engine.add_request(PROMPTS[0], LONG)
            running = await async_engine.add_request(PROMPTS[1], replace(LONG, max_tokens=40))
            await aborted.__anext__()
            await async_engine.run_on_engine(lambda e: e.abort(aborted.engine_id))
            aborted_outs = await asyncio.wait_for(collect_stream(aborted), timeout=30)
            running_outs = await asyncio.wait_for(collect_stream(running), timeout=60)
            return aborted_outs, running_outs, async_engine.stats()

    async def collect_stream(stream):
        return [out async for out in stream]

    aborted_outs, running_outs, stats = asyncio.run(main())
    assert aborted_outs[-1].finish_reason == "abort"
    assert running_outs[-1].finish_reason == "length" and running_outs[-1].num_output_tokens == 40
    assert stats.num_running == stats.num_waiting == 0
    assert_idle_and_clean(engine)


def test_run_on_engine_starts_the_step_thread_and_shutdown_fails_functions_no_thread_ran(engine):
    async def main():
        async_engine = AsyncEngine(engine)
        ran = await asyncio.wait_for(async_engine.run_on_engine(lambda e: e.has_unfinished_requests()), timeout=30)
        await async_engine.shutdown()
        never_started = AsyncEngine(engine)
        pending = never_started.submit(lambda e: 42)
        await never_started.shutdown()
        return ran, pending

    ran, pending = asyncio.run(main())
    assert ran is False
    with pytest.raises(EngineClosedError, match="shut down before this function ran"):
        pending.result(timeout=0)
