"""ServeConfig: engine threads sized to the concurrency limit (threads x generations <= cores)."""

from __future__ import annotations

import pytest

from specdec.models.errors import SpecdecError
from specdec.serve import ServeConfig
from specdec.serve.ray_app import check_local_resources, replica_config


@pytest.mark.parametrize("cores, concurrency, threads", [(2, 1, 2), (2, 2, 1), (8, 3, 2), (2, 4, 1), (16, 4, 4)])
def test_default_threads_fit_the_cores(cores, concurrency, threads):
    config = ServeConfig(artifact="a", max_concurrency=concurrency)
    assert config.engine_threads(cores) == threads
    assert (config.oversubscription(cores) is None) == (threads * concurrency <= cores)


def test_explicit_threads_are_kept_and_oversubscription_is_named():
    config = ServeConfig(artifact="a", max_concurrency=2, threads=2)
    assert config.engine_threads(2) == 2
    assert "2 threads x 2 concurrent generations > 2 cores" in config.oversubscription(2)
    assert ServeConfig(artifact="a", max_concurrency=2, threads=2).oversubscription(4) is None


def test_ray_replicas_size_threads_to_their_cpus_and_must_fit_the_machine():
    assert replica_config(ServeConfig(artifact="a"), 2.0).threads == 2
    assert replica_config(ServeConfig(artifact="a", max_concurrency=2), 4.0).threads == 2
    assert replica_config(ServeConfig(artifact="a"), 0.5).threads == 1
    assert replica_config(ServeConfig(artifact="a", threads=3), 1.0).threads == 3
    check_local_resources(2, 1.0, 0.0, cpus=2)
    with pytest.raises(SpecdecError, match="2 replicas x 1.5 CPUs need 3 CPUs; this machine has 2"):
        check_local_resources(2, 1.5, 0.0, cpus=2)
    with pytest.raises(SpecdecError, match="--replica-cpus must be > 0"):
        check_local_resources(1, 0.0, 0.0, cpus=2)


def test_ray_with_more_replicas_than_cpus_is_one_line_error(serve_artifact):
    from click.testing import CliRunner

    from specdec.cli.main import main

    result = CliRunner().invoke(main, ["serve", str(serve_artifact), "--ray", "--replicas", "64"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "64 replicas x 1 CPUs need 64 CPUs" in result.output


def test_app_builder_takes_a_config_files_args():
    pytest.importorskip("ray.serve")
    from ray.serve import Application

    from specdec.serve.ray_app import app_builder

    app = app_builder({"artifact": "/models/smollm2", "replicas": 3, "replica_cpus": 2, "max_concurrency": 2})
    assert isinstance(app, Application)
    deployment = app._bound_deployment  # what Ray will place: 3 replicas of 2 CPUs, 2 generations x 1 thread each
    assert deployment.num_replicas == 3 and deployment.ray_actor_options["num_cpus"] == 2.0
    assert deployment.init_args[0].threads == 1 and deployment.max_ongoing_requests == 2 + 16
    batched = app_builder({"artifact": "/models/smollm2", "replicas": 2, "replica_cpus": 2, "max_batch": 4})
    deployment = batched._bound_deployment  # the batch engine makes one call at a time: every CPU per call
    assert deployment.init_args[0].threads == 2 and deployment.max_ongoing_requests == 4 + 16
    with pytest.raises(SpecdecError, match="unknown max_batches"):
        app_builder({"artifact": "a", "max_batches": 4})
    with pytest.raises(SpecdecError, match="artifact missing"):
        app_builder({"replicas": 2})


def test_available_cores_reads_the_cgroup_quota(tmp_path):
    from specdec.serve.config import available_cores

    affinity = available_cores(str(tmp_path / "absent"))
    assert affinity >= 1
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")  # one CPU
    assert available_cores(str(quota)) == 1
    quota.write_text("max 100000\n")
    assert available_cores(str(quota)) == affinity
    quota.write_text("50000 100000\n")  # half a CPU still gets one thread
    assert available_cores(str(quota)) == 1


def test_max_batch_auto_is_twice_the_ragged_rows_or_those_rows_where_every_step_is_ragged(serve_artifact,
                                                                                         monkeypatch):
    from dataclasses import replace

    from click.testing import CliRunner

    from specdec.cli import serve as serve_cli
    from specdec.cli.main import main
    from specdec.models.manifest import load_manifest

    target = load_manifest(serve_artifact).target
    assert target.ragged_rows == 8 and target.serving_slots == 16
    assert replace(target, attention_pad_rows=1).serving_slots == 8  # int4: its plain graph batches no 1-token rows
    assert replace(target, min_rows=2).serving_slots == 8
    assert replace(target, ragged_rows=0, ragged_file=None).serving_slots == 8  # exported before the ragged graph

    started = []
    monkeypatch.setattr(serve_cli, "_serve_one_process", lambda config, *args: started.append(config.max_batch))
    for flag, slots in (([], 16), (["--max-batch", "auto"], 16), (["--max-batch", "3"], 3)):
        result = CliRunner().invoke(main, ["serve", str(serve_artifact), "--port", "0"] + flag)
        assert result.exit_code == 0, result.output
        assert started.pop() == slots
    for bad in ("0", "many"):
        result = CliRunner().invoke(main, ["serve", str(serve_artifact), "--max-batch", bad])
        assert result.exit_code == 2 and "must be a whole number >= 1 or 'auto'" in result.output
        assert "Traceback" not in result.output


def test_the_prefill_budget_reaches_the_batch_engine(tiny_artifacts):
    from specdec.runtime import Engine
    from specdec.serve import ServeConfig
    from specdec.serve.app import ServerState

    engine = Engine.load(tiny_artifacts["llama"], provider="cpu", threads=1)
    state = ServerState(ServeConfig(artifact=str(tiny_artifacts["llama"]), max_batch=2, prefill_budget=96), engine)
    try:
        assert state.batch.prefill_budget == 96 and state.batch.prefix_cache
    finally:
        state.batch.shutdown()
