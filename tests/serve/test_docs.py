"""docs/SERVE.md's manifests (docs/deploy/) stay in step with the CLI: every flag they pass exists, and the Serve
config's args are ones app_builder takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec.cli.serve import serve

yaml = pytest.importorskip("yaml")
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _yaml_blocks() -> list[dict]:
    """Return every YAML document of the manifests SERVE.md links (docs/deploy/*.yaml), checking it links each."""
    linked = set(re.findall(r"\(deploy/([\w.-]+\.yaml)\)", (DOCS / "SERVE.md").read_text()))
    files = sorted((DOCS / "deploy").glob("*.yaml"))
    assert linked == {f.name for f in files}
    return [doc for f in files for doc in yaml.safe_load_all(f.read_text())]


def test_the_kserve_manifest_passes_only_flags_specdec_serve_has():
    flags = {opt for param in serve.params for opt in getattr(param, "opts", [])}
    services = [doc for doc in _yaml_blocks() if doc.get("kind") == "InferenceService"]
    assert len(services) == 1
    predictor = services[0]["spec"]["predictor"]
    container = predictor["containers"][0]
    assert container["command"][:2] == ["specdec", "serve"]
    passed = [arg for arg in container["args"] if arg.startswith("--")]
    assert passed and not [arg for arg in passed if arg not in flags]
    args = container["args"]
    grace = float(args[args.index("--shutdown-grace") + 1])
    assert predictor["terminationGracePeriodSeconds"] > grace  # running streams finish before the kill
    port = int(args[args.index("--port") + 1])
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}


def test_the_serve_config_builds_with_app_builder():
    pytest.importorskip("ray.serve")
    from specdec.serve.ray_app import app_builder

    configs = [doc for doc in _yaml_blocks() if "applications" in doc]
    assert len(configs) == 1
    app = configs[0]["applications"][0]
    assert app["import_path"] == "specdec.serve.ray_app:app_builder"
    assert app_builder(app["args"])._bound_deployment.num_replicas == app["args"]["replicas"]
