"""The event bus on a real Redis Cluster (3 masters, a replica each, started by the test):
publishers and a consumer unchanged but for the ``redis+cluster://`` URL, each worker's keys
on one node by their hash tag; a master killed and replaced by its replica is survived."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster

from app.core.embedded_redis import EmbeddedCluster
from events import keys
from tests.events.support import Workload, assert_index_exact, drive, make_consumer, make_publisher


@pytest.fixture
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(3, replicas=1) as started:
        yield started


async def test_publishers_and_a_consumer_on_a_cluster(cluster: EmbeddedCluster) -> None:
    url = cluster.url
    workers = {f"w{i}": Workload(seed=700 + i) for i in range(6)}
    publishers = {w: make_publisher(url, w, load) for w, load in workers.items()}
    for publisher in publishers.values():
        await publisher.start()
    try:
        async with make_consumer(url) as consumer:
            for worker, load in workers.items():
                await drive(load, publishers[worker], 30)
            both = {w: (workers[w], publishers[w]) for w in workers}
            await assert_index_exact(consumer, both, timeout=20)

            # Each worker's keys live on one node, and the workers use all three masters.
            client = RedisCluster(host="127.0.0.1", port=cluster.masters[0].port)
            try:
                homes = {}
                for worker in workers:
                    names = [keys.events_key(worker), keys.snapshot_key(worker)]
                    names += [keys.load_key(worker), keys.alive_key(worker)]
                    ports = {client.get_node_from_key(name).port for name in names}
                    assert len(ports) == 1
                    homes[worker] = ports.pop()
                assert len(set(homes.values())) == 3
            finally:
                client.close()

            # A master dies; its replica takes over; everything carries on exactly.
            victim = next(m for m in cluster.masters if m.port == homes["w1"])
            victim.kill()
            for worker, load in workers.items():
                await drive(load, publishers[worker], 20)
            await assert_index_exact(consumer, both, timeout=30)
            stats = consumer.stats()
            assert stats["malformed"] == 0
    finally:
        for publisher in publishers.values():
            await publisher.aclose()
