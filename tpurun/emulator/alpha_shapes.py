"""Cloud TPU v2alpha1's shapes of what v2's handlers answer (a node, a queued resource, an operation, or a list of
them): its fields and type URLs. Imports nothing of the emulator's, so that an operation (model.py) answers in its
version's shapes wherever it is listed, and v2alpha1's front (alpha_api.py) answers in them too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_V2, _ALPHA = ".v2.", ".v2alpha1."


def to_alpha(x: Any) -> Any:
    """An answer of v2's handlers (a node, a queued resource, an operation, or a list of them) in v2alpha1's
    shapes and type URLs."""
    if not isinstance(x, dict):
        return x
    for key, fn in (("nodes", _node_to_alpha), ("queuedResources", _qr_to_alpha), ("operations", _op_to_alpha)):
        if isinstance(x.get(key), list):
            return {**x, key: [fn(i) for i in x[key]]}
    name = str(x.get("name", ""))
    kinds: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = [
        ("/operations/", _op_to_alpha),
        ("/queuedResources/", _qr_to_alpha),
        ("/nodes/", _node_to_alpha),
    ]
    return next((fn(x) for part, fn in kinds if part in name), x)


def _node_to_alpha(d: dict[str, Any]) -> dict[str, Any]:
    """v2alpha1's Node has no protectionTier, and its ApiVersion enum no V2: a node v2 made says no version there."""
    return {k: v for k, v in d.items() if k != "protectionTier" and not (k == "apiVersion" and v == "V2")}


def _qr_to_alpha(d: dict[str, Any]) -> dict[str, Any]:
    if "tpu" not in d:
        return d
    specs = []
    for spec in d["tpu"].get("nodeSpec", []):
        s = {k: v for k, v in spec.items() if k != "multisliceParams"}
        if "node" in s:
            s["node"] = _node_to_alpha(s["node"])
        if "multisliceParams" in spec:
            s["multiNodeParams"] = spec["multisliceParams"]
        specs.append(s)
    return {**d, "tpu": {**d["tpu"], "nodeSpec": specs}}


def _op_to_alpha(d: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    if "metadata" in d:
        out["metadata"] = {**d["metadata"], "@type": str(d["metadata"].get("@type", "")).replace(_V2, _ALPHA)}
    response = d.get("response")
    if isinstance(response, dict):
        kind = str(response.get("@type", ""))
        body = {k: v for k, v in response.items() if k != "@type"}
        if kind.endswith(".QueuedResource"):
            body = _qr_to_alpha(body)
        elif kind.endswith(".Node"):
            body = _node_to_alpha(body)
        out["response"] = {"@type": kind.replace(_V2, _ALPHA), **body}
    return out
