//! The report as JSON, built with serde_json so that every string is escaped and every number
//! is valid JSON (a non-finite figure is `null`).

use serde_json::{json, Value};

use super::report::{Report, Row};

impl Report {
    /// The report as pretty-printed JSON; `args` is the command line that produced it.
    pub(crate) fn to_json(&self, args: &str) -> String {
        let notes: Vec<Value> = self
            .notes
            .iter()
            .map(|(sec, n)| json!({"section": sec.name(), "note": n}))
            .collect();
        let doc = json!({
            "machine": self.machine.json(),
            "args": args,
            "rows": self.rows.iter().map(row_json).collect::<Vec<_>>(),
            "notes": notes,
        });
        let mut s = serde_json::to_string_pretty(&doc).expect("a Value always serialises");
        s.push('\n');
        s
    }
}

fn row_json(r: &Row) -> Value {
    let refs: Vec<Value> = r
        .refs
        .iter()
        .map(|f| {
            json!({
                "reference": f.name,
                "ratio": finite(Some(f.ratio)),
                "ratio_min": finite(f.spread.map(|s| s.0)),
                "ratio_max": finite(f.spread.map(|s| s.1)),
                "target": finite(f.target),
                "met": f.met(),
            })
        })
        .collect();
    json!({
        "section": r.section.name(),
        "system": r.system,
        "op": r.op,
        "size": r.size,
        "conns": r.conns,
        "depth": r.depth,
        "gbps": finite(r.gbps),
        "ops_per_s": finite(r.ops_per_s),
        "p50_ns": finite(r.p50_ns),
        "p99_ns": finite(r.p99_ns),
        "objects": r.objects,
        "bytes_per_object": finite(r.bytes_per_object),
        "gbps_runs": r.runs.iter().map(|g| finite(Some(*g))).collect::<Vec<_>>(),
        "refs": refs,
    })
}

/// JSON has no NaN or infinity: such a figure is written as `null`.
fn finite(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite())
}

#[cfg(test)]
mod tests {
    use super::super::machine::Machine;
    use super::super::report::{Ref, Report, Row};
    use super::super::Section;

    #[test]
    fn the_report_is_valid_json_whatever_its_strings_and_numbers() {
        let machine = Machine {
            nproc: 2,
            cpu: "cpu \"quoted\"\\ with\ttab\u{1}".into(),
            kernel: "6.1".into(),
            mem_gib: 23.5,
            date: "2026-11-23".into(),
        };
        let mut report = Report::new(machine);
        let mut row = Row::new(Section::Tcp, "kvpool", "get\n2 MiB");
        row.size = Some(2 << 20);
        row.gbps = Some(f64::NAN);
        row.ops_per_s = Some(1234.5);
        row.refs.push(Ref {
            name: "memcached".into(),
            ratio: f64::INFINITY,
            spread: None,
            target: Some(1.0),
        });
        report.rows.push(row);
        report.note(Section::Tcp, "a note with \"quotes\"\n");

        let text = report.to_json("kvpool-bench perf --json \"out file\".json");
        let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(v["machine"]["cpu"], "cpu \"quoted\"\\ with\ttab\u{1}");
        let row = &v["rows"][0];
        assert_eq!(row["op"], "get\n2 MiB");
        assert_eq!(row["size"], 2 << 20);
        assert!(row["gbps"].is_null(), "NaN is written as null");
        assert_eq!(row["ops_per_s"], 1234.5);
        assert!(row["refs"][0]["ratio"].is_null());
        assert_eq!(row["refs"][0]["met"], true);
        assert_eq!(v["notes"][0]["note"], "a note with \"quotes\"\n");
        assert_eq!(v["args"], "kvpool-bench perf --json \"out file\".json");
    }
}
