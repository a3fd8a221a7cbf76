"""Cluster resolvers, ClusterSpec and multi-worker helpers.

After TF's cluster_resolver and multi_worker_util tests.
"""

import json
import os
import re

import pytest

import keras_dist as kd
from keras_dist import cluster_resolver as cr

PS_WORKER_CLUSTER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}


def _set_tf_config(monkeypatch, config):
    monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))


def test_tf_config_cluster_spec_and_master(monkeypatch):
    _set_tf_config(monkeypatch, {"cluster": PS_WORKER_CLUSTER, "task": {"type": "ps", "index": 0}})
    resolver = cr.TFConfigClusterResolver()
    assert resolver.cluster_spec() == cr.ClusterSpec(PS_WORKER_CLUSTER)
    assert resolver.cluster_spec().as_dict() == PS_WORKER_CLUSTER
    assert resolver.master() == "ps0:2222"
    assert resolver.master("worker", 1) == "worker1:2222"


def test_tf_config_session_master_is_returned_as_is(monkeypatch):
    _set_tf_config(
        monkeypatch,
        {
            "cluster": PS_WORKER_CLUSTER,
            "session_master": "sessionmaster:2222",
            "task": {"type": "ps", "index": 0},
        },
    )
    assert cr.TFConfigClusterResolver().master() == "sessionmaster:2222"


def test_tf_config_rpc_layer(monkeypatch):
    _set_tf_config(
        monkeypatch,
        {"cluster": PS_WORKER_CLUSTER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 0}},
    )
    resolver = cr.TFConfigClusterResolver()
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, "grpc")


def test_tf_config_sparse_cluster(monkeypatch):
    _set_tf_config(
        monkeypatch,
        {
            "cluster": {"worker": {"1": "worker1:2222", "3": "worker3:2222"}},
            "task": {"type": "worker", "index": 3},
        },
    )
    resolver = cr.TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": {1: "worker1:2222", 3: "worker3:2222"}}
    assert resolver.master() == "worker3:2222"


def test_constructor_overrides_tf_config_task(monkeypatch):
    _set_tf_config(
        monkeypatch,
        {"cluster": PS_WORKER_CLUSTER, "rpc_layer": "grpc", "task": {"type": "worker", "index": 1}},
    )
    resolver = cr.TFConfigClusterResolver(task_type="ps", task_id=0)
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)


def test_setters(monkeypatch):
    _set_tf_config(
        monkeypatch,
        {"cluster": PS_WORKER_CLUSTER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 0}},
    )
    resolver = cr.TFConfigClusterResolver()
    resolver.task_type = "worker"
    resolver.task_id = 1
    resolver.rpc_layer = "test"
    assert resolver.master() == "test://worker1:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "test")


def test_constructor_rpc_layer_overrides(monkeypatch):
    _set_tf_config(
        monkeypatch,
        {"cluster": PS_WORKER_CLUSTER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 0}},
    )
    resolver = cr.TFConfigClusterResolver(task_type="worker", task_id=2, rpc_layer="test")
    assert resolver.master() == "test://worker2:2222"


def test_type_coercion(monkeypatch):
    _set_tf_config(
        monkeypatch, {"cluster": {"123456": ["h:1", "h:2"]}, "task": {"type": 123456, "index": "1"}}
    )
    resolver = cr.TFConfigClusterResolver()
    assert resolver.task_type == "123456"
    assert resolver.task_id == 1
    assert isinstance(resolver.task_id, int)


@pytest.mark.parametrize("config", ["{}", None])
def test_empty_or_unset_tf_config(monkeypatch, config):
    if config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        _set_tf_config(monkeypatch, config)
    resolver = cr.TFConfigClusterResolver()
    assert resolver.master() == ""
    assert not resolver.cluster_spec()
    assert resolver.task_type is None
    assert resolver.task_id is None
    assert resolver.rpc_layer is None


def test_one_task_cluster_has_no_master(monkeypatch):
    _set_tf_config(
        monkeypatch,
        {"cluster": {"worker": ["worker0:2222"]}, "task": {"type": "worker", "index": 0}},
    )
    assert cr.TFConfigClusterResolver().master() == ""


def test_bad_json_raises(monkeypatch):
    _set_tf_config(monkeypatch, "{not json")
    with pytest.raises(json.JSONDecodeError):
        cr.TFConfigClusterResolver().cluster_spec()


def test_environ_argument_replaces_os_environ(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    config = {"cluster": PS_WORKER_CLUSTER, "task": {"type": "worker", "index": 2}}
    resolver = cr.TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})
    assert resolver.master() == "worker2:2222"


def test_num_accelerators_filters_tasks_by_tf_config(monkeypatch):
    _set_tf_config(
        monkeypatch,
        {
            "cluster": {
                "worker1": ["w10:2222"],
                "worker2": ["w21:2222", "w22:2222", "w23:2222", "w24:2222"],
            },
            "rpc_layer": "grpc",
            "task": {"type": "worker1", "index": "0"},
        },
    )
    devices = [
        "/job:worker1/task:0/device:TPU:0",
        "/job:worker1/task:0/device:TPU:1",
        "/job:worker1/task:0/device:GPU:0",
        "/job:worker1/task:0/device:GPU:1",
        "/job:worker2/task:1/device:TPU:2",
        "/job:worker2/task:2/device:TPU:3",
        "/job:worker2/task:3/device:GPU:2",
        "/job:worker2/task:4/device:GPU:3",
        "/job:worker1/task:0/device:CPU:0",
    ]
    monkeypatch.setattr(cr.TFConfigClusterResolver, "_device_names", lambda self: devices)
    resolver = cr.TFConfigClusterResolver()
    assert resolver.num_accelerators() == {"TPU": 2, "GPU": 2}
    assert resolver.num_accelerators(task_type="worker2", task_id=3) == {"GPU": 1}


def test_num_accelerators_of_this_process_counts_no_cpus(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    # The test process has only (simulated) CPU devices.
    assert cr.TFConfigClusterResolver().num_accelerators() == {}


def test_simple_cluster_resolver_returns_what_it_was_given():
    spec = cr.ClusterSpec({"ps": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222"]})
    resolver = cr.SimpleClusterResolver(
        spec,
        task_type="ps",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 8},
        rpc_layer="grpc",
    )
    assert resolver.cluster_spec() == spec
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("ps", 1, "cloud")
    assert resolver.num_accelerators() == {"GPU": 8}
    assert resolver.rpc_layer == "grpc"
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://worker0:2222"
    assert cr.SimpleClusterResolver(spec, master="m:1").master() == "m:1"


def test_union_concatenates_overlapping_jobs():
    a = cr.SimpleClusterResolver(
        cr.ClusterSpec({"worker": ["w0:1", "w1:1"]}),
        task_type="worker",
        task_id=1,
        rpc_layer="grpc",
    )
    b = cr.SimpleClusterResolver(cr.ClusterSpec({"worker": ["w2:1"], "ps": ["p0:1"]}))
    union = cr.UnionClusterResolver(a, b)
    assert union.cluster_spec().as_dict() == {"worker": ["w0:1", "w1:1", "w2:1"], "ps": ["p0:1"]}
    assert (union.task_type, union.task_id, union.rpc_layer) == ("worker", 1, "grpc")
    assert union.master("worker", 2) == "grpc://w2:1"
    override = cr.UnionClusterResolver(a, b, task_type="ps", task_id=0, rpc_layer="test")
    assert (override.task_type, override.task_id, override.rpc_layer) == ("ps", 0, "test")


def test_union_merges_sparse_jobs_and_rejects_duplicate_keys():
    a = cr.SimpleClusterResolver(cr.ClusterSpec({"worker": {0: "w0:1", 2: "w2:1"}}))
    b = cr.SimpleClusterResolver(cr.ClusterSpec({"worker": {1: "w1:1", 5: "w5:1"}}))
    merged = cr.UnionClusterResolver(a, b).cluster_spec()
    assert merged.task_indices("worker") == [0, 1, 2, 5]
    c = cr.SimpleClusterResolver(cr.ClusterSpec({"worker": {2: "other:1"}}))
    with pytest.raises(KeyError, match="Duplicate keys detected"):
        cr.UnionClusterResolver(a, c).cluster_spec()


def test_union_needs_resolvers():
    with pytest.raises(ValueError, match="at least one"):
        cr.UnionClusterResolver()
    with pytest.raises(TypeError, match="ClusterResolver"):
        cr.UnionClusterResolver({"worker": ["w:1"]})


def test_union_resolver_is_tf_alias_of_union_cluster_resolver():
    assert kd.cluster_resolver.UnionResolver is kd.cluster_resolver.UnionClusterResolver
    assert "UnionResolver" in kd.cluster_resolver.__all__
    a = cr.SimpleClusterResolver(
        cr.ClusterSpec({"worker": ["w0:2222", "w1:2222"], "chief": ["c0:2222"]}),
        task_type="chief",
        task_id=0,
    )
    b = cr.SimpleClusterResolver(cr.ClusterSpec({"worker": ["w2:2222"], "ps": ["p0:2222"]}))
    union = kd.cluster_resolver.UnionResolver(a, b)
    assert union.cluster_spec().as_dict() == {
        "worker": ["w0:2222", "w1:2222", "w2:2222"],
        "chief": ["c0:2222"],
        "ps": ["p0:2222"],
    }
    assert (union.task_type, union.task_id) == ("chief", 0)
    assert union.master("worker", 2, rpc_layer="grpc") == "grpc://w2:2222"


def test_cluster_spec_sparse_job():
    spec = cr.ClusterSpec({"sparse": {0: "s0:2222", 3: "s3:2222"}})
    assert spec.num_tasks("sparse") == 2
    assert spec.task_indices("sparse") == [0, 3]
    assert spec.job_tasks("sparse") == ["s0:2222", None, None, "s3:2222"]
    assert spec.task_address("sparse", 3) == "s3:2222"
    assert spec.as_dict() == {"sparse": {0: "s0:2222", 3: "s3:2222"}}


def test_cluster_spec_unknown_job_or_index_raises():
    spec = cr.ClusterSpec({"worker": ["w0:2222"]})
    with pytest.raises(ValueError, match="No such job in cluster: 'ps'"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match="No such job in cluster"):
        spec.job_tasks("ps")
    with pytest.raises(ValueError, match="No task with index 1 in job 'worker'"):
        spec.task_address("worker", 1)


def test_cluster_spec_truth_and_equality():
    assert not cr.ClusterSpec({})
    assert cr.ClusterSpec({"job": ["h:2222"]})
    assert cr.ClusterSpec({}) == cr.ClusterSpec({})
    assert cr.ClusterSpec({"job": {0: "host:2222"}}) == cr.ClusterSpec({"job": ["host:2222"]})
    assert cr.ClusterSpec({}) != cr.ClusterSpec({"job": ["host:2223"]})
    assert cr.ClusterSpec({"job1": ["host:2222"]}) != cr.ClusterSpec({"job2": ["host:2222"]})
    assert cr.ClusterSpec({"job": ["host:2222"]}) != cr.ClusterSpec({"job": ["host:2223"]})
    # Order matters.
    assert cr.ClusterSpec({"job": ["h:2222", "h:2223"]}) != cr.ClusterSpec(
        {"job": ["h:2223", "h:2222"]}
    )


def test_cluster_spec_rejects_bad_input():
    with pytest.raises(TypeError, match="Received"):
        cr.ClusterSpec(["h:1"])
    with pytest.raises(TypeError, match="job 'worker'"):
        cr.ClusterSpec({"worker": "h:1"})


class _ForeignClusterSpec:
    """What keras_dist reads of a ``tf.train.ClusterSpec``: its methods and ``jobs``."""

    def __init__(self, cluster):
        self._cluster = cluster

    @property
    def jobs(self):
        return list(self._cluster)

    def as_dict(self):
        return self._cluster

    def as_cluster_def(self):
        raise AssertionError("keras_dist reads a foreign cluster spec through as_dict()")


def _takes_a_foreign_cluster_spec(foreign, expected):
    spec = cr.ClusterSpec(foreign)
    assert spec.as_dict() == expected
    assert spec == foreign
    resolver = cr.SimpleClusterResolver(foreign, task_type="worker", task_id=1)
    assert resolver.cluster_spec() == cr.ClusterSpec(expected)
    assert resolver.master("worker", 1, rpc_layer="grpc") == "grpc://worker1:2222"
    assert cr.worker_count(foreign, task_type="worker") == 2
    assert not cr.is_chief(foreign, "worker", 1)


def test_a_cluster_spec_of_tensorflows_shape_is_taken_wherever_a_cluster_is():
    cluster = {"worker": ["worker0:2222", "worker1:2222"], "ps": {0: "ps0:2222", 2: "ps2:2222"}}
    _takes_a_foreign_cluster_spec(_ForeignClusterSpec(cluster), cluster)


def test_a_tf_train_cluster_spec_is_taken_wherever_a_cluster_is():
    tf = pytest.importorskip("tensorflow")  # optional: the real class behind the stand-in
    cluster = {"worker": ["worker0:2222", "worker1:2222"], "ps": {0: "ps0:2222", 2: "ps2:2222"}}
    _takes_a_foreign_cluster_spec(tf.train.ClusterSpec(cluster), cluster)


def test_something_else_than_a_cluster_says_what_to_pass():
    class OnlyAsDict:  # not a cluster spec: it lacks as_cluster_def and jobs
        def as_dict(self):
            return {"worker": ["w:1"]}

    with pytest.raises(
        TypeError, match=r"or a `tf.train.ClusterSpec`\. Received: cluster=.* of type OnlyAsDict"
    ):
        cr.ClusterSpec(OnlyAsDict())
    with pytest.raises(TypeError, match="Received: cluster=.* of type OnlyAsDict"):
        cr.SimpleClusterResolver(OnlyAsDict())
    with pytest.raises(ValueError, match="or a `tf.train.ClusterSpec`. Received: cluster_spec="):
        cr.is_chief(OnlyAsDict(), "worker", 0)


# Slurm, Kubeflow, Keras and resolve_cluster (docs/architecture.md, "Several processes")


def _slurm_step(rank, nodes, tasks_per_node, num_tasks, **extra):
    """What srun sets for one task of a step (no GPUs: CUDA_VISIBLE_DEVICES is empty)."""
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_NUM_TASKS": str(num_tasks),
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "CUDA_VISIBLE_DEVICES": "",
        **extra,
    }


def test_slurm_hostlist_and_tasks_per_node():
    env = _slurm_step(4, "node[01-02],other", "2(x2),1", 5)
    resolver = cr.SlurmClusterResolver(environ=env)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["node01:8888", "node01:8889", "node02:8888", "node02:8889", "other:8888"]
    }
    assert resolver.get_task_info() == ("worker", 4)
    assert resolver.master() == "grpc://other:8888"
    assert resolver.master("worker", 1, rpc_layer="test") == "test://node01:8889"


def test_slurm_jobs_take_the_ranks_in_tfs_order_of_job_names_and_nodes():
    # TF sorts the jobs by name and the nodes by host name: rank 0 is the chief.
    env = _slurm_step(1, "n4,n[1,3]", "1(x2),2", 4, SLURM_NTASKS="99")
    jobs = {"ps": 1, "worker": 2, "chief": 1}
    resolver = cr.SlurmClusterResolver(jobs=jobs, port_base=9000, rpc_layer=None, environ=env)
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["n1:9000"],
        "ps": ["n3:9000"],
        "worker": ["n3:9001", "n4:9000"],
    }
    assert resolver.get_task_info() == ("ps", 0)
    assert resolver.master() == "n3:9000"
    for asked in ({"worker": 5}, {"worker": 3}):  # TF: more or fewer than the step's tasks
        with pytest.raises(RuntimeError, match=f"Requested {asked['worker']} tasks but only 4"):
            cr.SlurmClusterResolver(jobs=asked, environ=env)
    # tasks_per_node as a dict is the cluster, whatever the step's nodes.
    given = cr.SlurmClusterResolver(
        jobs={"worker": 2}, tasks_per_node={"b": 1, "a": 1}, environ=env
    )
    assert given.cluster_spec().as_dict() == {"worker": ["a:8888", "b:8888"]}


def test_slurm_outside_a_step_or_with_bad_variables_says_what_is_wrong():
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(RuntimeError, match="SLURM_STEP_NODELIST not found.*srun"):
        cr.SlurmClusterResolver(environ=batch_script)
    assert cr.resolve_cluster(batch_script) is None  # one process, not a 2-task wait
    with pytest.raises(RuntimeError, match="SLURM_PROCID not found"):
        cr.SlurmClusterResolver(environ={})
    for hostlist, bad in (("node[a-b]", "'a-b'"), ("node[1-2", "unbalanced")):
        expected = rf'Invalid hostlist format "{re.escape(hostlist)}".*{bad}'
        with pytest.raises(ValueError, match=expected):
            cr.SlurmClusterResolver(environ=_slurm_step(0, hostlist, "1(x2)", 2))
    with pytest.raises(ValueError, match='Invalid tasks-per-node list format "2x"'):
        cr.SlurmClusterResolver(environ=_slurm_step(0, "n1", "2x", 2))
    with pytest.raises(ValueError, match="SLURM_PROCID=2"):
        cr.SlurmClusterResolver(environ=_slurm_step(2, "n1", "2", 2))
    with pytest.raises(ValueError, match="port_base=65535"):
        cr.SlurmClusterResolver(port_base=65535, environ=_slurm_step(0, "n1", "2", 2))


def test_slurm_gpus_are_shared_between_a_nodes_tasks_as_tf_shares_them():
    # 2 nodes of 4 GPUs, 2 tasks each: rank 3 is node n2's second task, GPUs 2 and 3.
    def env_of_rank_3():
        return _slurm_step(3, "n[1-2]", "2(x2)", 4, CUDA_VISIBLE_DEVICES="0,1,2,3")

    env = env_of_rank_3()
    resolver = cr.SlurmClusterResolver(environ=env)
    assert resolver.local_gpu_ids() == [2, 3]
    assert resolver.num_accelerators() == {"GPU": 2}
    resolver.cluster_spec()
    assert env["JAX_LOCAL_DEVICE_IDS"] == "2,3"  # where JAX takes its local devices from
    mine = {**env, "JAX_LOCAL_DEVICE_IDS": "0"}
    cr.SlurmClusterResolver(environ=mine).cluster_spec()
    assert mine["JAX_LOCAL_DEVICE_IDS"] == "0"  # the user's choice stands
    off = env_of_rank_3()
    cr.SlurmClusterResolver(auto_set_gpu=False, environ=off).cluster_spec()
    assert "JAX_LOCAL_DEVICE_IDS" not in off
    with pytest.raises(RuntimeError, match="Requested more GPUs per node than available"):
        cr.SlurmClusterResolver(gpus_per_task=3, environ=env)
    # Slurm bound one GPU to each task: the task uses the one it sees.
    bound = _slurm_step(1, "n1", "2", 2, CUDA_VISIBLE_DEVICES="1")
    assert cr.SlurmClusterResolver(environ=bound).local_gpu_ids() == [0]
    # No GPUs: nothing is set.
    cpu = _slurm_step(1, "n1", "2", 2)
    cr.SlurmClusterResolver(environ=cpu).cluster_spec()
    assert "JAX_LOCAL_DEVICE_IDS" not in cpu


def test_slurm_port_base_comes_from_the_environment_unless_given():
    env = _slurm_step(1, "n[1-2]", "1(x2)", 2)
    with_base = {**env, "KERAS_DIST_SLURM_PORT_BASE": "20000"}
    assert cr.SlurmClusterResolver(environ=with_base).cluster_spec().as_dict() == {
        "worker": ["n1:20000", "n2:20000"]
    }
    assert cr.SlurmClusterResolver(port_base=9000, environ=with_base).master() == "grpc://n2:9000"
    assert cr.SlurmClusterResolver(environ=env).master() == "grpc://n2:8888"  # TF's default
    assert cr.resolve_cluster(with_base).master() == "grpc://n2:20000"
    with pytest.raises(ValueError, match=r"KERAS_DIST_SLURM_PORT_BASE='http'"):
        cr.SlurmClusterResolver(environ={**env, "KERAS_DIST_SLURM_PORT_BASE": "http"})


def _ompi(rank="1", size="4", uri="1147731968.0;tcp://10.0.0.5,192.168.1.5:37407", **extra):
    return {
        "OMPI_COMM_WORLD_RANK": rank,
        "OMPI_COMM_WORLD_SIZE": size,
        "OMPI_MCA_orte_hnp_uri": uri,
        **extra,
    }


# 1147731968 = 0x44690000 is a job id OpenMPI 4.1 gave: its family 0x4469 % 4096 = 1129 picks
# port 61440 + 1129.
@pytest.mark.parametrize(
    "uri, address",
    [
        ("1147731968.0;tcp://10.0.0.5,192.168.1.5:37407", "10.0.0.5:62569"),
        ("1147731968.0;tcp://127.0.0.1:56427", "127.0.0.1:62569"),
        # mpirun lists IPv4 before IPv6 when the host has both: the first list counts.
        ("1147731968.0;tcp://192.0.2.2:37407;tcp6://[fd00::2]:41353", "192.0.2.2:62569"),
        # IPv6 only: the address is bracketed, so host and port stay apart.
        (
            "1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620:10d:c083::2]:43370",
            "[fe80::b9b:ac5d:9cf0:b858]:65114",
        ),
        ("65536.0;tcp://h:1", "h:61441"),  # job family 1 (the low 16 bits: a job in it)
        (f"{4097 * 65536 + 1}.0;tcp://h:1", "h:61441"),  # family 4097: the ports come round
    ],
    ids=["two addresses", "loopback", "tcp and tcp6", "tcp6", "family 1", "family 4097"],
)
def test_openmpi_coordinator_from_the_hnp_uri(uri, address):
    resolver = cr.OpenMPIClusterResolver(environ=_ompi(uri=uri))
    assert resolver.coordinator_address == address
    assert resolver.master() == address
    assert (resolver.num_processes, resolver.process_id) == (4, 1)
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec().as_dict() == {"worker": [address, "", "", ""]}


def test_openmpi_coordinator_port_from_the_environment():
    env = _ompi(KERAS_DIST_COORDINATOR_PORT="23456")
    assert cr.OpenMPIClusterResolver(environ=env).coordinator_address == "10.0.0.5:23456"
    # The job id is not needed then (an mpirun whose URI has none).
    env = _ompi(uri=";tcp://10.0.0.5:1", KERAS_DIST_COORDINATOR_PORT="23456")
    assert cr.OpenMPIClusterResolver(environ=env).coordinator_address == "10.0.0.5:23456"
    with pytest.raises(ValueError, match=r"Received: KERAS_DIST_COORDINATOR_PORT='70000'"):
        cr.OpenMPIClusterResolver(environ=_ompi(KERAS_DIST_COORDINATOR_PORT="70000"))


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {},
            r"missing \['OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_RANK', 'OMPI_MCA_orte_hnp_uri'\]",
        ),
        (
            {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},
            r"missing \['OMPI_MCA_orte_hnp_uri'\]\. Received: \{'OMPI_COMM_WORLD_SIZE': '2'",
        ),
        (_ompi(rank="two"), r"Received: OMPI_COMM_WORLD_SIZE='4', OMPI_COMM_WORLD_RANK='two'"),
        (_ompi(rank="4"), r"rank < size"),
        (_ompi(uri="1147731968.0;ud://123"), r"Received: OMPI_MCA_orte_hnp_uri='1147731968.0;ud"),
        (_ompi(uri="1147731968.0"), r"Cannot find the coordinator's host"),
        (_ompi(uri="x.0;tcp://h:1"), r"does not start with .*Received: OMPI_MCA_orte_hnp_uri"),
    ],
    ids=["nothing", "no uri", "rank not a number", "rank too large", "no tcp", "no list", "job"],
)
def test_openmpi_resolver_says_what_is_missing_or_malformed(env, message):
    with pytest.raises(ValueError, match=message):
        cr.OpenMPIClusterResolver(environ=env)


def test_kubeflow_resolver():
    env = {
        "COORDINATOR_ADDRESS": "trainer-0.svc",
        "COORDINATOR_PORT": "1234",
        "NUM_PROCESSES": "3",
        "PROCESS_ID": "2",
    }
    resolver = cr.KubeflowClusterResolver(environ=env)
    assert resolver.coordinator_address == "trainer-0.svc:1234"
    assert (resolver.num_processes, resolver.process_id) == (3, 2)
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert resolver.cluster_spec().num_tasks("worker") == 3
    assert resolver.master() == "trainer-0.svc:1234"
    jax_env = {"JAX_COORDINATOR_ADDRESS": "c:5", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    jax_resolver = cr.KubeflowClusterResolver(environ=jax_env)
    assert (jax_resolver.coordinator_address, jax_resolver.num_processes) == ("c:5", 2)
    assert jax_resolver.task_id == 1
    with pytest.raises(ValueError, match="Received"):
        cr.KubeflowClusterResolver(environ={})


def test_keras_distribution_resolver():
    env = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:2345",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
        "KERAS_DISTRIBUTION_PROCESS_ID": "1",
    }
    resolver = cr.KerasDistributionClusterResolver(environ=env)
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.1:1234", "10.0.0.2:2345"]}
    assert (resolver.coordinator_address, resolver.num_processes, resolver.task_id) == (
        "10.0.0.1:1234",
        2,
        1,
    )


def test_resolve_cluster_order():
    tf_config = json.dumps(
        {"cluster": {"worker": ["w0:1", "w1:1"]}, "task": {"type": "worker", "index": 1}}
    )
    keras = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": "k:1",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
        "KERAS_DISTRIBUTION_PROCESS_ID": "0",
    }
    kubeflow = {"COORDINATOR_ADDRESS": "c", "NUM_PROCESSES": "2", "PROCESS_ID": "0"}
    slurm = _slurm_step(0, "n[1-2]", "1(x2)", 2)
    everything = {"TF_CONFIG": tf_config, **keras, **kubeflow, **slurm}
    assert isinstance(cr.resolve_cluster(everything), cr.TFConfigClusterResolver)
    # TF_CONFIG without a cluster does not count.
    no_cluster = {**everything, "TF_CONFIG": '{"task": {"type": "worker", "index": 0}}'}
    assert isinstance(cr.resolve_cluster(no_cluster), cr.KerasDistributionClusterResolver)
    assert isinstance(cr.resolve_cluster({**kubeflow, **slurm}), cr.KubeflowClusterResolver)
    assert isinstance(cr.resolve_cluster(slurm), cr.SlurmClusterResolver)
    assert cr.resolve_cluster({**slurm, "SLURM_STEP_NUM_TASKS": "1"}) is None
    assert cr.resolve_cluster({}) is None
    # mpirun's ranks inside a Slurm allocation see its SLURM_* too: OpenMPI's variables win.
    ompi = _ompi(rank="1", size="2")
    assert isinstance(cr.resolve_cluster({**ompi, **slurm}), cr.OpenMPIClusterResolver)
    assert isinstance(cr.resolve_cluster({**kubeflow, **ompi}), cr.KubeflowClusterResolver)
    # One rank is one process; a size that is not a number is reported, not ignored.
    assert cr.resolve_cluster(_ompi(rank="0", size="1")) is None
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE='many'"):
        cr.resolve_cluster(_ompi(size="many"))


def test_resolve_cluster_defaults_to_os_environ(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TF_CONFIG", "KERAS_DISTRIBUTION_", "SLURM_", "JAX_COORD", "OMPI_")):
            monkeypatch.delenv(name)
    for name in ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert cr.resolve_cluster() is None
    _set_tf_config(monkeypatch, {"cluster": PS_WORKER_CLUSTER, "task": {"type": "ps", "index": 1}})
    assert cr.resolve_cluster().master() == "ps1:2222"


CHIEF_CLUSTER = {
    "chief": ["127.0.0.1:1234"],
    "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
    "ps": ["127.0.0.1:1926", "127.0.0.1:3141"],
}
NO_CHIEF_CLUSTER = {"worker": ["127.0.0.1:8964", "127.0.0.1:2333"], "ps": ["127.0.0.1:1926"]}
EVALUATOR_CLUSTER = {
    "chief": ["127.0.0.1:1234"],
    "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
    "evaluator": ["127.0.0.1:2019"],
}


def test_is_chief_with_chief():
    assert cr.is_chief(CHIEF_CLUSTER, "chief", 0)
    assert not cr.is_chief(CHIEF_CLUSTER, "worker", 0)


def test_is_chief_without_chief():
    assert cr.is_chief(NO_CHIEF_CLUSTER, "worker", 0)
    assert not cr.is_chief(NO_CHIEF_CLUSTER, "worker", 1)
    with pytest.raises(ValueError, match="`task_type` 'chief' not found in cluster_spec."):
        cr.is_chief(NO_CHIEF_CLUSTER, "chief", 0)
    with pytest.raises(ValueError, match="The `task_id` 2 exceeds the maximum id of worker."):
        cr.is_chief(NO_CHIEF_CLUSTER, "worker", 2)


def test_evaluator_is_chief():
    assert cr.is_chief(EVALUATOR_CLUSTER, "evaluator", 0)


def test_is_chief_accepts_a_cluster_spec():
    assert cr.is_chief(cr.ClusterSpec(NO_CHIEF_CLUSTER), "worker", 0)


def test_disallowed_task_types():
    with pytest.raises(ValueError, match="Disallowed task type found in cluster spec"):
        cr.is_chief({"trainer": ["t:1"]}, "trainer", 0)
    with pytest.raises(ValueError, match="Unrecognized task_type: trainer"):
        cr.is_chief(NO_CHIEF_CLUSTER, "trainer", 0)


def test_worker_count():
    assert cr.worker_count(CHIEF_CLUSTER, task_type="chief") == 3
    assert cr.worker_count(CHIEF_CLUSTER, task_type="worker") == 3
    assert cr.worker_count(EVALUATOR_CLUSTER, task_type="evaluator") == 1
    with pytest.raises(ValueError, match="Unexpected `task_type` 'ps'"):
        cr.worker_count(CHIEF_CLUSTER, task_type="ps")


def test_id_in_cluster():
    assert cr.id_in_cluster(CHIEF_CLUSTER, "chief", 0) == 0
    assert cr.id_in_cluster(CHIEF_CLUSTER, "worker", 1) == 2
    assert cr.id_in_cluster(NO_CHIEF_CLUSTER, "worker", 1) == 1
    assert cr.id_in_cluster(EVALUATOR_CLUSTER, "evaluator", 0) == 0
    with pytest.raises(ValueError, match="There is no id for task_type 'ps'"):
        cr.id_in_cluster(CHIEF_CLUSTER, "ps", 0)


def test_multiple_chiefs():
    cluster = {"chief": ["127.0.0.1:8258", "127.0.0.1:7566"], "worker": ["127.0.0.1:8964"]}
    with pytest.raises(ValueError, match="There must be at most one 'chief' job."):
        cr.id_in_cluster(cluster, "worker", 0)


def test_collective_leader():
    assert cr.collective_leader(CHIEF_CLUSTER, "worker", 0) == "/job:chief/replica:0/task:0"
    assert cr.collective_leader(NO_CHIEF_CLUSTER, "worker", 1) == "/job:worker/replica:0/task:0"
    assert cr.collective_leader({**CHIEF_CLUSTER, **EVALUATOR_CLUSTER}, "evaluator", 0) == ""
    assert cr.collective_leader({}, None, 0) == ""


def test_between_graph_properties_for_three_workers():
    cluster = {"worker": ["w0:1", "w1:1", "w2:1"]}
    flags = [
        (
            cr.should_init(cluster, "worker", i),
            cr.should_checkpoint(cluster, "worker", i),
            cr.should_save_summary(cluster, "worker", i),
        )
        for i in range(3)
    ]
    assert flags == [(True, True, True), (True, False, False), (True, False, False)]


def test_single_process_checkpoints():
    assert cr.should_checkpoint() and cr.should_save_summary() and cr.should_init()


def test_cluster_without_task_raises():
    message = "When `cluster_spec` is given, you must also specify `task_type` and `task_id`."
    with pytest.raises(ValueError, match=re.escape(message)):
        cr.should_checkpoint({"worker": ["w0:1", "w1:1"]})
    with pytest.raises(ValueError) as info:
        cr.should_init({"worker": ["w0:1"]}, "worker", None)
    assert message in str(info.value)


WORKER_CLUSTER = {"worker": ["w0:1", "w1:1", "w2:1", "w3:1"]}


def test_chief_writes_to_the_given_paths(tmp_path):
    filepath = os.path.join(tmp_path, "foo.bar")
    assert cr.write_filepath(filepath, "worker", 0, WORKER_CLUSTER) == filepath
    assert cr.write_dirpath(str(tmp_path), "worker", 0, WORKER_CLUSTER) == str(tmp_path)
    assert cr.write_filepath(filepath) == filepath  # one process


def test_worker_writes_to_a_temp_dir(tmp_path):
    dirpath = str(tmp_path)
    filepath = os.path.join(dirpath, "foo.bar")
    assert cr.write_filepath(filepath, "worker", 3, WORKER_CLUSTER) == os.path.join(
        dirpath, "workertemp_3", "foo.bar"
    )
    assert cr.write_dirpath(dirpath, "worker", 3, WORKER_CLUSTER) == os.path.join(
        dirpath, "workertemp_3"
    )
    assert os.path.isdir(os.path.join(dirpath, "workertemp_3"))


def test_temp_dir_path_is_always_the_same(tmp_path):
    first = cr.write_dirpath(str(tmp_path), "worker", 3, WORKER_CLUSTER)
    assert cr.write_dirpath(first, "worker", 3, WORKER_CLUSTER) == first


@pytest.mark.parametrize("remove_from", ["original", "temp"])
def test_repeated_removal_is_fine(tmp_path, remove_from):
    dir_to_write = cr.write_dirpath(str(tmp_path), "worker", 3, WORKER_CLUSTER)
    with open(os.path.join(dir_to_write, "tmp"), "w") as f:
        f.write("dummy")
    target = str(tmp_path) if remove_from == "original" else dir_to_write
    for _ in range(3):
        cr.remove_temp_dirpath(target, "worker", 3, WORKER_CLUSTER)
    assert not os.path.exists(dir_to_write)
    assert os.path.isdir(tmp_path)


def test_removal_only_on_non_chiefs(tmp_path):
    (tmp_path / "workertemp_0").mkdir()
    cr.remove_temp_dirpath(str(tmp_path), "worker", 0, WORKER_CLUSTER)
    assert (tmp_path / "workertemp_0").is_dir()
    temp_file = cr.write_filepath(str(tmp_path / "ckpt.keras"), "worker", 2, WORKER_CLUSTER)
    open(temp_file, "w").close()
    cr.remove_temp_dir_with_filepath(str(tmp_path / "ckpt.keras"), "worker", 2, WORKER_CLUSTER)
    assert not (tmp_path / "workertemp_2").exists()
