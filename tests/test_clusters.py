"""Cluster configs are product: each validates against Ray's own autoscaler schema and keeps the
promises docs/clusters.md makes (on-demand GPU-free head, spot GPU types and CPU types with
markers, bounded scale, token auth, localhost dashboard, SSH-only ingress); KubeRay manifests
agree with each other and with `raytrain-lm submit`; placement asks for what the nodes
advertise; uploads and `ray up`'s rsync leave out runs and data but keep the package."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from raytrain_lm.clusters.autoscaling import offers_cpu_nodes
from raytrain_lm.clusters.jobs import UPLOAD_EXCLUDES, entrypoint
from raytrain_lm.config import load_config
from raytrain_lm.devices import gpu_peak_flops
from raytrain_lm.errors import UserError
from raytrain_lm.placement import (
    ACCELERATOR_LABEL,
    CPU_NODE,
    CPU_NODES_ENV,
    MARKER_AMOUNT,
    release_resource_requests,
    worker_resources,
)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
CLOUD = ["aws.yaml", "gcp.yaml"]
KUBERAY = ROOT / "cluster" / "kuberay"


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / "cluster" / name).read_text())


def _markers(resources: dict) -> tuple[list[str], list[str]]:
    """The node kinds a resource dict advertises (GPU types, or "cpu"), and its capacity."""
    kinds = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
    if resources.get(CPU_NODE):
        kinds.append("cpu")
    capacity = [k for k in ("spot", "on_demand") if resources.get(k)]
    return kinds, capacity


@pytest.mark.parametrize("name", CLOUD)
def test_cloud_config_passes_rays_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    # prepare_config merges the provider's defaults exactly as `ray up` does, then the schema
    # (ray/autoscaler/ray-schema.json) and Ray's cross-field checks run on the result.
    config = prepare_config(_load(name))
    validate_config(config)
    assert config["head_node_type"] == "head"


def test_local_config_passes_rays_validation():
    from ray.autoscaler._private.util import validate_config

    # The wheel lacks fake_multinode's defaults file, so local.yaml spells out every field.
    validate_config(_load("local.yaml"))


@pytest.mark.parametrize("name", [*CLOUD, "local.yaml"])
def test_node_types_keep_the_placement_contract(name):
    config = _load(name)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert _markers(head["resources"]) == ([], []), "training workers must not fit on the head"
    workers = {k: v for k, v in types.items() if k != config["head_node_type"]}
    offered = set()
    for node_type, spec in workers.items():
        (kind,), (capacity,) = _markers(spec["resources"])  # exactly one of each
        if kind == "cpu":
            assert spec["resources"].get("GPU", 0) == 0, node_type
        else:
            assert spec["resources"][f"accelerator_type:{kind}"] == 1, node_type
            assert spec["resources"]["GPU"] >= 1, node_type
        assert spec.get("min_workers", 0) == 0, node_type
        assert 1 <= spec["max_workers"] <= config["max_workers"], node_type
        offered.add((kind, capacity))
    gpu_kinds = {kind for kind, _ in offered if kind != "cpu"}
    assert len(gpu_kinds) >= 2 and ("cpu", "spot") in offered and ("cpu", "on_demand") in offered
    assert any(c == "on_demand" for k, c in offered if k != "cpu")
    assert sum(c == "spot" for k, c in offered if k != "cpu") >= 2
    assert 0 < config["idle_timeout_minutes"] <= 15


@pytest.mark.parametrize("name", [*CLOUD, "local.yaml"])
def test_heads_tell_drivers_the_cluster_has_cpu_nodes(name):
    """CPU-only runs ask for `cpu_node` only where the head's environment says it exists."""
    config = _load(name)
    if name == "local.yaml":
        assert offers_cpu_nodes(config)  # `cluster up` then sets the variable
    else:
        assert f"{CPU_NODES_ENV}=1 ray start --head" in " ".join(config["head_start_ray_commands"])


def test_spot_markers_match_the_instances_billing():
    for node_type, spec in _load("aws.yaml")["available_node_types"].items():
        market = spec["node_config"].get("InstanceMarketOptions", {}).get("MarketType")
        assert (market == "spot") == bool(spec["resources"].get("spot")), node_type
    for node_type, spec in _load("gcp.yaml")["available_node_types"].items():
        model = spec["node_config"].get("scheduling", {}).get("provisioningModel")
        assert (model == "SPOT") == bool(spec["resources"].get("spot")), node_type


@pytest.mark.parametrize("name", CLOUD)
def test_cloud_configs_are_secure_by_default(name):
    config = _load(name)
    head_start = " ".join(config["head_start_ray_commands"])
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("pip install" in c and "raytrain-lm" in c for c in config["setup_commands"])
    if name == "aws.yaml":
        # Ray adds SSH and the group's own members; anything listed here would come on top.
        rules = config["provider"]["security_group"].get("IpPermissions", [])
        assert all((r["FromPort"], r["ToPort"]) == (22, 22) for r in rules)
    text = (ROOT / "cluster" / name).read_text()
    for secret in (r"AKIA[0-9A-Z]{16}", r"PRIVATE KEY", r"(?i)aws_secret", r"(?i)password:"):
        assert not re.search(secret, text), secret


def _kuberay() -> list[dict]:
    """The RayCluster and RayJob manifests (the directory also holds their NetworkPolicy and
    ServiceAccount: tests/test_cluster_configs.py)."""
    docs = [d for p in sorted(KUBERAY.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    return [d for d in docs if d["kind"] in ("RayCluster", "RayJob")]


def _cluster_specs() -> list[dict]:
    specs = []
    for doc in _kuberay():
        specs.append(doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"])
    return specs


def test_kuberay_manifests_use_one_image_built_from_this_repo():
    import ray

    docs = _kuberay()
    assert {d["kind"] for d in docs} == {"RayCluster", "RayJob"}
    images = set(
        re.findall(r"image: (\S+)", "".join(p.read_text() for p in KUBERAY.glob("*.yaml")))
    )
    assert len(images) == 1
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}-" in dockerfile
    assert images.pop().split(":")[-1] in dockerfile  # the tag the build comment produces
    for spec in _cluster_specs():
        assert spec["rayVersion"] == ray.__version__
        assert spec["authOptions"]["mode"] == "token"
        assert spec["enableInTreeAutoscaling"] is True
        assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def test_kuberay_worker_groups_carry_markers_and_spot_scheduling():
    for spec in _cluster_specs():
        kinds = set()
        for group in spec["workerGroupSpecs"]:
            raw = group["rayStartParams"]["resources"]
            resources = json.loads(raw.strip('"').replace('\\"', '"'))
            (kind,), (capacity,) = _markers(resources)  # exactly one of each
            assert group["minReplicas"] == 0 and group["maxReplicas"] >= 1
            pod = group["template"]["spec"]
            spot_selector = pod["nodeSelector"].get("cloud.google.com/gke-spot") == "true"
            spot_toleration = any(
                t["key"] == "cloud.google.com/gke-spot" for t in pod.get("tolerations", [])
            )
            is_spot = capacity == "spot"
            assert spot_selector == is_spot and spot_toleration == is_spot, group["groupName"]
            gpus = pod["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", "0")
            assert (int(gpus) >= 1) == (kind != "cpu"), group["groupName"]
            kinds.add(kind)
        # CPU-only runs ask for `cpu_node` only where the head's environment says it exists.
        head_env = spec["headGroupSpec"]["template"]["spec"]["containers"][0].get("env", [])
        announced = {"name": CPU_NODES_ENV, "value": "1"} in head_env
        assert announced == ("cpu" in kinds)


RAYJOB_STORAGE = "gs://BUCKET_NAME/raytrain"  # docs/clusters.md replaces the bucket's name


def test_rayjob_runs_what_submit_sends():
    """The RayJob is `raytrain-lm submit --storage gs://...`: run state and data in the bucket."""
    job = next(d for d in _kuberay() if d["kind"] == "RayJob")
    words = shlex.split(job["spec"]["entrypoint"])
    config = words[4]
    assert (ROOT / config).is_file()
    moved = ("output_dir=", "data.cache_dir=", "tracking.uri=", "scaling.ray_address=")
    user = [w for w in words[5:] if w != "--set" and not w.startswith(moved)]
    expected, _ = entrypoint(config, user, ROOT, RAYJOB_STORAGE)
    assert " ".join(job["spec"]["entrypoint"].split()) == expected
    assert f"output_dir={RAYJOB_STORAGE}/runs" in words


def _scaling(*overrides: str):
    return load_config(None, list(overrides)).scaling


def test_placement_pins_one_type_and_capacity():
    s = _scaling("scaling.accelerator_type=A100", "scaling.capacity=spot", "scaling.use_gpu=false")
    placed = worker_resources(s, False, {})
    assert placed == {
        "resources_per_worker": {
            "CPU": 1.0,
            "spot": MARKER_AMOUNT,
            "accelerator_type:A100": MARKER_AMOUNT,
        }
    }


def test_placement_keeps_a_ddp_group_on_the_type_that_is_up():
    s = _scaling("scaling.accelerator_type=[L4, A100, H100]", "scaling.capacity=on_demand")
    placed = worker_resources(s, True, {"accelerator_type:A100": 2.0, "accelerator_type:L4": 1})
    resources = placed["resources_per_worker"]
    assert resources["GPU"] == 1.0 and resources["on_demand"] == MARKER_AMOUNT
    assert [k for k in resources if k.startswith("accelerator_type:")] == ["accelerator_type:A100"]
    # nothing up: the first listed type, whose nodes the autoscaler launches
    cold = worker_resources(s, True, {})["resources_per_worker"]
    assert "accelerator_type:L4" in cold


def test_mixed_placement_uses_a_selector_ray_accepts():
    from ray._private.label_utils import validate_label_selector

    s = _scaling("scaling.accelerator_type=[A100, H100]", "scaling.allow_mixed_accelerators=true")
    placed = worker_resources(s, True, {})
    assert placed["label_selector"] == {ACCELERATOR_LABEL: "in(A100,H100)"}
    assert validate_label_selector(placed["label_selector"]) is None
    assert not any(k.startswith("accelerator_type:") for k in placed["resources_per_worker"])


def test_peak_flops_by_accelerator_type():
    assert gpu_peak_flops("NVIDIA L40") == 181e12  # not L4's
    assert gpu_peak_flops("L4") == 121e12
    assert gpu_peak_flops("A100-80G") == gpu_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("TPU-V4") is None


# A working dir as users have it: runs and prepared data at the top and next to the notebooks
# (their default relative paths), MLflow stores, and the package's own data code.
WORKING_DIR = {
    "raytrain_lm/data/stream.py": True,
    "raytrain_lm/data/__init__.py": True,
    "experiments/demo.yaml": True,
    "notebooks/03_elastic.ipynb": True,
    "data/abc/shard-0.parquet": False,
    "data/abc/manifest.json": False,
    "runs/demo/summary.json": False,
    "notebooks/runs/elastic-1/events.jsonl": False,
    "notebooks/data/abc/manifest.json": False,
    "notebooks/mlflow.db": False,
    "mlruns/0/meta.yaml": False,
    ".git/HEAD": False,
    ".venv/bin/python": False,
}


def _layout(root: Path) -> None:
    for rel in WORKING_DIR:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")


def _kept(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != ".gitignore"
    )


def test_upload_excludes_keep_code_and_drop_outputs(tmp_path):
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    _layout(tmp_path)
    kept = []
    _dir_travel(
        tmp_path,
        [_get_excludes(tmp_path, UPLOAD_EXCLUDES)],
        lambda p: kept.append(p.relative_to(tmp_path).as_posix()) if p.is_file() else None,
        include_gitignore=False,
    )
    assert sorted(kept) == sorted(rel for rel, keep in WORKING_DIR.items() if keep)


def test_uploads_leave_out_what_ray_leaves_out_by_default():
    """`submit` turns Ray's default excludes off (else Ray warns at every submit that it now
    leaves them out): each of them must be one of ours."""
    from ray._private.ray_constants import RAY_RUNTIME_ENV_DEFAULT_EXCLUDES

    assert set(RAY_RUNTIME_ENV_DEFAULT_EXCLUDES.split(",")) <= set(UPLOAD_EXCLUDES)


def test_upload_of_this_checkout_keeps_the_package_data_code():
    """What `submit` sends from this very directory, .gitignore included as Ray reads it."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    kept = []
    _dir_travel(
        ROOT,
        [_get_excludes(ROOT, UPLOAD_EXCLUDES)],
        lambda p: kept.append(p.relative_to(ROOT).as_posix()) if p.is_file() else None,
        include_gitignore=True,
    )
    package_data = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "raytrain_lm" / "data").glob("*.py")
    )
    assert package_data and set(package_data) <= set(kept)
    assert not [
        k
        for k in kept
        if re.search(r"(^|/)(runs|data)/", k) and not k.startswith("raytrain_lm/data/")
    ]


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync, as `ray up` does")
@pytest.mark.parametrize("name", CLOUD)
def test_ray_up_rsync_keeps_the_package_data_code(name, tmp_path):
    """`ray up` copies the checkout to the head with rsync, the config's rsync_exclude first and
    .gitignore after; rsync takes the first rule that matches."""
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    source, target = tmp_path / "checkout", tmp_path / "head"
    _layout(source)
    shutil.copy(ROOT / ".gitignore", source / ".gitignore")
    config = _load(name)
    options = {"rsync_exclude": config["rsync_exclude"], "rsync_filter": config["rsync_filter"]}
    rules = SSHCommandRunner._create_rsync_filter_args(None, options)
    subprocess.run(["rsync", "-a", *rules, f"{source}/", f"{target}/"], check=True)
    assert _kept(target) == sorted(rel for rel, keep in WORKING_DIR.items() if keep)


def test_submit_moves_relative_outputs_to_storage_and_refuses_outside_configs(tmp_path):
    command, cfg = entrypoint(
        "experiments/demo.yaml", ["output_dir=/shared/runs", "name=x"], ROOT, "/mnt/store"
    )
    words = shlex.split(command)
    assert "output_dir=/shared/runs" in words and "data.cache_dir=/mnt/store/data" in words
    assert "scaling.ray_address=auto" in words and cfg.name == "x"
    outside = tmp_path / "run.yaml"
    outside.write_text("name: y\n")
    with pytest.raises(UserError, match="outside the working dir"):
        entrypoint(str(outside), [], ROOT)


def _settings(command: str) -> list[tuple[str, str]]:
    """The --set KEY=VALUE pairs of a job's command line, in order."""
    words = shlex.split(command)
    pairs = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    return [tuple(pair.split("=", 1)) for pair in pairs]


def _moved(command: str) -> dict[str, str]:
    return dict(_settings(command))


@pytest.mark.parametrize("storage", ["s3://my-runs/raytrain", "gs://my-runs/raytrain/"])
def test_submit_puts_relative_outputs_in_a_bucket(storage):
    command, _ = entrypoint("experiments/demo.yaml", ["name=x"], ROOT, storage)
    moved = _moved(command)
    prefix = storage.rstrip("/")
    assert moved["output_dir"] == f"{prefix}/runs"
    assert moved["data.cache_dir"] == f"{prefix}/data"
    # sqlite cannot live in a bucket: without the cluster's server the database stays on the
    # head, where the driver runs.
    assert moved["tracking.uri"] == "${MLFLOW_TRACKING_URI:-sqlite:///$HOME/raytrain-lm/mlflow.db}"
    assert '"output_dir=' + prefix + '/runs"' in command  # quoted like the head paths


def test_submit_leaves_absolute_outputs_and_servers_alone_with_a_bucket():
    command, _ = entrypoint(
        "experiments/demo.yaml",
        [
            "output_dir=gs://other/runs",
            "data.cache_dir=/mnt/data",
            "tracking.uri=http://mlflow:5000",
        ],
        ROOT,
        "s3://my-runs",
    )
    settings = _settings(command)
    for key, value in [
        ("output_dir", "gs://other/runs"),
        ("data.cache_dir", "/mnt/data"),
        ("tracking.uri", "http://mlflow:5000"),
    ]:
        assert [v for k, v in settings if k == key] == [value], key  # the user's, nothing moved


def test_submit_keeps_a_relative_sqlite_file_under_a_folder_storage():
    command, _ = entrypoint(
        "experiments/demo.yaml",
        ["name=x", "tracking.uri=sqlite:///runs.db", "output_dir=mine"],
        ROOT,
        "/mnt/store/",
    )
    settings = _settings(command)
    # Once each: the user's relative paths, moved (given again after, they would win).
    assert [v for k, v in settings if k == "tracking.uri"] == ["sqlite:////mnt/store/runs.db"]
    assert [v for k, v in settings if k == "output_dir"] == ["/mnt/store/mine"]


def test_a_moved_path_wins_over_a_section_the_user_set():
    command, _ = entrypoint("experiments/demo.yaml", ["data={cache_dir: mine}"], ROOT, "/mnt/store")
    settings = _settings(command)
    assert [k for k, _ in settings].index("data") < [k for k, _ in settings].index("data.cache_dir")
    assert _moved(command)["data.cache_dir"] == "/mnt/store/mine"


def _tracking_uri_on_head(command: str, **head_env: str) -> str:
    """The tracking.uri the head's shell hands the job, as Ray runs an entrypoint (`sh -c`)."""
    words = command.replace("python -m raytrain_lm.cli train", "printf '%s\\n'")
    env = {"PATH": os.environ["PATH"], "HOME": "/home/ray", **head_env}
    printed = subprocess.run(["sh", "-c", words], capture_output=True, text=True, env=env)
    return next(w for w in printed.stdout.splitlines() if w.startswith("tracking.uri="))


def test_a_job_naming_no_store_logs_to_the_clusters_server_else_to_sqlite_on_the_head():
    command, _ = entrypoint("experiments/demo.yaml", ["name=x"], ROOT, "$HOME/raytrain-lm")
    served = _tracking_uri_on_head(command, MLFLOW_TRACKING_URI="http://10.0.1.23:5000")
    assert served == "tracking.uri=http://10.0.1.23:5000"
    alone = _tracking_uri_on_head(command)
    assert alone == "tracking.uri=sqlite:////home/ray/raytrain-lm/mlflow.db"


@pytest.mark.parametrize(
    "storage",
    [
        "s3://",  # no bucket
        "s3:///runs",
        "gs://b",  # too short for a bucket name
        "ftp://my-runs/raytrain",
        "s3://my-runs/../elsewhere",
        "s3://my-runs/$HOME",
        "s3://my runs/x",
        "s3://-runs/x",
    ],
)
def test_submit_refuses_storage_that_is_not_a_bucket_or_folder(storage):
    with pytest.raises(UserError, match="--storage") as refused:
        entrypoint("experiments/demo.yaml", ["name=x"], ROOT, storage)
    assert "\n" not in str(refused.value)


def test_cli_user_errors_are_one_line(capsys):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "raytrain_lm.cli", "submit", "missing.yaml", "--address", "x:1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "raytrain-lm: error: config file not found: missing.yaml"


def test_user_label_selector_joins_the_placement():
    from ray._private.label_utils import validate_label_selector

    s = _scaling(
        "scaling.accelerator_type=[A100, H100]",
        "scaling.allow_mixed_accelerators=true",
        "scaling.label_selector.zone=us-east-1a",
    )
    placed = worker_resources(s, True, {})
    assert placed["label_selector"] == {ACCELERATOR_LABEL: "in(A100,H100)", "zone": "us-east-1a"}
    assert validate_label_selector(placed["label_selector"]) is None


def _scaling_cpu_run():
    return _scaling("scaling.use_gpu=false")


def test_cpu_runs_ask_for_cpu_nodes_where_the_cluster_has_them(monkeypatch):
    monkeypatch.delenv(CPU_NODES_ENV, raising=False)
    plain = worker_resources(_scaling_cpu_run(), False, {"CPU": 8.0})["resources_per_worker"]
    assert plain == {"CPU": 1.0}  # a Ray without CPU nodes: no marker, or nothing would fit
    up = worker_resources(_scaling_cpu_run(), False, {"CPU": 3.0, CPU_NODE: 1.0})
    assert up["resources_per_worker"][CPU_NODE] == MARKER_AMOUNT

    monkeypatch.setenv(CPU_NODES_ENV, "1")  # the head of one of our clusters, scaled to zero
    cold = worker_resources(_scaling_cpu_run(), False, {"CPU": 1.0})["resources_per_worker"]
    assert cold == {"CPU": 1.0, CPU_NODE: MARKER_AMOUNT}
    gpu = worker_resources(_scaling("scaling.use_gpu=true"), True, {})["resources_per_worker"]
    assert CPU_NODE not in gpu and gpu["GPU"] == 1.0
    # CPU workers that name a GPU type (fake GPU nodes) go to that type, not to CPU nodes.
    typed = _scaling("scaling.accelerator_type=A100", "scaling.use_gpu=false")
    assert CPU_NODE not in worker_resources(typed, False, {})["resources_per_worker"]


def _requested_bundles() -> list[dict]:
    """What the autoscaler is asked to keep room for (autoscaler v1 reads it from the GCS)."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def test_release_withdraws_only_the_runs_own_resource_request(ray_session):
    """What a Train controller that dies with its driver leaves behind: its registration with
    Ray Data's AutoscalingCoordinator, which keeps asking the autoscaler for the run's nodes."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        ResourceRequestPriority,
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    mine, other = {"CPU": 1.0, "released_run": 1.0}, {"CPU": 1.0, "other_run": 1.0}
    for requester, bundle in (("train-released", mine), ("train-other", other)):
        ray_session.get(
            coordinator.request_resources.remote(
                requester_id=requester,
                resources=[bundle, bundle],
                expire_after_s=180,
                priority=ResourceRequestPriority.HIGH,  # what Ray Train sends
            )
        )
    try:
        assert _requested_bundles().count(mine) == 2
        release_resource_requests("released")
        assert mine not in _requested_bundles()
        assert _requested_bundles().count(other) == 2
        release_resource_requests("never-ran")  # nothing to withdraw: no error
    finally:
        ray_session.get(coordinator.cancel_request.remote("train-other"))
