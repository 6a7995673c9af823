//! The report of a finished soak: the samples, the verdicts and the totals, as tables and
//! as JSON.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

use kvpool_bench::units::fmt_size;
use serde_json::json;

use super::ops::OPS;
use super::sample::{mib, Observed, Sample};
use super::verdict::Verdicts;
use crate::perf::machine::Machine;
use crate::perf::render::table;

impl Observed<'_> {
    /// The report: the samples, the verdicts, the totals.
    pub(super) fn text(&self, v: &Verdicts) -> String {
        let mut out = format!(
            "soak: {} pool, {} clients + 1 reconnecting, {:.0} s, samples every {} s, judged from {:.0} s\n\n",
            fmt_size(self.args.memory),
            self.args.clients,
            self.duration.as_secs_f64(),
            self.args.sample_every,
            v.warmup
        );
        out += &self.samples_table();
        out += "\n";
        out += &verdicts_table(v);
        out += &self.totals_text(v);
        out += &format!(
            "verdict: {} (RSS {}, fds {}, pending {}, wrong reads {})",
            if v.met { "met" } else { "missed" },
            if v.rss.flat { "flat" } else { "not flat" },
            if v.fds.flat { "flat" } else { "not flat" },
            if v.pending.flat { "flat" } else { "not flat" },
            v.wrong
        );
        out
    }

    /// One row per sample, and the sample after the load.
    fn samples_table(&self) -> String {
        let head = [
            "t (s)",
            "RSS",
            "RssAnon",
            "fds",
            "pending",
            "conns",
            "objects",
            "used",
            "evictions",
            "reaped",
            "ops/s",
            "wrong",
        ];
        let cells: Vec<Vec<String>> = self
            .samples
            .iter()
            .chain(std::iter::once(&self.after))
            .enumerate()
            .map(|(i, s)| {
                vec![
                    if i == self.samples.len() {
                        format!("{:.0} (after)", s.t_s)
                    } else {
                        format!("{:.0}", s.t_s)
                    },
                    mib(s.rss as f64),
                    mib(s.rss_anon as f64),
                    s.fds.to_string(),
                    format!("{:.0}", s.pending),
                    format!("{:.0}", s.connections),
                    format!("{:.0}", s.objects),
                    mib(s.used),
                    format!("{:.0}", s.evictions),
                    format!("{:.0}", s.reaped),
                    format!("{:.0}", s.ops_s),
                    s.wrong.to_string(),
                ]
            })
            .collect();
        table(&head, &cells)
    }

    /// The drain after the load, the operations and their errors, the wrong reads.
    fn totals_text(&self, v: &Verdicts) -> String {
        let stats = self.stats;
        let (hits, misses) = (stats.hits.load(Relaxed), stats.misses.load(Relaxed));
        let mut out = format!(
            "\n  after the load: pending {:.0} after {:.1} s ({} allocations reaped in all)\n",
            self.after.pending, self.drained_s, self.after.reaped
        );
        let total = stats.total_ops();
        out += &format!(
            "  operations {total} ({:.0}/s), errors {}, reads checked {} ({} hits, {} misses), \
             {} read, {} written\n",
            total as f64 / self.duration.as_secs_f64(),
            stats.total_errors(),
            hits + misses,
            hits,
            misses,
            mib(stats.read_bytes.load(Relaxed) as f64),
            mib(stats.written_bytes.load(Relaxed) as f64),
        );
        let op_cells: Vec<Vec<String>> = OPS
            .iter()
            .map(|op| {
                vec![
                    op.name().to_string(),
                    stats.ops[*op as usize].load(Relaxed).to_string(),
                    stats.errors[*op as usize].load(Relaxed).to_string(),
                ]
            })
            .collect();
        out += &table(&["operation", "count", "errors"], &op_cells);
        for (k, n) in &self.error_kinds() {
            out += &format!("  error x{n}: {k}\n");
        }
        out += &format!(
            "  wrong reads: {} ({} bytes)\n",
            v.wrong,
            stats.wrong_bytes.load(Relaxed)
        );
        out
    }

    /// The distinct error messages, with how often each came.
    fn error_kinds(&self) -> BTreeMap<String, u64> {
        self.stats
            .error_kinds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The JSON document of the run.
    pub(super) fn json(
        &self,
        v: &Verdicts,
        cmdline: &str,
        machine: &Machine,
        loadavg: &str,
    ) -> serde_json::Value {
        let (args, stats) = (self.args, self.stats);
        json!({
            "command": cmdline,
            "machine": machine.json(),
            "loadavg_end": loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
            "memory": args.memory,
            "clients": args.clients,
            "same_host_clients": self.local_paths,
            "keys": self.keys,
            "duration_s": self.duration.as_secs_f64(),
            "sample_every_s": args.sample_every,
            "warmup_s": v.warmup,
            "pending_timeout_ms": args.pending_timeout_ms,
            "samples": self.samples.iter().map(Sample::json).collect::<Vec<_>>(),
            "after": {
                "sample": self.after.json(),
                "secs_after_stop": self.drained_s,
                "drained": v.drained,
            },
            "verdict": {
                "rss": v.rss.json(),
                "rss_anon": v.rss_anon.json(),
                "fds": v.fds.json(),
                "pending": v.pending.json(),
                "wrong": v.wrong,
                "met": v.met,
            },
            "totals": {
                "ops": stats.total_ops(),
                "errors": stats.total_errors(),
                "hits": stats.hits.load(Relaxed),
                "misses": stats.misses.load(Relaxed),
                "wrong": v.wrong,
                "wrong_bytes": stats.wrong_bytes.load(Relaxed),
                "read_bytes": stats.read_bytes.load(Relaxed),
                "written_bytes": stats.written_bytes.load(Relaxed),
                "by_op": OPS.iter().map(|op| json!({
                    "op": op.name(),
                    "count": stats.ops[*op as usize].load(Relaxed),
                    "errors": stats.errors[*op as usize].load(Relaxed),
                })).collect::<Vec<_>>(),
                "error_kinds": self.error_kinds(),
            },
        })
    }
}

/// One row per judged gauge.
fn verdicts_table(v: &Verdicts) -> String {
    let vcells: Vec<Vec<String>> = [&v.rss, &v.rss_anon, &v.fds, &v.pending]
        .iter()
        .map(|j| {
            let fmt = |x: f64| {
                if j.name.starts_with("R") {
                    mib(x)
                } else {
                    format!("{x:.1}")
                }
            };
            vec![
                j.name.to_string(),
                fmt(j.min),
                fmt(j.max),
                fmt(j.max - j.min),
                format!("{}/min", fmt(j.slope)),
                if j.name == "RssAnon" {
                    "-".into()
                } else if j.flat {
                    "flat".into()
                } else {
                    "NOT flat".into()
                },
                j.rule.clone(),
            ]
        })
        .collect();
    table(
        &["gauge", "min", "max", "max-min", "slope", "verdict", "rule"],
        &vcells,
    )
}
