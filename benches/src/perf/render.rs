//! The report as text: one table per section (only the columns its rows fill), plus the raw
//! TCP stream, memcached and redis next to kvpool.

use std::fmt::Write as _;

use super::report::{Ref, Report, Row};
use super::tcp::RAW;
use super::Section;
use kvpool_bench::units::{fmt_ns, fmt_rate, fmt_size};

impl Report {
    /// The whole report as text tables, one per section.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "kvpool-bench perf — {}", self.machine.describe());
        for section in Section::ALL {
            let mut rows: Vec<&Row> = self.rows.iter().filter(|r| r.section == section).collect();
            if section == Section::Baselines {
                // Measured interleaved; shown one system after the other.
                rows.sort_by(|a, b| a.system.cmp(&b.system));
            }
            let notes: Vec<&String> = self
                .notes
                .iter()
                .filter(|(s, _)| *s == section)
                .map(|(_, n)| n)
                .collect();
            if rows.is_empty() && notes.is_empty() {
                continue;
            }
            let _ = writeln!(out, "\n== {} ==", section.title());
            if !rows.is_empty() {
                out.push_str(&rows_table(&rows));
            }
            if section == Section::Baselines {
                out.push_str(&self.side_by_side());
            }
            for n in notes {
                let _ = writeln!(out, "  * {n}");
            }
        }
        out
    }

    /// kvpool over TCP next to the raw TCP stream, memcached and redis, shape by shape.
    fn side_by_side(&self) -> String {
        let mut cells = Vec::new();
        for kv in self
            .rows
            .iter()
            .filter(|r| r.section == Section::Tcp && r.system == "kvpool")
        {
            let baseline = |name: &str| self.find(Section::Baselines, name, &kv.op, kv);
            let (mc, rd) = (baseline("memcached"), baseline("redis"));
            let raw = self.find(Section::Tcp, RAW, &kv.op, kv);
            let gb = |r: Option<&Row>| {
                r.and_then(|r| r.gbps)
                    .map_or("-".into(), |g| format!("{g:.2}"))
            };
            let ratio = |name: &str| {
                kv.refs
                    .iter()
                    .find(|r| r.name == name)
                    .map_or("-".into(), |r| r.describe())
            };
            cells.push(vec![
                kv.op.clone(),
                kv.size.map_or("-".into(), fmt_size),
                opt(kv.conns),
                opt(kv.depth),
                gb(Some(kv)),
                gb(raw),
                gb(mc),
                gb(rd),
                ratio(RAW),
                ratio("memcached"),
                ratio("redis"),
            ]);
        }
        if cells.is_empty() {
            return String::new();
        }
        let head = [
            "op",
            "size",
            "conns",
            "depth",
            "kvpool GB/s",
            "raw tcp GB/s",
            "memcached GB/s",
            "redis GB/s",
            "kvpool/raw tcp",
            "kvpool/memcached",
            "kvpool/redis",
        ];
        format!(
            "\n  side by side (same size, connections and depth):\n{}",
            table(&head, &cells)
        )
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

/// One section's rows, with only the columns some row fills.
fn rows_table(rows: &[&Row]) -> String {
    type Col = (&'static str, fn(&Row) -> Option<String>);
    let cols: [Col; 11] = [
        ("what", |r| Some(r.label())),
        ("size", |r| r.size.map(fmt_size)),
        ("conns", |r| r.conns.map(|c| c.to_string())),
        ("depth", |r| r.depth.map(|d| d.to_string())),
        ("GB/s", |r| r.gbps.map(|g| format!("{g:.2}"))),
        ("ops/s", |r| r.ops_per_s.map(fmt_rate)),
        ("p50", |r| r.p50_ns.map(fmt_ns)),
        ("p99", |r| r.p99_ns.map(fmt_ns)),
        ("objects", |r| r.objects.map(|o| o.to_string())),
        ("B/object", |r| {
            r.bytes_per_object.map(|b| format!("{b:.1}"))
        }),
        ("vs reference (same run)", |r| {
            Some(if r.refs.is_empty() {
                "-".into()
            } else {
                r.refs
                    .iter()
                    .map(Ref::describe)
                    .collect::<Vec<_>>()
                    .join("; ")
            })
        }),
    ];
    let used: Vec<&Col> = cols
        .iter()
        .filter(|(_, f)| rows.iter().any(|r| f(r).is_some()))
        .collect();
    let head: Vec<&str> = used.iter().map(|(h, _)| *h).collect();
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            used.iter()
                .map(|(_, f)| f(r).unwrap_or_else(|| "-".into()))
                .collect()
        })
        .collect();
    table(&head, &cells)
}

/// Left-aligned columns, two spaces apart, indented by two.
pub(crate) fn table(head: &[&str], cells: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for row in cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |items: &mut dyn Iterator<Item = &str>| {
        let mut l = String::from(" ");
        for (item, w) in items.zip(&width) {
            let _ = write!(l, " {item:<w$} ");
        }
        l.trim_end().to_string() + "\n"
    };
    let mut out = line(&mut head.iter().copied());
    out += &line(
        &mut width
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str),
    );
    for row in cells {
        out += &line(&mut row.iter().map(String::as_str));
    }
    out
}

/// Ends a benchmark command: prints its report (`rendered`) and the time since `began`, and
/// writes the report's JSON (`to_json` of the command line) to `json` when asked.
pub(crate) fn publish(
    rendered: &str,
    began: std::time::Instant,
    json: Option<&std::path::Path>,
    to_json: impl FnOnce(&str) -> String,
) -> anyhow::Result<()> {
    println!("{rendered}");
    println!("total time {:.1} s", began.elapsed().as_secs_f64());
    if let Some(path) = json {
        let cmdline = std::env::args().collect::<Vec<_>>().join(" ");
        anyhow::Context::with_context(std::fs::write(path, to_json(&cmdline)), || {
            format!("writing {}", path.display())
        })?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
