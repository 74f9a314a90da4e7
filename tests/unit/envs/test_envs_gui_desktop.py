"""The offline GUI desktop: actions, determinism, checker, reward, screenshots, a11y tree."""

import asyncio
import hashlib
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_megatron.envs import EnvClient, EnvClientConfig, EnvServer, EnvServerConfig
from tide_megatron.envs.config import EnvConfig, GuiDesktopConfig, ImageLimits, LatencyConfig
from tide_megatron.envs.gui_actions import (
    ActionError, Click, Done, KeyPress, TypeText, parse_action, to_pyautogui,
)
from tide_megatron.envs.gui_desktop import GuiDesktopEnv, build_gui_task
from tide_megatron.envs.images import validate_image
from tide_megatron.envs.latency import LatencyEnv
from tide_megatron.envs.registry import build_env


def make_env(**kw):
    return GuiDesktopEnv(EnvConfig(name="gui_desktop", gui_desktop=GuiDesktopConfig(**kw)))


def first_task(env, family, start=0):
    """Reset `env` on the first train task of `family` and return its id."""
    for i in range(start, 500):
        if build_gui_task(env._cfg, "gui_desktop", f"train/{i}").family == family:
            env.reset(f"train/{i}", "t")
            return f"train/{i}"
    raise AssertionError(family)


def click_on(env, role, name):
    from tide_megatron.envs.gui_screen import find, layout

    x, y = find(layout(env.state, 224, 160), role, name).center
    return env.step(f"click {x},{y}")


@pytest.mark.parametrize("reply, action", [
    ("click 10,20", Click(10, 20)), ("  click 223, 159\n", Click(223, 159)), ("click 0,0", Click(0, 0)),
    ('type "milk"', TypeText("milk")), (r'type "say \"hi\" \\ bye"', TypeText('say "hi" \\ bye')),
    ("key enter", KeyPress("enter")), ("key escape", KeyPress("escape")), ("done", Done()),
])
def test_well_formed_actions_parse(reply, action):
    assert parse_action(reply, 224, 160) == action


@pytest.mark.parametrize("reply, reason", [
    ("", "empty"), ("   ", "empty"), ("click 224,10", "outside the 224x160"), ("click 5,160", "outside"),
    ("click -1,5", "malformed click"), ("click 5 5", "malformed click"), ("Click 5,5", "not an action"),
    ("click 5,5\ndone", "more than one line"), ("I will click 5,5", "not an action"), ('type "', "malformed type"),
    ('type ""', "at least one character"), ('type "' + "a" * 65 + '"', "at most 64"), ('type "caf\u00e9"', "ASCII"),
    ("type milk", "malformed type"), ("key f5", "unknown key"), ("key", "malformed key"), ("DONE", "not an action"),
    ("x" * 300, "at most 256"), ("done done", "not an action"),
])
def test_malformed_actions_say_why(reply, reason):
    with pytest.raises(ActionError, match=reason):
        parse_action(reply, 224, 160)


def test_pyautogui_translation():
    assert to_pyautogui(Click(3, 4)) == "pyautogui.click(3, 4)"
    assert to_pyautogui(TypeText("it's")) == 'pyautogui.typewrite("it\'s")'
    assert to_pyautogui(KeyPress("enter")) == "pyautogui.press('enter')"
    assert to_pyautogui(Done()) is None


def test_deterministic_under_a_seed():
    a, b = make_env(seed=3), make_env(seed=3)
    actions = ["click 20,20", "click 100,30", 'type "milk"', "key tab", "click 195,52", "done"]
    for task in ["train/0", "train/7", "eval/3"]:
        ra, rb = a.reset(task, "g0"), b.reset(task, "g1")  # group members share the first screenshot
        assert ra.image_data == rb.image_data and ra.observation == rb.observation and ra.info == rb.info
        for act in actions:
            sa, sb = a.step(act), b.step(act)
            assert (sa.observation, sa.reward, sa.done, sa.image_data) == (sb.observation, sb.reward, sb.done, sb.image_data)
            if sa.done:
                break
    c = make_env(seed=4)
    digests = lambda env: [hashlib.sha256(env.reset(f"train/{i}", "t").image_data[0]).hexdigest() for i in range(20)]
    assert digests(a) == digests(b) != digests(c)
    assert len({t.task_type for t in a.list_tasks("eval")}) == 5


def test_expert_solves_every_family_in_the_shortest_number_of_actions():
    env = make_env()
    seen = set()
    for i in range(120):
        env.reset(f"train/{i}", "t")
        seen.add(env._task.family)
        total, steps = 0.0, 0
        while True:
            res = env.step(env.expert_action())
            total, steps = total + res.reward, steps + 1
            if res.done:
                break
        assert res.info["won"] and steps == env._task.shortest and total == pytest.approx(1.0)
        assert res.info["episode_return"] == pytest.approx(total)
    assert seen == {"open_app", "close_window", "toggle", "write_note", "delete_file"}


def test_malformed_replies_cost_a_penalty_and_a_step_never_a_crash():
    env = make_env(max_steps=3)
    first_task(env, "write_note")
    res = env.step("open the notes app please")
    assert not res.done and res.reward == pytest.approx(-0.1) and res.info["invalid_action"]
    assert res.observation.startswith("Invalid action: not an action") and "click X,Y" in res.observation
    assert len(res.image_data) == 1  # a screenshot after every action, valid or not
    env.step("click 999,1")
    res = env.step("key f1")
    assert res.done and res.info["truncated"] and not res.info["won"]
    assert res.info["episode_return"] == pytest.approx(-0.3 - 0.02 * 0)  # shortest is 3: no extra-step penalty


@settings(max_examples=150, deadline=None)
@given(reply=st.text(max_size=80))
def test_any_reply_is_answered(reply):
    env = make_env(max_steps=2)
    env.reset("train/1", "t")
    res = env.step(reply)
    assert isinstance(res.reward, float) and res.observation and len(res.image_data) == 1


def test_the_checker_reads_state_and_wants_nothing_else_changed():
    env = make_env()
    first_task(env, "toggle")
    task = env._task
    if env.state.window is None:
        click_on(env, "icon", "Settings")
    other = next(s for s in env.state.settings if s != task.target)
    res = click_on(env, "switch", other)  # a collateral change first
    assert not res.done
    res = click_on(env, "switch", task.target)
    assert not res.done and env.state.settings[task.target] == task.value  # target right, but another switch moved
    res = click_on(env, "switch", other)
    assert res.done and res.info["won"] and res.info["episode_return"] < 1.0  # extra steps cost

    first_task(env, "delete_file")
    wrong = next(f for f in env.state.files if f != env._task.target)
    click_on(env, "icon", "Files")
    click_on(env, "listitem", wrong)
    res = click_on(env, "button", "Delete")
    assert not res.done and wrong not in env.state.files
    click_on(env, "listitem", env._task.target)
    res = click_on(env, "button", "Delete")
    assert not res.done and env._task.target not in env.state.files  # a wrong deletion cannot be undone
    res = env.step("done")
    assert res.done and not res.info["won"] and not res.info["truncated"]


def test_done_is_required_without_auto_done_and_an_early_done_fails():
    env = make_env(auto_done=False)
    first_task(env, "open_app")
    res = click_on(env, "icon", env._task.target)
    assert not res.done and res.reward == pytest.approx(0.5)
    res = env.step("done")
    assert res.done and res.info["won"] and res.reward == pytest.approx(0.5)
    first_task(env, "open_app")
    res = env.step("done")
    assert res.done and not res.info["won"] and not res.info["truncated"] and res.reward == 0.0


def test_random_clicks_give_groups_a_spread_of_returns():
    env = make_env()
    rng = random.Random(0)
    returns, wins_open = [], []
    for i in range(600):
        env.reset(f"train/{i}", "t")
        family = env._task.family
        while True:
            res = env.step(f"click {rng.randrange(224)},{rng.randrange(160)}")
            if res.done:
                break
        returns.append(res.info["episode_return"])
        if family == "open_app":
            wins_open.append(res.info["won"])
    assert 0.1 < statistics.mean(wins_open) < 0.5  # a 1-action task is often solved by chance
    assert statistics.pstdev(returns) > 0.1 and len(set(returns)) > 50
    assert -0.2 <= min(returns) and max(returns) <= 1.0


def test_screenshot_and_a11y_tree():
    env = make_env()
    first_task(env, "toggle")
    first = env.reset(env._task.spec.task_id, "t")
    info = validate_image(first.image_data[0], ImageLimits())
    assert (info.format, info.width, info.height) == ("png", 224, 160) and info.nbytes < 8000
    tree = first.info["a11y_tree"]
    assert tree.startswith("desktop 224x160") and 'icon "Settings" at (' in tree and "a11y" not in first.observation
    assert "Turn " in first.observation and "224x160" in first.observation
    big = make_env(width=448, height=320, image_format="jpeg", a11y_in_observation=True, a11y_tree=False)
    res = big.reset("train/0", "t")
    info = validate_image(res.image_data[0], ImageLimits())
    assert (info.format, info.width, info.height) == ("jpeg", 448, 320)
    assert 'icon "Notes"' in res.observation and "a11y_tree" not in res.info
    with pytest.raises(ValueError, match="families"):
        make_env(families=["chess"])


def test_latency_wrapper_keeps_screenshots_on_retry_turns():
    cfg = EnvConfig(name="gui_desktop", latency=LatencyConfig(enabled=True, extra_turns_mean=3.0, extra_turns_within=1))
    env = build_env(cfg)
    assert isinstance(env, LatencyEnv) and env.blocking
    for i in range(20):
        first = env.reset(f"train/{i}", "t")
        res = env.step("click 1,1")
        if res.info.get("retry"):
            assert res.image_data == first.image_data and res.latency_s > 0
            return
    pytest.fail("no retry turn was injected")


def test_played_through_the_server_with_screenshots(tmp_path):
    cfg = EnvServerConfig(envs=[EnvConfig(name="gui_desktop", gui_desktop=GuiDesktopConfig(families=["open_app"]))],
                          image_store_dir=str(tmp_path))
    local = make_env(families=["open_app"])

    async def main():
        async with EnvServer(cfg) as server, EnvClient(EnvClientConfig(port=server.port)) as client:
            (task,) = await client.list_tasks("gui_desktop", limit=1)
            first = await client.reset("gui_desktop", task.task_id, "t")
            local.reset(task.task_id, "t")
            assert first.image_data == local.reset(task.task_id, "t").image_data
            res = await client.step(first.session_id, local.expert_action())
            assert res.done and res.info["won"] and res.reward == pytest.approx(1.0) and len(res.image_data) == 1
    asyncio.run(main())
