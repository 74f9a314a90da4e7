"""The `tide_ctb` contract of a rollout engine, as checks that run against any engine that serves it:
the SGLang engine with the plugin (`test_ctb_engine.py`) and the emulated engine
(`test_ctb_emulated_engine.py`). Each check takes `stack` = (engine, chat format, env client
connected to an env server that serves `door_game`)."""

from __future__ import annotations

import asyncio
import contextlib
import os


@contextlib.contextmanager
def door_game_stack(root, make_engine):
    """(engine, chat format, env client) for the checks: a tiny checkpoint under `root`, an env
    server serving `door_game`, and `make_engine(checkpoint)`'s engine, shut down at the end."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tide_megatron.envs.client import EnvClient
    from tide_megatron.envs.config import EnvConfig, EnvServerConfig
    from tide_megatron.envs.server_process import EnvServerProcess
    from tide_megatron.models.config import ModelConfig
    from tide_megatron.models.hf_checkpoint import write_random_hf_checkpoint
    from tide_megatron.rollout.worker import build_chat
    from tide_megatron.tokenizer import write_tokenizer

    tok = write_tokenizer(str(root / "tok"), kind="tiny_bpe")
    ckpt = write_random_hf_checkpoint(str(root / "hf"), ModelConfig(vocab_size=3072), seed=0, tokenizer_dir=tok)
    with EnvServerProcess(EnvServerConfig(envs=[EnvConfig(name="door_game")])) as server:
        engine = make_engine(ckpt)
        try:
            yield engine, build_chat(ckpt, None), EnvClient(server.client_config())
        finally:
            engine.shutdown()


def _run(engine, coro):
    return engine.loop.run_until_complete(coro)


def check_tagged_requests_are_reported(stack):
    """A tagged request comes back with the plugin's report; an untagged one without. Returns
    the report (the SGLang test also checks which process wrote it)."""
    from sglang_patches.task_tag import ADMIT, TaskTag
    from tide_megatron.rollout.ctb_task_runner import generate_tagged

    engine, _chat, _env = stack
    tag = TaskTag(ADMIT, "probe/0", "probe", False, 3.0, 64, 32)
    gen, report = _run(engine, generate_tagged(engine, list(range(20, 60)), {"max_new_tokens": 4, "temperature": 0},
                                               tag, None))
    assert report is not None, "no tide_ctb report: the plugin is not active in the engine's scheduler"
    assert report["plugin"] == "tide_ctb" and report["task_id"] == "probe/0" and report["kind"] == ADMIT
    assert report["hooks_called"]["intake"] >= 1 and report["hooks_called"]["add_one_req"] >= 1
    assert report["context_tokens"] == 40 + len(gen.output_ids)
    assert report["kv_total"] >= 2048 and 0 <= report["kv_available"] <= report["kv_total"]
    # An untagged request is left alone: no report.
    _gen, none = _run(engine, generate_tagged(engine, list(range(20, 60)), {"max_new_tokens": 4}, None, None))
    assert none is None
    return report


def check_the_engine_reports_the_pool_and_rows_it_allocated(stack):
    """What CTB sizes its budget from (`RolloutEngine.kv_tokens` / `request_rows`, sent in
    `RankReady`) is what the scheduler holds: the plugin's allocator counts agree."""
    from sglang_patches.task_tag import ADMIT, TaskTag
    from tide_megatron.rollout.ctb_task_runner import generate_tagged

    engine, _chat, _env = stack
    tag = TaskTag(ADMIT, "size/0", "probe", False, 3.0, 64, 32)
    _gen, report = _run(engine, generate_tagged(engine, list(range(20, 40)), {"max_new_tokens": 2, "temperature": 0},
                                                tag, None))
    assert engine.kv_tokens >= 2048 and engine.kv_tokens == report["kv_total"]
    assert engine.request_rows == 32 == report["rows_total"]


def check_decode_iterations_are_timed_in_the_scheduler(stack):
    """Every finished tagged request reports the engine's cumulative decode counters; one
    request alone decodes in batches of one, so the floor is measured too."""
    from sglang_patches.scheduler_hooks import DECODE_COUNTERS
    from sglang_patches.task_tag import ADMIT, TaskTag
    from tide_megatron.rollout.ctb_task_runner import generate_tagged

    engine, _chat, _env = stack
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    reports = []
    for i in range(2):
        tag = TaskTag(ADMIT, f"decode/{i}", "decode", False, 1.0, 64, 32)
        gen, report = _run(engine, generate_tagged(engine, list(range(30, 70)), sampling, tag, None))
        assert len(gen.output_ids) == 8
        reports.append(report)
    first, second = reports
    assert all(k in first for k in DECODE_COUNTERS)
    # The report is written while the last decode's result is processed, before that iteration
    # is booked: at least 6 of the 7 decode iterations of the request are in.
    assert first["decode_iterations"] >= 6 and first["decode_seqs"] >= first["decode_iterations"]
    assert 0 < first["decode_s"] / first["decode_iterations"] < 10.0
    assert first["decode_floor_iterations"] >= 6 and first["decode_floor_s"] > 0
    assert second["decode_iterations"] >= first["decode_iterations"] + 7  # cumulative
    assert second["decode_floor_s"] > first["decode_floor_s"]
    assert second["decode_seq_s"] >= second["decode_floor_s"]
    # busy time: the decode iterations and the request's prefill (booked before the decode)
    assert first["batch_s"] > first["decode_s"] and second["batch_s"] > second["decode_s"]

    async def together():
        tags = [TaskTag(ADMIT, f"decode/b{i}", "decode", False, 1.0, 64, 32) for i in range(4)]
        return await asyncio.gather(*(generate_tagged(engine, list(range(30 + i, 70 + i)), sampling, t, None)
                                      for i, t in enumerate(tags)))

    last = max((r for _gen, r in _run(engine, together())), key=lambda r: r["decode_iterations"])
    iterations = last["decode_iterations"] - second["decode_iterations"]
    assert iterations > 0 and (last["decode_seqs"] - second["decode_seqs"]) / iterations > 1  # batched decode


class _PausingListener:
    """Tags turns like the dispatcher; pauses the task after `pause_after` turns and resumes it later."""

    def __init__(self, handle, engines, pause_after=None):
        self.handle, self.engines, self.pause_after = handle, engines, pause_after
        self.kinds, self.reports = [], []

    def turn_started(self, task_id, context_tokens, kind):
        from sglang_patches.task_tag import TaskTag

        self.kinds.append(kind)
        return TaskTag(kind, task_id, task_id.split("/")[0], False, 1.0, context_tokens, 32)

    def turn_finished(self, task_id, context_tokens, report):
        self.reports.append(report)
        if self.pause_after is not None and len(self.kinds) == self.pause_after:
            rank = self.handle.rank
            self.handle.pause(self.engines)
            asyncio.get_running_loop().call_later(0.3, self.handle.place, rank)


def _one_task(stack, pause_after):
    from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner, TaskHandle
    from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunnerConfig

    engine, chat, env = stack
    engines = {0: engine}
    runner = CTBTaskRunner(TaskRunnerConfig(max_turns=4, max_context_tokens=512, max_new_tokens=8, temperature=0.0),
                           engines, chat, env)

    async def go():
        await env.connect()
        (spec,) = await env.list_tasks("door_game", "train", offset=3, limit=1)
        handle = TaskHandle("t/0")
        listener = _PausingListener(handle, engines, pause_after)
        handle.place(0)
        traj = await runner.run(TaskAssignment(task=spec.to_json(), group_id="t", index=0), handle, listener)
        await env.close()
        await engine.flush_cache()
        return traj, listener

    return _run(engine, go())


def check_a_paused_task_resumes_and_matches_an_unpaused_run(stack):
    plain, plain_listener = _one_task(stack, pause_after=None)
    assert plain.turns >= 2, "the task must have a turn after the pause point"
    paused, listener = _one_task(stack, pause_after=1)
    assert paused.info["ctb_pauses"] == 1
    assert listener.kinds[:2] == ["admit", "resume"]  # the turn after the pause re-sent the whole context
    assert all(r is not None for r in listener.reports)
    assert paused.token_ids == plain.token_ids
    assert paused.loss_mask == plain.loss_mask
    assert paused.reward == plain.reward
    assert max(abs(a - b) for a, b in zip(paused.logprobs, plain.logprobs)) < 1e-4
    # Pausing closed the session: the resumed turn saw the whole context again.
    assert paused.prompt_tokens == plain.prompt_tokens


def check_a_dispatcher_rollout_respects_the_kv_budget(stack):
    from tide_megatron.core.ctb import CTBConfig, TaskState
    from tide_megatron.rollout.ctb_config import CTBDispatchConfig
    from tide_megatron.rollout.ctb_rollout import LocalCTBRollout
    from tide_megatron.rollout.ctb_task_runner import CTBTaskRunner
    from tide_megatron.rollout.task_runner import TaskAssignment, TaskRunnerConfig

    engine, chat, env = stack
    engines = {0: engine}
    runner = CTBTaskRunner(TaskRunnerConfig(max_turns=3, max_context_tokens=512, max_new_tokens=8), engines, chat, env)
    rollout = LocalCTBRollout(CTBDispatchConfig(max_resident_tasks_per_rank=8, kv_budget_fraction=0.5,
                                                policy=CTBConfig(probe_turn_reserve_tokens=48, staleness_throttle=False)),
                              runner)
    d = rollout.dispatcher
    hard_water = d.policy.config.hard_water
    peak = {"used": 0}
    original = d.schedule

    def checked_schedule(now, unconsumed=0):
        out = original(now, unconsumed)
        used, budget = d.policy.rank_usage(0)
        # Above the budget only tasks protected from pausing (last turn, out of pauses) remain,
        # and never beyond hard water.
        assert used <= budget * hard_water or len(d.policy.residents(0)) == 1
        peak["used"] = max(peak["used"], used)
        return out

    d.schedule = checked_schedule

    async def go():
        await env.connect()
        specs = await env.list_tasks("door_game", "train", limit=3)
        assignments = [TaskAssignment(task=s.to_json(), group_id=f"g{i}", index=j, is_eval=(i == 2))
                       for i, s in enumerate(specs) for j in range(4)]
        trajs = await rollout.run(assignments, prompt_tokens=100)
        await env.close()
        await engine.flush_cache()
        return trajs

    trajs = _run(engine, go())
    assert len(trajs) == 12 and not d.policy.audit()
    assert len(d.policy.tasks_in(TaskState.FINISHED)) == 12
    assert 0 < peak["used"] <= 1024 * hard_water
    assert d.rank_kv[0]["plugin"] == "tide_ctb"
    assert sum(t.cached_tokens for t in trajs) > 0


def check_closing_a_ctb_session_leaves_its_whole_context_cached(stack):
    """Pause = close the session. SGLang alone frees every turn but the first prompt on close;
    the plugin inserts the whole committed context into the radix tree first, so the resume
    (whole context, fresh session) hits all of it when the pool is not under pressure."""
    from sglang_patches.task_tag import ADMIT, RESUME, TURN, TaskTag
    from tide_megatron.rollout.ctb_task_runner import generate_tagged

    engine, _chat, _env = stack
    greedy = {"max_new_tokens": 8, "temperature": 0}

    def tag(kind):
        return TaskTag(kind, "keep/0", "keep", False, 1.0, 128, 32)

    async def go(tagged: bool):
        await engine.flush_cache()
        prompt, obs = list(range(300, 340)), list(range(400, 430))
        sid = await engine.open_session(4096)
        g1, _ = await generate_tagged(engine, prompt, greedy, tag(ADMIT) if tagged else None, {"id": sid})
        g2, _ = await generate_tagged(engine, obs, greedy, tag(TURN) if tagged else None, {"id": sid, "rid": g1.rid})
        context = prompt + g1.output_ids + obs + g2.output_ids
        await engine.close_session(sid)
        sid2 = await engine.open_session(4096)
        g3, report = await generate_tagged(engine, context + [7, 8, 9], greedy, tag(RESUME) if tagged else None,
                                           {"id": sid2})
        await engine.close_session(sid2)
        await engine.flush_cache()
        return len(context), g3.cached_tokens, report

    context, cached, report = _run(engine, go(tagged=True))
    # Everything but the last generated token (never forwarded, so it has no KV) is a hit.
    assert cached >= context - 1, (cached, context)
    assert report["released_sessions"] >= 1 and report["released_cached_tokens"] >= context - 1 - 40
    # Untagged sessions keep SGLang's own behaviour: only the first prompt survives the close.
    _context, cached_plain, _ = _run(engine, go(tagged=False))
    assert cached_plain < context - 20, (cached_plain, context)


def check_request_rows_are_held_as_ctb_assumes(stack):
    """The row rule CTB's resident cap rests on (`rollout/ctb_config.py`, `benchmarks/ctb_rows.py`):
    max_running_requests rows; an open streaming session holds one between turns and its turns
    borrow it; a turn is admitted only while some row is free; closing a session frees its row."""
    from sglang_patches.task_tag import ADMIT, TURN, TaskTag
    from tide_megatron.rollout.ctb_task_runner import generate_tagged

    engine, _chat, _env = stack
    rows = engine.cfg.max_running_requests
    greedy = {"max_new_tokens": 2, "temperature": 0}

    def tag(kind, tid):
        return TaskTag(kind, tid, tid.split("/")[0], False, 1.0, 32, 8)

    async def go():
        _g, report = await generate_tagged(engine, list(range(30, 50)), greedy, tag(ADMIT, "plain/0"), None)
        assert report["rows_total"] == rows and report["rows_free"] == rows  # a one-shot request gave its row back
        sessions = []
        for k in range(rows - 1):
            sid = await engine.open_session(1024)
            g, report = await generate_tagged(engine, [40 + k] * 12, greedy, tag(ADMIT, f"s{k}/0"), {"id": sid})
            sessions.append([sid, g.rid])
            assert report["rows_free"] == rows - 1 - k  # one row per open session

        async def next_turn(k):
            sid, rid = sessions[k]
            g, rep = await generate_tagged(engine, [7, 8], greedy, tag(TURN, f"s{k}/0"), {"id": sid, "rid": rid})
            sessions[k][1] = g.rid
            return rep["rows_free"]

        # rows - 1 sessions open: every next turn runs, borrowing its own row (one stays free).
        assert set(await asyncio.gather(*(next_turn(k) for k in range(rows - 1)))) == {1}
        last = await engine.open_session(1024)
        _g, report = await generate_tagged(engine, [99] * 12, greedy, tag(ADMIT, "last/0"), {"id": last})
        assert report["rows_free"] == 0
        stalled = asyncio.get_running_loop().create_task(next_turn(0))
        done, _ = await asyncio.wait([stalled], timeout=5.0)
        assert not done, "a session turn ran with no free row: SGLang's admission rule changed, re-measure"
        await engine.close_session(last)
        assert await asyncio.wait_for(stalled, 120) == 1  # ran once a row was free, on its own row
        for sid, _rid in sessions:
            await engine.close_session(sid)
        await engine.flush_cache()

    _run(engine, go())


CHECKS = [check_tagged_requests_are_reported, check_the_engine_reports_the_pool_and_rows_it_allocated,
          check_decode_iterations_are_timed_in_the_scheduler, check_a_paused_task_resumes_and_matches_an_unpaused_run,
          check_a_dispatcher_rollout_respects_the_kv_budget, check_closing_a_ctb_session_leaves_its_whole_context_cached,
          check_request_rows_are_held_as_ctb_assumes]
