from sglang_patches.task_tag import ADMIT, RESUME, TaskTag, parse_rid


def test_tag_round_trips_through_rid_with_any_characters():
    tag = TaskTag(ADMIT, "g:1/3 %x", "g:1", True, 1012.25, 345, 64)
    rid = tag.to_rid()
    assert parse_rid(rid) == tag
    assert tag.to_rid() != rid  # every request gets its own rid


def test_untagged_and_malformed_rids_are_vanilla():
    assert parse_rid(None) is None
    assert parse_rid("0123abcd") is None
    assert parse_rid("tide-ctb:bogus:a:b:0:1.0:1:1:x") is None
    assert parse_rid("tide-ctb:resume:a:b:0:notanumber:1:1:x") is None
    assert parse_rid(TaskTag(RESUME, "a", "b", False, 0.5, 1, 1).to_rid()).kind == RESUME
