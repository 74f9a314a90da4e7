"""The trajectory record's wire form: every field but the simulator's payload, copies of its
lists and dicts (not the record's own), and a lossless round trip through JSON."""

from __future__ import annotations

import json
from dataclasses import asdict

from hypothesis import given
from hypothesis import strategies as st

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
        token_ids=draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)),
        loss_mask=[0] * prompt + [1] * generated, logprobs=[0.0] * prompt + [-0.5] * generated,
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
