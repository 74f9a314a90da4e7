import json

import pytest

from tide_megatron.envs.config import EnvConfig, EnvServerConfig, LatencyConfig, config_from_dict, config_to_dict
from tide_megatron.envs.protocol import ResetResult, StepResult, TaskSpec
from tide_megatron.envs.wire import (
    Request, Response, WireError, decode_request, decode_response, encode_request, encode_response, leading_id,
)


def test_request_and_response_round_trip():
    req = Request(7, "step", {"session_id": "s1", "action": "blue\nand a newline, ünïcode"})
    line = encode_request(req)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and line.isascii()
    assert decode_request(line) == req
    ok = Response(7, True, result=StepResult("obs", 0.5, False, {"k": [1]}).to_json())
    assert decode_response(encode_response(ok)) == ok
    err = Response(8, False, error_type="UnknownSession", error_message="gone")
    assert decode_response(encode_response(err)) == err


@pytest.mark.parametrize("line", [
    b"not json\n", b"[1, 2]\n", b'{"id": "x", "ok": true, "result": {}}\n', b'{"id": 1, "ok": 1, "result": {}}\n',
    b'{"id": 1, "ok": true, "result": []}\n', b'{"id": 1, "ok": false, "error": "boom"}\n', b"\xff\xfe\n",
])
def test_malformed_responses_are_wire_errors(line):
    with pytest.raises(WireError):
        decode_response(line)


@pytest.mark.parametrize("line", [b'{"op": "ping"}\n', b'{"id": true, "op": "ping"}\n', b'{"id": 1, "op": 3}\n',
                                  b'{"id": 1, "op": "step", "args": []}\n'])
def test_malformed_requests_are_wire_errors(line):
    with pytest.raises(WireError):
        decode_request(line)


def test_nan_is_never_sent():
    with pytest.raises(ValueError):
        encode_response(Response(1, True, result={"reward": float("nan")}))


def test_protocol_dataclasses_round_trip_and_validate():
    t = TaskSpec("door_game", "train/1", "door_game/rooms2")
    assert TaskSpec.from_json(json.loads(json.dumps(t.to_json()))) == t
    r = ResetResult("hello", {"a": 1}, "door_game/rooms2", 0.25, "s3")
    assert ResetResult.from_json(r.to_json()) == r
    s = StepResult("o", 1, True, {})
    assert StepResult.from_json(s.to_json()) == StepResult("o", 1.0, True, {})
    for bad in [{"observation": 1, "reward": 0, "done": False, "info": {}, "latency_s": 0},
                {"observation": "o", "reward": "1", "done": False, "info": {}, "latency_s": 0},
                {"observation": "o", "reward": 0, "done": 0, "info": {}, "latency_s": 0},
                {"observation": "o", "reward": 0, "done": False, "info": None, "latency_s": 0}]:
        with pytest.raises(ValueError):
            StepResult.from_json(bad)


def test_server_config_round_trips_through_json():
    cfg = EnvServerConfig(port=1234, envs=[EnvConfig(), EnvConfig(served_name="slow", latency=LatencyConfig(enabled=True, seed=9))])
    back = config_from_dict(EnvServerConfig, json.loads(json.dumps(config_to_dict(cfg))))
    assert back == cfg and back.envs[1].key == "slow" and isinstance(back.envs[1].latency, LatencyConfig)
    with pytest.raises(ValueError, match="unknown"):
        config_from_dict(EnvServerConfig, {"prot": 1})


def test_every_config_field_has_a_docstring():
    import ast
    import inspect

    from tide_megatron.envs import config, env_config

    classes = [n for m in (config, env_config) for n in ast.parse(inspect.getsource(m)).body if isinstance(n, ast.ClassDef)]
    for cls in classes:
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), f"{cls.name}.{node.target.id}"


from hypothesis import given, settings
from hypothesis import strategies as st

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(req_id=st.integers(0, 2**53), op=st.text(), args=st.dictionaries(st.text(), _json, max_size=5))
def test_any_json_request_round_trips_on_one_ascii_line(req_id, op, args):
    line = encode_request(Request(req_id, op, args))
    assert line.isascii() and line.count(b"\n") == 1
    assert decode_request(line) == Request(req_id, op, args)


@pytest.mark.parametrize("line, detail", [
    (b'{"id": 5, "op": "ping", "args": {"x": ' + b"[" * 40 + b"]" * 40 + b"}}\n", "max_depth=32"),
    (b'{"id": 5, "op": "ping", "args": {"x": ' + b"[" * 3000 + b"]" * 3000 + b"}}\n", "max_depth=32"),
    (b'{"id": 5, "op": "ping", "args": {"x": ' + b"7" * 5000 + b"}}\n", "a number of 5000 characters"),
    (b'{"id": 5, "op": "ping", "args": {"x": NaN}}\n', "NaN is not a number JSON allows"),
    (b'{"id": 5, "op": "ping", "args": {"x": -Infinity}}\n', "Infinity is not a number JSON allows"),
    (b'{"id": 5, "op": "ping", "args": {"x": 1e999}}\n', "overflows to infinity"),
    (b'{"id": 5, "op": "ping", "args": {"x": }\n', "not JSON"),
])
def test_request_limits_are_refused_with_the_request_id(line, detail):
    with pytest.raises(WireError, match=detail) as e:
        decode_request(line)
    assert e.value.request_id == 5


def test_limits_are_configurable_and_ordinary_messages_pass():
    deep = b'{"id": 1, "op": "ping", "args": {"x": [[[[1]]]]}}\n'
    assert decode_request(deep).args == {"x": [[[[1]]]]}
    with pytest.raises(WireError, match="max_depth=4"):
        decode_request(deep, max_depth=4)
    with pytest.raises(WireError, match="max_number_digits=3"):
        decode_request(b'{"id": 1, "op": "ping", "args": {"x": 1234}}\n', max_number_digits=3)
    assert leading_id(b'{"id":42,"op":"step","args":{"action":"') == 42 and leading_id(b"[1]") is None


def test_a_reply_holding_nan_fails_its_call_only():
    line = b'{"id": 9, "ok": true, "result": {"observation": "o", "reward": NaN, "info": {"x": [1, Infinity]}}}\n'
    with pytest.raises(WireError, match=r"non-finite number \(NaN or infinity\) at result.reward") as e:
        decode_response(line)
    assert e.value.request_id == 9
    with pytest.raises(WireError, match=r"at result.info.x\[1\]"):
        decode_response(b'{"id": 9, "ok": true, "result": {"info": {"x": [1, -Infinity]}}}\n')
    with pytest.raises(ValueError, match="finite"):
        StepResult.from_json({"observation": "o", "reward": float("inf"), "done": False, "info": {}, "latency_s": 0})
