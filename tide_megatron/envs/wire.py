"""Wire format of the env server: newline-delimited JSON over TCP. Never pickle.

One request or response per line, UTF-8 JSON objects. A connection carries many calls at
once; responses may come back in any order and are matched by `id`.

    request:  {"id": 7, "op": "step", "args": {"session_id": "s12", "action": "blue"}}
    response: {"id": 7, "ok": true, "result": {"observation": "...", "reward": 0.5, ...}}
    error:    {"id": 7, "ok": false, "error": {"type": "UnknownSession", "message": "..."}}

Ops and their args (results are the `to_json` of the protocol dataclasses):

    ping   {}                                          -> {"server": "tide-env", "version": 1}
    envs   {}                                          -> {"envs": [name, ...]}
    tasks  {"env", "split", "offset", "limit"}         -> {"tasks": [TaskSpec...], "total": n}
    reset  {"env", "task_id", "trajectory_id"}         -> ResetResult (with session_id)
    step   {"session_id", "action"}                    -> StepResult
    close  {"session_id"}                              -> {}
    stats  {}                                          -> {"sessions": n, "max_sessions": m, ...}
    image  {"session_id", "image_id"}                  -> ImageRef fields + {"data_b64": ...}

Image observations travel by reference (`protocol.ImageRef`): a client on the server's node
reads the file; `image` is for clients elsewhere and answers only the session's owner.

A remote benchmark server (WebShop, ALFWorld, OSWorld) that speaks this format plugs in
without any code on the trainer side; see the `tide_megatron.envs` docstring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
SERVER_NAME = "tide-env"

OPS = ("ping", "envs", "tasks", "reset", "step", "close", "stats", "image")

# Error types a server reports; the client raises EnvRemoteError carrying one of these.
ERROR_TYPES = (
    "BadRequest", "UnknownOp", "UnknownEnv", "UnknownTask", "UnknownSession", "EpisodeDone",
    "ServerBusy", "EnvFailure", "BadImage",
)


@dataclass
class Request:
    id: int
    op: str
    args: dict[str, Any]


@dataclass
class Response:
    id: int
    ok: bool
    result: dict[str, Any] | None = None
    error_type: str = ""
    error_message: str = ""


class WireError(ValueError):
    """A line that is not a well-formed message of this protocol."""


def encode_request(req: Request) -> bytes:
    return _line({"id": req.id, "op": req.op, "args": req.args})


def encode_response(resp: Response) -> bytes:
    if resp.ok:
        return _line({"id": resp.id, "ok": True, "result": resp.result or {}})
    return _line({"id": resp.id, "ok": False, "error": {"type": resp.error_type, "message": resp.error_message}})


def decode_request(line: bytes) -> Request:
    obj = _load(line)
    req_id, op, args = obj.get("id"), obj.get("op"), obj.get("args", {})
    if not _is_int(req_id):
        raise WireError(f"request id must be an integer, got {req_id!r}")
    if not isinstance(op, str):
        raise WireError(f"request op must be a string, got {op!r}")
    if not isinstance(args, dict):
        raise WireError(f"request args must be an object, got {type(args).__name__}")
    return Request(id=req_id, op=op, args=args)


def decode_response(line: bytes) -> Response:
    obj = _load(line)
    resp_id, ok = obj.get("id"), obj.get("ok")
    if not _is_int(resp_id):
        raise WireError(f"response id must be an integer, got {resp_id!r}")
    if not isinstance(ok, bool):
        raise WireError(f"response ok must be a bool, got {ok!r}")
    if ok:
        result = obj.get("result")
        if not isinstance(result, dict):
            raise WireError(f"response result must be an object, got {type(result).__name__}")
        return Response(id=resp_id, ok=True, result=result)
    err = obj.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("type"), str) or not isinstance(err.get("message"), str):
        raise WireError(f"error response must carry error.type and error.message strings, got {err!r}")
    return Response(id=resp_id, ok=False, error_type=err["type"], error_message=err["message"])


def _line(obj: dict[str, Any]) -> bytes:
    # ensure_ascii keeps every line pure ASCII, so a newline can never hide inside a
    # multi-byte sequence and framing on b"\n" is always exact. allow_nan=False: NaN is not JSON.
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii") + b"\n"


def _load(line: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"not JSON ({e}): {line[:80]!r}") from None
    if not isinstance(obj, dict):
        raise WireError(f"message must be a JSON object, got {type(obj).__name__}")
    return obj


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
