"""Several slices as one TPU: a multislice queued resource and the nodes it makes.

`tpurun create NAME -t v4-16 --slices N` asks for one queued resource NAME whose one node spec carries
`multisliceParams {nodeCount: N, nodeIdPrefix: NAME}`; Cloud TPU then makes the nodes NAME-0 …
NAME-(N-1), one per slice, each marked `multisliceNode`, and gives every worker the MEGASCALE values
that join the slices (docs/multislice.md). Everywhere else in tpurun, NAME stands for all of them.
"""

from __future__ import annotations

from google.cloud import tpu_v2

from tpurun.cloud.client import Cloud
from tpurun.errors import UsageError
from tpurun.naming import validate_name
from tpurun.topology import Topology


def slice_ids(name: str, count: int) -> list[str]:
    """The node ids Cloud TPU gives the slices of queued resource NAME (its id as the prefix)."""
    return [f"{name}-{i}" for i in range(count)]


def check_request(name: str, topo: Topology, slices: int) -> None:
    """Refuse what Cloud TPU would refuse, before any call: a count below 1, or several slices of a
    generation that cannot be joined."""
    if slices < 1:
        raise UsageError(f"--slices {slices}: give 1 or more")
    if slices == 1:
        return
    if not topo.multislice:
        raise UsageError(
            f"--slices {slices}: Cloud TPU joins slices of TPU v4 and newer only; {topo.name} is a "
            f"{topo.generation} slice",
            hint="use one bigger slice (`tpurun topology` lists the sizes) or a v4, v5e, v5p or v6e type",
        )
    for node_id in slice_ids(name, slices):
        validate_name(node_id)  # the last slice's id must fit too


def refuse_taken(cloud: Cloud, name: str, slices: int) -> None:
    """A multislice request spans several resources: say which one of them exists, before asking."""
    taken = [n for n in [name, *slice_ids(name, slices)] if cloud.find_node(n) is not None]
    if cloud.find_queued_resource(name) is not None:
        taken.insert(0, f"queued resource {name}")
    if taken:
        raise UsageError(
            f"{name}: {', '.join(taken)} already exist(s), so {slices} slices named {name}-0…{name}-{slices - 1} "
            "cannot be made",
            hint=f"choose another name, or `tpurun delete {name}` first",
        )


def queued_resource(cloud: Cloud, name: str, slices: int, node: tpu_v2.Node) -> tpu_v2.QueuedResource:
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
        parent=cloud.parent,
        multislice_params=tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(node_count=slices, node_id_prefix=name),
        node=node,
    )
    return tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))


def slice_count(qr: tpu_v2.QueuedResource) -> int:
    """How many slices a queued resource asks for: 0 when it is not a multislice request."""
    specs = list(qr.tpu.node_spec) if qr.tpu else []
    if len(specs) == 1 and "multislice_params" in specs[0]:
        return int(specs[0].multislice_params.node_count)
    return 0


# a multislice TPU: its queued resource, and each slice's node in slice order (None where there is none)
Slices = tuple[tpu_v2.QueuedResource, list[tpu_v2.Node | None]]


def slice_nodes(cloud: Cloud, name: str) -> Slices | None:
    """The multislice queued resource NAME and its slices' nodes in slice order (None for one that does
    not exist, yet or any more); None when NAME is not a multislice request."""
    qr = cloud.find_queued_resource(name)
    if qr is None or not slice_count(qr):
        return None
    prefix = qr.tpu.node_spec[0].multislice_params.node_id_prefix or name
    return qr, [cloud.find_node(n) for n in slice_ids(prefix, slice_count(qr))]


def slice_of(node: tpu_v2.Node) -> tuple[str, int] | None:
    """(queued resource id, slice index) of a node a multislice request made, from its name."""
    if not node.multislice_node or not node.queued_resource:
        return None
    base, _, index = node.name.rsplit("/", 1)[-1].rpartition("-")
    return (node.queued_resource.rsplit("/", 1)[-1], int(index)) if index.isdigit() and base else None


def qr_state(qr: tpu_v2.QueuedResource) -> str:
    return tpu_v2.QueuedResourceState.State(qr.state.state).name
