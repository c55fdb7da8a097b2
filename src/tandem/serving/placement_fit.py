"""Whether a placement group can ever be placed on the cluster's nodes, so an impossible one
(STRICT_SPREAD over more nodes than exist, a bundle larger than any node) fails at once with a
message instead of waiting out its deadline. Judged on the nodes' total resources: what other
work holds now may free up, a missing node or resource never appears by waiting."""

from __future__ import annotations

from typing import Any, Sequence

Resources = dict[str, float]


def alive_nodes() -> list[Resources]:
    """Total resources of every alive node of the Ray cluster this process is connected to."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def _fits(bundle: Resources, node: Resources) -> bool:
    return all(node.get(name, 0.0) >= amount for name, amount in bundle.items() if amount > 0)


def placement_problem(bundles: Sequence[Resources], strategy: str,
                      nodes: Sequence[Resources]) -> str | None:
    """Why `bundles` under `strategy` (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD) can never be
    placed on `nodes`, or None."""
    bundles = [{k: float(v) for k, v in bundle.items()} for bundle in bundles]
    shape = f"{len(bundles)} bundle(s) {bundles[0] if bundles else {}} ({strategy})"
    cluster = f"{len(nodes)} node(s): {[_main(node) for node in nodes]}"
    for bundle in bundles:
        if not any(_fits(bundle, node) for node in nodes):
            return f"{shape}: no node can hold a bundle of {bundle}; the cluster has {cluster}"
    if strategy == "STRICT_PACK":
        total = _sum(bundles)
        if not any(_fits(total, node) for node in nodes):
            return f"{shape}: STRICT_PACK needs one node with {total}; the cluster has {cluster}"
    elif strategy == "STRICT_SPREAD":
        free = list(nodes)
        for bundle in sorted(bundles, key=lambda b: -sum(b.values())):
            match = next((node for node in free if _fits(bundle, node)), None)
            if match is None:
                return (f"{shape}: STRICT_SPREAD puts each bundle on a node of its own, but only "
                        f"{sum(any(_fits(b, n) for b in bundles) for n in nodes)} node(s) can "
                        f"take one; the cluster has {cluster}. Use PACK or SPREAD, or fewer "
                        "bundles")
            free.remove(match)
    else:
        total, capacity = _sum(bundles), _sum(list(nodes))
        short = {k: v for k, v in total.items() if capacity.get(k, 0.0) < v}
        if short:
            return f"{shape}: needs {total} in all; the cluster has {capacity} ({cluster})"
    return None


def _sum(resources: Sequence[Resources]) -> Resources:
    total: Resources = {}
    for item in resources:
        for name, amount in item.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def _main(node: Resources) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k in ("CPU", "GPU")}
