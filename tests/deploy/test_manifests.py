"""deploy/k8s is something an operator can apply as it is, checked offline (no cluster here):

- every Kubernetes object that `kubectl kustomize` builds (the base, the example overlay, the overlay with
  its external-database component) validates against Kubernetes' schemas (`kubernetes-validate`, strict:
  unknown fields are errors, as `kubectl apply` makes them), and the RayCluster against KubeRay's CRD
  (its schema is kept in tests/deploy/schemas/kuberay);
- every `PELT_*` variable of the image, compose.yaml, env.example and the manifests is a field of
  `services.settings.Settings`, with a value it accepts;
- every command line a container runs, KubeRay's `ray start` lines included, is parsed by that program's own
  click command, and the roles are the same as in compose.yaml;
- Services, ports, URLs, Secret and ConfigMap keys, volumes and images agree.

What this cannot show: that the manifests run on a cluster.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml
from sqlalchemy.engine import make_url

from services.settings import Settings
from tests.deploy import kustomize_lite
from tests.deploy.deployment_files import (
    DEPLOY,
    K8S,
    OTHER_IMAGES,
    ROLES,
    S3_SECRETS,
    SECRET_KEYS,
    SECRETS,
    compose_command_lines,
    compose_environment,
    container_command_lines,
    container_environment,
    containers,
    env_file,
    head_address,
    instruction,
    kuberay_start_line,
    load_compose_override,
    objects_of,
    parse_command_line,
    parsed,
    pelt_containers,
    pod_templates,
    render_with_kubectl,
    settings_of,
)

KUBERNETES_VERSION = "1.32"
RAYCLUSTER_SCHEMA = Path(__file__).parent / "schemas" / "kuberay" / "ray.io_rayclusters.v1.json"
SETTINGS_VARIABLES = {f"PELT_{name.upper()}" for name in Settings.model_fields}


# --- Kubernetes: schemas ----------------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """A CRD schema in which an object's unknown fields are errors, as `kubectl apply` (strict field
    validation) makes them, unless the schema keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    tightened = {key: strict(value) for key, value in schema.items()}
    if (
        tightened.get("type") == "object"
        and "properties" in tightened
        and "additionalProperties" not in tightened
        and not tightened.get("x-kubernetes-preserve-unknown-fields")
    ):
        tightened["additionalProperties"] = False
    return tightened


@pytest.fixture(scope="module")
def raycluster_schema() -> jsonschema.protocols.Validator:
    """KubeRay's RayCluster schema: its CRD's v1 OpenAPI schema (tests/deploy/schemas/kuberay)."""
    return jsonschema.Draft7Validator(strict(json.loads(RAYCLUSTER_SCHEMA.read_text())))


@pytest.mark.parametrize("build", ["example", "external-database", "s3-artifacts", "base"])
def test_every_kubernetes_object_validates_against_its_schema(builds, raycluster_schema, build: str):
    kinds = {manifest["kind"] for manifest in builds[build]}
    assert {"Namespace", "ConfigMap", "Service", "PersistentVolumeClaim", "Deployment"} <= kinds
    assert "Job" not in kinds  # migrations run in the API pods' init container: applied any number of times
    assert {"NetworkPolicy", "RayCluster"} <= kinds
    # PostgreSQL in the cluster unless the overlay points at an external one; Redis (the GCS state) always
    assert set(objects_of(builds[build], "StatefulSet")) == (
        {"pelt-redis"} if build == "external-database" else {"pelt-redis", "postgres"}
    )
    assert ("Secret" in kinds) == (build != "base")  # the overlay makes it from secrets.env
    for manifest in builds[build]:
        if manifest["apiVersion"] != "ray.io/v1":
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    for manifest in builds[build]:
        if manifest["apiVersion"] == "ray.io/v1":
            errors = [
                f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in raycluster_schema.iter_errors(manifest)
            ]
            assert not errors, errors


def test_a_schema_mistake_would_fail(cluster, raycluster_schema):
    """The checks above can fail: a misspelt field is refused in both kinds of object."""
    deployment = copy.deepcopy(objects_of(cluster, "Deployment")["pelt-api"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    ray = copy.deepcopy(objects_of(cluster, "RayCluster")["pelt-ray"])
    ray["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert list(raycluster_schema.iter_errors(ray))


@pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="no kubectl here to compare tests/deploy/kustomize_lite with (the other checks build the manifests "
    "with kustomize_lite instead); it needs a kubectl with kustomize 5, e.g. 1.27 or newer (Debian 12's "
    "kubernetes-client, 1.20, cannot build deploy/k8s)",
)
def test_the_test_renderer_builds_what_kubectl_builds(overlays: dict[str, Path]):
    def canonical(objects: list[dict[str, Any]]) -> list[str]:
        """Objects as sorted JSON, without the Secret's hash suffix and with its values decoded (kubectl
        breaks long base64 lines)."""
        for manifest in objects:
            if manifest["kind"] == "Secret":
                manifest["data"] = {k: base64.b64decode(v).decode() for k, v in manifest["data"].items()}
        text = [json.dumps(o, sort_keys=True) for o in objects]
        return sorted(re.sub(r'"pelt-secrets-[a-z0-9]{10}"', '"pelt-secrets"', t) for t in text)

    for folder in [*overlays.values(), K8S / "base"]:
        assert canonical(kustomize_lite.build(folder)) == canonical(render_with_kubectl("kubectl", folder))


# --- Kubernetes: settings and command lines ---------------------------------------------------------------


def test_every_pelt_variable_is_a_setting_with_a_value_it_accepts(compose, builds, monkeypatch):
    mentioned = set(env_file(DEPLOY / "env.example", commented=True))
    mentioned |= {line.split("=")[0] for line in " ".join(instruction("ENV")).split() if "=" in line}
    for service in compose["services"].values():
        environment = compose_environment(service)
        mentioned |= set(environment)
        settings_of(environment, monkeypatch)
    for objects in builds.values():
        if objects is builds["base"]:
            continue  # no Secret to read
        for config_map in objects_of(objects, "ConfigMap").values():
            mentioned |= set(config_map["data"])
        for _, _container, environment in pelt_containers(objects):
            mentioned |= set(environment)
            settings_of(environment, monkeypatch)
    text = "\n".join(p.read_text() for p in [DEPLOY / "compose.yaml", *K8S.rglob("*.yaml")])
    mentioned |= set(re.findall(r"\$\(?(PELT_[A-Z_]+)", text))
    pelt_variables = {name for name in mentioned if name.startswith("PELT_")}
    assert pelt_variables - SETTINGS_VARIABLES == set()
    assert {"PELT_DATABASE_URL", "PELT_MLFLOW_TRACKING_URI", "PELT_RAY_ADDRESS"} <= pelt_variables


def kubernetes_roles(objects: list[dict[str, Any]], monkeypatch) -> dict[str, list[Any]]:
    """command path -> the parsed params of every command line the cluster's containers run."""
    roles: dict[str, list[Any]] = {}
    for pod, container, environment in pelt_containers(objects):
        started_by_kuberay = pod.startswith("RayCluster/")  # its `ray start` line: below
        for argv in [] if started_by_kuberay else container_command_lines(container, environment):
            context = parsed(argv, environment, monkeypatch)
            roles.setdefault(context.command_path, []).append((pod, context.params))
        for probe in ("readinessProbe", "livenessProbe"):
            command = container.get(probe, {}).get("exec", {}).get("command", [])
            if command[:1] == ["ray"]:
                context = parse_command_line(command)
                roles.setdefault(context.command_path, []).append((pod, context.params))
    for ray in objects_of(objects, "RayCluster").values():
        for group in [None, *ray["spec"]["workerGroupSpecs"]]:
            context = parse_command_line(kuberay_start_line(ray, group))
            roles.setdefault(context.command_path, []).append((group and group["groupName"], context.params))
    return roles


@pytest.mark.parametrize("build", ["example", "external-database"])
def test_every_kubernetes_command_is_a_real_command_line(builds, build: str, monkeypatch):
    roles = kubernetes_roles(builds[build], monkeypatch)
    assert set(roles) == ROLES | {"ray health-check"}


def test_kubernetes_roles_match_the_compose_ones(cluster, compose, monkeypatch):
    roles = kubernetes_roles(cluster, monkeypatch)
    (head,) = [params for group, params in roles["ray start"] if params["head"]]
    assert head["num_cpus"] == 0 and head["include_dashboard"] is False
    (dispatcher_node,) = [p for pod, p in roles["ray start"] if pod == "Deployment/pelt-dispatcher"]
    assert dispatcher_node["num_cpus"] == 0
    (api_node,) = [p for pod, p in roles["ray start"] if pod == "Deployment/pelt-api"]
    assert api_node["num_cpus"] == 0  # the API calls the prediction replicas as a Ray node with no CPUs
    (predict_node,) = [p for group, p in roles["ray start"] if group == "predict"]
    api = objects_of(cluster, "Deployment")["pelt-api"]["spec"]["template"]["spec"]["containers"][0]
    resource = container_environment(api, cluster)["PELT_PREDICT_RESOURCE"]
    assert predict_node["num_cpus"] == 0 and json.loads(predict_node["resources"])[resource] >= 1
    (dispatcher,) = [params for _, params in roles["pelt dispatcher"]]
    assert dispatcher["delta_store"] == "mlflow"
    (token,) = [params for _, params in roles["pelt token create"]]
    assert (token["scope"], token["secret_variable"], token["if_none"]) == ("admin", "FIRST_API_TOKEN", True)
    (serve,) = [params for _, params in roles["pelt serve"]]
    assert (serve["dispatcher"], serve["host"], serve["port"]) == (False, "0.0.0.0", 8000)
    api_pod = objects_of(cluster, "Deployment")["pelt-api"]["spec"]["template"]["spec"]
    scripts = {
        "migrate": api_pod["initContainers"][0],  # compose's one-shot service: the API pods' init container
        "dispatcher": objects_of(cluster, "Deployment")["pelt-dispatcher"]["spec"]["template"]["spec"][
            "containers"
        ][0],
        "api": api_pod["containers"][0],
    }
    for service, container in scripts.items():  # the same script as compose.yaml's
        assert container["args"] == compose["services"][service]["command"], service


@pytest.mark.parametrize(
    "argv",
    [
        ["pelt", "dispatcher", "--delta-store", "s3"],  # a value the option refuses
        ["pelt", "serve", "--no-dispatchers"],  # an option that does not exist
        ["pelt", "db", "migrate"],  # a command that does not exist
        ["pelt", "db"],  # a group without its command
        ["ray", "start", "--num-cpu", "0"],
        ["mlflow", "server", "--serve-artifact"],
    ],
)
def test_a_wrong_command_line_would_fail(argv: list[str]):
    with pytest.raises(click.UsageError):
        parse_command_line(argv)


# --- Kubernetes: names, ports, keys -----------------------------------------------------------------------


def services_to_pods(objects: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Service name -> (the Service, the containers of the pods it selects)."""
    templates = [template for _, template in pod_templates(objects)]
    found = {}
    for name, service in objects_of(objects, "Service").items():
        selector = service["spec"]["selector"].items()
        selected = [t for t in templates if selector <= t["metadata"].get("labels", {}).items()]
        assert selected, f"Service {name} selects no pod"
        found[name] = (service, [c for t in selected for c in t["spec"]["containers"]])
    return found


def listens(name: str, objects: list[dict[str, Any]], port: int) -> dict[str, Any]:
    """The container behind Service `name`'s port: the port resolves to one of its containerPorts."""
    service, pods = services_to_pods(objects)[name]
    (entry,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    target = entry.get("targetPort", port)
    for container in pods:
        for declared in container.get("ports", []):
            if target in (declared.get("name"), declared["containerPort"]):
                assert declared["containerPort"] == port or isinstance(target, str)
                return container
    raise AssertionError(f"Service {name}: no container listens on {target}")


@pytest.mark.parametrize("build", ["example", "external-database"])
def test_kubernetes_urls_name_services_that_listen_there(builds, build: str, monkeypatch):
    objects = builds[build]
    ray = objects_of(objects, "RayCluster")["pelt-ray"]
    mlflow = listens("mlflow", objects, 5000)
    server = parse_command_line(["mlflow", *mlflow["args"]]).params
    assert server["port"] == 5000 and server["serve_artifacts"]
    checked = 0
    for pod, _, environment in pelt_containers(objects):
        for variable in ("PELT_DATABASE_URL", "MLFLOW_BACKEND_STORE_URI"):
            if variable in environment:
                url = make_url(environment[variable])
                assert url.password == SECRETS["POSTGRES_PASSWORD"] and url.database in ("pelt", "mlflow")
                if build == "example":
                    assert listens(url.host, objects, url.port) is not None, pod
                else:
                    assert url.host == "db.example.com" and "postgres" not in objects_of(objects, "Service")
                checked += 1
        if pod.startswith("RayCluster/"):
            continue  # Ray's own containers: no pelt settings
        assert environment["PELT_RAY_ADDRESS"] == head_address(ray)
        location = environment["PELT_MLFLOW_TRACKING_URI"].removeprefix("http://")
        assert location in server["allowed_hosts"].split(",")
        assert listens(location.split(":")[0], objects, int(location.split(":")[1])) is mlflow
    assert checked == 6  # mlflow (init container and server), migrate (two URLs), api, dispatcher
    assert head_address(ray) == "pelt-ray-head-svc:6379"


def test_every_reference_names_something_the_cluster_has(cluster):
    secrets = objects_of(cluster, "Secret")
    assert set(secrets) == {"pelt-secrets"} or all(n.startswith("pelt-secrets-") for n in secrets)
    (secret,) = secrets.values()
    assert set(secret["data"]) == SECRET_KEYS == set(env_file(K8S / "overlays/example/secrets.env.example"))
    claims = set(objects_of(cluster, "PersistentVolumeClaim"))
    claim_templates = {  # a StatefulSet's pods mount the claims it makes per pod
        f"StatefulSet/{name}": {
            claim["metadata"]["name"] for claim in workload["spec"]["volumeClaimTemplates"]
        }
        for name, workload in objects_of(cluster, "StatefulSet").items()
    }
    for pod, template in pod_templates(cluster):
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, pod
        for container in containers(template):
            container_environment(container, cluster)  # every Secret and ConfigMap key it names exists
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claim_templates.get(pod, ()), (pod, mount)
    ray = objects_of(cluster, "RayCluster")["pelt-ray"]
    autoscaler = {"spec": {"containers": [{"image": "", **ray["spec"]["autoscalerOptions"]}]}}
    for pod, template in [*pod_templates([ray]), ("autoscaler", autoscaler)]:
        environment = container_environment(template["spec"]["containers"][0], cluster)
        assert environment["RAY_AUTH_MODE"] == "token", pod
        assert environment["RAY_AUTH_TOKEN"] == SECRETS["RAY_AUTH_TOKEN"], pod


def test_task_data_are_shared_by_the_api_and_every_ray_worker(cluster):
    data_dir = objects_of(cluster, "ConfigMap")["pelt-config"]["data"]["PELT_DATA_DIR"]
    assert objects_of(cluster, "PersistentVolumeClaim")["pelt-data"]["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]
    readers = {"Deployment/pelt-api", "RayCluster/pelt-ray/cpu", "RayCluster/pelt-ray/gpu"}
    assert readers <= {pod for pod, _ in pod_templates(cluster)}
    for pod, template in pod_templates(cluster):
        if pod in readers:
            volumes = template["spec"]["volumes"]
            (claim,) = [
                v["name"]
                for v in volumes
                if v.get("persistentVolumeClaim", {}).get("claimName") == "pelt-data"
            ]
            mounts = template["spec"]["containers"][0]["volumeMounts"]
            assert {"name": claim, "mountPath": data_dir} in mounts, pod


def test_the_ray_cluster_has_an_idle_head_and_an_autoscaling_cpu_group(builds):
    ray = objects_of(builds["example"], "RayCluster")["pelt-ray"]
    spec = ray["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {group["groupName"]: group for group in spec["workerGroupSpecs"]}
    cpu = groups["cpu"]
    assert (
        1 <= cpu["minReplicas"] <= cpu["replicas"] <= cpu["maxReplicas"]
        and cpu["maxReplicas"] > cpu["minReplicas"]
    )
    resources = cpu["template"]["spec"]["containers"][0]["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
    gpu = groups["gpu"]  # an option: present, off
    assert gpu["replicas"] == gpu["minReplicas"] == gpu["maxReplicas"] == 0
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu["template"]["spec"]["containers"][0]["image"].endswith("cu130")
    base_gpu = objects_of(builds["base"], "RayCluster")["pelt-ray"]["spec"]["workerGroupSpecs"][1]
    assert base_gpu["template"]["spec"]["containers"][0]["image"] == "pelt-cuda:0.1.0-ray2.60.0-cu130"


def test_workloads_run_non_root_with_health_probes_and_a_standby_dispatcher(cluster):
    deployments = objects_of(cluster, "Deployment")
    assert deployments["pelt-dispatcher"]["spec"]["replicas"] == 2
    api = deployments["pelt-api"]["spec"]["template"]["spec"]["containers"][0]
    # ready while the database and the MLflow server answer; alive while the process answers at all
    assert api["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert api["ports"] == [{"name": "http", "containerPort": 8000}]
    # migrations first, in every API pod (each upgrade under a database lock)
    assert [c["name"] for c in deployments["pelt-api"]["spec"]["template"]["spec"]["initContainers"]] == [
        "migrate"
    ]
    for pod, template in pod_templates(cluster):
        if pod != "StatefulSet/postgres":
            context = template["spec"]["securityContext"]
            assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001, pod


def test_a_restarted_ray_head_takes_up_the_cluster_state_from_redis(cluster):
    """GCS fault tolerance as KubeRay documents it (an offline check: the head restart itself is measured by
    benchmarks/soak.py's `restart Ray head` fault on namespaced hosts)."""
    options = objects_of(cluster, "RayCluster")["pelt-ray"]["spec"]["gcsFaultToleranceOptions"]
    host, port = options["redisAddress"].split(":")
    container = listens(host, cluster, int(port))
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"]["key"] == "RAY_AUTH_TOKEN"
    assert container_environment(container, cluster)["REDIS_PASSWORD"] == SECRETS["RAY_AUTH_TOKEN"]
    assert "--requirepass" in container["args"]


def test_disruptions_leave_an_api_a_dispatcher_and_the_ray_head_and_dispatchers_spread(cluster):
    budgets = objects_of(cluster, "PodDisruptionBudget")
    labels = {
        pod: template["metadata"]["labels"].get("app.kubernetes.io/name")
        for pod, template in pod_templates(cluster)
    }
    for name, rule in (("pelt-api", ("maxUnavailable", 1)), ("pelt-dispatcher", ("maxUnavailable", 1))):
        budget = budgets[name]["spec"]
        assert (
            budget[rule[0]] == rule[1]
            and budget["selector"]["matchLabels"]["app.kubernetes.io/name"] in labels.values()
        )
    assert budgets["pelt-redis"]["spec"]["minAvailable"] == 1  # the GCS state the head takes up
    # ... kept on a volume of its own, so that it outlives the Redis pod (an emptyDir would not)
    redis = objects_of(cluster, "StatefulSet")["pelt-redis"]["spec"]
    (claim,) = redis["volumeClaimTemplates"]
    mounts = redis["template"]["spec"]["containers"][0]["volumeMounts"]
    assert claim["metadata"]["name"] in {m["name"] for m in mounts if m["mountPath"] == "/data"}
    assert "--appendonly" in redis["template"]["spec"]["containers"][0]["args"]
    assert not any("emptyDir" in v for v in redis["template"]["spec"].get("volumes", []))
    head = budgets["pelt-ray-head"]["spec"]
    assert (
        head["minAvailable"] == 1
        and head["selector"]["matchLabels"]["app.kubernetes.io/name"] == "pelt-ray-head"
    )
    assert "pelt-ray-head" in labels.values()
    spread = objects_of(cluster, "Deployment")["pelt-dispatcher"]["spec"]["template"]["spec"]["affinity"]
    (term,) = spread["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_images_are_named_once_in_the_overlay(builds):
    overlay = yaml.safe_load((K8S / "overlays/example/kustomization.yaml").read_text())
    named = {f"{image['newName']}:{image['newTag']}" for image in overlay["images"]}
    for build, expected in (
        ("example", named),
        ("base", {"pelt:0.1.0-ray2.60.0", "pelt-cuda:0.1.0-ray2.60.0-cu130"}),
    ):
        images = {c["image"] for _, t in pod_templates(builds[build]) for c in containers(t)} - OTHER_IMAGES
        assert images == expected, build


def test_only_the_api_is_reachable_from_outside_the_namespace(cluster):
    policies = objects_of(cluster, "NetworkPolicy")
    deny = policies["default-deny-ingress"]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}
    within = policies["allow-within-namespace"]["spec"]
    assert within["podSelector"] == {} and within["ingress"] == [{"from": [{"podSelector": {}}]}]
    open_to_all = [
        p["spec"] for p in policies.values() if any("from" not in r for r in p["spec"].get("ingress", []))
    ]
    assert open_to_all == [
        {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "pelt-api"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": 8000}]}],
        }
    ]


def test_the_overlay_patches_aim_at_objects_of_the_base(builds):
    base = builds["base"]
    overlay = K8S / "overlays" / "example"
    patches = [
        yaml.safe_load((overlay / p["path"]).read_text())
        for p in yaml.safe_load((overlay / "kustomization.yaml").read_text())["patches"]
    ]
    component = yaml.safe_load((overlay / "external-database/kustomization.yaml").read_text())
    for entry in component["patches"]:
        patches.append(
            yaml.safe_load(
                (overlay / "external-database" / entry["path"]).read_text()
                if "path" in entry
                else entry["patch"]
            )
        )
    assert len(patches) == 5
    for patch in patches:
        assert kustomize_lite.find(base, patch["kind"], patch["metadata"]["name"])


def test_the_s3_artifacts_option_points_mlflow_at_a_bucket_with_credentials_and_drops_the_volume(
    builds, compose
):
    """Kubernetes (the s3-artifacts component) and compose (compose.s3.yaml) alike: the MLflow server's
    artifacts go to a bucket, the rest of its command is the same as without the option, and the credentials
    come from the secrets; pelt's own containers get none of them (they reach the files through the server)."""
    default = objects_of(builds["example"], "Deployment")["mlflow"]["spec"]["template"]["spec"]
    s3 = objects_of(builds["s3-artifacts"], "Deployment")["mlflow"]["spec"]["template"]["spec"]
    (server,), (before,) = s3["containers"], default["containers"]
    destination = server["args"].index("--artifacts-destination") + 1
    assert server["args"][destination].startswith("s3://")
    assert [a for i, a in enumerate(server["args"]) if i != destination] == [
        a for i, a in enumerate(before["args"]) if i != destination
    ]
    env = {item["name"]: item for item in server["env"]}
    for key in S3_SECRETS:
        reference = env[key]["valueFrom"]["secretKeyRef"]  # kustomize names the Secret with a hash suffix
        assert reference["key"] == key and reference["name"].startswith("pelt-secrets")
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"].startswith("https://")
    assert "mlflow-artifacts" not in objects_of(builds["s3-artifacts"], "PersistentVolumeClaim")
    assert [volume for volume in s3["volumes"] if volume["name"] == "artifacts"] == [
        {"name": "artifacts", "emptyDir": {}}
    ]
    for name, template in pod_templates(builds["s3-artifacts"]):
        if name != "Deployment/mlflow":
            assert not any(
                item.get("name", "").startswith("AWS_")
                for c in containers(template)
                for item in c.get("env", [])
            ), name

    variables = {**SECRETS, **S3_SECRETS, "MLFLOW_ARTIFACTS_DESTINATION": "s3://pelt/deltas"}
    variables["MLFLOW_S3_ENDPOINT_URL"] = "http://minio:9000"
    override = load_compose_override("compose.s3.yaml", variables)
    (service,) = override["services"].values()
    assert service["command"][destination] == "s3://pelt/deltas"
    expected = [a for i, a in enumerate(compose["services"]["mlflow"]["command"]) if i != destination]
    assert [a for i, a in enumerate(service["command"]) if i != destination] == expected
    assert service["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    with pytest.raises(KeyError, match="MLFLOW_ARTIFACTS_DESTINATION"):
        load_compose_override("compose.s3.yaml", {**SECRETS, **S3_SECRETS})


def test_every_ray_nodes_object_store_is_set_and_fits_its_dev_shm(cluster, compose, monkeypatch):
    """Ray's object store holds a node's shared backbone copies; by default it is 30% of the memory, which
    outgrows a pod's /dev/shm (Ray then spills to disk). Every Ray node sets it, below its /dev/shm, and a
    training node holds two warm copies of the largest packaged backbone in fp32 (SmolLM2-135M)."""
    largest_backbone = 134_515_008 * 4  # SmolLM2-135M's parameters, fp32
    units = {"Gi": 1 << 30, "Mi": 1 << 20, "gb": 1 << 30, "mb": 1 << 20}

    def size(text: str) -> int:
        number, unit = re.fullmatch(r"(\d+)(Gi|Mi|gb|mb)", str(text)).groups()
        return int(number) * units[unit]

    shm = {}
    for pod, template in pod_templates(cluster):
        for volume in template["spec"].get("volumes", []):
            if volume["name"] == "shm":
                shm[pod] = size(volume["emptyDir"]["sizeLimit"])
    pods = {None: "RayCluster/pelt-ray/head"} | {
        g: f"RayCluster/pelt-ray/{g}" for g in ("cpu", "gpu", "predict")
    }
    pods |= {
        "Deployment/pelt-api": "Deployment/pelt-api",
        "Deployment/pelt-dispatcher": "Deployment/pelt-dispatcher",
    }
    starts = kubernetes_roles(cluster, monkeypatch)["ray start"]
    assert len(starts) == len(pods)
    for where, params in starts:
        store = params["object_store_memory"]
        assert store and store < shm[pods[where]], where
        if where in ("cpu", "gpu"):
            assert store >= 2 * largest_backbone, where

    for name, service in compose["services"].items():
        for argv in compose_command_lines(service):
            if argv[:2] == ["ray", "start"]:
                params = parse_command_line(argv).params
                store = params["object_store_memory"]
                assert store and store < size(service["shm_size"]), name
                if name in ("ray-worker", "ray-gpu-worker"):
                    assert store >= 2 * largest_backbone, name
