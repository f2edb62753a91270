"""A fleet of nodes: one cluster leader elected through an etcd v3 lease (see docs/fleet.md).

Not yet wired into `supervisor run`: `spec.ClusterSpec` is the policy's `cluster:` section,
`election.Elector` one node's part in the election, `etcd.EtcdClient` the client under it.
"""
