"""Write `docs/gpu_plans.md`: the dry run of every shipped recipe at 8 and 32 GPUs (80 GB each).

    python scripts/dry_run_docs.py          # rewrite the file
    python scripts/dry_run_docs.py --check  # exit 1 if the file differs from what it would write

`tests/unit/launch/test_dry_run.py` runs the check, so the page always matches the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "launch"), str(REPO / "scripts")]

import generated_file  # noqa: E402
from hydra_schema import compose_job_config  # noqa: E402

from tide_megatron.job_plan import dry_run  # noqa: E402

DOC = REPO / "docs" / "gpu_plans.md"
MACHINES = ((1, 8), (4, 8))


def render() -> str:
    out = ["# Rank plans of the shipped recipes",
           "",
           "Written by `python scripts/dry_run_docs.py` from `launch/train.py +recipe=NAME --dry-run --nnodes N "
           "--nproc-per-node 8` (80 GB GPUs); a test fails when it is out of date. `*` marks the ranks ERS may move. "
           "Memory and weight-sync figures are estimates (`tide_megatron/core/memory_estimate.py` says how each is "
           "computed); the tiny recipes are CPU recipes, shown for completeness.", ""]
    for recipe in sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml")):
        cfg = compose_job_config([f"+recipe={recipe}"])
        for nodes, gpus in MACHINES:
            report = dry_run(cfg, nodes, gpus)
            out += [f"## {recipe}, {nodes} x {gpus} GPUs", "", "```"]
            out += report.lines
            if report.error:
                out.append(f"the plan cannot work: {report.error}")
            out += ["```", ""]
    return "\n".join(out)


def main() -> int:
    return generated_file.main(DOC, render, "dry_run_docs.py", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
