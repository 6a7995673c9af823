//! The scale run's figures and their tables (Markdown) and JSON.

use std::fmt::Write as _;
use std::time::Duration;

use kvpool_bench::units::{fmt_size, fmt_size as size};
use serde_json::json;

use super::metadata::PerObject;
use super::routing::Cost;
use super::traffic::Traffic;

/// One membership mode's figures.
#[derive(Clone, Debug)]
pub(crate) struct ModeFigures {
    pub(crate) mode: String,
    /// Spawning every node, one after another, until the last printed its ready line.
    pub(crate) spawn: Duration,
    /// From the last ready line until every view has every node serving.
    pub(crate) start: Duration,
    pub(crate) start_rounds: u32,
    pub(crate) traffic: Traffic,
    pub(crate) etcd_rss: Option<u64>,
    /// From the joining node's spawn until every view has it serving.
    pub(crate) join: Duration,
    /// Share of the keys whose owner changed at the join, and that the nodes handed over.
    pub(crate) join_moved: f64,
    pub(crate) join_handed: f64,
    pub(crate) drain: Duration,
    pub(crate) drain_moved: f64,
    pub(crate) drain_handed: f64,
    /// From the SIGKILL until every other view has the node down.
    pub(crate) kill: Duration,
    pub(crate) hits: f64,
    pub(crate) misses: usize,
    pub(crate) wrong: usize,
    pub(crate) live: u32,
}

impl ModeFigures {
    pub(crate) fn new(mode: &str) -> ModeFigures {
        ModeFigures {
            mode: mode.to_string(),
            spawn: Duration::ZERO,
            start: Duration::ZERO,
            start_rounds: 0,
            traffic: Traffic::default(),
            etcd_rss: None,
            join: Duration::ZERO,
            join_moved: 0.0,
            join_handed: 0.0,
            drain: Duration::ZERO,
            drain_moved: 0.0,
            drain_handed: 0.0,
            kill: Duration::ZERO,
            hits: 0.0,
            misses: 0,
            wrong: 0,
            live: 0,
        }
    }
}

/// Everything the run measured.
pub(crate) struct ScaleReport {
    pub(crate) nodes: u32,
    pub(crate) modes: Vec<ModeFigures>,
    pub(crate) routing: Vec<Cost>,
    pub(crate) metadata: Vec<PerObject>,
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

impl ScaleReport {
    pub(crate) fn new(nodes: u32) -> ScaleReport {
        ScaleReport {
            nodes,
            modes: Vec::new(),
            routing: Vec::new(),
            metadata: Vec::new(),
        }
    }

    /// The tables.
    pub(crate) fn render(&self) -> String {
        let n = self.nodes;
        let mut o = String::new();
        let _ = writeln!(o, "\n## A pool of {n} nodes on one machine\n");
        let _ = write!(o, "| figure | ideal |");
        for m in &self.modes {
            let _ = write!(o, " {} |", m.mode);
        }
        let _ = write!(o, "\n| --- | --- |");
        for _ in &self.modes {
            let _ = write!(o, " --- |");
        }
        o.push('\n');
        let row = |o: &mut String, name: &str, ideal: &str, f: &dyn Fn(&ModeFigures) -> String| {
            let _ = write!(o, "| {name} | {ideal} |");
            for m in &self.modes {
                let _ = write!(o, " {} |", f(m));
            }
            o.push('\n');
        };
        row(
            &mut o,
            &format!("spawn {n} nodes (each waits for the one before)"),
            "–",
            &|m| secs(m.spawn),
        );
        row(
            &mut o,
            "start: last ready line → all serving in every view",
            "–",
            &|m| format!("{} ({} polls)", secs(m.start), m.start_rounds),
        );
        row(
            &mut o,
            &format!("join: spawn of node {n} → {} serving in every view", n + 1),
            "–",
            &|m| secs(m.join),
        );
        row(
            &mut o,
            "drain: request → every view without it",
            "–",
            &|m| secs(m.drain),
        );
        row(
            &mut o,
            "kill (SIGKILL) → down in every other view",
            "–",
            &|m| secs(m.kill),
        );
        row(
            &mut o,
            "TCP bytes per node per second, sent + received (`ss`)",
            "–",
            &|m| format!("{}/s", size(m.traffic.bytes as u64)),
        );
        row(
            &mut o,
            "TCP data segments per node per second, out + in (`ss`)",
            "–",
            &|m| format!("{:.0}", m.traffic.segments),
        );
        row(
            &mut o,
            "established TCP sockets per node / closed in the window",
            "–",
            &|m| format!("{:.1} / {}", m.traffic.sockets, m.traffic.closed),
        );
        row(&mut o, "CPU per node, idle pool (cores)", "–", &|m| {
            format!("{:.3}", m.traffic.cpu)
        });
        row(
            &mut o,
            "heartbeats answered per node per second",
            "–",
            &|m| format!("{:.1}", m.traffic.heartbeats_in),
        );
        row(
            &mut o,
            "etcd client bytes per node per second (etcd's count)",
            "–",
            &|m| format!("{}/s", size(m.traffic.etcd_bytes as u64)),
        );
        row(
            &mut o,
            "etcd messages per node per second (etcd's count)",
            "–",
            &|m| format!("{:.2}", m.traffic.etcd_messages),
        );
        row(&mut o, "etcd resident memory", "–", &|m| {
            m.etcd_rss.map_or("–".into(), fmt_size)
        });
        let join_ideal = 1.0 / f64::from(n + 1);
        row(
            &mut o,
            "join: keys whose owner changed",
            &pct(join_ideal),
            &|m| {
                format!(
                    "{} ({:.2}× ideal)",
                    pct(m.join_moved),
                    m.join_moved / join_ideal
                )
            },
        );
        row(
            &mut o,
            "join: objects handed over (kvpool_handover_objects_total)",
            &pct(join_ideal),
            &|m| {
                format!(
                    "{} ({:.2}× ideal)",
                    pct(m.join_handed),
                    m.join_handed / join_ideal
                )
            },
        );
        row(
            &mut o,
            "drain: keys whose owner changed",
            &pct(join_ideal),
            &|m| {
                format!(
                    "{} ({:.2}× ideal)",
                    pct(m.drain_moved),
                    m.drain_moved / join_ideal
                )
            },
        );
        row(
            &mut o,
            "drain: objects the others gained",
            &pct(join_ideal),
            &|m| {
                format!(
                    "{} ({:.2}× ideal)",
                    pct(m.drain_handed),
                    m.drain_handed / join_ideal
                )
            },
        );
        let kept = 1.0 - 1.0 / f64::from(n);
        let ideal = format!("{} / the killed node's share / 0", pct(kept));
        row(
            &mut o,
            "after all: keys read back with their bytes / misses / wrong bytes",
            &ideal,
            &|m| format!("{} / {} / {}", pct(m.hits), m.misses, m.wrong),
        );
        if let [three, many] = &self.routing[..] {
            let _ = writeln!(
                o,
                "\n| routing cost per key | 3 nodes | {} nodes | ratio |",
                many.nodes
            );
            let _ = writeln!(o, "| --- | --- | --- | --- |");
            let _ = writeln!(
                o,
                "| owner of one key (`ClusterView::owner`) | {:.1} ns | {:.1} ns | {:.2}× |",
                three.owner_ns,
                many.owner_ns,
                many.owner_ns / three.owner_ns
            );
            let _ = writeln!(
                o,
                "| a batch of 64 grouped by owner (`group_by_owner`) | {:.1} ns | {:.1} ns | {:.2}× |",
                three.batch_ns, many.batch_ns, many.batch_ns / three.batch_ns
            );
        }
        if !self.metadata.is_empty() {
            let _ = writeln!(o, "\n| objects on one node | count | RssAnon growth per object | segment reserved per object | RssAnon empty |");
            let _ = writeln!(o, "| --- | --- | --- | --- | --- |");
            for m in &self.metadata {
                let _ = writeln!(
                    o,
                    "| {} | {} | {:.1} B | {} ({:.3}× the value) | {} |",
                    fmt_size(m.size),
                    m.objects,
                    m.anon,
                    fmt_size(m.reserved as u64),
                    m.reserved / m.size as f64,
                    fmt_size(m.anon_empty)
                );
            }
        }
        o
    }

    /// The figures as JSON, with the command line.
    pub(crate) fn to_json(&self, cmdline: &str) -> String {
        let modes: Vec<_> = self
            .modes
            .iter()
            .map(|m| {
                json!({
                    "mode": m.mode,
                    "spawn_s": m.spawn.as_secs_f64(),
                    "start_s": m.start.as_secs_f64(),
                    "join_s": m.join.as_secs_f64(),
                    "drain_s": m.drain.as_secs_f64(),
                    "kill_s": m.kill.as_secs_f64(),
                    "bytes_per_node_s": m.traffic.bytes,
                    "segments_per_node_s": m.traffic.segments,
                    "sockets_per_node": m.traffic.sockets,
                    "sockets_closed_in_window": m.traffic.closed,
                    "heartbeats_in_per_node_s": m.traffic.heartbeats_in,
                    "cpu_per_node": m.traffic.cpu,
                    "etcd_bytes_per_node_s": m.traffic.etcd_bytes,
                    "etcd_messages_per_node_s": m.traffic.etcd_messages,
                    "etcd_rss": m.etcd_rss,
                    "join_moved": m.join_moved,
                    "join_handed": m.join_handed,
                    "drain_moved": m.drain_moved,
                    "drain_handed": m.drain_handed,
                    "hits": m.hits,
                    "misses": m.misses,
                    "wrong": m.wrong,
                    "live": m.live,
                })
            })
            .collect();
        let routing: Vec<_> = self
            .routing
            .iter()
            .map(|r| json!({"nodes": r.nodes, "owner_ns": r.owner_ns, "batch_ns": r.batch_ns}))
            .collect();
        let metadata: Vec<_> = self
            .metadata
            .iter()
            .map(|m| {
                json!({"size": m.size, "objects": m.objects, "anon_per_object": m.anon,
                       "reserved_per_object": m.reserved, "anon_empty": m.anon_empty})
            })
            .collect();
        serde_json::to_string_pretty(&json!({
            "command": cmdline,
            "nodes": self.nodes,
            "modes": modes,
            "routing": routing,
            "metadata": metadata,
        }))
        .unwrap_or_default()
    }
}

fn pct(x: f64) -> String {
    format!("{:.2} %", x * 100.0)
}
