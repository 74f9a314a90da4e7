"""Discrete-event simulator of agentic RL training: TIDE (through the core objects) and the
synchronous, static-partition and streaming baselines on a modelled H100 cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tide_megatron.sim.config import (HardwareConfig, SimConfig, SimModelConfig, SimSchedulerConfig, TaskTypeConfig,
                                      WorkloadConfig)

if TYPE_CHECKING:
    from tide_megatron.sim.metrics import RunMetrics


def run_simulation(cfg: SimConfig) -> RunMetrics:
    """Build, run, and (if `cfg.out_dir` is set) write metrics JSON and the timeline PNG."""
    from tide_megatron.sim.report import write_outputs
    from tide_megatron.sim.simulator import Simulator

    metrics = Simulator(cfg).run()
    if cfg.out_dir:
        write_outputs(metrics, cfg)
    return metrics


def __getattr__(name: str):
    # `RunMetrics` is imported on first use: importing `sim.config` runs this file first, and a
    # config module loads no part of the simulator.
    if name == "RunMetrics":
        from tide_megatron.sim.metrics import RunMetrics

        globals()[name] = RunMetrics
        return RunMetrics
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HardwareConfig", "RunMetrics", "SimConfig", "SimModelConfig", "SimSchedulerConfig", "TaskTypeConfig",
           "WorkloadConfig", "run_simulation"]
