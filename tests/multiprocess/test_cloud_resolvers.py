"""Cluster resolvers that ask a cloud API (Kubernetes, GCE) and TF's ``CollectiveHints``.

The expected cluster specs are those of TF's ``kubernetes_cluster_resolver_test``
and ``gce_cluster_resolver_test``. The APIs are fakes: the Kubernetes one
returns the real client's ``V1PodList``; the Compute one is shaped like
``googleapiclient``'s service (requests with ``execute()``, paging through
``listInstances_next``).
"""

import re
import sys
import types
import warnings

import pytest

import keras_dist as kd
from keras_dist import cluster_resolver as cr

# Kubernetes


def _pod_list(*pods):
    """A real ``V1PodList`` of ``(name, phase, host_ip)`` pods."""
    k8s = pytest.importorskip("kubernetes.client")
    return k8s.V1PodList(
        items=[
            k8s.V1Pod(
                metadata=k8s.V1ObjectMeta(name=name),
                status=k8s.V1PodStatus(phase=phase, host_ip=host_ip, pod_ip="192.168.0.1"),
            )
            for name, phase, host_ip in pods
        ]
    )


class FakeCoreV1Api:
    """``CoreV1Api.list_pod_for_all_namespaces`` over fixed pod lists, by label selector."""

    def __init__(self, pods_by_selector):
        self.pods_by_selector = pods_by_selector
        self.selectors = []

    def list_pod_for_all_namespaces(self, label_selector):
        self.selectors.append(label_selector)
        return self.pods_by_selector[label_selector]


def _k8s_resolver(pods_by_selector, **kwargs):
    return cr.KubernetesClusterResolver(override_client=FakeCoreV1Api(pods_by_selector), **kwargs)


def test_kubernetes_single_pod():
    client = FakeCoreV1Api({"job-name=tensorflow": _pod_list(("tf-abc123", "Running", "10.1.2.3"))})
    resolver = cr.KubernetesClusterResolver(override_client=client)
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.1.2.3:8470"]}
    assert client.selectors == ["job-name=tensorflow"]  # TF's default mapping
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, "grpc")
    assert resolver.master() == ""  # no task set yet, as in TF
    assert resolver.environment == ""


def test_kubernetes_pods_are_sorted_by_name():
    pods = _pod_list(
        ("tensorflow-abc123", "Running", "10.1.2.3"),
        ("tensorflow-def456", "Running", "10.1.2.4"),
        ("tensorflow-999999", "Running", "10.1.2.5"),
    )
    resolver = _k8s_resolver({"job-name=tensorflow": pods})
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["10.1.2.5:8470", "10.1.2.3:8470", "10.1.2.4:8470"]
    }


def test_kubernetes_master_with_task_and_overrides():
    pods = _pod_list(
        ("worker-0", "Running", "10.1.2.3"),
        ("worker-1", "Running", "10.1.2.4"),
        ("worker-2", "Running", "10.1.2.5"),
    )
    resolver = _k8s_resolver({"job-name=tensorflow": pods})
    resolver.task_type, resolver.task_id = "worker", 0
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)
    assert resolver.master() == "grpc://10.1.2.3:8470"
    assert resolver.master("worker", 2) == "grpc://10.1.2.5:8470"
    assert resolver.master("worker", 1, rpc_layer="test") == "test://10.1.2.4:8470"
    resolver.rpc_layer = None
    assert resolver.master() == "10.1.2.3:8470"


def test_kubernetes_non_running_pod_raises_tfs_error():
    pods = _pod_list(("tensorflow-abc123", "Failed", "10.1.2.3"))
    resolver = _k8s_resolver({"job-name=tensorflow": pods})
    message = 'Pod "tensorflow-abc123" is not running; phase: "Failed"'
    with pytest.raises(RuntimeError, match=re.escape(message)):
        resolver.cluster_spec()


def test_kubernetes_several_selectors_and_jobs():
    worker1 = _pod_list(
        ("tensorflow-abc123", "Running", "10.1.2.3"),
        ("tensorflow-def456", "Running", "10.1.2.4"),
        ("tensorflow-999999", "Running", "10.1.2.5"),
    )
    worker2 = _pod_list(
        ("tensorflow-abc124", "Running", "10.1.2.6"),
        ("tensorflow-def457", "Running", "10.1.2.7"),
        ("tensorflow-999990", "Running", "10.1.2.8"),
    )
    ps = _pod_list(
        ("tensorflow-ps-1", "Running", "10.1.2.1"),
        ("tensorflow-ps-2", "Running", "10.1.2.2"),
    )
    resolver = _k8s_resolver(
        {"job-name=worker1": worker1, "job-name=worker2": worker2, "job-name=ps": ps},
        job_to_label_mapping={
            "worker": ["job-name=worker1", "job-name=worker2"],
            "ps": ["job-name=ps"],
        },
        tf_server_port=2222,
    )
    assert resolver.cluster_spec().as_dict() == {
        "worker": [
            "10.1.2.5:2222",
            "10.1.2.3:2222",
            "10.1.2.4:2222",
            "10.1.2.8:2222",
            "10.1.2.6:2222",
            "10.1.2.7:2222",
        ],
        "ps": ["10.1.2.1:2222", "10.1.2.2:2222"],
    }


def test_kubernetes_lists_the_pods_at_every_call():
    client = FakeCoreV1Api({"job-name=tensorflow": _pod_list(("a", "Running", "10.0.0.1"))})
    resolver = cr.KubernetesClusterResolver(override_client=client)
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.1:8470"]}
    client.pods_by_selector["job-name=tensorflow"] = _pod_list(
        ("a", "Running", "10.0.0.1"), ("b", "Running", "10.0.0.2")
    )
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.1:8470", "10.0.0.2:8470"]}


def test_kubernetes_bad_arguments_fail_early():
    client = FakeCoreV1Api({})
    with pytest.raises(ValueError, match="executable_location=None"):
        cr.KubernetesClusterResolver(override_client=client, executable_location=None)
    with pytest.raises(TypeError, match=r"list of strings.*worker='job-name=tensorflow'"):
        cr.KubernetesClusterResolver(
            {"worker": "job-name=tensorflow"}, override_client=FakeCoreV1Api({})
        )


def test_kubernetes_without_the_client_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(ImportError, match=re.escape('pip install "keras_dist[kubernetes]"')):
        cr.KubernetesClusterResolver()
    # A given client needs no package.
    resolver = _k8s_resolver({"job-name=tensorflow": types.SimpleNamespace(items=[])})
    assert resolver.cluster_spec().as_dict() == {"worker": []}


@pytest.mark.parametrize(
    "location,loaded",
    [
        (cr.KubernetesExecutableLocation.WITHIN_CLUSTER, "load_incluster_config"),
        (cr.KubernetesExecutableLocation.OFF_CLUSTER, "load_kube_config"),
    ],
)
def test_kubernetes_configures_the_real_client(monkeypatch, location, loaded):
    kubernetes = pytest.importorskip("kubernetes")
    calls = []
    for loader in ("load_incluster_config", "load_kube_config"):
        monkeypatch.setattr(kubernetes.config, loader, lambda loader=loader: calls.append(loader))
    api = FakeCoreV1Api({"job-name=tensorflow": _pod_list(("a", "Running", "10.0.0.1"))})
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: api)
    resolver = cr.KubernetesClusterResolver(executable_location=location)
    assert calls == [loaded]
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.1:8470"]}


def test_kubernetes_resolver_drives_multi_worker_mirrored_strategy():
    resolver = _k8s_resolver({"job-name=tensorflow": _pod_list(("a", "Running", "127.0.0.1"))})
    resolver.task_type, resolver.task_id = "worker", 0
    strategy = kd.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    assert strategy.cluster_resolver is resolver
    assert strategy.extended.should_checkpoint
    assert strategy.num_replicas_in_sync == 8


# GCE


class _Request:
    def __init__(self, response, **kwargs):
        self.response = response
        self.kwargs = kwargs

    def execute(self):
        return self.response


class _InstanceGroups:
    def __init__(self, compute):
        self.compute = compute

    def listInstances(self, pageToken=None, **kwargs):  # noqa: N802 (the API's name)
        self.compute.list_calls.append(kwargs)
        self.compute.page_tokens.append(pageToken)
        page = int(pageToken or 0)
        response = {"items": self.compute.pages[page]} if self.compute.pages[page] else {}
        if page + 1 < len(self.compute.pages):
            response["nextPageToken"] = str(page + 1)
        return _Request(response, pageToken=pageToken, **kwargs)

    def listInstances_next(self, previous_request, previous_response):  # noqa: N802
        token = previous_response.get("nextPageToken")
        if token is None:
            return None
        return self.listInstances(**{**previous_request.kwargs, "pageToken": token})


class _Instances:
    def __init__(self, compute):
        self.compute = compute

    def get(self, project, zone, instance):
        assert (project, zone) == ("test-project", "us-east1-d")
        ip = self.compute.ips[instance]
        return _Request({"name": instance, "networkInterfaces": [{"networkIP": ip}]})


class FakeCompute:
    """The Compute v1 service of ``googleapiclient``, over pages of instances."""

    def __init__(self, *pages):
        self.ips = {}
        self.pages = []
        self.list_calls = []
        self.page_tokens = []
        for page in pages:
            items = []
            for name, ip, *status in page:
                self.ips[name] = ip
                url = f"https://compute.example.com/zones/us-east1-d/instances/{name}"
                items.append({"instance": url, "status": status[0] if status else "RUNNING"})
            self.pages.append(items)

    def instanceGroups(self):  # noqa: N802
        return _InstanceGroups(self)

    def instances(self):
        return _Instances(self)


THREE = [("instance1", "10.1.2.3"), ("instance2", "10.2.3.4"), ("instance3", "10.3.4.5")]


def _gce(service, **kwargs):
    kwargs.setdefault("port", 8470)
    return cr.GCEClusterResolver(
        "test-project", "us-east1-d", "test-instance-group", service=service, **kwargs
    )


def test_gce_single_instance_and_the_request():
    service = FakeCompute([("gce-instance-1", "10.123.45.67")])
    resolver = _gce(service, credentials=None)
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.123.45.67:8470"]}
    assert service.list_calls == [
        {
            "project": "test-project",
            "zone": "us-east1-d",
            "instanceGroup": "test-instance-group",
            "body": {"instanceState": "RUNNING"},
            "orderBy": "name",
        }
    ]
    assert resolver.master() == "grpc://10.123.45.67:8470"  # task_id 0 by default
    assert resolver.environment == ""


def test_gce_master_of_another_task():
    resolver = _gce(FakeCompute(THREE))
    assert resolver.master("worker", 2, "test") == "test://10.3.4.5:8470"


def test_gce_task_id_and_rpc_layer_may_be_set():
    resolver = _gce(FakeCompute(THREE), task_type="testworker")
    resolver.task_id = 1
    resolver.rpc_layer = "test"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("testworker", 1, "test")
    assert resolver.master() == "test://10.2.3.4:8470"


def test_gce_task_type_cannot_be_set():
    resolver = _gce(FakeCompute(THREE), task_type="testworker")
    message = "You cannot reset the task_type of the GCEClusterResolver after it has been created."
    with pytest.raises(RuntimeError, match=re.escape(message)):
        resolver.task_type = "foobar"
    assert resolver.task_type == "testworker"


def test_gce_empty_task_type_and_zero_task_id():
    resolver = _gce(FakeCompute(THREE), task_type="", task_id=1)
    assert resolver.master(task_type="", task_id=0) == "grpc://10.1.2.3:8470"


def test_gce_custom_job_and_port():
    resolver = _gce(
        FakeCompute([("gce-instance-1", "10.123.45.67")]), task_type="custom", port=2222
    )
    assert resolver.cluster_spec().as_dict() == {"custom": ["10.123.45.67:2222"]}


def test_gce_pages_running_instances_sorted_as_strings():
    service = FakeCompute(
        [("vm-a", "10.0.0.9"), ("vm-b", "10.0.0.10"), ("vm-c", "10.0.0.5", "STOPPING")],
        [],
        [("vm-d", "10.0.0.1")],
    )
    resolver = _gce(service)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["10.0.0.10:8470", "10.0.0.1:8470", "10.0.0.9:8470"]
    }
    assert service.page_tokens == [None, "1", "2"]


def test_gce_union_of_groups():
    workers1 = _gce(FakeCompute(THREE))
    workers2 = _gce(
        FakeCompute(
            [("instance4", "10.4.5.6"), ("instance5", "10.5.6.7"), ("instance6", "10.6.7.8")]
        )
    )
    ps = _gce(
        FakeCompute([("ps1", "10.100.1.2"), ("ps2", "10.100.2.3")]), task_type="ps", port=2222
    )
    union = cr.UnionClusterResolver(workers1, workers2, ps)
    assert union.cluster_spec() == cr.ClusterSpec(
        {
            "ps": ["10.100.1.2:2222", "10.100.2.3:2222"],
            "worker": [
                "10.1.2.3:8470",
                "10.2.3.4:8470",
                "10.3.4.5:8470",
                "10.4.5.6:8470",
                "10.5.6.7:8470",
                "10.6.7.8:8470",
            ],
        }
    )


def test_gce_without_the_client_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "googleapiclient", None)
    with pytest.raises(ImportError, match=re.escape('pip install "keras_dist[gce]"')):
        cr.GCEClusterResolver("p", "z", "g", 8470)


def test_gce_builds_the_compute_service_with_default_credentials(monkeypatch):
    built = []
    discovery = types.SimpleNamespace(
        build=lambda *args, **kwargs: built.append((args, kwargs)) or FakeCompute(THREE)
    )
    monkeypatch.setitem(sys.modules, "googleapiclient", types.SimpleNamespace(discovery=discovery))
    cr.GCEClusterResolver("p", "z", "g", 8470)
    credentials = object()
    cr.GCEClusterResolver("p", "z", "g", 8470, credentials=credentials)
    assert built == [
        (("compute", "v1"), {"credentials": None}),
        (("compute", "v1"), {"credentials": credentials}),
    ]


# CollectiveHints


def test_collective_hints_makes_communication_options_and_warns():
    with pytest.warns(DeprecationWarning, match="use kd.experimental.CommunicationOptions") as w:
        options = kd.experimental.CollectiveHints(bytes_per_pack=1024, timeout_seconds=30)
    assert w[0].filename == __file__  # points at the caller
    assert isinstance(options, kd.experimental.CommunicationOptions)
    assert (options.bytes_per_pack, options.timeout_seconds) == (1024, 30)
    assert options.implementation is kd.experimental.CommunicationImplementation.AUTO
    with pytest.warns(DeprecationWarning):
        defaults = kd.experimental.CollectiveHints()
    assert (defaults.bytes_per_pack, defaults.timeout_seconds) == (0, None)
    assert kd.strategies.CollectiveHints is kd.experimental.CollectiveHints


def test_collective_hints_validates_like_communication_options():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="bytes_per_pack=-1"):
            kd.experimental.CollectiveHints(bytes_per_pack=-1)
        with pytest.raises(ValueError, match="timeout_seconds=0"):
            kd.experimental.CollectiveHints(timeout_seconds=0)
        with pytest.raises(TypeError):
            kd.experimental.CollectiveHints(implementation="RING")  # not in TF's signature


def test_collective_hints_go_where_communication_options_go():
    with pytest.warns(DeprecationWarning):
        hints = kd.experimental.CollectiveHints(timeout_seconds=30)
    strategy = kd.MultiWorkerMirroredStrategy(communication_options=hints)
    assert strategy.num_replicas_in_sync == 8
    with pytest.warns(DeprecationWarning):
        hints = kd.experimental.CollectiveHints(bytes_per_pack=4)
    strategy = kd.experimental.MultiWorkerMirroredStrategy(communication_options=hints)
    assert strategy.num_replicas_in_sync == 8
