"""Hydra's side of the configuration, kept inside launch/.

`register()` stores the job schema (`tide_megatron.config.JobConfig`) in Hydra's
ConfigStore as `job_schema`; `recipes/config.yaml` extends it, so overrides and recipe
files are checked against the dataclasses at compose time. `to_job_config()` turns the
composed DictConfig into the plain dataclasses the library receives.
"""

from __future__ import annotations

import argparse
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


def pop_dry_run_args(argv: list[str]) -> argparse.Namespace | None:
    """Take `--dry-run [--nnodes N] [--nproc-per-node G] [--gpu-memory-gb X]` out of `argv` (in
    place, leaving Hydra's overrides); None when `--dry-run` is not among them."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    args, rest = parser.parse_known_args(argv[1:])
    if not args.dry_run:
        if len(rest) != len(argv) - 1:
            raise SystemExit("launch/train.py: --nnodes, --nproc-per-node and --gpu-memory-gb go with --dry-run; "
                             "under torchrun the launcher takes them")
        return None
    argv[1:] = rest
    return args


def compose_job_config(overrides: list[str]) -> JobConfig:
    """The `JobConfig` that `launch/train.py` with these overrides composes (Hydra's compose API
    over the same config root and schema), for checks made before any rank starts."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return to_job_config(compose(config_name="config", overrides=list(overrides)))


SECRET_KEYS = ("auth_token",)


def refuse_secret_overrides(argv: list[str]) -> None:
    """A secret in a Hydra override sits on the command line of every rank, which `ps` shows to
    every user of the node: stop with one line saying where it goes instead."""
    for arg in argv[1:]:
        key, _, value = arg.lstrip("+~").partition("=")
        if value and key.rsplit(".", 1)[-1] in SECRET_KEYS:
            raise SystemExit(f"launch/train.py: {key} on the command line is visible to every user of the node "
                             "(ps); pass the env server's token in the TIDE_ENV_TOKEN environment variable instead")
