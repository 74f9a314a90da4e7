"""SGLang plugin entry point (`sglang.srt.plugins` group, name `tide_ctb`).

SGLang calls `load()` in every process that runs `sglang.srt.plugins.load_plugins()` (the
engine's process and, what matters here, the scheduler subprocess), then applies the
registered hooks. The hooks are pinned to one SGLang version: on any other version `load()`
raises, SGLang logs the traceback, and no hook is installed; the dispatcher then sees no
`meta_info["tide_ctb"]` report and refuses to run CTB (`CTBDispatchConfig.require_plugin`).

Set `TIDE_CTB_PLUGIN=0` to keep the plugin out of a process (e.g. a vanilla baseline run).
"""

from __future__ import annotations

import inspect
import logging
import os
import pkgutil

logger = logging.getLogger(__name__)

PINNED_SGLANG_VERSION = "0.5.23"

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_POLICY = "sglang.srt.managers.schedule_policy"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_SESSIONS = "sglang.srt.session.session_controller.SessionController"
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"

HOOKED_SIGNATURES: dict[str, str] = {
    f"{_SCHED}.handle_generate_request":
        "(self, recv_req: sglang.srt.managers.io_struct.TokenizedGenerateReqInput, *, mm_input_error: Optional[str] = None)",
    f"{_SCHED}.close_session": "(self, recv_req: sglang.srt.managers.io_struct.CloseSessionReqInput)",
    f"{_SCHED}.process_batch_result":
        "(self, batch: sglang.srt.managers.schedule_batch.ScheduleBatch, "
        "result: Union[sglang.srt.managers.utils.GenerationBatchResult, sglang.srt.managers.utils.EmbeddingBatchResult])",
    f"{_SESSIONS}._close": "(self, session_id: 'str')",
    f"{_POLICY}.SchedulePolicy.calc_priority":
        "(self, waiting_queue: 'List[Req]', running_batch: 'Optional[ScheduleBatch]' = None, processed_tokens: 'int' = 0) -> 'None'",
    f"{_POLICY}.PrefillAdder.add_one_req":
        "(self, req: 'Req', has_chunked_req: 'bool', truncation_align_size: 'Optional[int]')",
    f"{_BATCH}._get_decode_retraction_order": "(reqs: 'List[Req]') -> 'List[int]'",
    f"{_STREAMER}.stream_output": "(self, reqs: 'List[Req]', return_logprob: 'bool', skip_req: 'Optional[Req]' = None)",
    f"{_STREAMER}.is_request_level_customized_info_key": "(self, key: 'str') -> 'bool'",
}
"""Every SGLang function the plugin hooks, with its signature in the pinned version."""

_ATTRIBUTES_READ = (f"{_POLICY}.AddReqResult.CONTINUE",
                    "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.available_size",
                    "sglang.srt.mem_cache.base_prefix_cache.InsertParams",
                    "sglang.srt.mem_cache.radix_cache.RadixKey.page_aligned",
                    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert",
                    "sglang.srt.session.streaming_session.StreamingSession.release_session",
                    "sglang.srt.mem_cache.unified_cache.component_type.BASE_COMPONENT_TYPE",
                    "sglang.srt.managers.schedule_batch.ScheduleBatch.launch_ts",
                    "sglang.srt.model_executor.forward_batch_info.ForwardMode.is_decode")
"""Further SGLang names the hooks read."""

_SOURCE_FACTS = {f"{_SCHED}.run_batch": "batch.launch_ts = time.monotonic()"}
"""Source lines the hooks rely on: the decode timing compares `launch_ts` with its own
`time.monotonic()`, so a change of clock would corrupt it without any signature change."""


class SGLangVersionMismatch(RuntimeError):
    pass


def installed_sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def check_hook_targets() -> list[str]:
    """Problems with the hook targets in the installed SGLang (empty when all match)."""
    problems = []
    for target, expected in HOOKED_SIGNATURES.items():
        try:
            fn = pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{target}: missing ({exc})")
            continue
        got = str(inspect.signature(fn))  # follows __wrapped__, so also valid once hooked
        if got != expected:
            problems.append(f"{target}: signature changed\n  expected {expected}\n  found    {got}")
    for name in _ATTRIBUTES_READ:
        try:
            pkgutil.resolve_name(name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{name}: missing ({exc})")
    for target, line in _SOURCE_FACTS.items():
        try:
            source = inspect.getsource(inspect.unwrap(pkgutil.resolve_name(target)))
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            problems.append(f"{target}: source unavailable ({exc})")
            continue
        if line not in source:
            problems.append(f"{target}: no longer contains `{line}`")
    return problems


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_patches import scheduler_hooks as h

    HookRegistry.register(f"{_SCHED}.handle_generate_request", h.on_generate_request, HookType.BEFORE)
    HookRegistry.register(f"{_SCHED}.close_session", h.on_close_session, HookType.BEFORE)
    HookRegistry.register(f"{_SCHED}.process_batch_result", h.after_process_batch_result, HookType.AFTER)
    HookRegistry.register(f"{_SESSIONS}._close", h.before_session_release, HookType.BEFORE)
    HookRegistry.register(f"{_POLICY}.SchedulePolicy.calc_priority", h.after_calc_priority, HookType.AFTER)
    HookRegistry.register(f"{_POLICY}.PrefillAdder.add_one_req", h.around_add_one_req, HookType.AROUND)
    HookRegistry.register(f"{_BATCH}._get_decode_retraction_order", h.around_retraction_order, HookType.AROUND)
    HookRegistry.register(f"{_STREAMER}.stream_output", h.before_stream_output, HookType.BEFORE)
    HookRegistry.register(f"{_STREAMER}.is_request_level_customized_info_key", h.around_is_request_level_key,
                          HookType.AROUND)


def load() -> None:
    """The entry point SGLang calls. Refuses (raises) on any SGLang but the pinned one."""
    if os.environ.get("TIDE_CTB_PLUGIN", "1") == "0":
        logger.info("tide_ctb plugin disabled by TIDE_CTB_PLUGIN=0")
        return
    found = installed_sglang_version()
    if found != PINNED_SGLANG_VERSION:
        msg = (f"tide_ctb SGLang plugin is pinned to sglang=={PINNED_SGLANG_VERSION} but sglang=={found} "
               "is installed; CTB hooks NOT installed. Re-record sglang_patches.plugin.HOOKED_SIGNATURES "
               "against the new version and re-check every hook before moving the pin.")
        logger.error(msg)
        raise SGLangVersionMismatch(msg)
    problems = check_hook_targets()
    if problems:
        msg = "tide_ctb SGLang plugin: hook targets changed; CTB hooks NOT installed:\n" + "\n".join(problems)
        logger.error(msg)
        raise SGLangVersionMismatch(msg)
    register_hooks()
