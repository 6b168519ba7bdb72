"""Validate a rendered TrainJob against a Kubeflow Trainer CRD's openAPIV3Schema, as the API server would.

The server prunes (or, with `kubectl apply --validate=strict` / fieldValidation=Strict, refuses) every field the
structural schema does not declare; a field it drops silently is how a v2.1-style TrainJob loses its volumes on a
v2.2+ server. This checker reports unknown fields, wrong types, missing required fields and values outside an enum,
which is the part of the server's validation a rendered manifest can get wrong (CEL rules and defaults are not
evaluated). The CRDs are test data under crds/ (see crds/SOURCE.md).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import yaml

CRDS = Path(__file__).parent / "crds"
TRAINER_RELEASES = ("v2.1.0", "v2.3.0")  # oldest with podTemplateOverrides, newest with runtimePatches

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float)}


def trainjob_schema(release: str) -> dict[str, Any]:
    """The openAPIV3Schema of the TrainJob CRD of Kubeflow Trainer `release` (e.g. "v2.3.0")."""
    crd = yaml.safe_load(gzip.decompress((CRDS / f"trainjobs-{release}.yaml.gz").read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
    return version["schema"]["openAPIV3Schema"]


def schema_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every place where `value` breaks `schema` (empty when it is valid)."""
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        return [] if ok else [f"{path or '.'}: expected an integer or a string, got {value!r}"]
    if "anyOf" in schema and all(schema_errors(value, branch, path) for branch in schema["anyOf"]):
        return [f"{path or '.'}: matches none of anyOf"]
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = kind is None or isinstance(value, _TYPES[kind])
    if not ok:
        return [f"{path or '.'}: expected {kind}, got {type(value).__name__} {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path or '.'}: {value!r} is not one of {schema['enum']}"]
    if kind == "array":
        return [e for i, item in enumerate(value) for e in schema_errors(item, schema.get("items", {}), f"{path}[{i}]")]
    if kind == "object":
        return _object_errors(value, schema, path)
    return []


def _object_errors(value: dict, schema: dict[str, Any], path: str) -> list[str]:
    properties = schema.get("properties")
    extra = schema.get("additionalProperties")
    open_ended = schema.get("x-kubernetes-preserve-unknown-fields") or (properties is None and extra is None)
    errors = [f"{path}.{name}: required field missing" for name in schema.get("required", ()) if name not in value]
    for key, item in value.items():
        where = f"{path}.{key}"
        if properties and key in properties:
            errors += schema_errors(item, properties[key], where)
        elif isinstance(extra, dict):
            errors += schema_errors(item, extra, where)
        elif not (open_ended or extra is True):
            errors.append(f"{where}: unknown field (the API server drops or refuses it)")
    return errors


def trainjob_errors(manifest: dict[str, Any], release: str) -> list[str]:
    """Where a TrainJob manifest breaks the CRD of Kubeflow Trainer `release`."""
    return schema_errors(manifest, trainjob_schema(release))
