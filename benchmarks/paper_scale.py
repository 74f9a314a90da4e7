"""The paper's system comparison on the real system with emulated devices, against the simulator.

Every mode the real system runs, on the paper's text workload (`recipes/recipe/text_emulated.yaml`:
the real controller, CTB, RA2P, ERS, mailbox, process groups and weight-sync protocol on `--ranks`
processes; device work takes the simulator's cost-model time, dilated), and the same workload,
batch, ranks, steps and seed through the simulator (`recipes/sim/text_32gpu.yaml` resized), in
the same run:

- sync: VeRL-like, every rank time-shares rollout and training (the paper's sync baseline);
- async_static: the static split (AReaL-like), at its best share;
- stream: StreamRL-like, at its best share and executor (VSO, VS, RA2P's colocated rounds);
- tide without ERS, and tide (CTB + RA2P + ERS), both from the recipe's starting split;
- elastic (verl-like dynamic scaling): the simulator only; the real system has no such mode.

Known differences between the two sides, beside the cost model's: in sync, rank 0 (the
controller) trains but never rolls out, so the real rollout phase has one rank fewer than the
simulator's; tide without ERS has no reference ranks on the real side (`cluster.ref_ranks=0`), so
RA2P can only run colocated there, while the simulator's RA2P may choose decoupled (each run
records the RA2P mode of every step on both sides); swaps and offloads inside a step take the small
model's host time on the real side, and a rank ERS moves out of the trainer parks its state in
the cost model's time there but for free in the simulator (docs/emulation.md, "Not modelled yet").

"Best" is chosen by the simulator's sweep of the same settings (every share of the ranks, every
stream executor) before the emulated runs, since sweeping every share on emulated ranks would take
hours; the emulated run of that setting is then set against the simulator's. `--reps`
repetitions in alternating order, repetition r with seed `--seed + r` on both sides (the replayed
task stream is the simulator's for that seed).

Per mode: goodput and mean step time at the modelled speed (emulated: wall / dilation), their
emulated/simulator ratio per repetition (the goal: within 10%), the wasted share, RWT+TWT,
the host's busy share; and what the ratio is made of: the generated tokens each step consumed
and its train time on both sides, and the emulated goodput without its checkpoints' time (the
simulator saves none). The recipe draws the replayed tasks in the simulator's order
(`scheduler.task_order=sequential`), so both sides run the same groups. The TIDE goals on the emulated system: tide >= 1.3x the best static split
and >= 3x sync, ERS's RWT+TWT <= 0.3 of the best static split's, wasted tokens <= 2%.
Writes benchmarks/results/paper_scale.json (paper_scale_<N>ranks.json at another size) and the
tide run's timeline PNG beside it; prints a short table.

    python benchmarks/paper_scale.py                          # 32 ranks, dilation 4, 3 steps, 2 reps
    python benchmarks/paper_scale.py --ranks 8 --groups-per-step 16 --dilation 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import bench_record
from e2e_goodput import geomean as _geomean
from emulated_runs import modelled, run_emulated
from sim_paper import SHARES, STREAM_EXECUTORS

from tide_megatron.sim import run_simulation
from tide_megatron.sim.loader import load_config

SIM_SETUP = "text_32gpu"
GOALS = {"tide_over_best_static": (">=", 1.3), "tide_over_sync": (">=", 3.0),
         "ers_waits_over_best_static": ("<=", 0.3), "tide_wasted_share": ("<=", 0.02)}
AGREE = 0.10  # emulated within 10% of the simulator


def rollout_splits(ranks: int) -> list[int]:
    """Rollout ranks the sweep tries: every split on a few ranks, the paper's shares on many."""
    if ranks <= 8:
        return list(range(1, ranks))
    return sorted({max(1, min(ranks - 1, round(s * ranks))) for s in SHARES})


def variant(mode: str, rollout: int | None = None, executor: str | None = None) -> dict:
    label = mode + (f"/{executor}" if executor else "") + (f"@{rollout}" if rollout else "")
    return {"label": label, "mode": mode, "rollout": rollout, "executor": executor}


def real_overrides(v: dict) -> list[str]:
    """Hydra overrides of the emulated recipe for `v` (ERS only in tide's full variant)."""
    mode = "tide" if v["mode"].startswith("tide") else v["mode"]
    out = [f"scheduler.mode={mode}", f"ers.enabled={str(v['mode'] == 'tide+ers').lower()}"]
    if v["mode"] == "sync":  # every rank time-shares: its start-up split does not matter
        out += ["cluster.rollout_share=0", "cluster.rollout_ranks=1"]
    elif v["rollout"]:
        out += ["cluster.rollout_share=0", f"cluster.rollout_ranks={v['rollout']}"]
    if v["executor"]:
        out.append(f"ra2p.executor={v['executor']}")
    return out


def sim_overrides(v: dict, ranks: int) -> list[str]:
    mode = "tide" if v["mode"].startswith("tide") else v["mode"]
    out = [f"mode={mode}"]
    if mode == "tide":  # the real ERS's bounds: one rank on either side (its cold start leaves one trainer)
        out += [f"scheduler.min_rollout_share={1 / ranks}", f"scheduler.max_rollout_share={(ranks - 1) / ranks}"]
    if v["mode"] == "tide":
        out.append("scheduler.ers=false")
    if v["rollout"]:
        out.append(f"scheduler.rollout_share={v['rollout'] / ranks}")
    if v["executor"]:
        out.append(f"scheduler.stream_executor={v['executor']}")
    return out


def simulate(v: dict, args, seed: int) -> dict:
    over = [f"n_gpus={args.ranks}", f"steps={args.steps}", f"seed={seed}", f"workload.group_size={args.group_size}",
            f"workload.batch_groups={args.groups_per_step}", f"workload.min_batch_groups={args.groups_per_step}",
            "workload.eval_every=0", *sim_overrides(v, args.ranks)]
    m = run_simulation(load_config(SIM_SETUP, over))
    s = m.summary()
    return {"command": " ".join(["python launch/simulate.py", f"+sim={SIM_SETUP}", *over]),
            "goodput_tok_s": s["goodput"], "mean_step_s": s["mean_step_s"],
            "wasted_share": s["wasted_tokens"] / max(1, s["generated_tokens"]),
            "waiting_rank_s": m.waiting_rank_s, "steps": s["steps_done"],
            "ra2p_modes": [step.ra2p_mode for step in m.steps],
            "step_tokens": [step.tokens for step in m.steps], "step_train_s": [step.train_s for step in m.steps],
            "step_s": [step.end - step.start for step in m.steps],
            "step_rollout_s": [step.rollout_s for step in m.steps]}


def per_step(rows: list[dict], dilation: float) -> dict:
    """The emulated run's steps beside the simulator's (`step_tokens`, `step_train_s`, `step_s`):
    generated tokens consumed, step, train and checkpoint time at the modelled speed, the trainer's
    wait (in sync: the rollout phase, the simulator's `step_rollout_s`), the share of the step's
    tasks its busiest rollout rank was sent, and the run goodput with the checkpoints' time left
    out (the simulator saves none)."""
    consumed = sum(r["consumed_tokens"] for r in rows)
    checkpoint_s = sum(r["time/checkpoint_s"] for r in rows)
    elapsed = consumed / rows[-1]["run_goodput_tok_s"]  # the run's wall time since its first dispatch
    return {"step_tokens": [r["consumed_tokens"] for r in rows],
            "step_train_s": [r["time/train_s"] / dilation for r in rows],
            "step_s": [r["time/step_s"] / dilation for r in rows],
            "step_twt_s": [r["twt_s"] / dilation for r in rows],
            "step_busiest_rank_share": [r.get("placement/busiest_rank_share") for r in rows],
            "checkpoint_s": checkpoint_s / dilation,
            "goodput_without_checkpoint_tok_s": consumed / (elapsed - checkpoint_s) * dilation}


def best_settings(args) -> tuple[dict[str, dict], dict[str, float]]:
    """The simulator's best setting of each swept mode (seed `args.seed`), and every goodput it saw."""
    seen, best = {}, {}
    for mode, executors in (("async_static", (None,)), ("stream", STREAM_EXECUTORS), ("elastic", (None,))):
        tried = [variant(mode, r, e) for e in executors for r in rollout_splits(args.ranks)]
        for v in tried:
            seen[v["label"]] = simulate(v, args, args.seed)["goodput_tok_s"]
        best[mode] = max(tried, key=lambda v: seen[v["label"]])
        print(f"simulator's best {mode}: {best[mode]['label']} ({seen[best[mode]['label']]:.0f} tok/s)", flush=True)
    return best, seen


def geomean(xs: list[float]) -> float | None:
    """Their geometric mean; None for none (a JSON record holds no NaN)."""
    return _geomean(xs) if xs else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--groups-per-step", type=int, default=64, help="the workload's 64 x 8 at 32 ranks")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dilation", type=float, default=4.0, help="every modelled device and env time x this")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per emulated run")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every emulated run")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(bench_record.RESULTS_DIR) / (
        "paper_scale.json" if args.ranks == 32 else f"paper_scale_{args.ranks}ranks.json")

    best, swept = best_settings(args)
    variants = [variant("sync"), best["async_static"], best["stream"], variant("tide"), variant("tide+ers")]
    common = [f"run.steps={args.steps}", f"scheduler.groups_per_step={args.groups_per_step}",
              f"scheduler.group_size={args.group_size}", *args.overrides]
    runs, timeline = [], None
    for rep in range(args.reps):
        seed = args.seed + rep
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            run = run_emulated(args.ranks, args.dilation, [*real_overrides(v), *common, f"run.seed={seed}",
                                                          f"envs.server.envs.0.workload.seed={seed}"], args.timeout)
            record = {"label": v["label"], "mode": v["mode"], "rep": rep, "seed": seed, "command": run["command"],
                      "process_wall_s": run["process_wall_s"], "failed": run["failed"],
                      "sim": simulate(v, args, seed)}
            if run["failed"]:
                record["error"] = run["error"]
                print(f"rep {rep} {v['label']:<18} FAILED: {run['error'][-300:]}", flush=True)
            else:
                record["emulated"] = {**modelled(run, args.ranks, args.dilation), **per_step(run["rows"], args.dilation)}
                if v["mode"] == "tide+ers" and run["timeline_png"]:
                    timeline = run["timeline_png"]
                e, s = record["emulated"], record["sim"]
                print(f"rep {rep} {v['label']:<18} emulated {e['goodput_tok_s']:>7.0f} tok/s {e['mean_step_s']:>6.1f} s"
                      f" | simulator {s['goodput_tok_s']:>7.0f} tok/s {s['mean_step_s']:>6.1f} s"
                      f" | host busy {e['cpu_busy_share']}", flush=True)
            runs.append(record)
    elastic = simulate(best["elastic"], args, args.seed)

    ok = [r for r in runs if not r["failed"]]
    summary = {}
    for v in variants:
        mine = [r for r in ok if r["label"] == v["label"]]
        if not mine:
            summary[v["label"]] = {"failed_runs": args.reps}
            continue
        g = [r["emulated"]["goodput_tok_s"] / r["sim"]["goodput_tok_s"] for r in mine]
        t = [r["emulated"]["mean_step_s"] / r["sim"]["mean_step_s"] for r in mine]
        tokens = [sum(r["emulated"]["step_tokens"]) / sum(r["sim"]["step_tokens"]) for r in mine]
        g_ckpt = [r["emulated"]["goodput_without_checkpoint_tok_s"] / r["sim"]["goodput_tok_s"] for r in mine]
        summary[v["label"]] = {
            "mode": v["mode"], "runs": len(mine),
            **{f"emulated_{k}": statistics.fmean(r["emulated"][k] for r in mine)
               for k in ("goodput_tok_s", "mean_step_s", "wasted_share", "waiting_rank_s", "rank_moves")},
            **{f"sim_{k}": statistics.fmean(r["sim"][k] for r in mine) for k in ("goodput_tok_s", "mean_step_s")},
            "goodput_emulated_over_sim": geomean(g), "step_emulated_over_sim": geomean(t),
            "tokens_emulated_over_sim": geomean(tokens), "goodput_without_checkpoint_emulated_over_sim": geomean(g_ckpt),
            "agree_within_10pct": all(abs(x - 1) <= AGREE for x in g + t),
            "cpu_busy_share": statistics.fmean(r["emulated"]["cpu_busy_share"] or 0 for r in mine)}

    def per_rep(a: str, b: str, key: str, side: str = "emulated") -> list[float]:
        pairs = {(r["rep"], r["label"]): r for r in ok}
        return [pairs[rep, a][side][key] / pairs[rep, b][side][key] for rep in range(args.reps)
                if (rep, a) in pairs and (rep, b) in pairs and pairs[rep, b][side][key]]

    static = best["async_static"]["label"]

    def goal_values(side: str) -> dict:
        tide = [r[side]["wasted_share"] for r in ok if r["label"] == "tide+ers"]
        return {"tide_over_best_static": geomean(per_rep("tide+ers", static, "goodput_tok_s", side)),
                "tide_over_sync": geomean(per_rep("tide+ers", "sync", "goodput_tok_s", side)),
                "ers_waits_over_best_static": geomean(per_rep("tide+ers", static, "waiting_rank_s", side)),
                "tide_wasted_share": statistics.fmean(tide) if tide else None}

    ops = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}
    emulated, simulated = goal_values("emulated"), goal_values("sim")
    goals = {k: {"goal": f"{op} {x}", "value": emulated[k], "simulator": simulated[k],
                 "met": None if emulated[k] is None else ops[op](emulated[k], x)} for k, (op, x) in GOALS.items()}

    print(f"\n{args.ranks} ranks, dilation {args.dilation:g}, {args.groups_per_step}x{args.group_size} per step, "
          f"{args.steps} steps, {args.reps} reps (modelled speed)")
    print(f"{'mode':<18}{'emu tok/s':>10}{'sim tok/s':>10}{'ratio':>7}{'no ckpt':>8}{'emu step':>9}{'sim step':>9}"
          f"{'ratio':>7}{'tokens':>7}{'wasted':>8}{'busy':>6}")
    for label, s in summary.items():
        if "emulated_goodput_tok_s" not in s:
            print(f"{label:<18}{'failed':>10}")
            continue
        print(f"{label:<18}{s['emulated_goodput_tok_s']:>10.0f}{s['sim_goodput_tok_s']:>10.0f}"
              f"{s['goodput_emulated_over_sim']:>7.2f}{s['goodput_without_checkpoint_emulated_over_sim']:>8.2f}"
              f"{s['emulated_mean_step_s']:>9.1f}{s['sim_mean_step_s']:>9.1f}{s['step_emulated_over_sim']:>7.2f}"
              f"{s['tokens_emulated_over_sim']:>7.2f}{s['emulated_wasted_share']:>8.3f}{s['cpu_busy_share']:>6.2f}")
    print(f"{best['elastic']['label']:<18}{'-':>10}{elastic['goodput_tok_s']:>10.0f}{'':>7}{'-':>9}"
          f"{elastic['mean_step_s']:>9.1f}   (simulator only)")
    for k, g in goals.items():
        value, sim = ("-" if x is None else f"{x:.3f}" for x in (g["value"], g["simulator"]))
        print(f"{k:<28}{value:>8}  goal {g['goal']:<7} {'-' if g['met'] is None else 'met' if g['met'] else 'MISSED':<7}"
              f" (simulator {sim})")

    record = {**bench_record.header("paper_scale", config=vars(args)),
              "best_settings_by_simulator": {m: v["label"] for m, v in best.items()},
              "simulator_sweep_goodput_tok_s": swept, "summary": summary, "elastic_simulator_only": elastic,
              "goals": goals, "runs": runs}
    if timeline:
        png = out.with_name(out.stem + "_timeline.png")
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(timeline)
        record["timeline_png"] = png.name
    bench_record.write(str(out), record)
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
