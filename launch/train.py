"""Train a policy: `torchrun --nproc-per-node N launch/train.py +recipe=NAME [key=value ...]`.

Every rank composes the same config; rank 0 runs the controller. See README.md.

    python launch/train.py +recipe=NAME --dry-run --nnodes N --nproc-per-node G [--gpu-memory-gb 80]

prints the rank plan, the memory per GPU and the weight-sync time without starting anything,
and exits 1 with one line naming the key to change when the plan cannot work.
"""

from __future__ import annotations

import atexit
import os
import sys

_CLOSED_CLEANLY = False


def _exit_without_teardown() -> None:
    """A rank whose job closed cleanly ends here, before the interpreter frees the objects of
    torch, Megatron-core and SGLang one by one (seconds per rank on a loaded host). Registered
    before anything else, this exit handler runs last: by now the executors have stopped, the
    non-daemon threads are joined and every other exit handler (logging's, multiprocessing's)
    has run, as in a normal exit."""
    import multiprocessing

    # A rank forked by `forked_ranks` is a multiprocessing child: it runs these handlers itself
    # and must return to torchrun's wrapper, which reports its end and exits without teardown.
    if _CLOSED_CLEANLY and multiprocessing.parent_process() is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


atexit.register(_exit_without_teardown)

import faulthandler  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: ranks share the cores

import hydra  # noqa: E402
from hydra_schema import CONFIG_DIR, pop_dry_run_args, refuse_secret_overrides, register, to_job_config  # noqa: E402

register()
refuse_secret_overrides(sys.argv)
DRY_RUN = pop_dry_run_args(sys.argv)  # Hydra would take the flags for overrides
# `kill -USR1 <pid>` prints every thread's stack: the first tool for a hung rank.
faulthandler.register(signal.SIGUSR1, all_threads=True)


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    from tide_megatron.utils import console

    job_cfg = to_job_config(cfg)
    if DRY_RUN is not None:
        from tide_megatron.job_plan import dry_run

        report = dry_run(job_cfg, DRY_RUN.nnodes, DRY_RUN.nproc_per_node, DRY_RUN.gpu_memory_gb)
        print("\n".join(report.lines))
        if report.error:
            print(f"the plan cannot work: {report.error}", file=sys.stderr)
            sys.exit(1)
        return
    rank = int(os.environ.get("RANK", "0"))
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
    _CLOSED_CLEANLY = True  # a failed rank leaves by SystemExit or an exception and tears down as usual
