"""Build one-device, one-replica rings (2^8 partitions) for account, container and object servers.

The same as `swift-ring-builder X.builder create 8 1 1`, `add r1z1-127.0.0.1:PORT/sdb1 100`, `rebalance`
for each ring, but in one process: each CLI call pays Swift's import time, nine of them took ~30 s on a
busy two-core machine. Run with the interpreter Swift is installed for (start.sh takes swift-ring-builder's).
usage: make_rings.py SWIFT_DIR ACCOUNT_PORT CONTAINER_PORT OBJECT_PORT
"""
import sys

from swift.common.ring import RingBuilder


def main() -> None:
    swift_dir, *ports = sys.argv[1:]
    for kind, port in zip(("account", "container", "object"), ports, strict=True):
        builder = RingBuilder(8, 1, 1)  # part_power, replicas, min_part_hours
        builder.add_dev({
            "region": 1, "zone": 1, "ip": "127.0.0.1", "port": int(port), "device": "sdb1", "weight": 100,
            "replication_ip": "127.0.0.1", "replication_port": int(port), "meta": "",
        })
        builder.rebalance()
        builder.get_ring().save(f"{swift_dir}/{kind}.ring.gz")
        builder.save(f"{swift_dir}/{kind}.builder")  # kept so an operator can inspect or extend the ring


if __name__ == "__main__":
    main()
