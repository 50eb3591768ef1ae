"""A discrete-event simulation of a fleet of replicas behind cache-aware routers
(BENCHMARKS, "Fleet simulation"): the workload of BENCHMARKS 15 in token space
(:mod:`.workload`), replicas that step as rbln-ray's engine does on the cost model's device
times (:mod:`.replica`), and whatever router the caller injects (:mod:`.sim`: the real
cache-aware router, through :mod:`rbln_ray.serve.fleet_router`)."""

from rbln_ray.planning.fleet.events import EventQueue
from rbln_ray.planning.fleet.ingress import DEFAULT_MODE, THROUGHPUT_MODE, IngressCosts
from rbln_ray.planning.fleet.metrics import summarise
from rbln_ray.planning.fleet.replica import Replica, ReplicaConfig, Report, SimRequest, StepCosts
from rbln_ray.planning.fleet.sim import Fleet, FleetConfig, FleetRouter, FleetRun, run_fleet
from rbln_ray.planning.fleet.workload import Corpus, SessionSpec, Workload, build_sessions

__all__ = [
    "DEFAULT_MODE",
    "THROUGHPUT_MODE",
    "Corpus",
    "EventQueue",
    "Fleet",
    "FleetConfig",
    "FleetRouter",
    "FleetRun",
    "IngressCosts",
    "Replica",
    "ReplicaConfig",
    "Report",
    "SessionSpec",
    "SimRequest",
    "StepCosts",
    "Workload",
    "build_sessions",
    "run_fleet",
    "summarise",
]
