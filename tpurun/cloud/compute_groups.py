"""A multi-host TPU's parts on Compute Engine, a part of tpurun's Compute backend: its zonal managed instance
groups (one per slice), the regional workload policy that gives them the slice's shape, and the
regional instance template their VMs are made from, all named after the TPU; finding, making and deleting them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from google.cloud import compute_v1

from tpurun.cloud.backend import Progress
from tpurun.cloud.client import short_name
from tpurun.cloud.compute_calls import ComputeCalls
from tpurun.errors import UsageError
from tpurun.topology import Topology, from_machine_type, vm_topology

# what tpurun writes in the description of the template and policy it makes for a TPU: delete takes only
# those with it (a MIG made elsewhere may share its template or policy with other groups)
MADE_BY = "made by tpurun for the TPU "


class ComputeGroups:
    """A TPU's instance groups, workload policy and instance template, through CALLS' clients."""

    def __init__(self, calls: ComputeCalls) -> None:
        self.calls = calls
        self.project, self.zone, self.region = calls.project, calls.zone, calls.region

    # ------------------------------------------------------------------ reading

    def get_group(self, name: str) -> compute_v1.InstanceGroupManager | None:
        return self.calls.find(
            f"get instance group {name}",
            lambda: self.calls.managers.get(project=self.project, zone=self.zone, instance_group_manager=name),
        )

    def group_vms(self, name: str) -> list[compute_v1.Instance]:
        """The VMs of the group NAME that exist, through listManagedInstances."""
        managed = self.calls.call(
            f"list the VMs of {name}",
            lambda: list(
                self.calls.managers.list_managed_instances(
                    project=self.project, zone=self.zone, instance_group_manager=name
                )
            ),
        )
        names = {short_name(m.instance) for m in managed if m.instance}  # a placeholder has no VM yet
        if not names:
            return []
        vms = self.calls.call(
            "list instances", lambda: list(self.calls.instances.list(project=self.project, zone=self.zone))
        )
        return [vm for vm in vms if vm.name in names]

    def group_topology(self, group: compute_v1.InstanceGroupManager, machine_type: str) -> Topology:
        policy_url = group.resource_policies.workload_policy
        if not policy_url:
            return vm_topology(machine_type)
        policy = self.policy(policy_url)
        shape = policy.workload_policy.accelerator_topology if policy else ""
        return from_machine_type(machine_type, shape) if shape else vm_topology(machine_type)

    def template(self, url: str) -> compute_v1.InstanceTemplate | None:
        parts = url.split("/")
        name = parts[-1]
        if "regions" in parts:
            region = parts[parts.index("regions") + 1]
            return self.calls.find(
                f"get instance template {name}",
                lambda: self.calls.templates.get(project=self.project, region=region, instance_template=name),
            )
        return self.calls.find(
            f"get instance template {name}",
            lambda: self.calls.global_templates.get(project=self.project, instance_template=name),
        )

    def policy(self, url: str) -> compute_v1.ResourcePolicy | None:
        parts = url.split("/")
        region = parts[parts.index("regions") + 1] if "regions" in parts else self.region
        return self.calls.find(
            f"get workload policy {parts[-1]}",
            lambda: self.calls.policies.get(project=self.project, region=region, resource_policy=parts[-1]),
        )

    def made_template(self, group: compute_v1.InstanceGroupManager, name: str) -> bool:
        """The group's template is the one tpurun made for the TPU NAME (a group made elsewhere may share its
        template with other groups)."""
        template = self.template(group.instance_template)
        return template is not None and template.description == MADE_BY + name

    def made_policy(self, group: compute_v1.InstanceGroupManager, name: str) -> bool:
        url = group.resource_policies.workload_policy
        policy = self.policy(url) if url else None
        return policy is not None and policy.description == MADE_BY + name

    # ------------------------------------------------------------------ making

    def refuse_taken(self, name: str, groups: list[str], *, policy: bool) -> None:
        """Refuse, before anything is made, a TPU whose group, template or policy name is taken."""
        taken = [f"instance group {g}" for g in groups if self.get_group(g) is not None]
        if self.template(self.template_path(name)) is not None:
            taken.append(f"instance template {name}")
        if policy and self.policy(self.policy_path(name)) is not None:
            taken.append(f"workload policy {name}")
        if taken:
            raise UsageError(
                f"{name}: Compute Engine already has {', '.join(taken)}, which tpurun would make for it",
                hint=f"choose another name, or `tpurun delete {name}` first",
            )

    def insert_group(
        self,
        name: str,
        template: str,
        size: int,
        policy: str,
        about: str,
        started: Callable[[], None] | None = None,
        *,
        bulk: bool = False,
    ) -> None:
        """The managed instance group NAME: SIZE VMs of TEMPLATE, shaped by the workload POLICY (if any); in
        BULK mode (flex-start) it makes them all at once when capacity for all of them is free."""
        group = compute_v1.InstanceGroupManager(
            name=name,
            description=about,
            base_instance_name=name,
            instance_template=template,
            target_size=size,
        )
        if bulk:
            group.target_size_policy = compute_v1.InstanceGroupManagerTargetSizePolicy(mode="BULK")
        if policy:
            group.resource_policies = compute_v1.InstanceGroupManagerResourcePolicies(workload_policy=policy)
        self.calls.operate(
            f"create instance group {name}",
            lambda: self.calls.managers.insert_unary(
                project=self.project, zone=self.zone, instance_group_manager_resource=group
            ),
            600,
            started=started,
        )

    def make_policy(self, name: str, topo: Topology, started: Callable[[], None]) -> str:
        """The workload policy NAME of TOPO's shape; "" for a single-host slice, which needs none."""
        if not topo.multi_host:
            return ""
        policy = compute_v1.ResourcePolicy(
            name=name,
            description=MADE_BY + name,
            workload_policy=compute_v1.ResourcePolicyWorkloadPolicy(
                type_="HIGH_THROUGHPUT", accelerator_topology=topo.topology
            ),
        )
        self._regional(
            f"create workload policy {name}", self.calls.policies.insert_unary, started, resource_policy_resource=policy
        )
        return self.policy_path(name)

    def make_template(self, name: str, props: compute_v1.InstanceProperties, started: Callable[[], None]) -> str:
        template = compute_v1.InstanceTemplate(name=name, description=MADE_BY + name, properties=props)
        self._regional(
            f"create instance template {name}",
            self.calls.templates.insert_unary,
            started,
            instance_template_resource=template,
        )
        return self.template_path(name)

    def _regional(
        self, what: str, call: Callable[..., Any], started: Callable[[], None] | None = None, **args: Any
    ) -> None:
        """CALL on a regional resource of the TPU (its template, its workload policy) run to its end, said as WHAT."""
        self.calls.operate(what, lambda: call(project=self.project, region=self.region, **args), 300, started=started)

    def policy_path(self, name: str) -> str:
        return f"projects/{self.project}/regions/{self.region}/resourcePolicies/{name}"

    def template_path(self, name: str) -> str:
        return f"projects/{self.project}/regions/{self.region}/instanceTemplates/{name}"

    # ------------------------------------------------------------------ deleting

    def delete_groups(self, names: list[str], progress: Progress | None = None) -> None:
        """The groups NAMES deleted with their VMs: every deletion asked for first, then each waited for (a
        second Ctrl-C while waiting leaves none that was not asked for); one being deleted already is waited for."""
        asked = []
        for name in names:
            what = f"delete instance group {name}"
            call = functools.partial(
                self.calls.managers.delete_unary, project=self.project, zone=self.zone, instance_group_manager=name
            )
            asked.append((name, what, self.calls.ask_delete(what, call)))
        for name, what, op in asked:
            on_poll = functools.partial(progress, f"{name}: DELETING its VMs") if progress else None
            self.calls.deleted(what, op, functools.partial(self.get_group, name), on_poll)

    def delete_template(self, name: str) -> None:
        self._regional(f"delete instance template {name}", self.calls.templates.delete_unary, instance_template=name)

    def delete_policy(self, name: str) -> None:
        self._regional(f"delete workload policy {name}", self.calls.policies.delete_unary, resource_policy=name)
