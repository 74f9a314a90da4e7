"""Image observations end to end through an in-process server and the client."""

import asyncio
import os

import pytest
from PIL import Image

from tide_megatron.envs import (
    EnvClient, EnvClientConfig, EnvConfig, EnvImageError, EnvServer, EnvServerConfig, ImageLimits,
)
from tide_megatron.envs.images import encode_image
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec
from tide_megatron.envs.registry import register_env


def screen(shade: int) -> bytes:
    return encode_image(Image.new("RGB", (32, 24), (shade, 255 - shade, 7)))


class ScreensEnv(Env):
    """Each observation is a screenshot whose shade counts the steps; the action `bad:<kind>`
    makes the env return a broken image instead."""

    blocking = True

    def list_tasks(self, split):
        return [self.task("t/0")]

    def task(self, task_id):
        return TaskSpec("screens", task_id, "screens/any")

    def reset(self, task_id, trajectory_id):
        self.turn = 0
        return ResetResult("look", image_data=[screen(0)])

    def step(self, action):
        self.turn += 1
        bad = {"bad:truncated": screen(9)[:-30], "bad:html": b"<html>oops</html>"}
        if action in bad:
            return StepResult("broken", 0.0, False, image_data=[bad[action]])
        return StepResult(f"turn {self.turn}", 0.1, self.turn >= 5, image_data=[screen(self.turn), screen(100)])


register_env("screens", lambda cfg: ScreensEnv())


def run(main, tmp_path, **server_kw):
    cfg = EnvServerConfig(envs=[EnvConfig(name="screens")], image_store_dir=str(tmp_path), **server_kw)

    async def wrapped():
        async with EnvServer(cfg) as server:
            await main(server)
    asyncio.run(wrapped())


@pytest.mark.parametrize("transport", ["file", "wire", "auto"])
def test_screenshots_arrive_by_reference_and_are_read_back(tmp_path, transport):
    async def main(server):
        async with EnvClient(EnvClientConfig(port=server.port, image_transport=transport)) as client:
            first = await client.reset("screens", "t/0", "a")
            assert first.image_data == [screen(0)] and first.images[0].width == 32
            assert first.images[0].path.startswith(str(tmp_path))
            res = await client.step(first.session_id, "go")
            assert res.image_data == [screen(1), screen(100)] and res.observation == "turn 1"
            assert [r.format for r in res.images] == ["png", "png"]
            assert (await client.stats())["images"] == 3
            await client.close_session(first.session_id)
            assert (await client.stats())["images"] == 0
            assert not any(os.path.exists(r.path) for r in first.images + res.images)
    run(main, tmp_path)


def test_references_only_when_resolution_is_off(tmp_path):
    async def main(server):
        async with EnvClient(EnvClientConfig(port=server.port, resolve_images=False)) as client:
            first = await client.reset("screens", "t/0", "a")
            assert first.image_data == [] and len(first.images) == 1
    run(main, tmp_path)


@pytest.mark.parametrize("action, detail", [("bad:truncated", "truncated png"), ("bad:html", "not a PNG or JPEG")])
def test_a_bad_env_image_is_a_typed_task_failure_and_the_server_goes_on(tmp_path, action, detail):
    async def main(server):
        async with EnvClient(EnvClientConfig(port=server.port)) as client:
            first = await client.reset("screens", "t/0", "a")
            with pytest.raises(EnvImageError) as e:
                await client.step(first.session_id, action)
            msg = str(e.value)
            assert detail in msg and "'screens'" in msg and "'t/0'" in msg and f"127.0.0.1:{server.port}" in msg
            assert e.value.env == "screens" and e.value.task_id == "t/0"
            # The rest of the server is unaffected: the same session and new ones go on.
            assert (await client.step(first.session_id, "go")).image_data[1] == screen(100)
            other = await client.reset("screens", "t/0", "b")
            assert other.image_data == [screen(0)]
    run(main, tmp_path)


def test_images_over_the_server_limits_are_refused(tmp_path):
    async def main(server):
        async with EnvClient(EnvClientConfig(port=server.port)) as client:
            with pytest.raises(EnvImageError, match="max_width"):
                await client.reset("screens", "t/0", "a")
            assert (await client.stats())["sessions"] == 0  # the failed reset left no session behind
    run(main, tmp_path, images=ImageLimits(max_width=16))


def test_the_client_checks_what_it_reads(tmp_path):
    async def main(server):
        async with EnvClient(EnvClientConfig(port=server.port, image_transport="file")) as client:
            first = await client.reset("screens", "t/0", "a")
            res = await client.step(first.session_id, "go")
            # Corrupt the next screenshot file as soon as the server writes it: the client must notice.
            real_put = server._images.put

            def corrupting_put(session_id, data, info):
                ref = real_put(session_id, data, info)
                with open(ref.path, "r+b") as f:
                    f.seek(ref.nbytes // 2)
                    f.write(b"\xff\xff\xff")
                return ref
            server._images.put = corrupting_put
            with pytest.raises(EnvImageError) as e:
                await client.step(first.session_id, "go")
            assert "t/0" in str(e.value) and res.image_data
        async with EnvClient(EnvClientConfig(port=server.port, images=ImageLimits(max_height=10))) as client:
            server._images.put = real_put
            with pytest.raises(EnvImageError, match="max_width x max_height"):
                await client.reset("screens", "t/0", "b")
    run(main, tmp_path)
