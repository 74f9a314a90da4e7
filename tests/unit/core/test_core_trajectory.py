"""The trajectory record's JSON form (every field but the simulator's payload, copies of its
lists and dicts, not the record's own) and its packed wire form: both round trip losslessly
through JSON, and the packed one falls back to lists for values its types cannot hold."""

from __future__ import annotations

import json
from dataclasses import asdict

from hypothesis import given
from hypothesis import strategies as st

import pytest

from tide_megatron.comm.messages import TrainMicroBatch, decode
from tide_megatron.core.trajectory import Segment, Trajectory


@st.composite
def trajectories(draw) -> Trajectory:
    prompt = draw(st.integers(0, 20))
    generated = draw(st.integers(0, 20))
    n = prompt + generated
    version = draw(st.integers(0, 5))
    return Trajectory(
        group_id=draw(st.text(min_size=1, max_size=8)), index=draw(st.integers(0, 7)), task_id="train/3",
        policy_version=version, prompt_tokens=prompt, generated_tokens=generated,
        reward=draw(st.floats(-1, 1)), advantage=draw(st.none() | st.floats(-2, 2)), payload={"sim": 1},
        token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        loss_mask=[0] * prompt + [1] * generated,
        logprobs=[0.0] * prompt + draw(st.lists(st.floats(-1e4, 0.0), min_size=generated, max_size=generated)),
        segments=[Segment(prompt, n, version)] if generated else [],
        task={"task_id": "train/3", "env": "door_game"}, turns=draw(st.integers(0, 9)),
        images=draw(st.lists(st.text(max_size=4), max_size=2)),
        image_grid_thw=draw(st.lists(st.lists(st.integers(1, 8), min_size=3, max_size=3), max_size=2)),
        info={"stop": draw(st.sampled_from(["env", "turns"]))})


@given(trajectories())
def test_the_wire_form_is_every_field_but_the_payload_and_round_trips(t):
    data = t.to_json()
    expected = asdict(t)
    expected.pop("payload")
    expected["segments"] = [[s.start, s.end, s.version] for s in t.segments]
    assert data == expected
    back = Trajectory.from_json(json.loads(json.dumps(data)))
    assert back == Trajectory(**{**asdict(t), "payload": None, "segments": t.segments})


@given(trajectories())
def test_changing_the_wire_form_leaves_the_record_alone(t):
    before = asdict(t)
    data = t.to_json()
    data["token_ids"].append(1)
    data["task"]["env"] = "other"
    data["info"]["stop"] = "x"
    for grid in data["image_grid_thw"]:
        grid.append(0)
    assert asdict(t) == before


@given(trajectories())
def test_the_packed_wire_form_round_trips_exactly(t):
    data = t.to_wire()
    assert all(isinstance(data[k], str) for k in ("token_ids", "loss_mask", "logprobs"))
    back = Trajectory.from_json(json.loads(json.dumps(data, allow_nan=False)))
    assert back == Trajectory.from_json(t.to_json())
    assert [x.hex() for x in back.logprobs] == [float(x).hex() for x in t.logprobs]  # bit for bit


@given(trajectories())
def test_a_micro_batch_message_carries_its_trajectories_packed(t):
    wire = {"kind": TrainMicroBatch.KIND, "src": 3, **TrainMicroBatch([t, t]).to_wire()}
    msg = decode(json.loads(json.dumps(wire, allow_nan=False)))
    assert isinstance(msg, TrainMicroBatch) and msg.src == 3
    assert msg.trajectories == [Trajectory.from_json(t.to_json())] * 2


def test_values_the_packed_types_cannot_hold_travel_as_lists():
    t = Trajectory.from_tokens([5, 2**40, 7], [0.0, 1.0, 1.0], [0.0, -0.25, float("nan")])
    data = t.to_wire()
    assert data["token_ids"] == [5, 2**40, 7] and isinstance(data["loss_mask"], str)  # int32 overflow: a list
    assert data["logprobs"][:2] == [0.0, -0.25]  # NaN: the list, which strict JSON refuses as before
    with pytest.raises(ValueError):
        json.dumps(data, allow_nan=False)
    half = Trajectory.from_tokens([1, 2], [0, 1], [0.0, -1.0], info={})
    half.loss_mask = [0, 0.5]
    assert half.to_wire()["loss_mask"] == [0, 0.5]  # not a byte: kept as it is
