"""deploy/monitoring/kvpool-dashboard.json is what Grafana's foundation SDK builds from
deploy/monitoring/dashboard.py, and the SDK reads it back as a dashboard with every panel."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from conftest import REPO, require_module

MONITORING = REPO / "deploy" / "monitoring"


def load_builder():
    require_module("grafana_foundation_sdk", "pip install grafana-foundation-sdk")
    spec = importlib.util.spec_from_file_location(
        "kvpool_dashboard", MONITORING / "dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_dashboard_is_what_the_sdk_builds():
    builder = load_builder()
    committed = (MONITORING / "kvpool-dashboard.json").read_text()
    assert committed == builder.render(), (
        "kvpool-dashboard.json differs from what deploy/monitoring/dashboard.py builds; "
        "regenerate it: python deploy/monitoring/dashboard.py > deploy/monitoring/kvpool-dashboard.json"
    )


def test_the_sdk_reads_the_dashboard_back_whole():
    require_module("grafana_foundation_sdk", "pip install grafana-foundation-sdk")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    raw = json.loads(Path(MONITORING / "kvpool-dashboard.json").read_text())
    model = Dashboard.from_json(raw)
    assert model.uid == "kvpool"
    assert len(model.panels) == len(raw["panels"])
    again = json.loads(json.dumps(model, cls=JSONEncoder))
    titles = [p["title"] for p in raw["panels"]]
    assert [p["title"] for p in again["panels"]] == titles
    exprs = [t["expr"] for p in raw["panels"] for t in p.get("targets", [])]
    assert exprs and all("kvpool" in e or "up{" in e for e in exprs)
    assert [t["expr"] for p in again["panels"] for t in p.get("targets", [])] == exprs
