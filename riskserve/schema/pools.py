"""Shared CPU/GPU pools: what the models of a pipeline ask of each pool, and how Ray is told.

A pool (``pools.<name>`` in the YAML) is capacity offered by one node group. Every deployment of a pipeline
(each model, the feature stage, the ingress) is placed on one pool and takes a share of it per replica:
``num_cpus`` (fractions allowed) and ``num_gpus`` (a fraction of one GPU, or whole GPUs). Several models share
one pool, and one GPU, by their fractions; the pool's budget is not split per model, so a model that scales
up uses whatever the others leave free.

How the pool reaches Ray
------------------------
A pool is the Ray custom resource ``riskserve_pool_<name>`` (:meth:`PipelineSpec.pool_resource`), offered
only by the nodes of that pool's node group (:func:`node_resources`; on one machine, every pool on the one
node: :func:`single_node_resources`). A replica asks (:func:`actor_options`):

* ``num_cpus``: its CPUs, from Ray's own ``CPU`` of the node;
* ``num_gpus``: its GPUs (only when non-zero), from Ray's own ``GPU`` of the node, so fractions of one GPU
  are shared by Ray's GPU accounting and ``CUDA_VISIBLE_DEVICES`` is set by Ray;
* ``resources={"riskserve_pool_<name>": units}``: its CPUs again, in pool units. Because only the pool's
  nodes offer that resource, this pins the replica to them, and it makes Ray enforce the pool's CPU budget
  even where pools share a node (one machine), where ``CPU`` alone cannot tell them apart.

The unit: 1000 pool units per CPU (a milli-CPU)
-----------------------------------------------
``riskserve_pool_<name>`` counts milli-CPUs: a replica with ``num_cpus: 0.25`` asks 250 units, and a node
of a 2-CPU pool offers 2000 (plus a small pinning allowance, below). Why this unit and not the others:

* *1 unit = 1 CPU* (the pool's ``cpus`` as its capacity) cannot be offered: Ray requires a node's resource
  quantities to be whole numbers ("Resource quantities must all be whole numbers", raised by ``ray start``
  and ``ray.init``), so a pool of 2.5 CPUs, or any allowance for pinning, is not expressible in CPUs.
  Milli-CPUs make every capacity a whole number while replicas still ask fractions (Ray's requests have a
  precision of 1e-4 unit, i.e. 1e-7 CPU).
* *A fixed number of slots per pool (e.g. 1000) scaled by share* makes a replica's request depend on the
  pool's size: resizing a pool would silently change every replica's request, and two pipelines that
  declare the same pool (one cluster resource) with different sizes would ask in different units. An
  absolute unit keeps requests comparable across pipelines and readable in ``ray status``
  (``riskserve_pool_cpu: 1250/2001`` reads as 1.25 of 2 CPUs).

A replica with ``num_cpus: 0`` (e.g. a GPU-bound model whose CPU work is negligible) still asks
:data:`PIN_UNITS` (0.01 unit = 0.00001 CPU) so that it is pinned to its pool's nodes; every node offers
:data:`PIN_ALLOWANCE_UNITS` (1 unit) on top of its CPUs to hold up to 100 such replicas, so pinning never
eats into the budget of real CPU shares (the budget is over-runnable by at most one milli-CPU).

GPUs are not in the pool resource: they are Ray's ``GPU`` of the pool's nodes (``--num-gpus`` of the node
group). A pool's ``gpus`` is what :func:`overcommit_errors` checks the models against and what the node
group must offer. Ray places more than one GPU only in whole GPUs (1.5 is refused when the replica is
created), which :func:`overcommit_errors` reports up front.

Memory: ``PoolSpec.memory_gb`` caps what the pool's deployments declare. ``ModelSpec`` and ``StageSpec``
have no ``memory_gb`` today, so their memory demand is 0; once they do, it is summed and checked here, and
:func:`actor_options` passes it to Ray's ``memory`` resource.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from riskserve.platform.errors import ConfigError
from riskserve.schema.deployments import FEATURES, FEEDBACK, INGRESS
from riskserve.schema.pipeline import PipelineSpec, PoolSpec

__all__ = [
    "PIN_ALLOWANCE_UNITS",
    "PIN_UNITS",
    "UNITS_PER_CPU",
    "Placement",
    "PoolDemand",
    "actor_options",
    "check_pools",
    "ingress_cpus",
    "node_group_resources",
    "node_resources",
    "overcommit_errors",
    "pool_capacity",
    "pool_demands",
    "pool_units",
    "single_node_resources",
]

UNITS_PER_CPU = 1000
"""Units of ``riskserve_pool_<name>`` per CPU of the pool (a unit is one milli-CPU)."""
PIN_UNITS = 0.01
"""Units a zero-CPU replica asks, only to be pinned to its pool's nodes."""
PIN_ALLOWANCE_UNITS = 1
"""Units every pool node offers beyond its CPUs, for pinning zero-CPU replicas (100 of them per node)."""

_GIB = 1024**3
_EPS = 1e-9

Specs = PipelineSpec | Iterable[PipelineSpec]


@dataclass(frozen=True)
class Placement:
    """One deployment's replicas on a pool: how many, and the share each replica takes."""

    pipeline: str
    deployment: str
    """The model's name, ``features``, ``ingress`` or ``feedback``."""
    path: str
    """Where it is set in the YAML: ``models.<name>`` or ``serving.features`` / ``serving.ingress``."""
    replicas: int
    num_cpus: float
    """CPUs of one replica."""
    num_gpus: float
    """GPUs of one replica."""
    memory_gb: float
    """Memory of one replica (0: not declared)."""


@dataclass(frozen=True)
class PoolDemand:
    """Everything placed on one pool: the summed demand of all its replicas, and who makes it up."""

    pool: str
    capacity: PoolSpec
    """The pool as declared (the largest declaration when several pipelines declare it)."""
    cpus: float
    gpus: float
    memory_gb: float
    placements: tuple[Placement, ...]

    @property
    def units(self) -> float:
        """``riskserve_pool_<name>`` units all replicas ask (CPUs in milli-CPUs, plus pins)."""
        return sum(p.replicas * pool_units(p.num_cpus) for p in self.placements)


def _as_list(specs: Specs) -> list[PipelineSpec]:
    return [specs] if isinstance(specs, PipelineSpec) else list(specs)


def _num(value: float) -> str:
    return f"{round(value, 4):g}"


def _memory_gb(obj: object) -> float:
    # ModelSpec/StageSpec have no memory_gb yet; count it as soon as one does.
    value = getattr(obj, "memory_gb", None)
    return float(value) if value else 0.0


def pool_units(num_cpus: float) -> float:
    """``riskserve_pool_<name>`` units one replica asks for ``num_cpus`` (a zero-CPU replica asks a pin)."""
    if num_cpus < 0:
        raise ValueError(f"num_cpus must be >= 0, not {num_cpus}")
    return max(round(num_cpus * UNITS_PER_CPU, 4), PIN_UNITS)


def pool_capacity(specs: Specs, pool: str) -> PoolSpec:
    """A pool as declared by ``specs``; when several declare it, the largest of each capacity.

    Raises:
        ConfigError: no spec declares the pool.
    """
    declared = [spec.pools[pool] for spec in _as_list(specs) if pool in spec.pools]
    if not declared:
        raise ConfigError(f"pool '{pool}' is not declared by any pipeline")
    memories = [p.memory_gb for p in declared if p.memory_gb is not None]
    return PoolSpec(
        cpus=max(p.cpus for p in declared),
        gpus=max(p.gpus for p in declared),
        memory_gb=max(memories) if memories else None,
        node_group=next((p.node_group for p in declared if p.node_group), None),
    )


def ingress_cpus(spec: PipelineSpec) -> float:
    """CPUs one ingress replica takes: its own share plus that of every model placed in it."""
    return spec.serving.ingress.num_cpus + sum(m.num_cpus for m in spec.models.values() if m.in_ingress)


def _placements(spec: PipelineSpec) -> Iterable[tuple[str, Placement]]:
    for name, model in spec.models.items():
        # A model in the ingress runs in every ingress replica: its share counts once per ingress replica.
        replicas = spec.serving.ingress.replicas if model.in_ingress else model.replicas
        yield (
            model.pool,
            Placement(
                pipeline=spec.name,
                deployment=f"{INGRESS} ({name})" if model.in_ingress else name,
                path=f"models.{name}",
                replicas=replicas,
                num_cpus=model.num_cpus,
                num_gpus=model.num_gpus,
                memory_gb=_memory_gb(model),
            ),
        )
    own = (INGRESS,) if spec.serving.feature_stage == "ingress" else (FEATURES, INGRESS)
    stages = {name: getattr(spec.serving, name) for name in own}
    if spec.feedback is not None:
        stages[FEEDBACK] = spec.feedback.stage
    for stage_name, stage in stages.items():
        yield (
            spec.stage_pool(stage),
            Placement(
                pipeline=spec.name,
                deployment=stage_name,
                path="feedback" if stage_name == FEEDBACK else f"serving.{stage_name}",
                replicas=stage.replicas,
                num_cpus=stage.num_cpus,
                num_gpus=0.0,
                memory_gb=_memory_gb(stage),
            ),
        )


def pool_demands(specs: Specs) -> dict[str, PoolDemand]:
    """Per declared pool, the summed CPUs/GPUs/memory of every replica placed on it, with its make-up.

    With several pipelines (one Ray cluster, pools shared by name), their demands on a pool add up.
    Placements on an undeclared pool are left out (:func:`~riskserve.schema.pipeline.parse_pipeline`
    rejects them).
    """
    spec_list = _as_list(specs)
    by_pool: dict[str, list[Placement]] = {}
    for spec in spec_list:
        for pool in spec.pools:
            by_pool.setdefault(pool, [])
    for spec in spec_list:
        for pool, placement in _placements(spec):
            if pool in by_pool:
                by_pool[pool].append(placement)
    return {
        pool: PoolDemand(
            pool=pool,
            capacity=pool_capacity(spec_list, pool),
            cpus=float(sum(p.replicas * p.num_cpus for p in placements)),
            gpus=float(sum(p.replicas * p.num_gpus for p in placements)),
            memory_gb=float(sum(p.replicas * p.memory_gb for p in placements)),
            placements=tuple(placements),
        )
        for pool, placements in by_pool.items()
    }


def overcommit_errors(specs: Specs) -> list[str]:
    """Every way the pools cannot hold what is placed on them, one message each (empty: all fit).

    * a pool whose replicas need more CPUs, GPUs or memory than it has, naming the numbers:
      ``pools.gpu: models need 1.5 GPUs (intent 2 x 0.5, embed 1 x 0.5), the pool has 1``;
    * a deployment asking for GPUs (CPUs) on a pool with ``gpus: 0`` (``cpus: 0``);
    * a single replica asking for more than its pool has: it could never be placed;
    * a replica asking for more than one GPU but not a whole number: Ray refuses it.

    With several pipelines, their demands on a pool add up and deployments are named ``pipeline/name``.
    """
    spec_list = _as_list(specs)
    several = len(spec_list) > 1
    errors: list[str] = []

    def who(p: Placement) -> str:
        return f"{p.pipeline}/{p.deployment}" if several else p.deployment

    def where(p: Placement) -> str:
        return f"{p.pipeline}: {p.path}" if several else p.path

    for pool, demand in pool_demands(spec_list).items():
        capacity = demand.capacity
        for p in demand.placements:
            if p.num_gpus > 1 and not float(p.num_gpus).is_integer():
                errors.append(
                    f"{where(p)}.num_gpus: {_num(p.num_gpus)} GPUs per replica cannot be placed: above 1, "
                    "Ray gives whole GPUs only (use 1, 2, ... or a fraction of one)"
                )
        dimensions: list[tuple[str, str, str, float, float | None]] = [
            ("num_cpus", "CPUs", "cpus", demand.cpus, capacity.cpus),
            ("num_gpus", "GPUs", "gpus", demand.gpus, capacity.gpus),
            ("memory_gb", "GB of memory", "memory_gb", demand.memory_gb, capacity.memory_gb),
        ]
        for field, unit, pool_field, needed, has in dimensions:
            if has is None:  # memory not limited by the pool
                continue
            asking = [p for p in demand.placements if getattr(p, field) > 0]
            if has <= 0:
                for p in asking:
                    errors.append(
                        f"{where(p)}.{field}: {_num(getattr(p, field))} {unit} per replica on pool "
                        f"'{pool}', which has none ({pool_field}: 0)"
                    )
                continue
            for p in asking:
                if getattr(p, field) > has + _EPS:
                    errors.append(
                        f"{where(p)}: one replica needs {_num(getattr(p, field))} {unit}, more than pool "
                        f"'{pool}' has ({_num(has)}): it could never be placed"
                    )
            if needed > has + _EPS:
                parts = ", ".join(f"{who(p)} {p.replicas} x {_num(getattr(p, field))}" for p in asking)
                errors.append(
                    f"pools.{pool}: models need {_num(needed)} {unit} ({parts}), the pool has {_num(has)}"
                )
    return errors


def check_pools(specs: Specs) -> None:
    """Raise if any pool is over-committed (see :func:`overcommit_errors`).

    Raises:
        ConfigError: listing every problem.
    """
    errors = overcommit_errors(specs)
    if errors:
        names = ", ".join(s.name for s in _as_list(specs))
        raise ConfigError(f"{names}: {len(errors)} pool error(s)\n  " + "\n  ".join(errors))


def actor_options(
    spec: PipelineSpec, pool: str, num_cpus: float, num_gpus: float = 0.0, *, memory_gb: float | None = None
) -> dict[str, Any]:
    """``ray_actor_options`` of one replica placed on ``pool`` with its share.

    ``num_cpus`` and (when non-zero) ``num_gpus`` are Ray's own resources; the pool's custom resource is
    asked in milli-CPUs (a pin for a zero-CPU replica), which keeps the replica on the pool's nodes and
    within the pool's CPU budget. ``memory_gb`` becomes Ray's ``memory`` (bytes) when given.

    Raises:
        ConfigError: ``pool`` is not declared by ``spec``.
    """
    if pool not in spec.pools:
        raise ConfigError(f"{spec.name}: unknown pool '{pool}' (pools: {', '.join(spec.pools)})")
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "resources": {spec.pool_resource(pool): pool_units(num_cpus)},
    }
    if num_gpus:
        options["num_gpus"] = num_gpus
    if memory_gb:
        options["memory"] = int(memory_gb * _GIB)
    return options


def node_resources(specs: Specs, pool: str, *, nodes: int = 1) -> dict[str, float]:
    """The custom resources a node of ``pool`` must offer: ``--resources`` of ``ray start``, KubeRay's
    ``rayStartParams.resources``.

    The pool's CPUs are split evenly over the ``nodes`` of its node group (a replica is placed on one
    node, so it must fit one node's part). Whole numbers, as Ray requires. The node's own CPUs and GPUs
    are set apart (``--num-cpus`` >= the node's part of ``cpus``, ``--num-gpus`` = its part of ``gpus``);
    a node of two pools (same node group) offers both pools' resources (:func:`node_group_resources`).

    Raises:
        ConfigError: no spec declares ``pool``; ``nodes`` < 1.
    """
    if nodes < 1:
        raise ConfigError(f"pool '{pool}': a node group has at least 1 node, not {nodes}")
    capacity = pool_capacity(specs, pool)
    units = math.floor(capacity.cpus * UNITS_PER_CPU / nodes + _EPS) + PIN_ALLOWANCE_UNITS
    return {PipelineSpec.pool_resource(pool): float(units)}


def node_group_resources(specs: Specs, nodes: Mapping[str, int] | None = None) -> dict[str, dict[str, float]]:
    """Per node group, the custom resources each of its nodes offers (every pool declared on the group).

    ``nodes`` gives a group's node count (default 1). A pool without ``node_group`` is listed under its
    own name.
    """
    spec_list = _as_list(specs)
    groups: dict[str, dict[str, float]] = {}
    for pool in dict.fromkeys(p for spec in spec_list for p in spec.pools):
        group = pool_capacity(spec_list, pool).node_group or pool
        count = (nodes or {}).get(group, 1)
        groups.setdefault(group, {}).update(node_resources(spec_list, pool, nodes=count))
    return groups


def single_node_resources(specs: Specs) -> dict[str, float]:
    """The custom resources of a one-machine Ray hosting every pool of ``specs`` (``ray.init(resources=)``).

    Each pool offers its full CPU budget on the one node, so pools stay apart even though they share the
    machine's ``CPU``; ``ray.init``'s ``num_cpus`` should cover the sum (Ray's own GPUs are detected).
    """
    spec_list = _as_list(specs)
    resources: dict[str, float] = {}
    for pool in dict.fromkeys(p for spec in spec_list for p in spec.pools):
        resources.update(node_resources(spec_list, pool))
    return resources
