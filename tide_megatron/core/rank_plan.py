"""Where every rank of a job sits: its role at start-up, its GPUs, its engine, its groups.

One pure function, `plan_ranks`, turns (nodes, GPUs per node, the job's parallel sizes) into a
`RankPlan`, and every process reads its own place from it: the torch device of a trainer rank,
the SGLang engine's `base_gpu_id`, the trainer's TP/PP/DP groups, which ranks ERS may move. The
dry run (`launch/train.py --dry-run`) prints the same plan, so what a user checks before renting
a cluster is what the job does on it.

The layout, for W = nodes x gpus_per_node ranks, rank r on node r // gpus_per_node, local GPU
r % gpus_per_node (torchrun's LOCAL_RANK: one process per GPU):

- **Trainer units.** The trainer's model-parallel unit is `tp * pp` consecutive ranks (TP
  fastest, then PP stages: stage s of unit u is ranks u*tp*pp + s*tp ... + tp - 1). A TP group
  never spans nodes (tp divides gpus_per_node); PP stages may. The start-up actors are the first
  units (a prefix: `comm/groups.py` makes groups for prefixes only), DP runs across units.
- **Reference ranks** (decoupled RA2P) follow the actors, in whole units.
- **Rollout ranks** are the last ones, in engines of `engine_tp` consecutive ranks aligned to
  multiples of `engine_tp` (so an engine never spans nodes when engine_tp divides
  gpus_per_node). The first rank of an engine hosts it (drives SGLang, which spawns one
  scheduler per GPU from `base_gpu_id`); the others lend it their GPU.
- **ERS** moves whole move units of `lcm(tp * pp, engine_tp)` ranks (one must divide the other,
  so a move is whole trainer units and whole engines at once). Rank 0's unit always trains;
  ranks past the last whole move unit only roll out.

Errors are `PlanError` whose message names the config key to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TRAINER_ROLES = ("actor", "ref")


class PlanError(ValueError):
    """A plan that cannot work; the message is one line naming the key to change."""


@dataclass(frozen=True)
class PlanRequest:
    """What the plan depends on: the machine and the job's parallel sizes."""

    nnodes: int
    """Nodes (torchrun's --nnodes)."""
    gpus_per_node: int
    """Processes per node, one per GPU (torchrun's --nproc-per-node)."""
    rollout_ranks: int = 0
    """Start-up rollout ranks (`cluster.rollout_ranks`); used when `rollout_share` is 0."""
    rollout_share: float = 0.0
    """Share of the world that starts as rollout (`cluster.rollout_share`), rounded to the
    nearest count that is whole engines and leaves whole trainer units; 0: `rollout_ranks`."""
    ref_ranks: int = 0
    """Dedicated reference ranks (`cluster.ref_ranks`), whole trainer units."""
    trainer_tp: int = 1
    """`trainer.tp_size`."""
    trainer_pp: int = 1
    """`trainer.pp_size`."""
    engine_tp: int = 1
    """`rollout.engine.tp_size`: GPUs per SGLang engine."""
    ers_moves_ranks: bool = False
    """Ranks may move between rollout and the trainer (`ers.enabled` and `ers.move_ranks`, or
    `scheduler.mode=sync`, which time-shares them)."""
    num_attention_heads: int | None = None
    """The model's query heads, if known: TP must divide them."""
    num_key_value_heads: int | None = None
    """The model's KV heads, if known: the trainer's TP must divide them."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def trainer_unit(self) -> int:
        return self.trainer_tp * self.trainer_pp


@dataclass(frozen=True)
class RankSlot:
    """One rank of the plan."""

    rank: int
    node: int
    local_rank: int
    role: str
    """`actor`, `ref` or `rollout` at start-up."""
    gpu: int
    """The local GPU id this rank's process owns (= local_rank)."""
    engine_host: int | None = None
    """Rollout ranks: the rank whose SGLang engine uses this GPU (itself when it hosts it)."""
    movable: bool = False
    """ERS may move this rank between rollout and the trainer."""

    @property
    def hosts_engine(self) -> bool:
        return self.engine_host == self.rank


@dataclass(frozen=True)
class EnginePlacement:
    """One SGLang engine: the rank that drives it and the local GPUs its TP ranks run on."""

    host: int
    node: int
    ranks: tuple[int, ...]
    gpus: tuple[int, ...]
    """Consecutive local GPU ids; SGLang's `base_gpu_id` is the first."""

    @property
    def base_gpu_id(self) -> int:
        return self.gpus[0]


@dataclass(frozen=True)
class TrainerGroups:
    """The start-up trainer's process groups, as rank tuples (Megatron's TP, PP and DP)."""

    tp: tuple[tuple[int, ...], ...]
    pp: tuple[tuple[int, ...], ...]
    dp: tuple[tuple[int, ...], ...]

    def of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The TP, PP and DP group holding `rank` (a trainer rank)."""
        found = {}
        for name in ("tp", "pp", "dp"):
            found[name] = next(g for g in getattr(self, name) if rank in g)
        return found


@dataclass(frozen=True)
class RankPlan:
    """The whole job's placement; see the module docstring."""

    request: PlanRequest
    slots: tuple[RankSlot, ...]
    engines: tuple[EnginePlacement, ...]
    groups: TrainerGroups
    """The actors' groups at start-up."""
    move_unit: int
    """Ranks ERS moves at once (0: ERS moves no rank)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """How a share was rounded, and other choices the plan made."""

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def ranks(self, role: str) -> list[int]:
        return [s.rank for s in self.slots if s.role == role]

    @property
    def actor_ranks(self) -> list[int]:
        return self.ranks("actor")

    @property
    def ref_ranks(self) -> list[int]:
        return self.ranks("ref")

    @property
    def rollout_ranks(self) -> list[int]:
        return self.ranks("rollout")

    @property
    def movable_ranks(self) -> list[int]:
        return [s.rank for s in self.slots if s.movable]

    @property
    def dp_size(self) -> int:
        return len(self.actor_ranks) // self.request.trainer_unit

    def slot(self, rank: int) -> RankSlot:
        if not 0 <= rank < len(self.slots):
            raise PlanError(f"rank {rank} outside the job's {len(self.slots)} ranks")
        return self.slots[rank]

    def engine_of(self, rank: int) -> EnginePlacement | None:
        """The engine `rank` hosts (None if it hosts none at start-up)."""
        return next((e for e in self.engines if e.host == rank), None)


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise PlanError(message)


def resolve_rollout_ranks(req: PlanRequest) -> tuple[int, str | None]:
    """The start-up rollout count, and a note when it was rounded from `rollout_share`.

    From a share: the count nearest to share x W that is whole engines and leaves the trainer
    (actors + reference) whole units, at least one engine and one actor unit; ties go to the
    smaller rollout (the trainer's DP size is the scarcer resource)."""
    world, unit = req.world_size, req.trainer_unit
    if req.rollout_share <= 0:
        return req.rollout_ranks, None
    _need(req.rollout_share < 1, f"cluster.rollout_share={req.rollout_share}: expected a share in (0, 1)")
    target = req.rollout_share * world
    fits = [n for n in range(req.engine_tp, world, req.engine_tp)
            if (world - n - req.ref_ranks) >= unit and (world - n - req.ref_ranks) % unit == 0]
    _need(bool(fits), f"cluster.rollout_share={req.rollout_share}: no rollout count of whole engines "
                      f"(rollout.engine.tp_size={req.engine_tp}) leaves the trainer whole units of "
                      f"trainer.tp_size x trainer.pp_size={unit} among {world} ranks")
    count = min(fits, key=lambda n: (abs(n - target), n))
    note = None
    if count != target:
        note = (f"cluster.rollout_share={req.rollout_share} of {world} ranks = {target:g} -> {count} rollout ranks "
                f"(whole engines of {req.engine_tp}, trainer in whole units of {unit})")
    return count, note


def _check_request(req: PlanRequest) -> None:
    _need(req.nnodes >= 1, f"--nnodes {req.nnodes}: need at least one node")
    _need(req.gpus_per_node >= 1, f"--nproc-per-node {req.gpus_per_node}: need at least one process per node")
    for key, value in (("trainer.tp_size", req.trainer_tp), ("trainer.pp_size", req.trainer_pp),
                       ("rollout.engine.tp_size", req.engine_tp)):
        _need(value >= 1, f"{key}={value}: must be >= 1")
    g, world = req.gpus_per_node, req.world_size
    for key, size, what in (("trainer.tp_size", req.trainer_tp, "a TP group"),
                            ("rollout.engine.tp_size", req.engine_tp, "an engine")):
        _need(size <= world, f"{key}={size} exceeds the job's {world} ranks")
        # Groups sit at multiples of their size: on one node they never cross a node boundary.
        _need(req.nnodes == 1 or g % size == 0,
              f"{key}={size} does not divide the {g} GPUs of a node ({what} stays on one node)")
    for key, heads in (("num_attention_heads", req.num_attention_heads), ("num_key_value_heads", req.num_key_value_heads)):
        if heads is None:
            continue
        _need(heads % req.trainer_tp == 0,
              f"trainer.tp_size={req.trainer_tp} does not divide the model's {heads} {key.replace('num_', '')}")
        _need(heads % req.engine_tp == 0 or key == "num_key_value_heads" and req.engine_tp % heads == 0,
              f"rollout.engine.tp_size={req.engine_tp} does not divide the model's {heads} {key.replace('num_', '')}")
    _need(req.ref_ranks >= 0 and req.ref_ranks % req.trainer_unit == 0,
          f"cluster.ref_ranks={req.ref_ranks}: must be whole trainer units of trainer.tp_size x trainer.pp_size="
          f"{req.trainer_unit} (a reference rank runs the model at the trainer's parallel sizes)")


def _trainer_groups(actors: int, tp: int, pp: int) -> TrainerGroups:
    unit = tp * pp
    units = actors // unit

    def rank(u: int, stage: int, pos: int) -> int:
        return u * unit + stage * tp + pos

    tp_groups = tuple(tuple(rank(u, s, j) for j in range(tp)) for u in range(units) for s in range(pp))
    pp_groups = tuple(tuple(rank(u, s, j) for s in range(pp)) for u in range(units) for j in range(tp))
    dp_groups = tuple(tuple(rank(u, s, j) for u in range(units)) for s in range(pp) for j in range(tp))
    return TrainerGroups(tp_groups, pp_groups, dp_groups)


def plan_ranks(req: PlanRequest) -> RankPlan:
    """The plan of `req`; `PlanError` naming the key to change when it cannot work."""
    _check_request(req)
    world, unit, etp = req.world_size, req.trainer_unit, req.engine_tp
    rollout, note = resolve_rollout_ranks(req)
    trainer_side = world - rollout
    actors = trainer_side - req.ref_ranks
    _need(rollout >= 1, f"cluster.rollout_ranks={rollout}: need at least one rollout rank")
    _need(actors >= 1, f"cluster.rollout_ranks={rollout} and cluster.ref_ranks={req.ref_ranks} leave no trainer rank "
                       f"of {world}; lower cluster.rollout_ranks (or set cluster.rollout_share)")
    _need(actors % unit == 0,
          f"cluster.rollout_ranks={rollout}: the {actors} actor ranks left are not whole units of trainer.tp_size x "
          f"trainer.pp_size={unit}; choose cluster.rollout_ranks so that world - rollout - ref divides by {unit}")
    _need(rollout % etp == 0 and trainer_side % etp == 0,
          f"cluster.rollout_ranks={rollout}: rollout must be whole engines of rollout.engine.tp_size={etp} "
          f"aligned to the engine size (the {trainer_side} trainer-side ranks before them divide by {etp})")
    move_unit = 0
    if req.ers_moves_ranks:
        big, small = max(unit, etp), min(unit, etp)
        _need(big % small == 0, f"rollout.engine.tp_size={etp} and trainer.tp_size x trainer.pp_size={unit}: ERS "
                                "moves whole engines and whole trainer units at once, so one must divide the other")
        move_unit = math.lcm(unit, etp)
        _need(world >= 2 * move_unit, f"ers.move_ranks=true moves {move_unit} ranks at once but rank 0's unit always "
                                      f"trains: {world} ranks leave nothing to move; set ers.move_ranks=false")
    movable_end = world // move_unit * move_unit if move_unit else 0
    engines = []
    for host in range(trainer_side, world, etp):
        node = host // req.gpus_per_node
        ranks = tuple(range(host, host + etp))
        engines.append(EnginePlacement(host, node, ranks, tuple(r % req.gpus_per_node for r in ranks)))
    slots = []
    for r in range(world):
        role = "actor" if r < actors else "ref" if r < trainer_side else "rollout"
        host = trainer_side + (r - trainer_side) // etp * etp if role == "rollout" else None
        slots.append(RankSlot(rank=r, node=r // req.gpus_per_node, local_rank=r % req.gpus_per_node, role=role,
                              gpu=r % req.gpus_per_node, engine_host=host,
                              movable=bool(move_unit) and move_unit <= r < movable_end))
    return RankPlan(req, tuple(slots), tuple(engines), _trainer_groups(actors, req.trainer_tp, req.trainer_pp),
                    move_unit, (note,) if note else ())


def describe(plan: RankPlan) -> list[str]:
    """The plan as lines for a console: each node's ranks by role, then the groups."""
    req = plan.request
    lines = [f"{req.nnodes} node(s) x {req.gpus_per_node} GPUs = {plan.world_size} ranks: "
             f"{len(plan.actor_ranks)} actor, {len(plan.ref_ranks)} reference, {len(plan.rollout_ranks)} rollout "
             f"({len(plan.engines)} engine(s) of TP {req.engine_tp})"]
    lines += [f"  note: {n}" for n in plan.notes]
    for node in range(req.nnodes):
        parts = []
        for s in (s for s in plan.slots if s.node == node):
            tag = s.role
            if s.role == "rollout":
                engine = plan.engine_of(s.rank)
                tag = f"engine GPUs {','.join(map(str, engine.gpus))}" if engine else f"GPU for rank {s.engine_host}"
            parts.append(f"{s.rank}:{tag}{'*' if s.movable else ''}")
        lines.append(f"  node {node}: " + "  ".join(f"[{p}]" for p in parts))
    g = plan.groups
    lines.append(f"  trainer: TP {req.trainer_tp} x PP {req.trainer_pp} x DP {plan.dp_size}; "
                 f"TP groups {_short(g.tp)}, PP groups {_short(g.pp)}, DP groups {_short(g.dp)}")
    if plan.move_unit:
        lines.append(f"  ERS moves {plan.move_unit} rank(s) at once; movable (*): {_ranges(plan.movable_ranks)}")
    else:
        lines.append("  ERS moves no rank (ers.enabled and ers.move_ranks off)")
    return lines


def _short(groups: tuple[tuple[int, ...], ...], limit: int = 4) -> str:
    shown = " ".join("(" + ",".join(map(str, grp)) + ")" for grp in groups[:limit])
    return shown + (f" ... {len(groups)} in all" if len(groups) > limit else "")


def _ranges(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    out, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return ", ".join(out)
