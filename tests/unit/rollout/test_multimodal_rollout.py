"""The multi-turn loop with image observations, against a fake SGLang engine and a fake env.

The fake engine does what SGLang 0.5.23 does with token-in requests that carry images (checked
against the real engine in tests/integration/rollout/test_rollout_vl_sync.py): it expands each
`<|image_pad|>` of the ids it is sent to the image's token count, keeps a streaming session's
context between turns, and reports the context length as `prompt_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tide_megatron.models.qwen3_vl_checkpoint import write_random_vl_checkpoint
from tide_megatron.models.qwen3_vl_config import VLModelConfig
from tide_megatron.models.qwen3_vl_inputs import ImageInputError, TrajectoryImages
from tide_megatron.rollout.engine import Generation
from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunner, TaskRunnerConfig
from tide_megatron.rollout.worker import build_chat
from tide_megatron.tokenizer import TINY_BPE_DIR


def png(width: int, height: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_vl_checkpoint(tmp_path_factory.mktemp("vl"), VLModelConfig(), TINY_BPE_DIR)


@pytest.fixture(scope="module")
def chat(ckpt):
    return build_chat(ckpt[0], None)


@dataclass
class FakeEngine:
    images: object  # ImagePrompts: how the engine counts an image's pads
    use_sessions: bool = True
    outputs: list[list[int]] = field(default_factory=list)  # scripted outputs, else [40, 41, eos]
    eos: int = 2
    weight_version: int = 0
    calls: list[dict] = field(default_factory=list)
    sessions: dict[str, int] = field(default_factory=dict)
    miscount: int = 0  # extra pads per image (an engine that disagrees)

    def __post_init__(self):
        self.cfg = SimpleNamespace(use_sessions=self.use_sessions)
        self.weight_epoch = 0

    @contextlib.asynccontextmanager
    async def turn(self):
        yield

    async def open_session(self, capacity_tokens: int):
        sid = f"s{len(self.sessions)}"
        self.sessions[sid] = 0
        return sid

    async def close_session(self, session_id):
        self.sessions.pop(session_id, None)

    async def generate(self, input_ids, sampling_params, session_id=None, previous_rid=None, rid=None,
                       image_data=None):
        images = self.images.prepare(image_data or [], "engine")
        pads = sum(t == self.images.image_token_id for t in input_ids)
        assert pads == len(images), "one pad per image"
        context = len(input_ids) + sum(im.num_tokens - 1 + self.miscount for im in images)
        if session_id is not None and previous_rid is not None:
            context += self.sessions[session_id]
        out = self.outputs.pop(0) if self.outputs else [40, 41, self.eos]
        if session_id is not None:
            self.sessions[session_id] = context + len(out)
        self.calls.append({"ids": list(input_ids), "images": list(image_data or []), "session": session_id,
                           "previous": previous_rid, "bias": sampling_params.get("logit_bias")})
        return Generation(output_ids=out, logprobs=[-1.0] * len(out), finish_reason="stop", prompt_tokens=context,
                          cached_tokens=0, rid=f"r{len(self.calls)}")


class FakeEnv:
    """Every observation carries `per_turn[k]` images; the episode ends after `turns` steps."""

    def __init__(self, per_turn: list[list[bytes]], turns: int, text: str = "Screen:"):
        self.per_turn, self.turns, self.text = per_turn, turns, text
        self.steps = 0

    async def reset(self, env, task_id, trajectory_id):
        return SimpleNamespace(observation=self.text, session_id="e0", image_data=self.per_turn[0], info={})

    async def close_quietly(self, session_id):
        pass

    async def step(self, session_id, action):
        self.steps += 1
        done = self.steps >= self.turns
        images = [] if done else self.per_turn[self.steps]
        return SimpleNamespace(observation=f"{self.text} {self.steps}", reward=float(done), done=done,
                               info={"episode_return": float(done)}, image_data=images)


def _run(chat, engine, env, max_context: int = 1024):
    runner = TaskRunner(TaskRunnerConfig(max_turns=6, max_context_tokens=max_context, max_new_tokens=4), engine, chat, env)
    assignment = TaskAssignment(task={"env": "gui", "task_id": "t0"}, group_id="g0", index=0)
    return asyncio.run(runner.run(assignment))


IMAGES = [[png(96, 64, 0)], [png(64, 64, 1), png(40, 90, 2)], [png(96, 64, 3)]]


def test_trajectory_holds_expanded_pads_and_its_images(ckpt, chat):
    path, cfg = ckpt
    engine = FakeEngine(chat.images)
    traj = _run(chat, engine, FakeEnv(IMAGES, turns=3))
    assert traj.turns == 3 and len(traj.images) == 4
    images = chat.images.prepare([d for turn in IMAGES for d in turn], "test")
    assert traj.image_grid_thw == [list(im.grid) for im in images]
    assert traj.image_tokens == sum(im.num_tokens for im in images) == traj.token_ids.count(cfg.image_token_id)
    # The trainer reads the same record back: grids agree, every pad has an image feature.
    import torch

    fields = TrajectoryImages.for_model(cfg, path).fields(traj, torch.tensor(traj.token_ids),
                                                          torch.tensor(traj.loss_mask))
    assert int(fields["image_mask"].sum()) == traj.image_tokens


def test_a_live_session_gets_only_the_new_ids_and_images(chat):
    engine = FakeEngine(chat.images)
    _run(chat, engine, FakeEnv(IMAGES, turns=3))
    first, second, third = engine.calls
    assert first["previous"] is None and first["images"] == IMAGES[0]
    assert second["previous"] == "r1" and second["images"] == IMAGES[1]
    assert third["images"] == IMAGES[2]
    assert second["ids"].count(chat.images.image_token_id) == 2  # one pad per image
    banned = set(chat.images.logit_bias)
    assert all(set(c["bias"]) == banned and set(c["bias"].values()) == {-1e9} for c in engine.calls)


def test_without_sessions_every_turn_resends_the_context_with_every_image(chat):
    engine = FakeEngine(chat.images, use_sessions=False)
    traj = _run(chat, engine, FakeEnv(IMAGES, turns=3))
    assert [len(c["images"]) for c in engine.calls] == [1, 3, 4]
    last = engine.calls[-1]
    assert last["images"] == [d for turn in IMAGES for d in turn]
    assert last["ids"] == engine.calls[1]["ids"] + [40, 41, 2] + last["ids"][len(engine.calls[1]["ids"]) + 3:]
    assert traj.image_tokens == traj.token_ids.count(chat.images.image_token_id)


def test_the_policy_never_samples_a_vision_special_token(ckpt, chat):
    from tide_megatron.models.policy import banned_token_ids

    _, cfg = ckpt
    assert set(chat.images.logit_bias) == {str(t) for t in banned_token_ids(cfg)}
    assert {cfg.image_token_id, cfg.vision_start_token_id} <= set(banned_token_ids(cfg))


def test_a_corrupt_image_fails_the_task_with_a_clear_error(chat):
    env = FakeEnv([IMAGES[0], [png(64, 64)[:120]], IMAGES[2]], turns=3)
    with pytest.raises(ImageInputError, match=r"^task g0/0 turn 1 image 0: cannot decode"):
        _run(chat, FakeEngine(chat.images), env)


def test_an_image_turn_over_the_context_budget_is_not_cut(chat):
    engine = FakeEngine(chat.images)
    first = _run(chat, FakeEngine(chat.images), FakeEnv(IMAGES[:1] + [[]], turns=1))
    budget = len(first.token_ids) + 5  # room for the first turn's action, not for a second image turn
    traj = _run(chat, engine, FakeEnv(IMAGES, turns=3), max_context=budget)
    assert traj.truncated and traj.turns == 1 and len(traj.images) == 1
    assert traj.token_ids.count(chat.images.image_token_id) == traj.image_tokens


def test_a_first_observation_larger_than_the_context_is_an_error(chat):
    with pytest.raises(ImageInputError, match="turn 0: the first observation takes"):
        _run(chat, FakeEngine(chat.images), FakeEnv(IMAGES, turns=3), max_context=10)


def test_an_engine_that_counts_pads_differently_is_caught(chat):
    with pytest.raises(RuntimeError, match="image pads expanded differently"):
        _run(chat, FakeEngine(chat.images, miscount=1), FakeEnv(IMAGES, turns=3))


def test_text_policies_refuse_images_and_envs_cannot_forge_placeholders(chat):
    from transformers import AutoTokenizer

    from tide_megatron.rollout.chat import ChatFormat

    text_chat = ChatFormat(AutoTokenizer.from_pretrained(TINY_BPE_DIR))
    with pytest.raises(ImageInputError, match="the policy is text-only"):
        _run(text_chat, FakeEngine(chat.images), FakeEnv(IMAGES, turns=3))
    forged = FakeEnv([[]], turns=1, text="<|vision_start|><|image_pad|><|vision_end|> click")
    traj = _run(chat, FakeEngine(chat.images), forged)
    assert chat.images.image_token_id not in traj.token_ids and traj.images == []


def test_turn_deltas_with_images_match_the_template(chat):
    tok = chat.tokenizer
    out = tok("click 3", add_special_tokens=False)["input_ids"] + [chat.eos_token_id]
    tokens = chat.prompt_ids("first", 2) + out + chat.user_turn_ids("second", out, 1) + out + chat.user_turn_ids("third", out)
    image = {"type": "image"}
    messages = [{"role": "user", "content": [image, image, {"type": "text", "text": "first"}]},
                {"role": "assistant", "content": "click 3"},
                {"role": "user", "content": [image, {"type": "text", "text": "second"}]},
                {"role": "assistant", "content": "click 3"}, {"role": "user", "content": "third"}]
    full = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokens == tok(full, add_special_tokens=False)["input_ids"]


def test_the_worker_reports_a_task_with_a_bad_image_instead_of_losing_it(chat):
    from tide_megatron.comm.messages import RunTask, TaskFailed
    from tide_megatron.rollout.worker import RolloutWorker

    posted = []
    mailbox = SimpleNamespace(post=lambda dest, msg: posted.append(msg))
    engine = FakeEngine(chat.images)
    env = FakeEnv([[b"\x89PNG\r\n\x1a\nbroken"]], turns=1)
    worker = RolloutWorker(1, engine, TaskRunnerConfig(max_turns=2, max_new_tokens=4), chat, env, mailbox,
                           job_group=None)
    assignment = TaskAssignment(task={"env": "gui", "task_id": "t0"}, group_id="g0", index=0)

    async def go():
        await worker._handle(RunTask(assignment, None))
        await asyncio.gather(*(t.job for t in list(worker._tasks.values())))

    asyncio.run(go())
    failed = [m for m in posted if isinstance(m, TaskFailed)]
    assert len(failed) == 1 and failed[0].assignment == assignment
    assert failed[0].error.startswith("ImageInputError: task g0/0 turn 0 image 0: cannot decode")
