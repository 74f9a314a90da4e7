"""Hydra glue: the structured schema, composing a recipe, and DictConfig -> dataclasses.

`recipes/` is the config root. `recipes/sim/<setup>.yaml` picks a hardware, a model and a
workload file (each documented with its sources) and the cluster size; the schema below
(`sim_schema`, the `SimConfig` dataclass) types and validates every key. The library never
sees a DictConfig: `to_sim_config` converts at the boundary.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from tide_megatron.sim.config import SimConfig

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
SCHEMA_NAME = "sim_schema"


def register_schema() -> None:
    """Register `SimConfig` as the primary config `sim_schema` (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=SimConfig)


def to_sim_config(cfg: DictConfig) -> SimConfig:
    """Typed dataclasses from a composed config (drops Hydra's own node if present)."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    merged = OmegaConf.merge(OmegaConf.structured(SimConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, SimConfig)
    return obj


def load_config(setup: str, overrides: Optional[List[str]] = None) -> SimConfig:
    """Compose `recipes/sim/<setup>.yaml` with `overrides` (Hydra syntax) outside any app."""
    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
        cfg = compose(config_name=SCHEMA_NAME, overrides=[f"+sim={setup}", *(overrides or [])])
    return to_sim_config(cfg)


def load_hardware_model(hardware: str, model: str):
    """The cost model (`sim.hardware.HardwareModel`) of `recipes/sim/hardware/<hardware>.yaml`
    and `recipes/sim/model/<model>.yaml`, as the simulator composes them."""
    from tide_megatron.sim.config import HardwareConfig, SimModelConfig
    from tide_megatron.sim.hardware import HardwareModel

    parts = []
    for kind, name, schema in (("hardware", hardware, HardwareConfig), ("model", model, SimModelConfig)):
        path = RECIPES_DIR / "sim" / kind / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in path.parent.glob("*.yaml"))
            raise ValueError(f"no {kind} named {name!r} in {path.parent} (known: {known})")
        parts.append(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path))))
    return HardwareModel(*parts)


def load_workload(name: str):
    """The task stream `recipes/sim/workload/<name>.yaml` (`sim.config.WorkloadConfig`)."""
    from tide_megatron.sim.config import WorkloadConfig

    path = RECIPES_DIR / "sim" / "workload" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"no workload named {name!r} in {path.parent} (known: {known})")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(WorkloadConfig), OmegaConf.load(path)))
