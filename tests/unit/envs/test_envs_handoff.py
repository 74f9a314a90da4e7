"""Handing an env session from one client connection to another (`detach` / `attach`), against
an in-process server: the episode goes on where it was, a step in flight is neither lost nor
waited for by `detach`, claims are single use, detached sessions outlive their connection and
are reaped when nobody takes them, or closed at once when rank 0 drops the hand-over."""

import asyncio
import time

import pytest
from PIL import Image

from tide_megatron.envs import (
    EnvClient, EnvClientConfig, EnvConfig, EnvError, EnvRemoteError, EnvServer, EnvServerConfig, EnvServerDown,
    EnvServerLimits, EnvSessionLost, LatencyConfig,
)
from tide_megatron.envs.images import encode_image
from tide_megatron.envs.protocol import AttachResult, Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.registry import register_env
from tide_megatron.rollout.task_carry import release_claim

STEP_S = 0.4  # emulated (or blocking) step time of the slow envs


class CounterEnv(Env):
    """Counts steps; the observation names the turn and the action. Done after 4 steps."""

    def __init__(self, blocking=False, delay_s=0.0, images=False):
        self.blocking, self.delay_s, self.images = blocking, delay_s, images

    def list_tasks(self, split):
        return [self.task("c/0")]

    def task(self, task_id):
        if task_id != "c/0":
            raise KeyError(task_id)
        return TaskSpec("counter", task_id, "counter/any")

    def reset(self, task_id, trajectory_id):
        self.n = 0
        return ResetResult("start", {"n": 0}, "counter/any", image_data=[screen(0)] if self.images else [])

    def step(self, action):
        if self.delay_s:
            time.sleep(self.delay_s)
        self.n += 1
        return StepResult(f"turn {self.n}: {action}", 0.25, self.n >= 4, {"n": self.n},
                          image_data=[screen(self.n), screen(100)] if self.images else [])


def screen(shade: int) -> bytes:
    return encode_image(Image.new("RGB", (16, 12), (shade, 255 - shade, 7)))


register_env("handoff_counter", lambda cfg: CounterEnv())
register_env("handoff_blocking", lambda cfg: CounterEnv(blocking=True, delay_s=STEP_S))
register_env("handoff_screens", lambda cfg: CounterEnv(blocking=True, images=True))

SLOW = LatencyConfig(enabled=True, reset_median_s=0.001, step_median_s=STEP_S, step_sigma=0.0, task_speed_sigma=0.0,
                     slow_step_prob=0.0)
ENVS = [EnvConfig(name="handoff_counter", served_name="counter"),
        EnvConfig(name="handoff_counter", served_name="counter_slow", latency=SLOW),
        EnvConfig(name="handoff_blocking", served_name="blocking"),
        EnvConfig(name="handoff_screens", served_name="screens")]


def serve(main, tmp_path, **cfg_kw):
    cfg = EnvServerConfig(envs=ENVS, image_store_dir=str(tmp_path), **cfg_kw)

    async def wrapped():
        async with EnvServer(cfg) as server:
            await main(server)
    asyncio.run(wrapped())


def client(server, **kw):
    return EnvClient(EnvClientConfig(port=server.port, **kw))


async def refused(call, kind):
    with pytest.raises(EnvRemoteError) as e:
        await call
    assert e.value.kind == kind, e.value
    return e.value


def test_a_session_moves_to_another_client_and_goes_on(tmp_path):
    async def main(server):
        async with client(server) as a, client(server) as b, client(server) as c:
            first = await a.reset("counter", "c/0", "g0")
            await a.step(first.session_id, "x")
            last = await a.step(first.session_id, "y")
            claim = await a.detach(first.session_id)
            assert isinstance(claim, str) and len(claim) >= 32
            stats = await b.stats()
            assert stats["detached"] == 1 and stats["sessions"] == 1

            got = await b.attach(claim)
            assert isinstance(got, AttachResult)
            assert (got.session_id, got.env, got.task_id, got.trajectory_id) == (first.session_id, "counter", "c/0", "g0")
            assert got.turns == got.last_turn == 2 and not got.done
            assert got.last == last and isinstance(got.last, StepResult)
            assert (await b.stats())["detached"] == 0

            nxt = await b.step(got.session_id, "z")
            assert nxt.observation == "turn 3: z" and nxt.info == {"n": 3}
            # The old owner lost it; the claim is spent, for everyone.
            e = await refused(a.step(first.session_id, "w"), "UnknownSession")
            assert "never opened here" in e.message
            for other in (b, c):
                e = await refused(other.attach(claim), "UnknownSession")
                assert claim not in e.message
            done = await b.step(got.session_id, "z")
            assert done.done and done.observation == "turn 4: z"
            await refused(b.step(got.session_id, "z"), "EpisodeDone")  # a failed step does not replace `last`
            again = await c.attach(await b.detach(got.session_id))
            assert again.done and again.turns == 4 and again.last == done
            await c.close_session(again.session_id)
            assert (await c.stats())["sessions"] == 0
    serve(main, tmp_path)


def test_attach_returns_exactly_what_the_last_call_returned(tmp_path):
    async def main(server):
        async with client(server) as a, client(server) as b:
            reset = await a.call("reset", {"env": "counter", "task_id": "c/0", "trajectory_id": "t"}, "reset")
            sid = reset["session_id"]
            claim = (await a.call("detach", {"session_id": sid}, "detach"))["claim"]
            got = await b.call("attach", {"claim": claim}, "attach")
            assert got["turns"] == got["last_turn"] == 0 and got["done"] is False
            assert got["last"] == reset and got["last"]["session_id"] == sid
            step = await b.call("step", {"session_id": sid, "action": "go"}, "step")
            claim = (await b.call("detach", {"session_id": sid}, "detach"))["claim"]
            got = await a.call("attach", {"claim": claim}, "attach")
            assert got["last"] == step and got["turns"] == 1
            # A client-side attach of a session still at its reset parses `last` as the reset.
            first = await a.reset("counter", "c/0", "t2")
            res = await b.attach(await a.detach(first.session_id))
            assert isinstance(res.last, ResetResult) and res.last == first and res.turns == 0
    serve(main, tmp_path)


@pytest.mark.parametrize("env", ["counter_slow", "blocking"])
def test_detach_does_not_wait_for_a_step_in_flight_and_attach_does(tmp_path, env):
    """The step in flight still answers the old owner, and its result is what the attacher
    gets (emulated latency holds the step on the loop, a blocking env on a worker thread)."""
    async def main(server):
        async with client(server) as a, client(server) as b:
            first = await a.reset(env, "c/0", "t")
            started = time.monotonic()
            in_flight = asyncio.create_task(a.step(first.session_id, "go"))
            await asyncio.sleep(0.05)  # the step has reached the server
            claim = await a.detach(first.session_id)
            assert time.monotonic() - started < STEP_S / 2  # did not wait for the step
            got = await b.attach(claim)
            assert time.monotonic() - started >= STEP_S * 0.9  # waited for it
            mine = await in_flight
            assert mine.observation == "turn 1: go"
            assert got.turns == got.last_turn == 1 and got.last == mine
            assert (await b.step(got.session_id, "on")).observation == "turn 2: on"
    serve(main, tmp_path)


@pytest.mark.parametrize("env", ["counter_slow", "blocking"])
def test_a_step_in_flight_finishes_when_the_old_connection_drops_after_detach(tmp_path, env):
    async def main(server):
        async with client(server) as b:
            a = client(server)
            first = await a.reset(env, "c/0", "t")
            in_flight = asyncio.create_task(a.step(first.session_id, "go"))
            await asyncio.sleep(0.05)
            claim = await a.detach(first.session_id)
            await a.close()  # the rank leaves at once; its step's reply goes nowhere
            with pytest.raises((EnvServerDown, EnvSessionLost)):
                await in_flight
            got = await b.attach(claim)
            assert got.turns == 1 and got.last.observation == "turn 1: go"
            assert (await b.step(got.session_id, "on")).observation == "turn 2: on"
    serve(main, tmp_path)


def test_a_detached_session_outlives_its_connection_and_is_reaped_when_idle(tmp_path):
    async def main(server):
        async with client(server) as b:
            a = client(server)
            first = await a.reset("counter", "c/0", "kept")
            await a.step(first.session_id, "x")
            kept = await a.detach(first.session_id)
            second = await a.reset("counter", "c/0", "dropped")
            await a.close()
            await asyncio.sleep(0.05)
            stats = await b.stats()
            assert stats["sessions"] == 1 and stats["detached"] == 1 and stats["connections"] == 1
            got = await b.attach(kept)
            assert got.turns == 1 and (await b.step(got.session_id, "y")).observation == "turn 2: y"
            assert second.session_id != got.session_id

            c = client(server)
            orphan = await c.detach((await c.reset("counter", "c/0", "orphan")).session_id)
            await c.close()
            await asyncio.sleep(0.5)  # past session_idle_timeout_s: the reaper closes it (and b's, idle too)
            stats = await b.stats()
            assert stats["sessions"] == 0 and stats["detached"] == 0
            await refused(b.attach(orphan), "UnknownSession")
    serve(main, tmp_path, session_idle_timeout_s=0.3)


def test_only_the_owner_detaches_and_attach_respects_the_connection_cap(tmp_path):
    """A refused attach (this connection is full) leaves the claim usable elsewhere."""
    async def main(server):
        async with client(server) as a, client(server) as b, client(server) as c:
            first = await a.reset("counter", "c/0", "t")
            for sid in (first.session_id, "s-no-such-session"):
                e = await refused(b.call("detach", {"session_id": sid}, "detach"), "UnknownSession")
                assert "never opened here" in e.message
            claim = await a.detach(first.session_id)
            await refused(a.detach(first.session_id), "UnknownSession")  # no second claim, even for the old owner
            await b.reset("counter", "c/0", "b")
            e = await refused(b.attach(claim), "ServerBusy")
            assert "max_sessions_per_connection=1" in e.message
            got = await c.attach(claim)
            assert got.session_id == first.session_id
            await refused(b.attach(claim), "UnknownSession")
            await refused(b.call("attach", {"claim": 7}, "attach"), "BadRequest")
    serve(main, tmp_path, limits=EnvServerLimits(max_sessions_per_connection=1))


def test_a_detached_session_counts_against_max_sessions(tmp_path):
    async def main(server):
        async with client(server) as b:
            a = client(server)
            claim = await a.detach((await a.reset("counter", "c/0", "t")).session_id)
            await a.close()
            await refused(b.reset("counter", "c/0", "u"), "ServerBusy")
            await b.attach(claim)
    serve(main, tmp_path, max_sessions=1)


def test_detaching_a_session_of_a_lost_connection_raises_session_lost(tmp_path):
    async def main(server):
        a = client(server)
        first = await a.reset("counter", "c/0", "t")
        await a.close()
        with pytest.raises(EnvSessionLost):
            await a.detach(first.session_id)
        await a.close()
    serve(main, tmp_path)


@pytest.mark.parametrize("transport", ["file", "wire"])
def test_attach_reads_the_last_images_back(tmp_path, transport):
    async def main(server):
        async with client(server) as a, client(server, image_transport=transport) as b:
            first = await a.reset("screens", "c/0", "t")
            got = await b.attach(await a.detach(first.session_id))
            assert got.last.image_data == [screen(0)] and got.last.images == first.images
            step = await b.step(got.session_id, "go")
            again = await a.attach(await b.detach(got.session_id))
            assert again.last.image_data == [screen(1), screen(100)] and again.last == step
    serve(main, tmp_path)


def test_attach_without_images_leaves_them_unread(tmp_path):
    async def main(server):
        async with client(server) as a, client(server) as b:
            first = await a.reset("screens", "c/0", "t")
            got = await b.attach(await a.detach(first.session_id), images=False)
            assert got.last.images == first.images and got.last.image_data == []
    serve(main, tmp_path)


@pytest.mark.parametrize("env", ["counter", "screens"])
def test_release_claim_closes_a_detached_session_at_once(tmp_path, env):
    """A hand-over that will not go on (`ReleaseCarry`): the session is closed now, not left to
    the idle reaper, without reading its images; a spent claim is an error for the caller to log."""
    async def main(server):
        async with client(server) as a, client(server) as b:
            claim = await a.detach((await a.reset(env, "c/0", "t")).session_id)
            for path in tmp_path.rglob("*"):  # a read of the session's images would now fail
                if path.is_file():
                    path.unlink()
            await release_claim(b, claim)
            stats = await b.stats()
            assert stats["sessions"] == 0 and stats["detached"] == 0
            with pytest.raises(EnvError):
                await release_claim(b, claim)
    serve(main, tmp_path)
