"""kvpool's Grafana dashboard, built with Grafana's foundation SDK (`grafana-foundation-sdk`).

`python deploy/monitoring/dashboard.py` prints the dashboard's JSON; kvpool-dashboard.json beside
this file is that output (python/tests/test_monitoring.py checks that they agree). Every panel
queries the Prometheus data source picked in the `datasource` variable, over the nodes picked in
`instance` (the scrape targets of the job `kvpool`).
"""

import json
import sys

from grafana_foundation_sdk.builders import (
    common,
    dashboard,
    prometheus,
    stat,
    timeseries,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableRefresh,
)

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
NODES = 'instance=~"$instance"'
RATE = "$__rate_interval"


def rate(metric: str, by: str, match: str = "") -> str:
    """The per-second rate of a counter over the picked nodes, summed by `by`."""
    sel = f"{{{match}, {NODES}}}" if match else f"{{{NODES}}}"
    return f"sum by ({by}) (rate({metric}{sel}[{RATE}]))"


def gauge(metric: str, by: str, match: str = "") -> str:
    """A gauge over the picked nodes, summed by `by`."""
    sel = f"{{{match}, {NODES}}}" if match else f"{{{NODES}}}"
    return f"sum by ({by}) ({metric}{sel})"


def hit_ratio() -> str:
    hits = f"rate(kvpool_hits_total{{{NODES}}}[{RATE}])"
    misses = f"rate(kvpool_misses_total{{{NODES}}}[{RATE}])"
    return f"sum by (instance) ({hits}) / (sum by (instance) ({hits} + {misses}) > 0)"


def latency(q: float) -> str:
    ops = 'op=~"get|put|batch_get|batch_put"'
    buckets = f"rate(kvpool_operation_seconds_bucket{{{ops}, {NODES}}}[{RATE}])"
    return f"histogram_quantile({q}, sum by (le, op) ({buckets}))"


# Rows of panels: (row title, [(panel kind, title, unit, [(expr, legend)])]).
ROWS = [
    (
        "Cluster",
        [
            ("stat", "Nodes up", "none", [(f'sum(up{{job="kvpool", {NODES}}})', "up")]),
            (
                "timeseries",
                "Cluster view: nodes by state (the most any node counts)",
                "none",
                [(f"max by (state) (kvpool_cluster_nodes{{{NODES}}})", "{{state}}")],
            ),
            ("timeseries", "Hit rate", "percentunit", [(hit_ratio(), "{{instance}}")]),
        ],
    ),
    (
        "Memory",
        [
            (
                "timeseries",
                "Memory use per node",
                "bytes",
                [
                    (
                        gauge("kvpool_segment_bytes", "instance", 'state="used"'),
                        "{{instance}} used",
                    ),
                    (
                        gauge("kvpool_segment_bytes", "instance", 'state="capacity"'),
                        "{{instance}} capacity",
                    ),
                ],
            ),
            (
                "timeseries",
                "Memory use per namespace",
                "bytes",
                [
                    (
                        gauge("kvpool_namespace_bytes", "namespace", 'kind="used"'),
                        "{{namespace}} used",
                    ),
                    (
                        gauge("kvpool_namespace_bytes", "namespace", 'kind="pinned"'),
                        "{{namespace}} pinned",
                    ),
                ],
            ),
            (
                "timeseries",
                "Objects per node",
                "short",
                [(gauge("kvpool_objects", "instance"), "{{instance}}")],
            ),
        ],
    ),
    (
        "Traffic",
        [
            (
                "timeseries",
                "Operations per second",
                "ops",
                [
                    (rate("kvpool_operations_total", "op", 'outcome="ok"'), "{{op}}"),
                    (
                        rate("kvpool_operations_total", "op", 'outcome="error"'),
                        "{{op}} errors",
                    ),
                ],
            ),
            (
                "timeseries",
                "Payload bytes per second",
                "Bps",
                [(rate("kvpool_payload_bytes_total", "direction"), "{{direction}}")],
            ),
            (
                "timeseries",
                "Latency inside the node (get, put, batches)",
                "s",
                [
                    (latency(0.5), "p50 {{op}}"),
                    (latency(0.99), "p99 {{op}}"),
                    (latency(0.999), "p99.9 {{op}}"),
                ],
            ),
        ],
    ),
    (
        "Pressure",
        [
            (
                "timeseries",
                "Evictions per second",
                "ops",
                [(rate("kvpool_evictions_total", "instance"), "{{instance}}")],
            ),
            (
                "timeseries",
                "Refusals by limit",
                "ops",
                [(rate("kvpool_limit_refusals_total", "limit"), "{{limit}}")],
            ),
            (
                "timeseries",
                "Open connections",
                "short",
                [(gauge("kvpool_connections", "transport"), "{{transport}}")],
            ),
            (
                "timeseries",
                "Wrong tokens and cluster proofs per second",
                "ops",
                [
                    (
                        rate("kvpool_auth_failures_total", "instance"),
                        "{{instance}} tokens",
                    ),
                    (
                        rate("kvpool_cluster_auth_failures_total", "instance"),
                        "{{instance}} cluster proofs",
                    ),
                ],
            ),
        ],
    ),
    (
        "Disk tier",
        [
            (
                "timeseries",
                "Demotions and promotions per second",
                "ops",
                [
                    (
                        rate("kvpool_disk_demotions_total", "instance"),
                        "{{instance}} demoted",
                    ),
                    (
                        rate("kvpool_disk_promotions_total", "instance"),
                        "{{instance}} promoted",
                    ),
                ],
            ),
            (
                "timeseries",
                "Disk hits and misses per second",
                "ops",
                [
                    (rate("kvpool_disk_hits_total", "instance"), "{{instance}} hits"),
                    (
                        rate("kvpool_disk_misses_total", "instance"),
                        "{{instance}} misses",
                    ),
                ],
            ),
            (
                "timeseries",
                "Disk use and demotion queue",
                "bytes",
                [
                    (gauge("kvpool_disk_bytes", "instance"), "{{instance}} on disk"),
                    (
                        gauge("kvpool_disk_queued_bytes", "instance"),
                        "{{instance}} queued",
                    ),
                ],
            ),
            (
                "timeseries",
                "Disk errors per second",
                "ops",
                [
                    (
                        rate("kvpool_disk_io_errors_total", "instance"),
                        "{{instance}} I/O errors",
                    ),
                    (
                        rate("kvpool_disk_checksum_failures_total", "instance"),
                        "{{instance}} checksum failures",
                    ),
                    (
                        rate("kvpool_disk_write_failures_total", "instance"),
                        "{{instance}} write failures",
                    ),
                ],
            ),
        ],
    ),
    (
        "Handoff, handover, KV events",
        [
            (
                "timeseries",
                "Handoff keys given up per second",
                "ops",
                [(rate("kvpool_handoff_failures_total", "cause"), "{{cause}}")],
            ),
            (
                "timeseries",
                "Handover to new owners",
                "short",
                [
                    (
                        rate("kvpool_handover_objects_total", "instance"),
                        "{{instance}} handed / s",
                    ),
                    (
                        gauge("kvpool_handover_pending", "instance"),
                        "{{instance}} pending",
                    ),
                ],
            ),
            (
                "timeseries",
                "KV events",
                "short",
                [
                    (
                        rate("kvpool_kv_events_published_total", "instance"),
                        "{{instance}} published / s",
                    ),
                    (
                        rate("kvpool_kv_events_dropped_total", "instance"),
                        "{{instance}} dropped / s",
                    ),
                    (
                        gauge("kvpool_kv_event_subscribers", "instance"),
                        "{{instance}} subscribers",
                    ),
                ],
            ),
            (
                "timeseries",
                "Index journal healthy",
                "bool",
                [(gauge("kvpool_journal_healthy", "instance"), "{{instance}}")],
            ),
        ],
    ),
]


def build() -> dict:
    """The dashboard, as Grafana's JSON model."""
    d = (
        dashboard.Dashboard("kvpool")
        .uid("kvpool")
        .description(
            "kvpool nodes: membership, memory, traffic, pressure, disk tier, handoff."
        )
        .tags(["kvpool"])
        .refresh("30s")
        .time("now-1h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(
            dashboard.DatasourceVariable("datasource")
            .label("Data source")
            .type("prometheus")
        )
        .with_variable(
            dashboard.QueryVariable("instance")
            .label("Node")
            .datasource(DATASOURCE)
            .query('label_values(up{job="kvpool"}, instance)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )
    panel_id = 0
    for row, panels in ROWS:
        panel_id += 1
        d = d.with_row(dashboard.Row(row).id(panel_id))
        width = 24 // len(panels)
        for kind, title, unit, queries in panels:
            panel_id += 1
            if kind == "stat":
                p = stat.Panel().reduce_options(
                    common.ReduceDataOptions().calcs(["lastNotNull"])
                )
            else:
                legend = common.VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                p = timeseries.Panel().legend(
                    legend.placement(LegendPlacement.BOTTOM).show_legend(True)
                )
            p = (
                p.id(panel_id)
                .title(title)
                .unit(unit)
                .datasource(DATASOURCE)
                .height(8)
                .span(width)
            )
            for i, (expr, legend) in enumerate(queries):
                q = prometheus.Dataquery().expr(expr).legend_format(legend)
                p = p.with_target(q.ref_id(chr(ord("A") + i)).datasource(DATASOURCE))
            d = d.with_panel(p)
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
