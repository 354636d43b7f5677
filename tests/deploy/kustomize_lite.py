"""A small kustomize for the tests, used where `kubectl` is not installed: it builds deploy/k8s with the
features those files use, and `test_manifests` checks that it builds what `kubectl kustomize` builds
wherever both are there.

Covered: `resources` (files and folders), `components`, `namespace`, `labels` (metadata only),
`secretGenerator` from env files (no hash suffix, so no name references to rewrite), `images` (every
`containers`/`initContainers` entry, at any depth: what base/kustomizeconfig.yaml teaches kustomize for the
RayCluster), and strategic-merge `patches` (from a file or inline; maps merge, lists of named items merge
by name, other lists are replaced, `$patch: delete` removes the object). Anything else is an error, not a
silent difference.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "components",
    "secretGenerator",
    "images",
    "patches",
    "configurations",  # what it teaches kustomize, this renderer does everywhere (images, no hash names)
}

Manifest = dict[str, Any]


def build(folder: Path) -> list[Manifest]:
    """The objects `kubectl kustomize folder` would print (generated names without their hash)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise NotImplementedError(
            f"{folder}/kustomization.yaml: kustomize_lite cannot build {sorted(unknown)}"
        )
    objects: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        objects.extend(build(path) if path.is_dir() else load_all(path))
    objects.extend(_generated_secrets(folder, kustomization.get("secretGenerator", [])))
    for entry in kustomization.get("components", []):
        objects = _apply_patches(folder / entry, _component(folder / entry), objects)
    objects = _apply_patches(folder, kustomization, objects)
    if "namespace" in kustomization:
        for manifest in objects:
            if manifest["kind"] != "Namespace":
                manifest["metadata"]["namespace"] = kustomization["namespace"]
    for label_set in kustomization.get("labels", []):
        if label_set.get("includeSelectors") or label_set.get("includeTemplates"):
            raise NotImplementedError("kustomize_lite adds labels to metadata only")
        for manifest in objects:
            manifest["metadata"].setdefault("labels", {}).update(label_set["pairs"])
    for image in kustomization.get("images", []):
        for manifest in objects:
            _retag(manifest, image)
    return objects


def load_all(path: Path) -> list[Manifest]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def _component(folder: Path) -> dict[str, Any]:
    component = yaml.safe_load((folder / "kustomization.yaml").read_text())
    if component.get("kind") != "Component" or set(component) - {"apiVersion", "kind", "patches"}:
        raise NotImplementedError(f"{folder}: kustomize_lite builds components of patches only")
    return component


def _generated_secrets(folder: Path, generators: list[dict[str, Any]]) -> list[Manifest]:
    secrets = []
    for generator in generators:
        data: dict[str, str] = {}
        for env_file in generator.get("envs", []):
            for line in (folder / env_file).read_text().splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    key, _, value = line.partition("=")
                    data[key.strip()] = base64.b64encode(value.encode()).decode()
        if set(generator) - {"name", "envs"}:
            raise NotImplementedError(f"kustomize_lite cannot generate {generator}")
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": generator["name"]},
                "type": "Opaque",
                "data": data,
            }
        )
    return secrets


def _apply_patches(folder: Path, kustomization: dict[str, Any], objects: list[Manifest]) -> list[Manifest]:
    for entry in kustomization.get("patches", []):
        if set(entry) - {"path", "patch"}:
            raise NotImplementedError(f"kustomize_lite applies strategic-merge patches only, not {entry}")
        patch = yaml.safe_load((folder / entry["path"]).read_text() if "path" in entry else entry["patch"])
        target = find(objects, patch["kind"], patch["metadata"]["name"])
        if patch.get("$patch") == "delete":
            objects = [manifest for manifest in objects if manifest is not target]
        else:
            merged = merge(target, patch)
            objects = [merged if manifest is target else manifest for manifest in objects]
    return objects


def find(objects: list[Manifest], kind: str, name: str) -> Manifest:
    """The one object of this kind and name; a patch aimed at nothing is an error, as in kustomize."""
    matches = [m for m in objects if m["kind"] == kind and m["metadata"]["name"] == name]
    if len(matches) != 1:
        raise LookupError(f"a patch targets {kind}/{name}, which the build has {len(matches)} times")
    return matches[0]


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge, as far as these manifests need it."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = merge(merged[key], value) if key in merged else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        merged, added = copy.deepcopy(base), []
        for item in patch:
            index = next((i for i, old in enumerate(merged) if old["name"] == item["name"]), None)
            if index is None:
                added.append(copy.deepcopy(item))
            else:
                merged[index] = merge(merged[index], item)
        return added + merged  # as kubectl's strategic merge: the patch's new items first, in its order
    return copy.deepcopy(patch)


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(item, dict) and "name" in item for item in items)


def _retag(node: Any, image: dict[str, str]) -> None:
    """Point every container image called image["name"] at newName:newTag, wherever containers are."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    name = container.get("image", "").split(":")[0]
                    if name == image["name"]:
                        container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
            _retag(value, image)
    elif isinstance(node, list):
        for item in node:
            _retag(item, image)
