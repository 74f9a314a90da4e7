"""Start the env server as a subprocess and stop it cleanly (the embedded default).

    with EnvServerProcess(EnvServerConfig(envs=[EnvConfig(name="door_game")])) as server:
        client = EnvClient(server.client_config())
        ...

The subprocess binds (port 0 by default: the OS picks a free port), prints its address on a
ready line, and must then answer a ping before `start()` returns. `stop()` sends SIGTERM (the
server closes every session) and kills the process if it is not gone within the grace time.
It is a synchronous context manager so a launcher can use it before any event loop exists.
The shared token, if any, reaches the subprocess through its environment, not its command line.

Restarting a server that died (a crash, the OOM killer, a stray signal):
- `restart()` stops what is left and starts a new server on the same host and port, so
  clients reconnect to the address they know (`EnvClient` does, with backoff);
- `ensure_running()` restarts it when it has exited, and says whether it did;
- with `supervise_interval_s > 0` (the default), a daemon thread started by `start()` calls
  `ensure_running()` at that interval, at most `max_restarts` times; past that it stops
  trying and `failure` says why.
A restart loses the dead server's state: every open env session (clients get
`EnvSessionLost` on their next step and re-run those tasks), its stored images, its cached
task lists and its `stats` counters. Env task definitions are pure functions of config and
task id, so the new server offers the same tasks.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import logging
import subprocess
import sys
import threading
import time
from dataclasses import replace

from tide_megatron.envs.config import (
    TOKEN_ENV_VAR, EnvClientConfig, EnvServerConfig, EnvServerProcessConfig, config_to_dict,
)
from tide_megatron.envs.server import READY_PREFIX
from tide_megatron.envs.wire import Request, decode_response, encode_request

logger = logging.getLogger(__name__)


class EnvServerProcess:
    def __init__(self, server_cfg: EnvServerConfig, process_cfg: EnvServerProcessConfig | None = None):
        self.server_cfg = server_cfg
        self.process_cfg = process_cfg or EnvServerProcessConfig()
        self.host = server_cfg.host
        self.port = server_cfg.port
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._lock = threading.RLock()  # start, stop and restart come from the launcher and the supervisor
        self._supervisor: threading.Thread | None = None
        self._stop_supervision = threading.Event()
        self._started = False
        self.restarts = 0
        """Times the server was restarted since `start()`."""
        self.failure = ""
        """Why supervision gave up (empty while it has not)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def client_config(self, base: EnvClientConfig | None = None) -> EnvClientConfig:
        """`base` (or the defaults) pointed at this server, with its token."""
        base = base or EnvClientConfig()
        return replace(base, host=self.host, port=self.port, auth_token=base.auth_token or self.server_cfg.auth_token)

    def start(self) -> EnvServerProcess:
        with self._lock:
            self._launch()
            self._started = True
        if self.process_cfg.supervise_interval_s > 0 and self._supervisor is None:
            self._stop_supervision.clear()
            self._supervisor = threading.Thread(target=self._supervise, name="env-server-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def alive(self) -> bool:
        """The server process runs (it may still be starting)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    def restart(self) -> EnvServerProcess:
        """Stop what is left of the server and start a new one on the same host and port.
        Open sessions, stored images, cached task lists and counters are lost."""
        with self._lock:
            code = self._terminate()
            self.restarts += 1
            logger.warning("restarting the env server on %s (the last one exited with %s)", self.address, code)
            self._launch(port=self.port)
        return self

    def ensure_running(self) -> bool:
        """Restart the server if it has exited; True when it did. RuntimeError once it has been
        restarted `max_restarts` times already (a server that keeps dying needs a person)."""
        with self._lock:
            if not self._started or self.alive():
                return False
            if self.restarts >= self.process_cfg.max_restarts:
                code = self._proc.returncode if self._proc is not None else "?"
                raise RuntimeError(f"env server on {self.address} exited again (code {code}) after "
                                   f"{self.restarts} restarts (max_restarts={self.process_cfg.max_restarts})")
            self.restart()
            return True

    def _supervise(self) -> None:
        while not self._stop_supervision.wait(self.process_cfg.supervise_interval_s):
            try:
                self.ensure_running()
            except Exception as e:  # give up, and say why: the job's next env call fails with EnvServerDown
                self.failure = str(e)
                logger.error("env server supervision gave up: %s", e)
                return

    def _launch(self, port: int | None = None) -> None:
        if self._proc is not None:
            raise RuntimeError("env server process already started")
        # The token travels in the environment, never on the command line (where `ps` shows it).
        env = os.environ.copy()
        data = config_to_dict(self.server_cfg)
        if port is not None:
            data["port"] = port
        if data["auth_token"]:
            env[TOKEN_ENV_VAR] = data["auth_token"]
            data["auth_token"] = ""
        cmd = [sys.executable, "-m", "tide_megatron.envs.server", "--config-json", json.dumps(data), "--exit-with-parent"]
        stderr = None
        if self.process_cfg.log_path:
            self._log = open(self.process_cfg.log_path, "ab")
            stderr = self._log
        # New session: a Ctrl-C aimed at the launcher's process group is handled by stop(),
        # in order, instead of hitting the server mid-reply.
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self._terminate()
            raise

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + self.process_cfg.ready_timeout_s
        buf = b""
        # A selector, not select(): rank 0 of a large job holds over 1,024 descriptors (gloo's
        # sockets to every rank, per process group), and select() refuses any numbered above that.
        with selectors.DefaultSelector() as selector:
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"env server (pid {self._proc.pid}) not ready within "
                                       f"{self.process_cfg.ready_timeout_s:g} s")
                if selector.select(min(left, 0.5)):
                    chunk = os.read(self._proc.stdout.fileno(), 4096)
                    if not chunk:
                        code = self._proc.wait()
                        where = f"; see {self.process_cfg.log_path}" if self.process_cfg.log_path else ""
                        raise RuntimeError(f"env server exited with code {code} before it was ready{where}")
                    buf += chunk
        line = buf.split(b"\n", 1)[0].decode(errors="replace")
        if not line.startswith(READY_PREFIX):
            raise RuntimeError(f"env server printed {line!r} instead of its ready line")
        addr = json.loads(line[len(READY_PREFIX) :])
        self.host, self.port = addr["host"], int(addr["port"])
        self._ping(deadline)

    def _ping(self, deadline: float) -> None:
        """One ping (a hello when there is a token) over a plain socket: proves the server
        answers, not just that it bound."""
        left = max(0.1, deadline - time.monotonic())
        token = self.server_cfg.auth_token or os.environ.get(TOKEN_ENV_VAR, "")
        req = Request(0, "hello", {"token": token}) if token else Request(0, "ping", {})
        with socket.create_connection((self.host, self.port), timeout=left) as sock:
            sock.sendall(encode_request(req))
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    raise RuntimeError(f"env server {self.address} closed the connection on ping")
                data += chunk
        resp = decode_response(data)
        if not resp.ok:
            raise RuntimeError(f"env server {self.address} refused ping: {resp.error_message}")

    def stop(self) -> int | None:
        """Stop supervising and stop the server; returns its exit code (None if it was never started)."""
        self._stop_supervision.set()
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=self.process_cfg.ready_timeout_s + self.process_cfg.stop_timeout_s)
        with self._lock:
            self._started = False
            return self._terminate()

    def _terminate(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.process_cfg.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode

    def __enter__(self) -> EnvServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:
        # Last resort for a caller that forgot stop(): never leave an orphan server behind.
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            self._proc.kill()
