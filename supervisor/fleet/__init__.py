"""A fleet of nodes: one cluster leader elected through an etcd v3 lease (see docs/fleet.md).

`election.Elector` is one node's part in the election (its roles: `roles.ROLE`),
`etcd.EtcdClient` the client under it, `node.Node` and `node.FleetView` what `supervisor run`
uses to join and to route, `status` the `supervisor status --cluster` view. The policy's
`cluster:` section, `ClusterSpec`, is part of the policy schema: `supervisor/fleet_spec.py`.
"""
