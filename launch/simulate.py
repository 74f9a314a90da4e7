"""Replay a workload on a modelled cluster with one scheduling mode.

    python launch/simulate.py +sim=text_32gpu mode=tide
    python launch/simulate.py +sim=text_32gpu mode=async_static scheduler.rollout_share=0.25
    python launch/simulate.py +sim=mm_32gpu mode=tide scheduler.ers=false out_dir=outputs/sim/mm

Setups live in recipes/sim/ (hardware, model and workload files cite their sources).
"""

import json
import sys

import hydra
from omegaconf import DictConfig

from tide_megatron.sim import run_simulation
from tide_megatron.sim.loader import SCHEMA_NAME, register_schema, to_sim_config

register_schema()
# never chdir; keep Hydra's own logs under outputs/
sys.argv += ["hydra.job.chdir=False", "hydra.run.dir=outputs/sim/hydra/${now:%Y-%m-%d_%H-%M-%S}"]


@hydra.main(config_path="../recipes", config_name=SCHEMA_NAME, version_base="1.3")
def main(cfg: DictConfig) -> None:
    metrics = run_simulation(to_sim_config(cfg))
    print(json.dumps(metrics.summary(), indent=2))


if __name__ == "__main__":
    main()
