"""The batched output path of a Ray group leader, without Ray: ``LocalEngineClient``'s
``OutputChannel`` (many requests' outputs, one delivery per engine step) against the engine's own
``generate``, and the controller's ``OutputPump`` handing a stream's batches to each request and
failing all of them when the stream ends. The real Ray path: tests/test_ray_runtime.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.outputs import RequestOutput
from fusedserve.worker.engine.sequence import InvalidRequest, SamplingParams
from fusedserve.worker.ray.output_pump import OutputPump
from fusedserve.worker.serving.engine_client import EngineDead
from fusedserve.worker.serving.local_engine_client import LocalEngineClient

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = Path(__file__).resolve().parents[1] / "examples" / "checkpoints" / "tiny-code"
PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "x = ["]


def engine() -> Engine:
    return Engine(MODEL, EngineConfig(num_blocks=64, max_num_seqs=4, seed=0))


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True)


def test_a_channel_carries_every_requests_outputs_one_delivery_per_step() -> None:
    expected = [c.token_ids for c in engine().generate(PROMPTS, [params(i) for i in range(len(PROMPTS))])]
    client = LocalEngineClient(engine())

    async def run() -> tuple[dict[str, list[int]], list[list[Any]]]:
        channel = client.open_channel()
        for i, p in enumerate(PROMPTS):
            await client.submit(p, params(i), f"r{i}", channel)
        with pytest.raises(InvalidRequest):
            await client.submit([10**9], params(0), "bad", channel)
        assert channel.requests <= {f"r{i}" for i in range(len(PROMPTS))}
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        batches = []
        while channel.requests:
            batch = await asyncio.wait_for(channel.next_batch(), 60)
            batches.append(batch)
            for out in batch:
                assert isinstance(out, RequestOutput)
                tokens[out.request_id] += out.new_token_ids
        return tokens, batches

    tokens, batches = asyncio.run(run())
    client.close()
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert max(len({o.request_id for o in b}) for b in batches) == len(PROMPTS)  # a step's outputs together
    for b in batches:  # at most one (merged) output per request in a batch
        assert len({o.request_id for o in b}) == len(b)


def test_a_final_only_request_arrives_once_with_every_steps_tokens_text_and_logprobs() -> None:
    """What a response sent whole asks for (``final_only``): one output at the end, equal to the streamed
    ones merged — on a channel beside streamed requests, and through ``generate``."""
    p = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=2 if i == 1 else None)
         for i in range(len(PROMPTS))]
    ref = engine().generate(PROMPTS, p)
    client = LocalEngineClient(engine())

    async def run() -> tuple[dict[str, list[RequestOutput]], list[RequestOutput]]:
        channel = client.open_channel()
        for i, prompt in enumerate(PROMPTS):
            await client.submit(prompt, p[i], f"r{i}", channel, final_only=i % 2 == 0)
        got: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        while channel.requests:
            for out in await asyncio.wait_for(channel.next_batch(), 60):
                assert isinstance(out, RequestOutput)
                got[out.request_id].append(out)
        whole = [o async for o in client.generate(PROMPTS[1], p[1], "g", final_only=True)]
        return got, whole

    got, whole = asyncio.run(run())
    client.close()
    for i, c in enumerate(ref):
        outs = got[f"r{i}"]
        assert [t for o in outs for t in o.new_token_ids] == c.token_ids
        assert "".join(o.text_delta for o in outs) == c.text
        assert outs[-1].finished and outs[-1].times is not None
        if i % 2 == 0:  # the steps' gaps come along (the metrics' inter-token latencies)
            assert len(outs) == 1 and outs[0].num_output_tokens == len(c.token_ids)
            assert 0 < len(outs[0].gaps) <= len(c.token_ids) - 1 and min(outs[0].gaps) >= 0
        else:
            assert len(outs) > 1
    [one] = whole
    assert one.finished and one.new_token_ids == ref[1].token_ids and one.text_delta == ref[1].text
    assert [lp.token_id for lp in one.logprobs] == ref[1].token_ids  # (batch 4 there, 1 here: values ~equal)
    assert [lp.logprob for lp in one.logprobs] == pytest.approx([lp.logprob for lp in ref[1].logprobs], abs=1e-5)


def test_closing_a_channel_aborts_its_requests_and_a_dead_engine_ends_it() -> None:
    client = LocalEngineClient(engine())

    async def run() -> None:
        channel = client.open_channel()
        await client.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "long", channel)
        await asyncio.wait_for(channel.next_batch(), 60)
        client.close_channel(channel)
        for _ in range(100):
            if not client.engine.has_unfinished():
                break
            await asyncio.sleep(0.05)
        assert not client.engine.has_unfinished()

        other = client.open_channel()
        await client.submit(PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "r", other)
        client.close()  # the engine stops: every request in flight gets EngineDead
        seen: list[Any] = []
        while not any(isinstance(i, EngineDead) for i in seen):
            seen += await asyncio.wait_for(other.next_batch(), 60)

    asyncio.run(run())


class _Ref:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        yield from asyncio.sleep(0).__await__()
        return self.value


class _FakeLeader:
    """What ``OutputPump`` uses of a Ray actor handle: ``outputs.options(...).remote(channel)``."""

    def __init__(self, batches: list[list[dict[str, Any]]], fail: BaseException | None = None) -> None:
        self.batches, self.fail, self.channels = batches, fail, []
        self.outputs = self

    def options(self, **kwargs: Any) -> _FakeLeader:
        assert kwargs == {"num_returns": "streaming"}
        return self

    def remote(self, channel: str) -> AsyncIterator[_Ref]:
        self.channels.append(channel)
        return self._stream()

    async def _stream(self) -> AsyncIterator[_Ref]:
        for b in self.batches:
            yield _Ref(b)
        if self.fail is not None:
            raise self.fail


def test_the_pump_hands_each_request_its_outputs_and_fails_them_all_when_the_stream_ends() -> None:
    ended: list[OutputPump] = []

    async def run() -> tuple[list[Any], list[Any], OutputPump]:
        leader = _FakeLeader([[{"request_id": "a", "n": 1}, {"request_id": "b", "n": 1}],
                              [{"request_id": "gone", "n": 1}, {"request_id": "a", "n": 2}]])
        pump = OutputPump(leader, 3, on_end=ended.append)
        a, b = pump.open("a"), pump.open("b")
        got_a = [await a.get() for _ in range(3)]
        got_b = [await b.get() for _ in range(2)]
        assert leader.channels == [pump.channel]
        return got_a, got_b, pump

    got_a, got_b, pump = asyncio.run(run())
    assert [x["n"] for x in got_a[:2]] == [1, 2] and got_b[0]["n"] == 1
    assert isinstance(got_a[2], EngineDead) and isinstance(got_b[1], EngineDead)
    assert "engine group 3 ended its output stream" in str(got_a[2])
    assert ended == [pump] and not pump.alive
    with pytest.raises(EngineDead):
        pump.open("late")

    async def dead_engine() -> Any:
        pump = OutputPump(_FakeLeader([[{"request_id": "a", "n": 1}, {"engine_dead": "a rank died"}]]), 0)
        q = pump.open("a")
        return [await q.get() for _ in range(2)]

    first, dead = asyncio.run(dead_engine())
    assert first["n"] == 1 and isinstance(dead, EngineDead) and "a rank died" in str(dead)
