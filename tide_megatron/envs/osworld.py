"""`osworld`: an adapter from our env protocol to OSWorld's VM servers.

OSWorld (xlang-ai/OSWorld) runs each desktop in a VM whose Flask server
(`desktop_env/server/main.py`, port 5000) exposes, among others:

    GET  /screenshot      -> the screen as PNG bytes (Content-Type image/png)
    GET  /accessibility   -> {"AT": "<accessibility tree as XML>"}
    POST /execute         {"command": [...] | "str", "shell": bool}
                          -> {"status": "success", "output", "error", "returncode"}, or
                             HTTP 500 {"status": "error", "message"}
    POST /setup/execute   same as /execute, for task setup
    POST /setup/launch    {"command": [...] | "str", "shell": bool} -> a text line, or 500

OSWorld's host side (`desktop_env/controllers/python.py`) runs an action as
`python -c "import pyautogui; import time; pyautogui.FAILSAFE = False; <code>"` through
/execute; so does this adapter. Our calls map to theirs:

    reset(task)  revert the VM (optional `revert_command`), run the task's setup steps
                 (/setup/execute, /setup/launch, a pause, or any other /setup endpoint), wait
                 `settle_s`, then GET /screenshot (+ GET /accessibility)
    step(action) `gui_text`: click x,y / type / key -> a pyautogui call; done -> check.
                 `pyautogui`: the code of the reply's fenced block (or the whole reply),
                 or DONE / FAIL / WAIT. Then /execute, `settle_s`, /screenshot (+ a11y).
    reward       on DONE, FAIL or the step limit: the task's check command runs through
                 /execute; the last line of its stdout is the score in [0, 1]. FAIL scores 1
                 on a task marked infeasible, else 0 (OSWorld's rule).

OSWorld's own evaluators run host-side Python against files fetched from the VM; they are not
ported. A task here carries its check as a command run in the VM, so a benchmark task needs a
check script (OSWorld's getters + metric, run inside the VM) to be used for training.

Tasks file (JSON list, or one object per line):

    {"id": "chrome-0001", "split": "train", "task_type": "chrome",
     "instruction": "Set the homepage to example.com.",
     "setup": [{"type": "launch", "command": ["google-chrome"]}, {"type": "sleep", "seconds": 2},
               {"type": "execute", "command": "rm -f ~/Downloads/*", "shell": true},
               {"type": "post", "endpoint": "/setup/activate_window", "json": {"window_name": "Chrome"}}],
     "check": {"command": ["python3", "/opt/checks/chrome_homepage.py"], "shell": false},
     "infeasible": false}

Errors: a VM that does not answer in time, answers with an HTTP error, sends malformed JSON,
or a screenshot that is not PNG/JPEG, raises `OSWorldError` naming the VM, the endpoint and
the task; the env server reports it as `EnvFailure` and the task is retried elsewhere. A
failed accessibility tree only drops the tree (`info["a11y_error"]`); the model's code
failing in the VM (non-zero return code) is an ordinary observation, not an error.
"""

from __future__ import annotations

import http.client
import io
import json
import math
import re
import shlex
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tide_megatron.envs.env_config import EnvConfig
from tide_megatron.envs.gui_actions import ACTION_HELP, ActionError, Done, parse_action, to_pyautogui
from tide_megatron.envs.images import sniff_format
from tide_megatron.envs.protocol import Env, ResetResult, StepResult, TaskSpec

PYAUTOGUI_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "
PYAUTOGUI_HELP = ("Reply with Python code using pyautogui in a ```python block, or with DONE when the task is "
                  "finished, FAIL when it cannot be done, WAIT to look again.")
MAX_CODE_CHARS = 8192
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


class OSWorldError(RuntimeError):
    """The VM server could not be used (unreachable, slow, an HTTP error, malformed data)."""


@dataclass(frozen=True)
class OSWorldTask:
    spec: TaskSpec
    instruction: str
    setup: tuple[dict[str, Any], ...]
    check: dict[str, Any]
    infeasible: bool = False


def load_tasks(path: str, env_key: str) -> dict[str, OSWorldTask]:
    """Tasks of a tasks file by id; ValueError naming the file and the entry when malformed."""
    if not path:
        raise ValueError("osworld.tasks_file is not set")
    with open(path) as f:
        text = f.read()
    stripped = text.lstrip()
    entries = json.loads(text) if stripped.startswith("[") else [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    tasks: dict[str, OSWorldTask] = {}
    for i, e in enumerate(entries):
        where = f"{path}: task {i}"
        if not isinstance(e, dict) or not isinstance(e.get("id"), str) or not isinstance(e.get("instruction"), str):
            raise ValueError(f"{where}: needs string fields id and instruction")
        check = e.get("check")
        if not isinstance(check, dict) or not isinstance(check.get("command"), (str, list)):
            raise ValueError(f"{where} ({e['id']}): needs check.command (a string or a list)")
        setup = e.get("setup", [])
        if not isinstance(setup, list) or not all(isinstance(s, dict) and s.get("type") in _SETUP_TYPES for s in setup):
            raise ValueError(f"{where} ({e['id']}): setup steps need a type of {_SETUP_TYPES}")
        split = e.get("split", "train")
        spec = TaskSpec(env=env_key, task_id=e["id"], task_type=f"osworld/{e.get('task_type', 'any')}", split=split)
        if e["id"] in tasks:
            raise ValueError(f"{where}: duplicate task id {e['id']!r}")
        tasks[e["id"]] = OSWorldTask(spec, e["instruction"], tuple(setup), check, bool(e.get("infeasible", False)))
    return tasks


_SETUP_TYPES = ("execute", "launch", "sleep", "post")


class VMPool:
    """The VMs of one `vm_urls` list, shared by every session of the process; a session leases
    one from reset to close."""

    _pools: dict[tuple[str, ...], VMPool] = {}
    _pools_lock = threading.Lock()

    def __init__(self, urls: tuple[str, ...]):
        self.urls = urls
        self._free = list(urls)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, urls: list[str]) -> VMPool:
        key = tuple(u.rstrip("/") for u in urls)
        with cls._pools_lock:
            return cls._pools.setdefault(key, cls(key))

    def lease(self) -> str:
        with self._lock:
            if not self._free:
                raise OSWorldError(f"all {len(self.urls)} OSWorld VMs are in use; keep the env server's "
                                   "max_sessions at most the number of vm_urls")
            return self._free.pop(0)

    def release(self, url: str) -> None:
        with self._lock:
            if url in self.urls and url not in self._free:
                self._free.append(url)


@dataclass
class VMClient:
    """Blocking HTTP calls to one VM server, each with a timeout and a one-line error."""

    url: str
    timeout_s: float
    context: str = ""
    """Prefix of every error message (the task)."""
    headers_seen: dict[str, str] = field(default_factory=dict)

    def request(self, endpoint: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + endpoint, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"} if body is not None else {})
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                self.headers_seen = {k.lower(): v for k, v in resp.headers.items()}
                return resp.read()
        except urllib.error.HTTPError as e:
            raise self.error(endpoint, f"HTTP {e.code}: {_error_message(e.read())}") from None
        except (TimeoutError, OSError) as e:  # URLError is an OSError; a read timeout a TimeoutError
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise self.error(endpoint, f"no reply within {timeout:g} s") from None
            raise self.error(endpoint, f"unreachable ({reason})") from None
        except http.client.HTTPException as e:  # e.g. the connection closed mid-body
            raise self.error(endpoint, f"broken reply ({type(e).__name__}: {e})") from None

    def json(self, endpoint: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        raw = self.request(endpoint, body, timeout_s)
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.error(endpoint, f"malformed JSON ({e}): {raw[:60]!r}") from None
        if not isinstance(obj, dict):
            raise self.error(endpoint, f"expected a JSON object, got {type(obj).__name__}")
        return obj

    def error(self, endpoint: str, detail: str) -> OSWorldError:
        return OSWorldError(f"{self.context}VM {self.url} {endpoint}: {detail}")


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        if isinstance(obj, dict):
            return str(obj.get("message") or obj.get("error") or obj)[:300]
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    return raw[:300].decode("utf-8", "replace")


def extract_code(reply: str) -> str:
    """The code of a pyautogui-space reply: its first fenced block, else the whole reply."""
    m = _FENCE.search(reply)
    return (m.group(1) if m else reply).strip()


class OSWorldEnv(Env):
    """One episode on one leased OSWorld VM. Every call blocks on HTTP: a worker thread's job."""

    blocking = True

    def __init__(self, env_cfg: EnvConfig):
        cfg = self._cfg = env_cfg.osworld
        self._key = env_cfg.key
        if cfg.action_space not in ("gui_text", "pyautogui"):
            raise ValueError(f"osworld.action_space must be gui_text or pyautogui, got {cfg.action_space!r}")
        if not cfg.vm_urls:
            raise ValueError("osworld.vm_urls is empty: give the URL of at least one VM's OSWorld server")
        self._tasks = load_tasks(cfg.tasks_file, self._key)
        self._pool = VMPool.of(cfg.vm_urls)
        self._vm: VMClient | None = None
        self._task: OSWorldTask | None = None
        self._size = (0, 0)
        self._steps = 0
        self._done = True

    def list_tasks(self, split: str) -> list[TaskSpec]:
        return [t.spec for t in self._tasks.values() if t.spec.split == split]

    def task(self, task_id: str) -> TaskSpec:
        if task_id not in self._tasks:
            raise KeyError(f"unknown osworld task {task_id!r} (not in {self._cfg.tasks_file})")
        return self._tasks[task_id].spec

    def reset(self, task_id: str, trajectory_id: str) -> ResetResult:
        self.task(task_id)
        task = self._task = self._tasks[task_id]
        if self._vm is None:
            url = self._pool.lease()
            self._vm = VMClient(url, self._cfg.request_timeout_s)
        self._vm.context = f"osworld task {task_id}: "
        self._revert()
        for step in task.setup:
            self._setup(step)
        time.sleep(self._cfg.settle_s)
        self._steps, self._done = 0, False
        help_text = PYAUTOGUI_HELP if self._cfg.action_space == "pyautogui" else ACTION_HELP
        images, info = self._observe()
        text = f"{task.instruction}\n{help_text} The screen is {self._size[0]}x{self._size[1]} pixels."
        return ResetResult(observation=text, info=info, task_type=task.spec.task_type, image_data=images)

    def step(self, action: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("step on a finished or unstarted osworld episode")
        self._steps += 1
        verdict, code, feedback = self._interpret(action)
        if verdict in ("DONE", "FAIL"):
            return self._finish(verdict, feedback)
        if code is not None:
            feedback = self._run_action(code)
        time.sleep(self._cfg.settle_s)
        if self._steps >= self._cfg.max_steps:
            return self._finish("LIMIT", feedback + " Out of steps.")
        images, info = self._observe()
        return StepResult(observation=feedback, reward=0.0, done=False, info=info, image_data=images)

    def close(self) -> None:
        if self._vm is not None:
            self._pool.release(self._vm.url)
            self._vm = None

    # Actions -------------------------------------------------------------------------------

    def _interpret(self, action: str) -> tuple[str, str | None, str]:
        """(verdict, pyautogui code or None, feedback): verdict is DONE, FAIL, WAIT or ACT."""
        if self._cfg.action_space == "gui_text":
            try:
                act = parse_action(action, *self._size)
            except ActionError as e:
                return "ACT", None, f"Invalid action: {e}. {ACTION_HELP}"
            return ("DONE", None, "Done.") if isinstance(act, Done) else ("ACT", to_pyautogui(act), "")
        code = extract_code(action)
        if code in ("DONE", "FAIL", "WAIT"):
            return code, None, f"{code}."
        if not code:
            return "ACT", None, f"Invalid action: empty reply. {PYAUTOGUI_HELP}"
        if len(code) > MAX_CODE_CHARS:
            return "ACT", None, f"Invalid action: {len(code)} characters of code; at most {MAX_CODE_CHARS}."
        return "ACT", code, ""

    def _run_action(self, code: str) -> str:
        reply = self._vm.json("/execute", {"command": ["python", "-c", PYAUTOGUI_PREFIX + code], "shell": False},
                              self._cfg.execute_timeout_s)
        if reply.get("status") != "success":
            raise self._vm.error("/execute", f"status {reply.get('status')!r}: {reply.get('message', '')}")
        if reply.get("returncode", 0) != 0:
            tail = str(reply.get("error") or "").strip().splitlines()[-1:] or ["(no message)"]
            return f"The action failed in the VM: {tail[0][:300]}"
        return "Action executed."

    def _finish(self, verdict: str, feedback: str) -> StepResult:
        task = self._task
        if verdict == "FAIL":
            score = 1.0 if task.infeasible else 0.0
        else:
            score = self._check()
        self._done = True
        info = {"won": score >= 1.0, "truncated": verdict == "LIMIT", "episode_return": score, "score": score}
        return StepResult(observation=feedback, reward=score, done=True, info=info)

    def _check(self) -> float:
        check = self._task.check
        reply = self._vm.json("/execute", {"command": check["command"], "shell": bool(check.get("shell", False))},
                              self._cfg.execute_timeout_s)
        lines = [ln for ln in str(reply.get("output") or "").splitlines() if ln.strip()]
        if reply.get("status") != "success" or reply.get("returncode", 0) != 0 or not lines:
            raise self._vm.error("/execute (check)", f"the check command failed: returncode {reply.get('returncode')}, "
                                                     f"stderr {str(reply.get('error') or '')[-200:]!r}")
        try:
            score = float(lines[-1])
        except ValueError:
            raise self._vm.error("/execute (check)", f"the check printed {lines[-1][:60]!r}, not a score") from None
        if not math.isfinite(score) or not 0.0 <= score <= 1.0:
            raise self._vm.error("/execute (check)", f"the check's score {score!r} is not a finite number in [0, 1]")
        return score

    # VM ------------------------------------------------------------------------------------

    def _revert(self) -> None:
        if not self._cfg.revert_command:
            return
        cmd = shlex.split(self._cfg.revert_command) + [self._vm.url]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=self._cfg.revert_timeout_s)
        except subprocess.TimeoutExpired:
            raise self._vm.error("(revert)", f"{cmd[0]} did not finish within {self._cfg.revert_timeout_s:g} s") from None
        if out.returncode != 0:
            raise self._vm.error("(revert)", f"{cmd[0]} exited {out.returncode}: {out.stderr.strip()[-200:]}")
        deadline = time.monotonic() + self._cfg.revert_timeout_s
        while True:  # the VM server comes back up after the snapshot is restored
            try:
                self._vm.request("/screenshot")
                return
            except OSWorldError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def _setup(self, step: dict[str, Any]) -> None:
        kind = step["type"]
        if kind == "sleep":
            time.sleep(float(step.get("seconds", 1.0)))
        elif kind == "post":
            self._vm.request(str(step["endpoint"]), dict(step.get("json", {})))
        else:
            body = {"command": step.get("command", []), "shell": bool(step.get("shell", False))}
            endpoint = "/setup/execute" if kind == "execute" else "/setup/launch"
            self._vm.request(endpoint, body, self._cfg.execute_timeout_s)

    def _observe(self) -> tuple[list[bytes], dict[str, Any]]:
        shot = self._vm.request("/screenshot")
        if sniff_format(shot) is None:
            kind = self._vm.headers_seen.get("content-type", "?")
            raise self._vm.error("/screenshot", f"{len(shot)} bytes that are not PNG or JPEG (Content-Type {kind})")
        try:
            self._size = _image_size(shot)
        except (OSError, ValueError) as e:
            raise self._vm.error("/screenshot", f"undecodable screenshot ({e})") from None
        info: dict[str, Any] = {}
        if self._cfg.a11y_tree:
            try:
                tree = self._vm.json("/accessibility").get("AT")
                if not isinstance(tree, str):
                    raise self._vm.error("/accessibility", "the reply has no AT string")
                info["a11y_tree"] = tree[: self._cfg.a11y_max_chars]
            except OSWorldError as e:
                info["a11y_error"] = str(e)
        return [shot], info


def _image_size(data: bytes) -> tuple[int, int]:
    """Width and height from the image header (the server validates the whole image)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.size
