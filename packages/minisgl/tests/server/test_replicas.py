"""The API server's view of data-parallel replicas (`server/replicas.py`): round-robin uids
that skip a replica out of rotation, n choices on one replica, summed stats, metric lines."""

from __future__ import annotations

from minisgl.server.replicas import Replicas, replica_threads, worker_names


def test_round_robin_uids_skip_a_replica_that_is_down():
    reps = Replicas(3, routes=True, workers=worker_names("python", 3))
    assert reps.workers == ["scheduler", "scheduler1", "scheduler2"]
    homes = [reps.replica_of(reps.new_uids(1)[0]) for _ in range(4)]
    assert homes == [0, 1, 2, 0]
    choices = reps.new_uids(3)
    assert len(set(choices)) == 3 and {reps.replica_of(u) for u in choices} == {1}
    reps.mark_down(2, "gone")
    homes = [reps.replica_of(reps.new_uids(1)[0]) for _ in range(4)]
    assert homes == [0, 1, 0, 1]
    assert reps.routed == [4, 6, 1]
    assert [e["alive"] for e in reps.view()] == [True, True, False]


def test_service_routes_and_stats_sum_per_replica():
    reps = Replicas(2, routes=False, workers=worker_names("rust_service", 2))
    assert reps.new_uids(2) == [1, 2]
    total = reps.on_stats({"prompt_tokens": 30, "replicas": [
        {"replica": 0, "alive": True, "routed": 2, "prompt_tokens": 10,
         "cached_prompt_tokens": 5, "prefix_hit_rate": 0.5},
        {"replica": 1, "alive": False, "routed": 1, "prompt_tokens": 20},
    ]})  # fmt: skip
    assert total["prompt_tokens"] == 30
    assert [e["routed"] for e in reps.view()] == [2, 1]
    assert not reps.alive(1) and reps.any_alive()
    text = reps.render()
    assert 'minisgl_replica_healthy{replica="1"} 0.0' in text
    assert 'minisgl_replica_cached_prompt_tokens_total{replica="0"} 5.0' in text


def test_python_stats_sum_and_threads_share_the_cores():
    reps = Replicas(2, routes=True, workers=worker_names("python", 2))
    reps.on_stats({"replica": 0, "running": 2, "prompt_tokens": 10, "cached_prompt_tokens": 4})
    total = reps.on_stats({"replica": 1, "running": 1, "prompt_tokens": 10})
    assert total["running"] == 3 and total["prefix_hit_rate"] == 0.2
    reps.mark_down(1, "gone")
    assert reps.total()["running"] == 2 and reps.total()["prompt_tokens"] == 20
    assert replica_threads(None, 2, 1, cores=8) == 4
    assert replica_threads(None, 2, 2, cores=2) == 1
    assert replica_threads(3, 2, 1, cores=8) == 3
    assert replica_threads(None, 1, 1, cores=8) is None
