"""A fleet of nodes: one cluster leader elected through an etcd v3 lease (see docs/fleet.md).

`spec.ClusterSpec` is the policy's `cluster:` section, `election.Elector` one node's part in
the election, `etcd.EtcdClient` the client under it, `node.Node` and `node.FleetView` what
`supervisor run` uses to join and to route, `status` the `supervisor status --cluster` view.
"""
