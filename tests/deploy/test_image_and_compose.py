"""deploy/Dockerfile and deploy/compose.yaml, checked offline (no Docker daemon here):

- the image installs with deploy/install.sh, as `make install` does, runs as a non-root user, starts `pelt`
  and checks the API's /health;
- compose.yaml's variables are the ones env.example explains, and it refuses to start without the secrets;
- every command line a service runs (`pelt ...`, `ray ...`, `mlflow ...`, inside `sh -c` scripts too) is
  parsed by that program's own click command;
- service names, ports, URLs, start order and volumes agree with each other and with the code.

What this cannot show: that the image builds (its base image cannot be pulled here); the deployment smoke
test runs compose.yaml's commands as local processes.
"""

from __future__ import annotations

import json
import tomllib
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

from services.settings import Settings
from tests.deploy.deployment_files import (
    DEPLOY,
    ROLES,
    ROOT,
    SECRET_KEYS,
    SECRETS,
    compose_command_lines,
    compose_environment,
    compose_variables,
    containers,
    created_databases,
    env_file,
    instruction,
    load_compose,
    objects_of,
    parse_command_line,
    parsed,
    pelt_services,
    pod_templates,
)

# --- the image --------------------------------------------------------------------------------------------


def test_the_image_installs_pelt_with_the_script_make_install_runs():
    """From the same lock (tests/deploy/test_lock.py checks the lock, its order in the image and the tags)."""
    assert instruction("FROM") == ["python:3.11-slim"]
    assert "TORCH_VARIANT=cpu" in instruction("ARG")
    installs = [run for run in instruction("RUN") if "deploy/install.sh" in run]
    assert len(installs) == 2  # the locked packages, then pelt (non-editable, no dev extra)
    assert "bash deploy/install.sh --deps-only /opt/venv runtime" in installs[0]
    assert "bash deploy/install.sh --project-only /opt/venv runtime" in installs[1]
    assert "bash deploy/install.sh $(VENV) dev" in (ROOT / "Makefile").read_text()
    script = (DEPLOY / "install.sh").read_text()
    assert "cpu | cu130 | cu128) ;;" in script  # any other variant stops the build


def test_the_image_runs_pelt_as_a_non_root_user_with_offline_models():
    users = instruction("USER")
    assert users and users[-1] not in ("root", "0")
    assert any("--uid 10001" in run and users[-1] in run for run in instruction("RUN"))
    environment = " ".join(instruction("ENV"))
    assert "PELT_DATA_DIR=/var/lib/pelt" in environment and "HF_HUB_OFFLINE=1" in environment
    assert json.loads(instruction("ENTRYPOINT")[-1]) == ["pelt"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pelt"] == "services.cli:main"
    serve = parse_command_line(["pelt", *json.loads(instruction("CMD")[-1])])
    assert serve.command_path == "pelt serve" and serve.params["host"] == "0.0.0.0"


def test_the_image_healthcheck_asks_the_api_for_health():
    (healthcheck,) = instruction("HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    assert "--interval" in options
    program, flag, code = json.loads(command)
    assert (program, flag) == ("python", "-c")  # no curl in the slim image
    compile(code, "HEALTHCHECK", "exec")
    assert f"http://127.0.0.1:{Settings().api_port}/health" in code


def test_the_build_context_and_git_leave_out_environments_and_secrets():
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for entry in (".venv", ".git", "deploy/.env", "deploy/k8s/overlays/*/secrets.env", "mlruns", "out"):
        assert entry in ignored
    git_ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "deploy/.env" in git_ignored and "deploy/k8s/overlays/*/secrets.env" in git_ignored


# --- compose.yaml -----------------------------------------------------------------------------------------


def test_compose_variables_are_the_ones_env_example_explains():
    raw = [yaml.safe_load((DEPLOY / name).read_text()) for name in ("compose.yaml", "compose.s3.yaml")]
    example = env_file(DEPLOY / "env.example", commented=True)
    assert compose_variables(raw) == set(example)  # the S3 override's (commented out there) included
    required = env_file(DEPLOY / "env.example")
    assert set(required) == SECRET_KEYS and not any(required.values())  # filled in by the operator


def test_compose_refuses_to_start_without_the_secrets():
    for missing in SECRET_KEYS:
        with pytest.raises(KeyError, match=f"set {missing} in deploy/.env"):
            load_compose({key: value for key, value in SECRETS.items() if key != missing})


def test_every_compose_command_is_a_real_command_line(compose: dict[str, Any], monkeypatch):
    roles = set()
    for name, service in pelt_services(compose).items():
        environment = compose_environment(service)
        for argv in compose_command_lines(service):
            roles.add(parsed(argv, environment, monkeypatch).command_path)
        healthcheck = service.get("healthcheck", {}).get("test", [])
        if healthcheck[:2] == ["CMD", "ray"]:
            assert parse_command_line(healthcheck[1:]).command_path == "ray health-check", name
    assert roles == ROLES


def test_compose_roles_do_what_the_deployment_needs(compose: dict[str, Any], monkeypatch):
    services = compose["services"]

    def lines(name: str) -> dict[str, Any]:
        environment = compose_environment(services[name])
        return {
            (context := parsed(argv, environment, monkeypatch)).command_path: context.params
            for argv in compose_command_lines(services[name])
        }

    migrate = lines("migrate")
    assert list(migrate) == ["pelt db upgrade", "pelt mlflow upgrade", "pelt token create"]
    token = migrate["pelt token create"]
    assert (token["scope"], token["secret_variable"], token["if_none"]) == ("admin", "FIRST_API_TOKEN", True)
    assert compose_environment(services["migrate"])["FIRST_API_TOKEN"] == SECRETS["FIRST_API_TOKEN"]
    assert make_url(migrate["pelt mlflow upgrade"]["uri"]).database == "mlflow"
    serve = lines("api")["pelt serve"]
    assert (serve["dispatcher"], serve["host"], serve["port"]) == (False, "0.0.0.0", 8000)
    assert services["api"]["ports"] == ["127.0.0.1:8000:8000"]
    api_node = lines("api")["ray start"]  # a Ray node with no CPUs: it deploys and calls the predictors
    assert api_node["num_cpus"] == 0 and not api_node["head"]
    predict_node = lines("ray-predict")["ray start"]  # the serving node: replicas, never training workers
    resource = compose_environment(services["api"])["PELT_PREDICT_RESOURCE"]
    assert predict_node["num_cpus"] == 0 and json.loads(predict_node["resources"])[resource] >= 1
    dispatcher = lines("dispatcher")
    assert dispatcher["pelt dispatcher"]["delta_store"] == "mlflow"
    assert dispatcher["ray start"]["num_cpus"] == 0 and not dispatcher["ray start"]["head"]
    assert services["dispatcher"]["deploy"]["replicas"] == 2  # a leader and a standby
    head = lines("ray-head")["ray start"]
    assert (head["head"], head["num_cpus"], head["block"]) == (True, 0, True)
    for worker in ("ray-worker", "ray-gpu-worker", "ray-predict", "api", "dispatcher"):
        address = lines(worker)["ray start"]["address"]
        assert address == f"ray-head:{head['port']}" or (
            address == "$PELT_RAY_ADDRESS"
            and compose_environment(services[worker])["PELT_RAY_ADDRESS"] == f"ray-head:{head['port']}"
        ), worker
    server = lines("mlflow")["mlflow server"]
    assert server["serve_artifacts"] and server["host"] == "0.0.0.0"
    assert server["artifacts_destination"].startswith("/var/lib/mlflow/")
    assert "mlflow-artifacts:/var/lib/mlflow" in services["mlflow"]["volumes"]
    assert make_url(server["backend_store_uri"]).database == "mlflow"


def test_compose_urls_name_services_that_listen_there(compose: dict[str, Any], monkeypatch):
    services = compose["services"]
    postgres = services["postgres"]["environment"]
    databases = {postgres["POSTGRES_DB"], *created_databases()}
    server = parsed(compose_command_lines(services["mlflow"])[0], {}, monkeypatch).params
    head_port = parsed(compose_command_lines(services["ray-head"])[0], {}, monkeypatch).params["port"]
    checked = 0
    for name, service in pelt_services(compose).items():
        environment = compose_environment(service)
        for variable in ("PELT_DATABASE_URL", "MLFLOW_BACKEND_STORE_URI"):
            if variable in environment:
                url = make_url(environment[variable])
                assert (url.host, url.port or 5432) == ("postgres", 5432), name
                assert (url.username, url.password) == (
                    postgres["POSTGRES_USER"],
                    postgres["POSTGRES_PASSWORD"],
                )
                assert url.database in databases, name
                checked += 1
        if "PELT_MLFLOW_TRACKING_URI" in environment:
            location = environment["PELT_MLFLOW_TRACKING_URI"].removeprefix("http://")
            assert location == f"mlflow:{server['port']}", name
            assert location in server["allowed_hosts"].split(",")
        if "PELT_RAY_ADDRESS" in environment:
            assert environment["PELT_RAY_ADDRESS"] == f"ray-head:{head_port}", name
    assert checked == 5  # migrate (2), mlflow, api, dispatcher


def test_compose_start_order_and_shared_data(compose: dict[str, Any]):
    services = compose["services"]
    conditions = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, service in services.items():
        for dependency, rule in service.get("depends_on", {}).items():
            assert dependency in services and rule["condition"] in conditions, name
            if rule["condition"] == "service_healthy":
                assert not services[dependency]["healthcheck"].get("disable"), (name, dependency)
        if any("@postgres" in value for value in compose_environment(service).values()) and name != "migrate":
            assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    data_dir = compose_environment(services["api"])["PELT_DATA_DIR"]
    for name in ("api", "ray-worker", "ray-gpu-worker"):  # task data: written by the API, read by workers
        assert f"pelt-data:{data_dir}" in services[name]["volumes"], name
    for name in ("ray-head", "ray-worker", "ray-gpu-worker", "dispatcher"):
        environment = compose_environment(services[name])
        assert environment["RAY_AUTH_MODE"] == "token", name
        assert environment["RAY_AUTH_TOKEN"] == SECRETS["RAY_AUTH_TOKEN"], name


def test_the_gpu_worker_is_an_option_compose_accepts(compose: dict[str, Any]):
    assert "ray-gpu-worker" not in load_compose(SECRETS)["services"]  # only with `--profile gpu`
    assert compose["services"]["ray-gpu-worker"]["profiles"] == ["gpu"]
    gpu = compose["services"]["ray-gpu-worker"]
    assert gpu["build"]["args"]["TORCH_VARIANT"] == "cu130"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_postgres_makes_the_mlflow_database_in_compose_and_kubernetes(compose, cluster):
    assert created_databases() == ["mlflow"]
    assert "./postgres-init:/docker-entrypoint-initdb.d:ro" in compose["services"]["postgres"]["volumes"]
    script = objects_of(cluster, "ConfigMap")["postgres-init"]["data"]["10-databases.sql"]
    assert script == (DEPLOY / "postgres-init" / "10-databases.sql").read_text()


def test_every_compose_container_has_the_manifests_memory_limit_and_rotated_logs(compose, cluster):
    """What a container may take, the same on one host as in the cluster (its role's limit in the manifests),
    and Docker's logs rotated (json-file, bounded) for every container."""
    limits = {
        (name, container["name"]): container.get("resources", {}).get("limits", {}).get("memory")
        for name, template in pod_templates(cluster)
        for container in containers(template)  # init containers too
    }
    roles = {
        "postgres": ("StatefulSet/postgres", "postgres"),
        "migrate": ("Deployment/pelt-api", "migrate"),
        "mlflow": ("Deployment/mlflow", "mlflow"),
        "ray-head": ("RayCluster/pelt-ray/head", "ray-head"),
        "ray-worker": ("RayCluster/pelt-ray/cpu", "ray-worker"),
        "ray-gpu-worker": ("RayCluster/pelt-ray/gpu", "ray-worker"),
        "ray-predict": ("RayCluster/pelt-ray/predict", "ray-worker"),
        "api": ("Deployment/pelt-api", "api"),
        "dispatcher": ("Deployment/pelt-dispatcher", "dispatcher"),
    }
    assert set(roles) == set(compose["services"])
    for service, container in roles.items():
        spec = compose["services"][service]
        assert spec["mem_limit"] == limits[container].removesuffix("Gi") + "g", service
        assert spec["logging"]["driver"] == "json-file" and spec["logging"]["options"]["max-size"], service
