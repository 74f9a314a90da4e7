"""Train a policy: `torchrun --nproc-per-node N launch/train.py +recipe=NAME [key=value ...]`.

Every rank composes the same config; rank 0 runs the controller. See README.md.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: ranks share the cores

import hydra  # noqa: E402
from hydra_schema import CONFIG_DIR, register, to_job_config  # noqa: E402

register()
# `kill -USR1 <pid>` prints every thread's stack: the first tool for a hung rank.
faulthandler.register(signal.SIGUSR1, all_threads=True)


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    from tide_megatron.utils import console

    rank = int(os.environ.get("RANK", "0"))
    job_cfg = to_job_config(cfg)
    log_dir = os.path.join(job_cfg.run.output_dir, "logs")
    console.setup(rank, log_dir, verbose=job_cfg.run.verbose)
    try:
        from tide_megatron.job import Job

        job = Job(job_cfg)
        try:
            job.run()
        finally:
            job.close()
    except Exception as exc:
        logging.getLogger("launch.train").exception("rank %d failed", rank)
        console.report_failure(rank, log_dir, exc)
        if job_cfg.run.verbose:
            raise
        sys.exit(1)


if __name__ == "__main__":
    main()
