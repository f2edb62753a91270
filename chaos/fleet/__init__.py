"""Fleet chaos: faults against several nodes electing one leader through etcd, run in
network namespaces built by scripts/fleet.sh; shared by bench/fleet.py and `chaos run`."""
