"""The engine deployment's Ray Serve request router: cobali.ray.policy in Ray Serve's RequestRouter.

Ray Serve builds one in each process that holds a handle to the engine deployment (the ingress), from the
deployment's request_router_config (cobali.ray.serve): its kwargs are the policy's config. It lists the replicas
(update_replicas, with the routing stats each replica last recorded: EngineReplica.record_routing_stats), asks
for them ranked for each call (choose_replicas; the call's RoutingHint rides as its `hint` keyword), and says when
a call was routed and when it completed, which is the policy's count of each replica's load.

The ingress finds its process's router's policy by the deployment's name (policy.policy_of): the replicas it lists
are those the ingress asks for /metrics, /health and /slots, each by a call whose hint pins it to one replica.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cobali.ray.policy import Policy, PolicyConfig, RoutingHint, publish

HINT = "hint"  # the keyword a call's RoutingHint rides as (EngineReplica.handle takes it)


def hint_of(request: PendingRequest | None) -> RoutingHint | None:
    hint = request.kwargs.get(HINT) if request is not None else None
    return hint if isinstance(hint, RoutingHint) else None


class CobaliRouter(RequestRouter):
    policy: Policy

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = Policy(PolicyConfig.from_kwargs(kwargs))
        publish(self._deployment_id.name, self.policy)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.retain([r.replica_id.unique_id for r in replicas])
        for replica in replicas:
            self.policy.report(replica.replica_id.unique_id, replica.routing_stats or {})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.retain([r for r in self.policy.replicas if r != replica_id.unique_id])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None:
            # Ray Serve asks again at once unless told to back off: a rank none of whose replicas takes the call
            # (full, or slow to say its queue length), or a call pinned to a replica not listed (gone, or not
            # yet listed; the ingress gives up on it after its timeout), would spin the router's loop.
            pending_request.routing_context.should_backoff = True
        ranks = self.policy.rank(hint_of(pending_request), list(by_id))
        return [[by_id[r] for r in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.policy.routed(pending_request.metadata.internal_request_id, replica_id.unique_id,
                           hint_of(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(internal_request_id)
