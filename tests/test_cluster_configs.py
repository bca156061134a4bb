"""The cloud configs boot as a new user would run them (issue 15.5): pinned current images,
bucket-scoped identities on the head and every worker, GCP workers without external IPs,
KubeRay pods that fit their machines after GKE's reservations, run as non-root and sit behind
a NetworkPolicy, and Ray's ports, the unauthenticated metrics endpoints included, closed to
everything outside the cluster. Parses files only: no Ray, no cloud."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
KUBERAY = CLUSTER / "kuberay"
IAM = CLUSTER / "iam"
DOCS = (ROOT / "docs" / "clusters.md").read_text()
CLUSTER_LABEL = "raytrain-lm/cluster"
BUCKET_PLACEHOLDER = "BUCKET_NAME"


@pytest.fixture(scope="session")
def ray_session():
    """Stands in for conftest's session-wide Ray, which these file checks do not need."""
    yield None


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def _kuberay_documents() -> list[dict]:
    return [
        doc
        for path in sorted(KUBERAY.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]


@pytest.mark.parametrize(
    "path", sorted(CLUSTER.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CLUSTER))
)
def test_every_cluster_file_parses(path):
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert documents and all(isinstance(d, dict) for d in documents)


# --- AWS -------------------------------------------------------------------------------------


def _aws_node_configs() -> dict[str, dict]:
    config = _load("aws.yaml")
    return {name: spec["node_config"] for name, spec in config["available_node_types"].items()}


def test_aws_nodes_boot_a_pinned_image_that_the_config_names():
    text = (CLUSTER / "aws.yaml").read_text()
    images = {name: node["ImageId"] for name, node in _aws_node_configs().items()}
    assert all(re.fullmatch(r"ami-[0-9a-f]{8,17}", image) for image in images.values()), images
    assert len(set(images.values())) == 1, "one image for every node type"
    # Which image, that its Python is new enough, and how to find it for another region.
    assert "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)" in text
    assert "Python 3.10" in text
    assert "aws ssm get-parameter" in text


def test_aws_head_and_every_worker_have_their_own_instance_profile():
    config = _load("aws.yaml")
    profiles = {
        name: node["IamInstanceProfile"]["Name"] for name, node in _aws_node_configs().items()
    }
    head = profiles.pop(config["head_node_type"])
    assert set(profiles.values()) == {"raytrain-lm-worker"}
    assert head == "raytrain-lm-head"


def _statements(name: str) -> list[dict]:
    return json.loads((IAM / name).read_text())["Statement"]


def test_aws_bucket_policy_reaches_the_run_bucket_only():
    resources = set()
    for statement in _statements("aws-bucket-policy.json"):
        assert statement["Effect"] == "Allow"
        actions = statement["Action"]
        assert all(a.startswith("s3:") and "*" not in a for a in actions), actions
        resources.add(statement["Resource"])
    assert resources == {
        f"arn:aws:s3:::{BUCKET_PLACEHOLDER}",
        f"arn:aws:s3:::{BUCKET_PLACEHOLDER}/*",
    }
    granted = {a for s in _statements("aws-bucket-policy.json") for a in s["Action"]}
    assert {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject"} <= granted


def test_aws_head_policy_ends_only_this_cluster_and_passes_only_the_worker_role():
    cluster_name = _load("aws.yaml")["cluster_name"]
    statements = _statements("aws-head-autoscaler-policy.json")
    actions = {
        a
        for s in statements
        for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }
    assert not any(a.startswith("s3:") or a.endswith("*") for a in actions)
    terminate = next(s for s in statements if s["Action"] == "ec2:TerminateInstances")
    # The tag Ray puts on every node of a cluster (ray.autoscaler.tags.TAG_RAY_CLUSTER_NAME).
    assert terminate["Condition"] == {
        "StringEquals": {"ec2:ResourceTag/ray-cluster-name": cluster_name}
    }
    pass_role = next(s for s in statements if s["Action"] == "iam:PassRole")
    assert pass_role["Resource"].endswith(":role/raytrain-lm-worker")
    trust = _statements("aws-ec2-trust.json")
    assert trust == [
        {
            "Effect": "Allow",
            "Principal": {"Service": "ec2.amazonaws.com"},
            "Action": "sts:AssumeRole",
        }
    ]


# --- GCP -------------------------------------------------------------------------------------


def test_gcp_workers_have_internal_ips_only():
    config = _load("gcp.yaml")
    provider = config["provider"]
    assert provider["use_internal_ips"] is True
    # `ray up`, `ray dashboard` and `ray attach` reach the head from outside the network.
    assert provider["use_external_head_ip"] is True
    subnetworks = set()
    for name, spec in config["available_node_types"].items():
        (interface,) = spec["node_config"]["networkInterfaces"]
        subnetworks.add(interface["subnetwork"])
        has_external_ip = bool(interface.get("accessConfigs"))
        assert has_external_ip == (name == config["head_node_type"]), name
        assert spec["node_config"]["tags"]["items"] == ["raytrain-lm"], name
    assert subnetworks == {f"regions/{provider['region']}/subnetworks/raytrain-lm"}


def test_gcp_nodes_boot_one_pinned_image():
    config = _load("gcp.yaml")
    images = {
        disk["initializeParams"]["sourceImage"]
        for spec in config["available_node_types"].values()
        for disk in spec["node_config"]["disks"]
    }
    (image,) = images
    assert "/family/" not in image
    assert re.fullmatch(r"projects/[a-z0-9-]+/global/images/[a-z0-9-]+-v\d{8}", image), image
    assert "gcloud compute images list" in (CLUSTER / "gcp.yaml").read_text()


def test_gcp_head_and_every_worker_run_as_their_own_service_account():
    config = _load("gcp.yaml")
    accounts = {
        name: [a["email"] for a in spec["node_config"]["serviceAccounts"]]
        for name, spec in config["available_node_types"].items()
    }
    head = accounts.pop(config["head_node_type"])
    assert head == ["raytrain-lm-head@PROJECT_ID.iam.gserviceaccount.com"]
    assert {tuple(a) for a in accounts.values()} == {
        ("raytrain-lm-worker@PROJECT_ID.iam.gserviceaccount.com",)
    }
    assert config["provider"]["project_id"] == "PROJECT_ID"  # docs/clusters.md replaces it


def _gcloud_commands(kind: str) -> list[list[str]]:
    """The `gcloud ... KIND create` commands of docs/clusters.md, as argument lists."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", DOCS, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if f"gcloud compute {kind} create" in command:
                # A command substitution stands for a value the shell fills in: one word.
                command = re.sub(r"\$\([^)]*\)", "SUBSTITUTED", command.split("#")[0])
                commands.append(shlex.split(command))
    return commands


def _flag(words: list[str], name: str) -> str | None:
    for word in words:
        if word.startswith(f"--{name}="):
            return word.split("=", 1)[1]
    return None


def test_gcp_firewall_in_the_docs_admits_only_ssh_from_outside_the_cluster():
    """Ray's ports and its unauthenticated metrics endpoints stay behind the VPC's implied deny:
    the only rules are SSH from one address and everything between the cluster's instances."""
    rules = _gcloud_commands("firewall-rules")
    assert len(rules) == 2
    for words in rules:
        assert _flag(words, "network") == "raytrain-lm"
        assert _flag(words, "target-tags") == "raytrain-lm"
        if _flag(words, "source-ranges") is not None:
            assert _flag(words, "rules") == "tcp:22"
            assert _flag(words, "source-ranges").endswith("/32")
        else:
            assert _flag(words, "source-tags") == "raytrain-lm"
    (subnet,) = _gcloud_commands("networks subnets")
    assert "--enable-private-ip-google-access" in subnet  # the bucket without external IPs
    assert _gcloud_commands("routers"), "Cloud NAT: workers reach PyPI without external IPs"


# --- Ports -----------------------------------------------------------------------------------


def test_docs_list_the_metrics_ports_ray_opens():
    from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
    from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT
    from ray.dashboard.consts import DASHBOARD_METRIC_PORT

    ports = DOCS.split("## Ports", 1)[1].split("\n## ", 1)[0]
    for number in (AUTOSCALER_METRIC_PORT, DASHBOARD_METRIC_PORT):
        assert f"| {number} | **" in ports
    assert f"| {DEFAULT_DASHBOARD_AGENT_LISTEN_PORT} |" in ports
    for flag in (
        "--metrics-export-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--node-manager-port",
        "AUTOSCALER_METRIC_PORT",
        "DASHBOARD_METRIC_PORT",
    ):
        assert f"`{flag}`" in ports, flag


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_vm_configs_open_no_port_beyond_ssh(name):
    config = _load(name)
    starts = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert "0.0.0.0" not in starts  # neither the dashboard nor anything else bound outward
    if name == "aws.yaml":
        rules = config["provider"]["security_group"].get("IpPermissions", [])
        assert all((r["FromPort"], r["ToPort"]) == (22, 22) for r in rules)


# --- KubeRay ---------------------------------------------------------------------------------

# GKE keeps part of every node for the kubelet, the system and evictions ("Plan GKE node
# sizes", cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes):
# memory: 25 % of the first 4 GiB, 20 % of the next 4, 10 % of the next 8, 6 % of the next 112,
# 2 % of the rest, plus a 100 MiB eviction threshold; CPU: 6 % of the first core, 1 % of the
# next, 0.5 % of the next 2, 0.25 % of the rest.
MEMORY_RESERVATION = [(4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02)]
CPU_RESERVATION = [(1, 0.06), (1, 0.01), (2, 0.005), (float("inf"), 0.0025)]
EVICTION_GIB = 100 / 1024
# The machine types the manifests name: vCPUs and GB of memory (GCE's GB are GiB).
MACHINES = {
    "n2-standard-8": (8, 32),
    "g2-standard-4": (4, 16),
    "a2-highgpu-1g": (12, 85),
    "a3-highgpu-8g": (208, 1872),
}
# Beyond the formula: the kernel keeps about 3 % of a VM's memory before the kubelet counts
# capacity, and GKE's DaemonSets (kube-proxy, logging, metadata server, GPU device plugin)
# request CPU and memory on every node.
KERNEL_SHARE = 0.03
DAEMONSET_CPU = 0.5
DAEMONSET_GIB = 1.0


def _reserved(amount: float, tiers: list[tuple[float, float]]) -> float:
    reserved, left = 0.0, amount
    for size, share in tiers:
        part = min(left, size)
        reserved += part * share
        left -= part
    return reserved


def schedulable(machine: str) -> tuple[float, float]:
    """CPUs and GiB a pod of its own can request on an otherwise empty node of `machine`."""
    cpus, memory = MACHINES[machine]
    capacity = memory * (1 - KERNEL_SHARE)
    allocatable_memory = capacity - _reserved(capacity, MEMORY_RESERVATION) - EVICTION_GIB
    allocatable_cpu = cpus - _reserved(cpus, CPU_RESERVATION)
    return allocatable_cpu - DAEMONSET_CPU, allocatable_memory - DAEMONSET_GIB


def test_reservation_formula_matches_gkes_own_example():
    # GKE's page: a 16 GiB node keeps 1 + 0.8 + 0.8 = 2.6 GiB; a 4-core node 0.08 cores.
    assert _reserved(16, MEMORY_RESERVATION) == pytest.approx(2.6)
    assert _reserved(4, CPU_RESERVATION) == pytest.approx(0.08)


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _gib(quantity: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024, "Ti": 1024.0}
    return float(quantity[:-2]) * units[quantity[-2:]]


def _ray_pods() -> list[tuple[str, str, dict]]:
    """(cluster label, group, pod template) of every Ray pod, and of the RayJob's submitter."""
    pods = []
    for doc in _kuberay_documents():
        if doc["kind"] not in ("RayCluster", "RayJob"):
            continue
        spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        label = doc["metadata"]["name"]
        pods.append((label, "head", spec["headGroupSpec"]["template"]))
        pods += [(label, g["groupName"], g["template"]) for g in spec["workerGroupSpecs"]]
        if doc["kind"] == "RayJob":
            pods.append((label, "submitter", doc["spec"]["submitterPodTemplate"]))
    return pods


def test_kuberay_requests_fit_the_named_machine_after_gkes_reservations():
    for _, group, template in _ray_pods():
        if group == "submitter":
            continue  # half a CPU on any node
        pod = template["spec"]
        machine = pod["nodeSelector"]["node.kubernetes.io/instance-type"]
        cpu = memory_gib = 0.0
        for container in pod["containers"]:  # the head's tracking server beside Ray
            resources = container["resources"]
            assert resources["requests"] == resources["limits"], group  # Ray sizes from limits
            cpu += _cpus(resources["requests"]["cpu"])
            memory_gib += _gib(resources["requests"]["memory"])
        cpus, memory = schedulable(machine)
        assert cpu <= cpus, (group, machine, cpu, cpus)
        assert memory_gib <= memory, (group, machine, memory_gib, memory)


def test_kuberay_pods_run_as_non_root_without_privileges():
    for _, group, template in _ray_pods():
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, group
        assert pod["securityContext"]["runAsUser"] != 0, group
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, group
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, group
            assert context["capabilities"]["drop"] == ["ALL"], group
    for doc in _kuberay_documents():
        if doc["kind"] in ("RayCluster", "RayJob"):
            spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
            # The autoscaler sidecar KubeRay adds to the head pod.
            assert spec["autoscalerOptions"]["securityContext"]["allowPrivilegeEscalation"] is False


def test_kuberay_pods_reach_the_bucket_through_one_service_account():
    (account,) = [d for d in _kuberay_documents() if d["kind"] == "ServiceAccount"]
    annotations = account["metadata"]["annotations"]
    assert annotations == {
        "iam.gke.io/gcp-service-account": "raytrain-lm-worker@PROJECT_ID.iam.gserviceaccount.com"
    }
    for _, group, template in _ray_pods():
        if group != "submitter":
            assert template["spec"]["serviceAccountName"] == account["metadata"]["name"], group
    job = next(d for d in _kuberay_documents() if d["kind"] == "RayJob")
    assert f"output_dir=gs://{BUCKET_PLACEHOLDER}/" in job["spec"]["entrypoint"]
    assert f"data.cache_dir=gs://{BUCKET_PLACEHOLDER}/" in job["spec"]["entrypoint"]


def test_a_network_policy_admits_only_each_clusters_own_pods_to_its_ports():
    policies = {
        d["metadata"]["name"]: d["spec"]
        for d in _kuberay_documents()
        if d["kind"] == "NetworkPolicy"
    }
    labels: dict[str, set[str]] = {}
    for cluster, _, template in _ray_pods():
        labels.setdefault(cluster, set()).add(template["metadata"]["labels"][CLUSTER_LABEL])
    assert {c: {c} for c in labels} == labels, "every pod of a cluster carries its name"
    assert set(policies) == set(labels)
    for cluster, spec in policies.items():
        own = {CLUSTER_LABEL: cluster}
        assert spec["podSelector"] == {"matchLabels": own}
        assert spec["policyTypes"] == ["Ingress"]
        for rule in spec["ingress"]:
            (source,) = rule["from"]
            if source["podSelector"]["matchLabels"] == own:
                assert "namespaceSelector" not in source  # this namespace's pods only
            elif source["podSelector"]["matchLabels"].get(CLUSTER_LABEL) in labels:
                # Another cluster's pods (the RayJob's), to the tracking server only.
                assert "namespaceSelector" not in source
                assert rule["ports"] == [{"protocol": "TCP", "port": 5000}]
            else:
                # The operator polls the Jobs API; nothing else of Ray's is open to it.
                assert source["podSelector"]["matchLabels"] == {
                    "app.kubernetes.io/name": "kuberay-operator"
                }
                assert rule["ports"] == [{"protocol": "TCP", "port": 8265}]


TRACKING_URL = "http://raytrain-lm-head-svc:5000"
LOGIN_SECRET = "raytrain-lm-tracking-login"


def test_kuberay_ray_containers_log_to_the_heads_tracking_server_with_the_secrets_login():
    for label, group, template in _ray_pods():
        if group == "submitter":
            continue
        (ray,) = [c for c in template["spec"]["containers"] if c["name"].startswith("ray-")]
        env = {item["name"]: item.get("value") for item in ray["env"]}
        assert env["MLFLOW_TRACKING_URI"] == TRACKING_URL, (label, group)
        assert ray["envFrom"] == [{"secretRef": {"name": LOGIN_SECRET}}], (label, group)
        assert not any("PASSWORD" in name for name in env), (label, group)  # only from the Secret


def test_kuberay_head_runs_the_tracking_server_on_a_volume_that_outlives_it():
    from raytrain_lm.cli.parser import build_parser

    cluster = next(d for d in _kuberay_documents() if d["kind"] == "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    containers = {c["name"]: c for c in head["containers"]}
    server = containers["tracking"]
    assert server["command"][:3] == ["python", "-m", "raytrain_lm.cli"]
    args = build_parser().parse_args(server["command"][3:])  # what the CLI accepts
    assert (args.tracking_command, args.host, args.port) == ("serve", "0.0.0.0", 5000)
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["tracking"]["mountPath"] == args.home
    assert mounts["tracking-login"]["mountPath"] == args.admin_login
    assert mounts["tracking-login"]["readOnly"] is True
    volumes = {v["name"]: v for v in head["volumes"]}
    claim = volumes["tracking"]["persistentVolumeClaim"]["claimName"]
    (volume,) = [d for d in _kuberay_documents() if d["kind"] == "PersistentVolumeClaim"]
    assert volume["metadata"]["name"] == claim
    assert volumes["tracking-login"]["secret"]["secretName"] == LOGIN_SECRET
    # MLflow answers the Service's name (its default Host list is localhost and private IPs).
    allowed = {e["name"]: e["value"] for e in server["env"]}["MLFLOW_SERVER_ALLOWED_HOSTS"]
    from mlflow.server.security_utils import is_allowed_host_header

    hosts = [h.strip() for h in allowed.split(",")]
    for host in ("raytrain-lm-head-svc:5000", "localhost:5000", "0.0.0.0:5000"):
        assert is_allowed_host_header(hosts, host), host
    assert head["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"  # PostgreSQL's 0700
    # The head Service carries the port, so TRACKING_URL reaches the server.
    assert {"containerPort": 5000, "name": "mlflow"} in containers["ray-head"]["ports"]
    # The RayJob's pods, which log there, are admitted to that port and no other.
    policy = next(
        d for d in _kuberay_documents()
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "raytrain-lm"
    )  # fmt: skip
    job_rule = [
        rule for rule in policy["spec"]["ingress"]
        if rule["from"][0].get("podSelector", {}).get("matchLabels", {}).get(
            "raytrain-lm/cluster") == "raytrain-lm-demo-l4"
    ]  # fmt: skip
    assert job_rule and job_rule[0]["ports"] == [{"protocol": "TCP", "port": 5000}]


def test_a_login_mounted_from_a_kubernetes_secret_reads_as_its_env_file(tmp_path):
    """Kubernetes mounts a Secret as a folder: the real files in `..data/`, a link per key."""
    data = tmp_path / "..2026_12_07"
    data.mkdir()
    (data / "MLFLOW_TRACKING_USERNAME").write_text("admin")
    (data / "MLFLOW_TRACKING_PASSWORD").write_text("s3cret\n")
    (tmp_path / "..data").symlink_to(data.name)
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        (tmp_path / key).symlink_to(f"..data/{key}")
    from raytrain_lm.tracking.server import read_env_file

    assert read_env_file(tmp_path) == {
        "MLFLOW_TRACKING_USERNAME": "admin",
        "MLFLOW_TRACKING_PASSWORD": "s3cret",
    }
