"""Reading deploy/ the way Docker, Docker Compose, kustomize, the kubelet and a shell would, for the offline
checks of tests/deploy: the Dockerfile's instructions, Compose's `${VAR}` interpolation, the commented-out GPU
service, a container's environment (`envFrom`, `$(VAR)`, Secret and ConfigMap keys), KubeRay's `ray start`
line, and parsing any command line with the click command of its program (`pelt`, `ray`, `mlflow`)."""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from services.settings import Settings
from tests.deploy import kustomize_lite

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
IMAGE_ENTRYPOINT = ["pelt"]  # deploy/Dockerfile's ENTRYPOINT: what a container without `command` runs

Manifest = dict[str, Any]
SECRETS = {  # what an operator puts in deploy/.env or secrets.env
    "POSTGRES_PASSWORD": "Pg_password-0123456789abcdef",
    "RAY_AUTH_TOKEN": "0123456789abcdef" * 4,
    "FIRST_API_TOKEN": "pelt_" + "Ab3_-" * 9,
}
SECRET_KEYS = set(SECRETS)
# the roles of a deployment: the same command lines in compose.yaml and in the manifests
ROLES = {
    "pelt db upgrade",
    "pelt mlflow upgrade",
    "pelt token create",
    "mlflow server",
    "ray start",
    "pelt serve",
    "pelt dispatcher",
}

# --- the Dockerfile -----------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            keyword, _, arguments = pending.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
            pending = ""
    return instructions


def instruction(name: str) -> list[str]:
    return [arguments for keyword, arguments in dockerfile() if keyword == name]


# --- env files and Compose ------------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\$|\$\{(?P<braced>[^}]*)\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)")


def env_file(path: Path, *, commented: bool = False) -> dict[str, str]:
    """KEY=VALUE lines of an env file; with `commented`, also the optional `#KEY=VALUE` ones."""
    pattern = re.compile(r"^(#)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
    found = {}
    for line in path.read_text().splitlines():
        match = pattern.match(line.strip())
        if match and (commented or not match.group(1)):
            found[match.group(2)] = match.group(3)
    return found


def _parts(match: re.Match[str]) -> tuple[str, str | None, str]:
    """(name, operator, argument) of one `$VAR` / `${VAR<operator><argument>}`."""
    if match.group("bare") is not None:
        return match.group("bare"), None, ""
    name, operator, argument = re.fullmatch(
        r"([A-Za-z_][A-Za-z0-9_]*)(:?[-?])?(.*)", match.group("braced")
    ).groups()
    return name, operator, argument


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Compose's interpolation: `$$`, `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, argument = _parts(match)
        value = variables.get(name)
        unset = (operator in (":-", ":?") and not value) or (operator in ("-", "?") and value is None)
        if unset:
            if operator.endswith("?"):
                raise KeyError(f"Compose would refuse to start: {argument or name + ' is not set'}")
            return argument
        return value or ""

    return _INTERPOLATION.sub(replace, text)


def compose_variables(node: Any) -> set[str]:
    """Every variable the Compose file's values interpolate."""
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        return set().union(set(), *(compose_variables(value) for value in node))
    if isinstance(node, str):
        return {_parts(match)[0] for match in _INTERPOLATION.finditer(node) if match.group(0) != "$$"}
    return set()


def _interpolated(node: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(node, dict):
        return {key: _interpolated(value, variables) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolated(value, variables) for value in node]
    return interpolate(node, variables) if isinstance(node, str) else node


def load_compose(variables: Mapping[str, str], *, gpu_worker: bool = False) -> dict[str, Any]:
    """deploy/compose.yaml as Compose sees it with these variables (deploy/.env's): a service of a profile
    (`ray-gpu-worker`, profile `gpu`) only when `gpu_worker` turns that profile on."""
    loaded = _interpolated(yaml.safe_load((DEPLOY / "compose.yaml").read_text()), variables)
    enabled = {"gpu"} if gpu_worker else set()
    loaded["services"] = {
        name: service
        for name, service in loaded["services"].items()
        if not service.get("profiles") or set(service["profiles"]) & enabled
    }
    return loaded


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {key: str(value) for key, value in environment.items()}


def compose_command_lines(service: dict[str, Any]) -> list[list[str]]:
    """The command lines a pelt-image service runs (its entrypoint, else the image's, then its command)."""
    entrypoint = service.get("entrypoint", IMAGE_ENTRYPOINT)
    command = service.get("command", [])
    return command_lines([*entrypoint, *command], compose_environment(service))


def created_databases() -> list[str]:
    """The databases deploy/postgres-init adds to POSTGRES_DB's."""
    return re.findall(r"CREATE DATABASE (\w+)", (DEPLOY / "postgres-init" / "10-databases.sql").read_text())


def pelt_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Compose services that run the pelt image (all but PostgreSQL)."""
    return {name: s for name, s in compose["services"].items() if not s["image"].startswith("postgres")}


# --- shells and command lines ---------------------------------------------------------------------------


def command_lines(argv: list[str], environment: Mapping[str, str]) -> list[list[str]]:
    """argv, or, for `/bin/sh -c SCRIPT`, the commands of SCRIPT (joined by `&&`, `exec` dropped), with the
    shell's `$VAR` taken from the container's environment; a variable it lacks is an error."""
    if argv[:2] != ["/bin/sh", "-c"]:
        return [argv]
    if len(argv) != 3:
        raise ValueError(f"/bin/sh -c takes one script, got {argv[2:]}")
    lexer = shlex.shlex(argv[2], posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lines: list[list[str]] = [[]]
    for token in lexer:
        if token == "&&":
            lines.append([])
        elif set(token) <= set("();<>|&"):
            raise ValueError(f"the script uses {token!r}; these checks read `a && b && c` only")
        else:
            lines[-1].append(_expand_shell(token, environment))
    return [line[1:] if line[:1] == ["exec"] else line for line in lines]


def _expand_shell(token: str, environment: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in environment:
            raise KeyError(f"the script reads ${name}, which the container's environment lacks")
        return environment[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", replace, token)


def program_group(program: str) -> click.Command:
    if program == "pelt":
        from services.cli import main

        return main
    if program == "ray":
        from ray.scripts.scripts import cli

        return cli
    if program == "mlflow":
        from mlflow.cli import cli

        return cli
    raise ValueError(f"not a pelt, ray or mlflow command line: {program}")


def parse_command_line(argv: list[str]) -> click.Context:
    """Parse argv with its program's own click commands, as running it would (no callback runs): unknown
    commands or options, bad values and missing arguments raise click's errors. Returns the leaf context."""
    command, name, parent, arguments = program_group(argv[0]), argv[0], None, list(argv[1:])
    while isinstance(command, click.Group):
        context = click.Context(command, info_name=name, parent=parent)
        if not arguments:
            raise click.UsageError(f"{context.command_path}: a command is missing", context)
        name, command, arguments = command.resolve_command(context, arguments)
        parent = context
    return command.make_context(name, arguments, parent=parent)


def parsed(argv: list[str], environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The click context of argv, parsed with the container's environment (options read from it too)."""
    with monkeypatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        return parse_command_line(argv)


def settings_of(environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as a container with this environment reads them."""
    with monkeypatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("PELT_")]:
            patch.delenv(name)
        for name, value in environment.items():
            if name.startswith("PELT_"):
                patch.setenv(name, value)
        return Settings()


# --- Kubernetes -----------------------------------------------------------------------------------------


def render(folder: Path) -> list[Manifest]:
    """`kubectl kustomize folder` where kubectl is installed, else tests/deploy/kustomize_lite's build."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return kustomize_lite.build(folder)
    return render_with_kubectl(kubectl, folder)


def render_with_kubectl(kubectl: str, folder: Path) -> list[Manifest]:
    built = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=False
    )
    assert built.returncode == 0, built.stderr
    return [document for document in yaml.safe_load_all(built.stdout) if document]


def objects_of(objects: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {manifest["metadata"]["name"]: manifest for manifest in objects if manifest["kind"] == kind}


def pod_templates(objects: list[Manifest]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(a name for the pod, its template) of every workload, RayCluster groups included."""
    for manifest in objects:
        kind, name, spec = manifest["kind"], manifest["metadata"]["name"], manifest.get("spec", {})
        if kind in ("Deployment", "StatefulSet", "Job"):
            yield f"{kind}/{name}", spec["template"]
        elif kind == "RayCluster":
            yield f"{kind}/{name}/head", spec["headGroupSpec"]["template"]
            for group in spec["workerGroupSpecs"]:
                yield f"{kind}/{name}/{group['groupName']}", group["template"]


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def expand_kubernetes(text: str, environment: Mapping[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion (`$$(VAR)` stays literal); an undefined VAR is an error here."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        if match.group(1) not in environment:
            raise KeyError(f"$({match.group(1)}) is not defined before it is used")
        return environment[match.group(1)]

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, text)


def container_environment(container: dict[str, Any], objects: list[Manifest]) -> dict[str, str]:
    """A container's environment as the kubelet builds it: envFrom first, then env in order, with every
    ConfigMap and Secret key it names looked up (a missing object or key is an error)."""
    config_maps, secrets = objects_of(objects, "ConfigMap"), objects_of(objects, "Secret")
    environment: dict[str, str] = {}
    for source in container.get("envFrom", []):
        environment.update(config_maps[source["configMapRef"]["name"]]["data"])
    for variable in container.get("env", []):
        if "value" in variable:
            environment[variable["name"]] = expand_kubernetes(variable["value"], environment)
            continue
        reference = variable["valueFrom"]
        if "secretKeyRef" in reference:
            ref = reference["secretKeyRef"]
            environment[variable["name"]] = base64.b64decode(
                secrets[ref["name"]]["data"][ref["key"]]
            ).decode()
        else:
            ref = reference["configMapKeyRef"]
            environment[variable["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
    return environment


def container_command_lines(container: dict[str, Any], environment: Mapping[str, str]) -> list[list[str]]:
    """What a container runs: command (else the image's ENTRYPOINT) and args, `$(VAR)` expanded."""
    if container["image"].split(":")[0].split("/")[-1] not in ("pelt", "pelt-cuda"):
        return []
    argv = [*container.get("command", IMAGE_ENTRYPOINT), *container.get("args", [])]
    return command_lines([expand_kubernetes(part, environment) for part in argv], environment)


def kuberay_start_line(cluster: Manifest, group: dict[str, Any] | None) -> list[str]:
    """The `ray start` line KubeRay runs in a head (group None) or worker pod: rayStartParams as
    `--key=value`, the head's address for workers, `--block`; KubeRay writes it as one shell command line
    (run by `bash -lc`), so a value is read as the shell reads it (`resources: '"{\"pelt_predict\": 1}"'`
    arrives as {"pelt_predict": 1})."""
    spec = cluster["spec"]
    params = (spec["headGroupSpec"] if group is None else group).get("rayStartParams", {})
    line = (
        ["ray", "start", "--head"]
        if group is None
        else ["ray", "start", f"--address={head_address(cluster)}"]
    )
    return shlex.split(" ".join([*line, *(f"--{key}={value}" for key, value in params.items()), "--block"]))


def head_address(cluster: Manifest) -> str:
    """host:port of the RayCluster's GCS: KubeRay's Service `<name>-head-svc`, the head's `port` param."""
    port = cluster["spec"]["headGroupSpec"].get("rayStartParams", {}).get("port", "6379")
    return f"{cluster['metadata']['name']}-head-svc:{port}"


S3_SECRETS = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE0123456789", "AWS_SECRET_ACCESS_KEY": "s3-secret-" + "x" * 30}


def overlay_copy(root: Path, *, external_database: bool = False, s3_artifacts: bool = False) -> Path:
    """deploy/k8s copied under root, with the overlay's secrets.env filled in (and the components on)."""
    shutil.copytree(K8S, root / "k8s")
    overlay = root / "k8s" / "overlays" / "example"
    secrets = {**SECRETS, **(S3_SECRETS if s3_artifacts else {})}
    (overlay / "secrets.env").write_text("".join(f"{key}={value}\n" for key, value in secrets.items()))
    components = [
        name for name, on in (("external-database", external_database), ("s3-artifacts", s3_artifacts)) if on
    ]
    if components:
        kustomization = overlay / "kustomization.yaml"
        listed = "".join(f"  - {name}\n" for name in components)
        kustomization.write_text(kustomization.read_text() + "components:\n" + listed)
    return overlay


def load_compose_override(name: str, variables: Mapping[str, str]) -> dict[str, Any]:
    """An override file of deploy/ (e.g. compose.s3.yaml) as Compose reads it with these variables."""
    return _interpolated(yaml.safe_load((DEPLOY / name).read_text()), variables)


OTHER_IMAGES = {"postgres:16", "redis:7"}  # the containers of the manifests that do not run pelt's image


def pelt_containers(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """(pod, container, its environment) of every container that runs the pelt image."""
    for pod, template in pod_templates(objects):
        for container in containers(template):
            if container["image"] not in OTHER_IMAGES:
                yield pod, container, container_environment(container, objects)
