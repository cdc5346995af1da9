"""The Ray Serve request router (cobali.ray.router) without a cluster: it takes the replicas' routing stats from
the list Ray Serve hands it, ranks them for a call by the hint riding with it, counts each replica's calls from
routed to completed, and publishes the replica ids the ingress asks; and the deployment's replica options."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from cobali.http.config import ServerConfig
from cobali.ray.policy import PolicyConfig, RoutingHint, policy_of
from cobali.ray.router import HINT, CobaliRouter
from cobali.ray.serve import ENGINES, scaling

DEPLOYMENT = DeploymentID(name=ENGINES, app_name="cobali")


class FakeReplica:
    """What the router reads of a RunningReplica (it probes a new one's queue length)."""

    def __init__(self, name: str, stats: dict[str, Any], max_ongoing_requests: int = 100) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.routing_stats = stats
        self.max_ongoing_requests = max_ongoing_requests

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def call(name: str, hint: RoutingHint | None) -> PendingRequest:
    return PendingRequest([], {HINT: hint} if hint is not None else {}, RequestMetadata(name, name))


def test_the_router_ranks_by_the_hint_and_the_reports_it_is_handed() -> None:
    async def run() -> None:
        router = CobaliRouter(DEPLOYMENT, DeploymentHandleSource.REPLICA)
        router.initialize_state(**PolicyConfig().as_kwargs())
        assert policy_of(ENGINES) is router.policy
        blocks = tuple(range(1, 9))
        a = FakeReplica("a", {})
        b = FakeReplica("b", {"seq": 1, "at": 0.0, "hashes": list(blocks), "kv_use": 0.1})
        router.update_replicas([a, b])  # type: ignore[list-item]
        assert router.policy.replicas == ("a", "b")

        hinted = call("1", RoutingHint(blocks, 8 * 64))
        ranks = await router.choose_replicas([a, b], hinted)  # type: ignore[list-item]
        assert ranks == [[b], [a]]
        assert hinted.routing_context.should_backoff  # should none take it: asked again after a backoff
        router.on_request_routed(hinted, b.replica_id, None)
        assert router.policy._queue["b"] == 1
        router.on_request_completed(b.replica_id, "1")
        assert router.policy._queue["b"] == 0

        pinned = call("2", RoutingHint(replica="gone"))
        assert await router.choose_replicas([a, b], pinned) == []  # type: ignore[list-item]
        assert pinned.routing_context.should_backoff  # waits with backoff, not in a busy loop
        assert await router.choose_replicas([a, b], call("3", None))  # type: ignore[list-item]

        router.update_replicas([a])  # type: ignore[list-item]
        assert router.policy.replicas == ("a",) and set(router.policy.report_ages()) == set()

    asyncio.run(run())


def test_replicas_are_a_number_or_autoscaled() -> None:
    assert scaling(ServerConfig(replicas=3)) == {"num_replicas": 3}
    assert scaling(ServerConfig(max_replicas=4)) == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}
    autoscaled = scaling(ServerConfig(min_replicas=0, max_replicas=2, target_ongoing_requests=8))
    assert autoscaled == {"autoscaling_config": {"min_replicas": 0, "max_replicas": 2, "target_ongoing_requests": 8}}
