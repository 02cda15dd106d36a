"""The tree's shape for people to look at (`GET /cache/tree`): per root (one per salt,
named by a digest, never by the salt itself: a salt partitions tenants), nodes down to
a depth, each with its span, which tier holds each component's slot, its locks and
session references. Read-only, standard library only."""
from __future__ import annotations

import hashlib


def _tier(nd, c: int) -> str:
    dev, host = nd.value[c] is not None, nd.host[c] is not None
    return "device+host" if dev and host else "device" if dev else "host" if host else "absent"


def node_shape(tree, nd, depth: int, children: int) -> dict:
    out = {"start": nd.start, "end": nd.end, "tokens": nd.end - nd.start,
           "components": {name: _tier(nd, i) for i, name in enumerate(tree.names)},
           "locks": dict(zip(tree.names, nd.locks)), "session_refs": dict(zip(tree.names, nd.refs)),
           "hits": nd.hits}
    kids = list(nd.children.values())
    if depth <= 0:
        out["children"], out["more_children"] = [], len(kids)
        return out
    kids.sort(key=lambda k: -(k.end - k.start))  # the longest spans first
    out["children"] = [node_shape(tree, k, depth - 1, children) for k in kids[:children]]
    out["more_children"] = max(0, len(kids) - children)
    return out


def tree_shape(tree, depth: int = 4, children: int = 32) -> dict:
    """{"page_size", "components", "nodes", "roots": [{"salt", "children", ...}]}."""
    roots = []
    for key, root in tree.roots.items():
        salt = None if key is None else hashlib.sha256(repr(key).encode()).hexdigest()[:12]
        shape = node_shape(tree, root, depth, children)
        roots.append({"salt": salt, "children": shape["children"], "more_children": shape["more_children"]})
    return {"page_size": tree.page_size, "components": list(tree.names), "nodes": tree.num_nodes,
            "depth": depth, "roots": roots}
