"""Environments: the env protocol, the env server and client, and the built-in envs.

Environments run outside the trainer, in an env server process (or a fleet of them), and
compute rewards next to their state. The rollout task runner talks to them with `EnvClient`
over newline-delimited JSON on TCP (`wire.py`), loopback by default.

Built-in envs (registered by name, configured by `EnvConfig`):
- `door_game`: a small deterministic multi-turn game a tiny random-init model learns with
  GRPO on CPU in minutes (random valid policy ~0.20 mean return, perfect policy 1.0).
- `textworld`: procedurally generated TextWorld games, offline, generated lazily and cached.
- `gui_desktop`: an offline GUI desktop drawn with Pillow (Settings, Notes, Files), screenshot
  observations (224x160 PNG by default) and an optional accessibility tree, text actions
  (`click x,y`, `type "text"`, `key NAME`, `done`), tasks of 1-3 actions checked on the
  desktop's state, a shaped reward; a tiny VL model learns it on CPU.
- `osworld`: an adapter to OSWorld's VM servers (screenshot, accessibility tree, /execute
  of pyautogui code); each session leases one VM; see `osworld.py`.
- any env with `EnvConfig.latency.enabled`: heavy-tailed emulated latency and per-task extra
  turns, deterministic under a seed, emulating remote environments.

Modules: `protocol` (Env, TaskSpec, ResetResult, StepResult, ImageRef), `wire` (message
format), `config` and `env_config` (typed configs), `server` (EnvServer), `server_process`
(EnvServerProcess, the embedded server as a subprocess), `client` (EnvClient), `errors`,
`registry`, `latency`, `images` (image validation), `image_store`, `door_game`,
`textworld_env`, `gui_desktop` (with `gui_screen` and `gui_actions`), `osworld`.

Plugging in a remote benchmark env server (WebShop, ALFWorld, OSWorld, ScienceBoard)
---------------------------------------------------------------------------------------
Nothing on the trainer side changes: the task runner only knows `EnvClient` and the JSON
protocol. A benchmark plugs in by standing up a server that speaks it, next to the benchmark
(on the CPU env cluster, where the browser, the ALFWorld game files or the OSWorld VMs live):

1. Implement `Env` (`protocol.py`) around the benchmark's own API: `list_tasks(split)` returns
   its task ids with a `task_type` (e.g. the WebShop goal category, the ALFWorld task family,
   the OSWorld app) so CTB can spread stragglers; `reset(task_id, trajectory_id)` starts an
   episode whose start depends on the task only (same goal, same initial page/room/VM
   snapshot for the G members of a group); `step(action)` executes the model's text action
   and returns the benchmark's reward (WebShop's attribute-match score at `buy`, ALFWorld's
   goal success, OSWorld's evaluator result) with `done`. Set `blocking = True` when calls
   block (a browser, a VM): they then run on the server's worker threads.
2. `register_env("webshop", factory)` in a small module named in `EnvServerConfig.plugins`
   (the server imports it first), and run, on each env host,
   `TIDE_ENV_TOKEN=<shared secret> python -m tide_megatron.envs.server --config-json
   '{"host": "<env host address>", "plugins": ["my_bench.tide_env"], "envs": [{"name": "webshop"}]}'`
   (a non-loopback address requires the shared token; clients present it in `hello`). Or,
   for a benchmark that already has its own server in another language, answer the ops of
   `wire.py` directly: the client checks every field, so a conforming server needs no
   Python from this package.
3. Point the recipe's env client at the fleet (`EnvClientConfig.host/port`, the same token in
   TIDE_ENV_TOKEN), give `call_timeout_s` room for the slowest real step, and size CTB's env
   concurrency to the servers' `max_sessions` (the `stats` op reports live sessions).

Server limits and security
--------------------------
The server binds loopback by default; another address requires a shared token of at least 16
characters (`EnvServerConfig.auth_token`, or TIDE_ENV_TOKEN), which authenticates but does not
encrypt. Sessions belong to the connection that opened them, under unguessable ids. Every
limit is a documented field of `EnvServerLimits` (connections, sessions per connection, calls
in flight per connection, request and reply bytes, JSON nesting and number size, read, idle
and write timeouts, tasks page size); blocking work runs on worker threads that connections
share in turn. NaN or infinite rewards are refused by the server and by the client, naming
the env and the task. The client reconnects with exponential backoff; sessions of a lost
connection are lost (`EnvSessionLost`). `EnvServerProcess.restart()` and its supervisor
restart an embedded server that died, on the same address.

Image observations (screenshots)
--------------------------------
An env returns PNG/JPEG bytes in a result's `image_data`. The server validates them
(`images.py`: magic bytes, completeness, decoded size within `ImageLimits`, max bytes),
writes them to its node-local image store (`image_store.py`, /dev/shm by default) and replies
with `ImageRef`s (id, path, format, width, height, sha256) in `images`; the client reads each
back (the file on the same node, the `image` call elsewhere), validates it again and fills
`image_data`. A bad image raises `EnvImageError`, naming the env and the task: a task failure
to retry. Text observations are unchanged.
"""

from tide_megatron.utils.lazy_exports import lazy_exports

# Each name below is imported from its module on first use (`utils/lazy_exports.py`), not here:
# importing one submodule runs this file first, and the env configs (`envs.config`) must import
# without the server and the client; `python -m tide_megatron.envs.server` then also runs the
# server module once, not a second copy of one this file imported.
__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "client": ("EnvClient",),
    "config": ("DoorGameConfig", "EnvClientConfig", "EnvConfig", "EnvServerConfig", "EnvServerLimits",
               "EnvServerProcessConfig", "GuiDesktopConfig", "ImageLimits", "LatencyConfig", "OSWorldConfig",
               "TextWorldConfig"),
    "errors": ("EnvError", "EnvImageError", "EnvProtocolError", "EnvRemoteError", "EnvServerDown",
               "EnvSessionLost", "EnvTimeout"),
    "protocol": ("Env", "ImageRef", "ResetResult", "StepResult", "TaskSpec"),
    "registry": ("build_env", "register_env", "registered_envs"),
    "server": ("EnvServer",),
    "server_process": ("EnvServerProcess",),
})
