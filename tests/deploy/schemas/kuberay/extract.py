"""Refresh the KubeRay schemas kept here from KubeRay's CustomResourceDefinitions.

Reads whole CRD files (e.g. `ray.io_rayclusters.yaml` from KubeRay's `ray-operator/config/crd/bases/`) and
writes, beside this script, only what tests/deploy/test_manifests.py reads: the OpenAPI v3 schema of the
`v1` version, as compact JSON with sorted keys (`ray.io_rayclusters.v1.json`). See README.md here.

    python tests/deploy/schemas/kuberay/extract.py /path/to/kuberay/ray-operator/config/crd/bases/ray.io_rayclusters.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
VERSION = "v1"


def openapi_schema(crd: dict[str, Any], version: str = VERSION) -> dict[str, Any]:
    """The `spec.versions[name=version].schema.openAPIV3Schema` of a CRD."""
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"not a CustomResourceDefinition: kind {crd.get('kind')!r}")
    matches = [entry for entry in crd["spec"]["versions"] if entry["name"] == version]
    if len(matches) != 1:
        raise ValueError(f"{crd['metadata']['name']} has {len(matches)} versions named {version!r}")
    return matches[0]["schema"]["openAPIV3Schema"]


def extract(crd_file: Path, folder: Path = HERE, version: str = VERSION) -> Path:
    """Write the schema of `crd_file`'s `version` to `folder`/<file name>.<version>.json; returns its path."""
    crd = yaml.load(crd_file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    target = folder / f"{crd_file.name.removesuffix('.yaml')}.{version}.json"
    schema = openapi_schema(crd, version)
    target.write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("crd_files", nargs="+", type=Path, help="KubeRay CRD files (YAML)")
    parser.add_argument("--version", default=VERSION, help="the CRD version to keep (default: v1)")
    arguments = parser.parse_args()
    for crd_file in arguments.crd_files:
        written = extract(crd_file, HERE, arguments.version)
        print(f"{crd_file} -> {written} ({written.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
