"""Hydra's side of the configuration, kept inside launch/.

`register()` stores the job schema (`tide_megatron.config.JobConfig`) in Hydra's
ConfigStore as `job_schema`; `recipes/config.yaml` extends it, so overrides and recipe
files are checked against the dataclasses at compose time. `to_job_config()` turns the
composed DictConfig into the plain dataclasses the library receives.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # launch/ scripts run from a checkout without installing
    sys.path.insert(0, str(REPO))

from tide_megatron.config import JobConfig  # noqa: E402

CONFIG_DIR = str(REPO / "recipes")


def register() -> None:
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job_config(cfg: DictConfig) -> JobConfig:
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig), type(job)
    return job
