"""Deltas: only what a job trained, as safetensors, plus a JSON manifest that makes them self-describing.

A delta folder holds `delta.safetensors` (never pickle) and `manifest.json`: the method spec, the
backbone's name and content hash, head (problem type, labels, pooling), parameter counts and the pelt
version. A delta loads only onto the backbone whose content hash it names. The format itself (file
names, versions, manifest checks, the multi-task bundle's layout) is `pelt_core.delta_format`; this
module writes and loads the tensors.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pelt_core.backbones import Backbone
from pelt_core.delta_format import (
    BUNDLE_FILE,
    DELTA_FILE,
    FORMAT,
    FORMAT_VERSION,
    DeltaError,
    bundle_entry,
    bundle_task_path,
    read_manifest,
    sha256_file,
    write_bundle_manifest,
    write_manifest,
)
from pelt_core.model import JobDelta
from pelt_core.spec import MethodSpec


@dataclass
class SavedDelta:
    """A delta (or multi-task bundle) folder as written: its sha256 identifies it."""

    path: Path
    sha256: str  # of delta.safetensors (a bundle: of bundle.json)
    manifest: dict[str, Any]


def build_manifest(
    delta: JobDelta, backbone: Backbone, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    from pelt_core import __version__

    counts = delta.parameter_counts()
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "pelt_version": __version__,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "method": delta.method.to_dict(),
        "backbone": {
            "name": backbone.name,
            "content_hash": backbone.content_hash,
            "model_type": backbone.config.model_type,
            "num_layers": backbone.num_layers,
            "hidden_size": backbone.hidden_size,
            "num_parameters": backbone.num_parameters,
        },
        "head": {
            "problem_type": delta.problem_type,
            "num_labels": delta.head.classifier.out_features,
            "label_names": delta.label_names,
            "pooling": delta.head.pooling,
            **({"text_fields": list(delta.text_fields)} if delta.text_fields else {}),
        },
        "parameters": {
            "pelt": counts["pelt"],
            "head": counts["head"],
            "pelt_percent_of_backbone": 100.0 * counts["pelt"] / backbone.num_parameters,
        },
        "extra": extra or {},
    }


def save_delta(
    delta: JobDelta, backbone: Backbone, out_dir: str | Path, extra: dict[str, Any] | None = None
) -> SavedDelta:
    """Write the delta (after dropping any training-only reparameterisation) and its manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    delta.drop_reparameterization()
    tensors = {
        name: t.detach().to("cpu", torch.float32).contiguous() for name, t in delta.state_dict().items()
    }
    manifest = build_manifest(delta, backbone, extra)
    # one metadata key: safetensors writes several keys in random order, which would change the file's sha256
    header = json.dumps({"format": FORMAT, "backbone_hash": backbone.content_hash}, sort_keys=True)
    save_file(tensors, str(out / DELTA_FILE), metadata={"pelt": header})
    write_manifest(out, manifest)
    return SavedDelta(out, sha256_file(out / DELTA_FILE), manifest)


def save_bundle(
    deltas: Mapping[str, JobDelta],
    backbone: Backbone,
    out_dir: str | Path,
    *,
    extras: Mapping[str, dict[str, Any] | None] | None = None,
    sources: Mapping[str, Mapping[str, Any]] | None = None,
) -> SavedDelta:
    """A multi-task bundle (layout: `pelt_core.delta_format`): each delta saved under tasks/<name>/ (a
    copy: the inputs are not changed) with `extras[name]` in its manifest, then bundle.json naming each
    part's sha256 and `sources[name]` (where it came from). Its sha256 is that of bundle.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, delta in deltas.items():
        folder = out / bundle_task_path(name)
        saved = save_delta(copy.deepcopy(delta), backbone, folder, extra=(extras or {}).get(name))
        entries[name] = bundle_entry(name, saved.sha256, **(sources or {}).get(name, {}))
    bundle = write_bundle_manifest(out, backbone.name, backbone.content_hash, entries)
    return SavedDelta(out, sha256_file(out / BUNDLE_FILE), bundle)


def load_delta(path: str | Path, backbone: Backbone, expected_sha256: str | None = None) -> JobDelta:
    """Load a saved delta onto `backbone`; refuses a different backbone or a file whose sha256 differs."""
    folder = Path(path)
    manifest = read_manifest(folder)
    if expected_sha256 is not None:
        actual = sha256_file(folder / DELTA_FILE)
        if actual != expected_sha256:
            raise DeltaError(
                f"{folder / DELTA_FILE}: sha256 {actual} does not match the recorded {expected_sha256}"
            )
    wanted = manifest["backbone"]
    if wanted["content_hash"] != backbone.content_hash:
        raise DeltaError(
            f"this delta was trained on backbone {wanted['name']!r} (content hash {wanted['content_hash'][:12]}…), "
            f"not on {backbone.name!r} (content hash {backbone.content_hash[:12]}…); load that backbone instead"
        )
    head = manifest["head"]
    delta = JobDelta(
        MethodSpec.from_dict(manifest["method"]),
        backbone,
        num_labels=head["num_labels"],
        problem_type=head["problem_type"],
        pooling=head["pooling"],
        label_names=head["label_names"],
        reparameterize_prefix=False,
    )
    fields = head.get("text_fields")  # absent in deltas saved before they were recorded
    if fields is not None:
        if not (
            isinstance(fields, list)
            and len(fields) in (1, 2)
            and all(isinstance(f, str) and f for f in fields)
        ):
            raise DeltaError(f"{folder}: the manifest's head.text_fields must be one or two column names")
        delta.text_fields = tuple(fields)
    state = load_file(str(folder / DELTA_FILE))
    missing, unexpected = delta.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DeltaError(
            f"{folder}: tensors do not match the manifest's method "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )
    delta.manifest = manifest
    return delta.eval()


# --------------------------------------------------------------------------------------------------
# HF PEFT interoperability (LoRA)
# --------------------------------------------------------------------------------------------------
def export_peft_lora(delta: JobDelta, backbone: Backbone, out_dir: str | Path) -> Path:
    """Write a LoRA delta as PEFT's adapter_config.json + adapter_model.safetensors (over the base AutoModel).

    `peft.PeftModel.from_pretrained(AutoModel..., out_dir)` then gives the same hidden states as pelt; the
    task head is saved beside it as head.safetensors.
    """
    modules = delta.method.modules
    if delta.method.bias or delta.method.layer_norm or delta.prefix_layers or not modules:
        raise DeltaError("only pure LoRA deltas export to PEFT (no adapters, prefixes, bias or norm deltas)")
    first = next(iter(modules.values()))
    for role, spec in modules.items():
        if not (
            spec.form == "bottleneck"
            and spec.nonlinearity == "identity"
            and not spec.proj_bias
            and spec.insertion == "parallel"
            and not spec.gate
            and not spec.learned_scale
            and spec.representation.count(".") == 1
        ):
            raise DeltaError(f"module {role!r} is not a plain LoRA on a weight matrix; PEFT cannot load it")
        if (spec.size, spec.effective_scale, spec.layers) != (
            first.size,
            first.effective_scale,
            first.layers,
        ):
            raise DeltaError("PEFT export needs one rank, scale and layer set shared by all LoRA modules")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, targets = {}, set()
    for (layer, concrete), ops in delta.linear_ops.items():
        path = backbone.linear_path(layer, concrete)
        targets.add(backbone.arch.linear_paths[concrete].split(".")[-1])
        for module in ops.parallel_x:
            tensors[f"base_model.model.{path}.lora_A.weight"] = (
                module.down.weight.detach().float().contiguous()
            )
            tensors[f"base_model.model.{path}.lora_B.weight"] = module.up.weight.detach().float().contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "r": first.size,
        "lora_alpha": first.effective_scale * first.size,
        "lora_dropout": first.dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_to_transform": list(first.layers) if first.layers is not None else None,
        "base_model_name_or_path": backbone.source,
    }
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.detach().float().contiguous() for k, v in delta.head.state_dict().items()},
        str(out / "head.safetensors"),
    )
    return out
