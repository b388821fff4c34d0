"""The deployment files in infra/, checked by the tools that install here (no Docker daemon or cluster needed):
compose.yaml against the Compose Specification, the Kubernetes manifests against Kubernetes' own schemas (strict:
an unknown field fails), the Dockerfile through hadolint. Each tool ships its schemas or binary: nothing is fetched."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import BIN, REPO

INFRA = REPO / "infra"
KUBERNETES_VERSION = "1.37.0"  # the schemas kubernetes-validate 1.37 ships; the manifests use only stable APIs


def _manifests() -> list[tuple[str, dict]]:
    return [(path.name, document) for path in sorted((INFRA / "k8s").glob("*.yaml"))
            for document in yaml.safe_load_all(path.read_text()) if document]


def test_compose_file_follows_the_compose_specification():
    checked = subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                              str(INFRA / "compose.yaml")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_kubernetes_manifests_follow_kubernetes_schemas():
    import kubernetes_validate

    kinds = []
    for name, document in _manifests():
        if document["kind"] == "Kustomization":  # kustomize's own file: no Kubernetes schema; its resources exist
            assert all((INFRA / "k8s" / resource).is_file() for resource in document["resources"]), name
            continue
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)  # raises, naming the field
        kinds.append(document["kind"])
    assert {"Deployment", "Service", "StatefulSet", "Secret", "Namespace"} <= set(kinds)


def test_strict_validation_refuses_a_misspelt_field():
    import kubernetes_validate

    deployment = next(d for _, d in _manifests() if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicyy"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_dockerfile_passes_hadolint():
    linted = subprocess.run([str(BIN / "hadolint"), "--format", "json", str(INFRA / "Dockerfile")],
                            capture_output=True, text=True)
    assert json.loads(linted.stdout or "[]") == [], linted.stdout
    assert linted.returncode == 0, linted.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its kustomize) is not installed here")
def test_kustomization_builds_into_valid_manifests():
    import kubernetes_validate

    built = subprocess.run(["kubectl", "kustomize", str(INFRA / "k8s")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    documents = [d for d in yaml.safe_load_all(built.stdout) if d]
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    namespaced = [d for d in documents if d["kind"] != "Namespace"]
    assert namespaced and all(d["metadata"]["namespace"] == "dreamgym" for d in namespaced)
