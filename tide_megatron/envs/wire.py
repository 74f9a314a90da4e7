"""Wire format of the env server: newline-delimited JSON over TCP. Never pickle.

One request or response per line, ASCII JSON objects. A connection carries many calls at
once; responses may come back in any order and are matched by `id`.

    request:  {"id": 7, "op": "step", "args": {"session_id": "s-Xq3...", "action": "blue"}}
    response: {"id": 7, "ok": true, "result": {"observation": "...", "reward": 0.5, ...}}
    error:    {"id": 7, "ok": false, "error": {"type": "UnknownSession", "message": "..."}}

Ops and their args (results are the `to_json` of the protocol dataclasses):

    hello  {"token", "version"}                -> {"server": "tide-env", "version": 2}
    ping   {}                                  -> {"server": "tide-env", "version": 2}
    envs   {}                                  -> {"envs": [name, ...]}
    tasks  {"env", "split", "offset", "limit"} -> {"tasks": [TaskSpec...], "total": n, "next_offset": k | null}
    reset  {"env", "task_id", "trajectory_id"} -> ResetResult (with session_id)
    step   {"session_id", "action"}            -> StepResult
    close  {"session_id"}                      -> {}
    stats  {}                                  -> {"sessions": n, "max_sessions": m, ...}
    image  {"session_id", "image_id"}          -> ImageRef fields + {"data_b64": ...}
    detach {"session_id"}                      -> {"claim": ...}
    attach {"claim"}                           -> {"session_id", "env", "task_id", "trajectory_id",
                                                   "turns", "done", "last", "last_turn"}

`hello` must be the first call on a connection to a server that has a shared token. `tasks`
answers one page (bounded in count and bytes); `next_offset` is where the next page starts.
Sessions belong to the connection that opened them: `step`, `close` and `image` on another
connection's session fail as `UnknownSession`. The owner may hand a session over: `detach`
leaves it to no connection (it survives its old connection) and returns a single-use claim;
`attach` with that claim, on any connection, makes that connection the owner and answers the
session's step count (`turns`), whether it is `done`, and `last`: the result of its latest
successful reset or step exactly as it was returned (the reset when `last_turn` is 0).
Image observations travel by reference (`protocol.ImageRef`): a client on the server's node
reads the file, `image` is for clients elsewhere.

Parsing limits (both ends): nesting deeper than `max_depth`, a number written with more than
`max_number_digits` characters, and NaN or infinity are refused. A request that breaks them
is answered with an error reply (carrying its id when the id could be read) and the
connection goes on; a reply that carries NaN fails only its own call on the client.

A remote benchmark server (WebShop, ALFWorld, OSWorld) that speaks this format plugs in
without any code on the trainer side; see the `tide_megatron.envs` docstring.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 2
SERVER_NAME = "tide-env"

OPS = ("hello", "ping", "envs", "tasks", "reset", "step", "close", "stats", "image", "detach", "attach")

# Error types a server reports; the client raises EnvRemoteError carrying one of these.
ERROR_TYPES = (
    "BadRequest", "UnknownOp", "UnknownEnv", "UnknownTask", "UnknownSession", "EpisodeDone",
    "ServerBusy", "EnvFailure", "BadImage", "Unauthorized", "TooLarge",
)

DEFAULT_MAX_DEPTH = 32
"""Our messages nest 3-6 deep (request, args, info with a list of dicts); 32 leaves a margin."""
DEFAULT_MAX_NUMBER_DIGITS = 32
"""A 64-bit integer has at most 20 characters, a double's shortest repr at most 24."""

_LEADING_ID = re.compile(rb'\s*\{\s*"id"\s*:\s*(\d{1,15})\s*[,}]')


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
    """A line that is not a well-formed message of this protocol. `request_id` is the id of
    the message when it could be read, so the error can be matched to its call."""

    def __init__(self, message: str, request_id: int | None = None):
        super().__init__(message)
        self.request_id = request_id


def leading_id(line: bytes) -> int | None:
    """The id of a message that starts `{"id": N, ...` (how our encoders write it), else None;
    lets an error about an unparseable or oversized line still name its call."""
    m = _LEADING_ID.match(line[:64])
    return int(m.group(1)) if m else None


def encode_request(req: Request) -> bytes:
    return _line({"id": req.id, "op": req.op, "args": req.args})


def encode_response(resp: Response) -> bytes:
    """Raises ValueError when the result holds NaN or infinity (not JSON)."""
    if resp.ok:
        return _line({"id": resp.id, "ok": True, "result": resp.result or {}})
    return _line({"id": resp.id, "ok": False, "error": {"type": resp.error_type, "message": resp.error_message}})


def decode_request(line: bytes, max_depth: int = DEFAULT_MAX_DEPTH,
                   max_number_digits: int = DEFAULT_MAX_NUMBER_DIGITS) -> Request:
    obj = _load(line, max_depth, max_number_digits, allow_non_finite=False)
    req_id, op, args = obj.get("id"), obj.get("op"), obj.get("args", {})
    if not _is_int(req_id):
        raise WireError(f"request id must be an integer, got {req_id!r}")
    if not isinstance(op, str):
        raise WireError(f"request op must be a string, got {op!r}", req_id)
    if not isinstance(args, dict):
        raise WireError(f"request args must be an object, got {type(args).__name__}", req_id)
    return Request(id=req_id, op=op, args=args)


def decode_response(line: bytes, max_depth: int = DEFAULT_MAX_DEPTH,
                    max_number_digits: int = DEFAULT_MAX_NUMBER_DIGITS) -> Response:
    obj = _load(line, max_depth, max_number_digits, allow_non_finite=True)
    resp_id, ok = obj.get("id"), obj.get("ok")
    if not _is_int(resp_id):
        raise WireError(f"response id must be an integer, got {resp_id!r}")
    if not isinstance(ok, bool):
        raise WireError(f"response ok must be a bool, got {ok!r}", resp_id)
    if ok:
        result = obj.get("result")
        if not isinstance(result, dict):
            raise WireError(f"response result must be an object, got {type(result).__name__}", resp_id)
        where = non_finite_path(result, "result")
        if where is not None:
            raise WireError(f"non-finite number (NaN or infinity) at {where}", resp_id)
        return Response(id=resp_id, ok=True, result=result)
    err = obj.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("type"), str) or not isinstance(err.get("message"), str):
        raise WireError(f"error response must carry error.type and error.message strings, got {err!r}", resp_id)
    return Response(id=resp_id, ok=False, error_type=err["type"], error_message=err["message"])


def non_finite_path(value: Any, path: str = "") -> str | None:
    """Path of the first NaN or infinity inside `value` (`result.info.x[2]`), else None."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return p
        if isinstance(v, dict):
            stack.extend((item, f"{p}.{k}") for k, item in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]") for i, item in reversed(list(enumerate(v))))
    return None


def _line(obj: dict[str, Any]) -> bytes:
    # ensure_ascii keeps every line pure ASCII, so a newline can never hide inside a
    # multi-byte sequence and framing on b"\n" is always exact. allow_nan=False: NaN is not JSON.
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii") + b"\n"


class _LimitExceeded(ValueError):
    pass


def _load(line: bytes, max_depth: int, max_number_digits: int, allow_non_finite: bool) -> dict[str, Any]:
    def number(text: str, convert):
        if len(text) > max_number_digits:
            raise _LimitExceeded(f"a number of {len(text)} characters (max_number_digits={max_number_digits})")
        return convert(text)

    def constant(name: str):
        if not allow_non_finite:
            raise _LimitExceeded(f"{name} is not a number JSON allows")
        return float(name.replace("Infinity", "inf"))

    def to_float(text: str) -> float:
        value = float(text)
        if not allow_non_finite and not math.isfinite(value):
            raise _LimitExceeded(f"the number {text} overflows to infinity")
        return value

    try:
        obj = json.loads(line, parse_int=lambda t: number(t, int), parse_float=lambda t: number(t, to_float),
                         parse_constant=constant)
    except _LimitExceeded as e:
        raise WireError(f"refused: {e}", leading_id(line)) from None
    except RecursionError:
        raise WireError(f"refused: nested deeper than max_depth={max_depth}", leading_id(line)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"not JSON ({e}): {line[:80]!r}", leading_id(line)) from None
    if not isinstance(obj, dict):
        raise WireError(f"message must be a JSON object, got {type(obj).__name__}")
    if _depth(obj) > max_depth:
        raise WireError(f"refused: nested deeper than max_depth={max_depth}", obj.get("id") if _is_int(obj.get("id")) else None)
    return obj


def _depth(value: Any) -> int:
    """Nesting depth of containers (an empty object is 1), computed without recursion."""
    best, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            best = max(best, d)
            stack.extend((item, d + 1) for item in v.values())
        elif isinstance(v, list):
            best = max(best, d)
            stack.extend((item, d + 1) for item in v)
    return best


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
