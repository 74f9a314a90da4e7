"""Which staleness admission rule should CTB use by default? The simulator's answer.

CTB always bounds staleness at admission. Two refinements predict instead of counting:
`deadline_admission` (start a group only if the 0.9 quantile of recent group latencies says it
finishes by its deadline) and `throttle_from_consumption` (size the window from the measured
consumption rate instead of (bound + 1) x batch). This runs TIDE on every simulator workload
(text, multimodal and the held-out shifted mix), with ERS on and off, under the four
combinations, and reports goodput, tokens dropped as stale or cancelled, and RWT/TWT.
Prints a table and writes benchmarks/results/ctb_admission_rules.json.

    python benchmarks/ctb_admission_rules.py [--workloads text,mm,shifted]
"""

from __future__ import annotations

import argparse
import time

from bench_record import header, write

from tide_megatron.sim import run_simulation
from tide_megatron.sim.loader import load_config

SETUPS = {"text": "text_32gpu", "mm": "mm_32gpu", "shifted": "text_shifted_32gpu"}
RULES = {"fixed window (default)": (False, False), "deadline admission": (True, False),
         "consumption throttle": (False, True), "both": (True, True)}
FIELDS = ("goodput", "generated_tokens", "wasted_tokens", "dropped_stale_tokens", "cancelled_tokens", "rwt_rank_s",
          "twt_rank_s", "mean_step_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="text,mm,shifted")
    args = parser.parse_args()
    runs = []
    print(f"{'workload':<9}{'ers':<5}{'rule':<25}{'goodput':>9}{'vs default':>11}{'wasted':>8}{'RWT':>9}{'TWT':>9}")
    for workload in args.workloads.split(","):
        for ers in (True, False):
            base = None
            for rule, (deadline, consumption) in RULES.items():
                overrides = ["mode=tide", f"scheduler.ers={str(ers).lower()}",
                             f"scheduler.ctb_deadline_admission={str(deadline).lower()}",
                             f"scheduler.ctb_throttle_from_consumption={str(consumption).lower()}"]
                t0 = time.perf_counter()
                summary = run_simulation(load_config(SETUPS[workload], overrides)).summary()
                row = {"workload": workload, "ers": ers, "rule": rule, "overrides": overrides,
                       "wall_s": round(time.perf_counter() - t0, 2), **{k: summary[k] for k in FIELDS}}
                row["wasted_share"] = row["wasted_tokens"] / max(row["generated_tokens"], 1)
                base = base or row["goodput"]
                row["goodput_vs_default"] = row["goodput"] / base
                runs.append(row)
                print(f"{workload:<9}{'on' if ers else 'off':<5}{rule:<25}{row['goodput']:>9.0f}"
                      f"{row['goodput_vs_default']:>11.3f}{row['wasted_share']:>8.3f}{row['rwt_rank_s']:>9.0f}"
                      f"{row['twt_rank_s']:>9.0f}", flush=True)
    write("ctb_admission_rules", {**header("ctb_admission_rules", config=vars(args)), "runs": runs})


if __name__ == "__main__":
    main()
