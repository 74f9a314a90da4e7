"""The OSWorld adapter against recorded VM-server replies, served by a fake server on 127.0.0.1."""

import http.server
import json
import os
import sys
import threading
import time

import pytest

from tide_megatron.envs.config import EnvConfig, OSWorldConfig
from tide_megatron.envs.osworld import OSWorldEnv, OSWorldError, VMPool, extract_code, load_tasks

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "osworld")
TASKS = os.path.join(FIXTURES, "tasks.jsonl")
with open(os.path.join(FIXTURES, "replies.json")) as f:
    REPLIES = json.load(f)


def reply_bytes(name):
    r = REPLIES[name]
    if "body_file" in r:
        with open(os.path.join(FIXTURES, r["body_file"]), "rb") as f:
            return r["status"], r["content_type"], f.read()
    return r["status"], r["content_type"], r["body"].encode()


class FakeVM:
    """Answers each (method, path) with the next recorded reply of its script (the last one
    repeats); `("hang", s)` sleeps s seconds first. Records every request."""

    def __init__(self, script):
        self.script = {k: list(v) for k, v in script.items()}
        self.requests = []
        vm = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                vm.requests.append((method, self.path, body))
                queue = vm.script.get((method, self.path)) or ["execute_error"]
                item = queue.pop(0) if len(queue) > 1 else queue[0]
                if isinstance(item, tuple):
                    time.sleep(item[1])
                    item = "execute_ok"
                status, ctype, data = reply_bytes(item)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def executed_code(self):
        return [b["command"][2] for m, p, b in self.requests if p == "/execute" and isinstance(b["command"], list)
                and b["command"][:2] == ["python", "-c"]]


GOOD = {("GET", "/screenshot"): ["screenshot_ok"], ("GET", "/accessibility"): ["accessibility_ok"],
        ("POST", "/setup/launch"): ["launch_ok"], ("POST", "/setup/execute"): ["execute_ok"],
        ("POST", "/execute"): ["execute_ok"]}


@pytest.fixture
def vm_factory():
    vms = []

    def make(overrides=None, **cfg_kw):
        vm = FakeVM({**GOOD, **(overrides or {})})
        vms.append(vm)
        cfg = OSWorldConfig(vm_urls=[vm.url], tasks_file=TASKS, settle_s=0.0, request_timeout_s=1.0,
                            execute_timeout_s=1.0, **cfg_kw)
        return vm, OSWorldEnv(EnvConfig(name="osworld", osworld=cfg))

    yield make
    for vm in vms:
        vm.close()


def test_tasks_file_and_catalogue(vm_factory):
    _, env = vm_factory()
    assert [t.task_id for t in env.list_tasks("train")] == ["chrome-0001"]
    assert env.task("gimp-0002").task_type == "osworld/gimp" and env.list_tasks("eval")[0].split == "eval"
    with pytest.raises(KeyError):
        env.task("nope")


def test_bad_tasks_files_name_the_entry(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps([{"id": "a", "instruction": "x"}]))
    with pytest.raises(ValueError, match=r"t.json: task 0 \(a\): needs check.command"):
        load_tasks(str(bad), "osworld")
    bad.write_text(json.dumps([{"id": "a", "instruction": "x", "check": {"command": "x"}, "setup": [{"type": "rm"}]}]))
    with pytest.raises(ValueError, match="setup steps need a type"):
        load_tasks(str(bad), "osworld")


def test_episode_with_text_actions(vm_factory):
    vm, env = vm_factory({("POST", "/execute"): ["execute_ok", "execute_ok", "check_pass"]})
    first = env.reset("chrome-0001", "t0")
    assert first.image_data == [reply_bytes("screenshot_ok")[2]] and "<desktop-frame" in first.info["a11y_tree"]
    assert first.observation.startswith("Set the homepage") and "128x80" in first.observation
    assert ("POST", "/setup/launch", {"command": ["google-chrome"], "shell": False}) in vm.requests
    assert ("POST", "/setup/execute", {"command": "rm -f ~/Downloads/*", "shell": True}) in vm.requests
    res = env.step("click 20,15")
    assert not res.done and res.observation == "Action executed." and res.reward == 0.0 and res.image_data
    res = env.step('type "example.com"')
    assert vm.executed_code()[-2:] == [
        "import pyautogui; import time; pyautogui.FAILSAFE = False; pyautogui.click(20, 15)",
        "import pyautogui; import time; pyautogui.FAILSAFE = False; pyautogui.typewrite('example.com')"]
    res = env.step("click 500,15")  # outside the 128x80 screen: an observation, no request
    assert "outside the 128x80 screen" in res.observation and not res.done
    res = env.step("done")
    assert res.done and res.reward == 1.0 and res.info == {"won": True, "truncated": False, "episode_return": 1.0,
                                                            "score": 1.0}
    assert vm.requests[-1] == ("POST", "/execute", {"command": ["python3", "/opt/checks/chrome_homepage.py"],
                                                     "shell": False})
    env.close()


def test_pyautogui_action_space_and_fail_on_infeasible(vm_factory):
    vm, env = vm_factory({("POST", "/execute"): ["execute_code_failed", "execute_ok"]}, action_space="pyautogui")
    env.reset("gimp-0002", "t")
    res = env.step("I will click.\n```python\npyautogi.click(1, 2)\n```")
    assert "failed in the VM: NameError: name 'pyautogi' is not defined" in res.observation and not res.done
    res = env.step("WAIT")
    assert res.observation == "WAIT." and not res.done
    res = env.step("FAIL")
    assert res.done and res.reward == 1.0  # the task is infeasible: saying so is right
    assert extract_code("```py\nx = 1\n```") == "x = 1" and extract_code(" DONE ") == "DONE"
    env.close()


def test_step_limit_checks_the_task(vm_factory):
    vm, env = vm_factory({("POST", "/execute"): ["execute_ok", "check_half"]}, max_steps=1)
    env.reset("chrome-0001", "t")
    res = env.step("key enter")
    assert res.done and res.info["truncated"] and res.reward == 0.5 and not res.info["won"]
    env.close()


@pytest.mark.parametrize("overrides, when, match", [
    ({("GET", "/screenshot"): ["screenshot_html"]}, "reset", r"/screenshot: \d+ bytes that are not PNG or JPEG \(Content-Type text/html"),
    ({("POST", "/execute"): ["execute_error"]}, "step", r"/execute: HTTP 500: \[Errno 2\] No such file"),
    ({("POST", "/execute"): ["execute_malformed"]}, "step", r"/execute: malformed JSON"),
    ({("POST", "/execute"): [("hang", 1.5)]}, "step", r"/execute: no reply within 1 s"),
    ({("POST", "/setup/launch"): [("hang", 1.5)]}, "reset", r"/setup/launch: no reply within 1 s"),
    ({("POST", "/execute"): ["check_nan"]}, "done", r"score nan is not a finite number"),
])
def test_vm_errors_name_the_vm_the_endpoint_and_the_task(vm_factory, overrides, when, match):
    vm, env = vm_factory(overrides)
    with pytest.raises(OSWorldError, match=match) as e:
        env.reset("chrome-0001", "t")
        env.step("done" if when == "done" else "click 1,1")
    assert f"osworld task chrome-0001: VM {vm.url}" in str(e.value)
    env.close()


def test_a_failed_accessibility_tree_is_not_fatal(vm_factory):
    _, env = vm_factory({("GET", "/accessibility"): ["accessibility_error"]})
    first = env.reset("chrome-0001", "t")
    assert "a11y_tree" not in first.info and "HTTP 500" in first.info["a11y_error"] and first.image_data
    env.close()


def test_unreachable_vm(tmp_path):
    from tide_megatron.utils.net import free_port

    env = OSWorldEnv(EnvConfig(name="osworld", osworld=OSWorldConfig(
        vm_urls=[f"http://127.0.0.1:{free_port()}"], tasks_file=TASKS, settle_s=0.0, request_timeout_s=1.0)))
    with pytest.raises(OSWorldError, match="unreachable"):
        env.reset("chrome-0001", "t")
    env.close()


def test_vms_are_leased_one_per_session(vm_factory):
    vm, env = vm_factory()
    other = OSWorldEnv(EnvConfig(name="osworld", osworld=env._cfg))
    env.reset("chrome-0001", "a")
    with pytest.raises(OSWorldError, match="all 1 OSWorld VMs are in use"):
        other.reset("chrome-0001", "b")
    env.reset("chrome-0001", "a2")  # a session keeps its VM across resets
    env.close()
    other.reset("chrome-0001", "b")
    other.close()
    assert VMPool.of([vm.url])._free == [vm.url]


def test_revert_command_runs_before_each_reset(vm_factory, tmp_path):
    log = tmp_path / "reverted"
    script = f"import sys; open({str(log)!r}, 'a').write(sys.argv[1] + '\\n')"
    vm, env = vm_factory(revert_command=f"{sys.executable} -c \"{script}\"")
    env.reset("chrome-0001", "t")
    env.reset("chrome-0001", "t")
    assert log.read_text().splitlines() == [vm.url, vm.url]
    env.close()
    _, failing = vm_factory(revert_command=f"{sys.executable} -c \"import sys; sys.exit('no snapshot')\"")
    with pytest.raises(OSWorldError, match="exited 1: no snapshot"):
        failing.reset("chrome-0001", "t")
    failing.close()


def test_through_the_env_server(vm_factory, tmp_path):
    import asyncio

    from tide_megatron.envs import EnvClient, EnvClientConfig, EnvRemoteError, EnvServer, EnvServerConfig

    vm, env = vm_factory({("POST", "/execute"): ["execute_error"]})
    cfg = EnvServerConfig(envs=[EnvConfig(name="osworld", osworld=env._cfg)], image_store_dir=str(tmp_path))

    async def main():
        async with EnvServer(cfg) as server, EnvClient(EnvClientConfig(port=server.port)) as client:
            assert [t.task_id for t in await client.list_tasks("osworld")] == ["chrome-0001"]
            first = await client.reset("osworld", "chrome-0001", "t")
            assert first.image_data == [reply_bytes("screenshot_ok")[2]] and first.images[0].width == 128
            with pytest.raises(EnvRemoteError) as e:
                await client.step(first.session_id, "click 1,1")
            assert e.value.kind == "EnvFailure" and "osworld task chrome-0001: VM" in e.value.message
    asyncio.run(main())
