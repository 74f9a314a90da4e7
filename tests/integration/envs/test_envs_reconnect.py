"""The env server dies; its launcher restarts it on the same address; the client carries on."""

import asyncio
import os
import signal
import time

import pytest

from tide_megatron.envs import (
    EnvClient, EnvClientConfig, EnvConfig, EnvServerConfig, EnvServerDown, EnvServerProcess, EnvServerProcessConfig,
    EnvSessionLost,
)
from tide_megatron.envs.config import GuiDesktopConfig

pytestmark = pytest.mark.integration


def gui_server(tmp_path, **process_kw):
    cfg = EnvServerConfig(envs=[EnvConfig(name="gui_desktop", gui_desktop=GuiDesktopConfig(families=["open_app"]))],
                          image_store_dir=str(tmp_path / "images"))
    return EnvServerProcess(cfg, EnvServerProcessConfig(log_path=str(tmp_path / "server.log"), **process_kw))


def kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.02)


async def play(client, task_id, trajectory_id):
    """One open_app episode, solved from the a11y tree; returns the first result and the return."""
    async with client.session("gui_desktop", task_id, trajectory_id) as first:
        goal = first.observation.split("Open the ")[1].split(" app")[0]
        line = next(ln for ln in first.info["a11y_tree"].splitlines() if f'icon "{goal}"' in ln)
        x, y = line.rsplit("(", 1)[1].rstrip(")").split(",")
        res = await client.step(first.session_id, f"click {x},{y}")
        return first, res.info["episode_return"]


def test_supervised_restart_and_the_client_continues(tmp_path):
    proc = gui_server(tmp_path, supervise_interval_s=0.2).start()
    try:
        address, first_pid = proc.address, proc.pid

        async def main():
            async with EnvClient(proc.client_config(EnvClientConfig(backoff_initial_s=0.2, max_retries=8))) as client:
                first, ret = await play(client, "train/0", "before")
                assert ret == pytest.approx(1.0) and len(first.image_data) == 1
                held = await client.reset("gui_desktop", "train/1", "held")
                old_store = os.path.dirname(held.images[0].path)
                kill(proc)
                with pytest.raises(EnvSessionLost) as e:  # the session died with the server
                    await client.step(held.session_id, "click 1,1")
                assert address in str(e.value) and "session=" in str(e.value)
                await client.close_session(held.session_id)  # nothing left to close: a no-op
                again, ret = await play(client, "train/0", "after")  # reconnects with backoff to the new server
                assert ret == pytest.approx(1.0) and again.image_data == first.image_data
                assert not os.path.exists(old_store)  # the dead server's images were swept at restart
                return (await client.stats())["sessions"]

        assert asyncio.run(main()) == 0
        assert proc.restarts == 1 and proc.address == address and proc.pid != first_pid and not proc.failure
    finally:
        proc.stop()


def test_restart_api_and_its_bound(tmp_path):
    proc = gui_server(tmp_path, supervise_interval_s=0, max_restarts=1).start()
    try:
        address = proc.address
        assert proc.ensure_running() is False  # alive: nothing to do
        proc.restart()  # explicit restart of a live server: same address
        assert proc.address == address and proc.alive() and proc.restarts == 1
        kill(proc)
        with pytest.raises(RuntimeError, match=f"{address} exited again .* after 1 restarts"):
            proc.ensure_running()
    finally:
        proc.stop()


def test_a_server_that_stays_down_is_reported_with_address_and_call(tmp_path):
    proc = gui_server(tmp_path, supervise_interval_s=0).start()

    async def main():
        cfg = proc.client_config(EnvClientConfig(backoff_initial_s=0.05, max_retries=3, connect_timeout_s=2))
        async with EnvClient(cfg) as client:
            held = await client.reset("gui_desktop", "train/0", "t")
            proc.stop()
            with pytest.raises(EnvSessionLost):
                await client.step(held.session_id, "click 1,1")
            with pytest.raises(EnvServerDown) as e:
                await client.reset("gui_desktop", "train/0", "t2")
            assert e.value.address == proc.address and e.value.call.startswith("reset(env=gui_desktop, task=train/0")
            assert "gave up after 4 attempts" in e.value.detail
    asyncio.run(main())
