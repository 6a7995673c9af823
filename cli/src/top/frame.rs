//! One frame of `kvpool top`: what two polls of the cluster say, each node's use now and what
//! it served between them. Computed from the samples alone (no sockets, no clock), so the
//! arithmetic is tested on its own.

use kvpool::placement::NodeState;
use kvpool::protocol::NodeTraffic;
use serde_json::{json, Value};

use super::sample::{Answer, NodeSample, Sample};

/// Operations that store objects: `Put`, `BatchPut`, and the `Commit` of one-sided writes.
pub(crate) const OPS_IN: [&str; 3] = ["put", "batch_put", "commit"];
/// Operations that fetch or locate objects: `Get`, `BatchGet`, and the `Lookup` of one-sided
/// reads.
pub(crate) const OPS_OUT: [&str; 3] = ["get", "batch_get", "lookup"];

/// The cluster over one interval.
pub(crate) struct Frame {
    /// The view's version at the second poll.
    pub(crate) version: u64,
    /// One per node of the second poll's view.
    pub(crate) rows: Vec<Row>,
    /// The sums over every node that answered.
    pub(crate) totals: Totals,
}

/// One node over the interval.
pub(crate) struct Row {
    /// Node id.
    pub(crate) id: u32,
    /// TCP endpoint.
    pub(crate) tcp: String,
    /// Its state in the view, or `down` when it did not answer.
    pub(crate) state: &'static str,
    /// Why it did not answer.
    pub(crate) error: Option<String>,
    /// Its use at the second poll (None when down).
    pub(crate) now: Option<Use>,
    /// What it served since the first poll: None when it did not answer both, or restarted
    /// between them (its counters went back).
    pub(crate) moved: Option<Moved>,
}

/// A node's use at one poll.
#[derive(Clone, Copy, Default)]
pub(crate) struct Use {
    /// Bytes reserved in its segments.
    pub(crate) used: u64,
    /// Bytes of its segments.
    pub(crate) capacity: u64,
    /// Committed objects.
    pub(crate) objects: u64,
    /// Its disk tier: bytes, capacity, objects (None when it has none).
    pub(crate) disk: Option<[u64; 3]>,
}

/// What a node served between two polls, as counts.
#[derive(Clone, Copy, Default)]
pub(crate) struct Moved {
    /// Seconds between its two answers.
    pub(crate) seconds: f64,
    /// Lookups that found their object.
    pub(crate) hits: u64,
    /// Lookups that did not.
    pub(crate) misses: u64,
    /// Objects evicted for space.
    pub(crate) evictions: u64,
    /// From `Traffic` (None from a node of an older protocol).
    pub(crate) traffic: Option<Traffic>,
}

/// The `Traffic` counters of a node between two polls.
#[derive(Clone, Copy, Default)]
pub(crate) struct Traffic {
    /// Operations of [`OPS_IN`].
    pub(crate) ops_in: u64,
    /// Operations of [`OPS_OUT`].
    pub(crate) ops_out: u64,
    /// Payload bytes received.
    pub(crate) bytes_in: u64,
    /// Payload bytes sent.
    pub(crate) bytes_out: u64,
    /// Requests and connections refused by a limit.
    pub(crate) refusals: u64,
}

/// The cluster's sums.
#[derive(Default)]
pub(crate) struct Totals {
    /// Nodes in the view.
    pub(crate) nodes: usize,
    /// Nodes that answered.
    pub(crate) up: usize,
    /// Summed use of the nodes that answered.
    pub(crate) now: Use,
    /// Summed counts of the nodes with counts; `seconds` is the longest of their intervals.
    pub(crate) moved: Moved,
    /// Summed per-second rates of the nodes with counts.
    pub(crate) rates: Rates,
}

/// Per-second rates (each node's counts over its own interval).
#[derive(Clone, Copy, Default)]
pub(crate) struct Rates {
    pub(crate) evictions: f64,
    pub(crate) ops_in: f64,
    pub(crate) ops_out: f64,
    pub(crate) bytes_in: f64,
    pub(crate) bytes_out: f64,
    pub(crate) refusals: f64,
}

impl Frame {
    /// The frame between polls `prev` and `cur`.
    pub(crate) fn new(prev: &Sample, cur: &Sample) -> Frame {
        let rows: Vec<Row> = cur
            .nodes
            .iter()
            .map(|n| {
                let before = prev.nodes.iter().find(|p| p.info.id == n.info.id);
                Row::new(before, n)
            })
            .collect();
        let mut totals = Totals {
            nodes: rows.len(),
            ..Totals::default()
        };
        for r in &rows {
            if let Some(u) = &r.now {
                totals.up += 1;
                totals.now.add(u);
            }
            if let Some(m) = &r.moved {
                totals.moved.add(m);
                totals.rates.add(&m.rates());
            }
        }
        Frame {
            version: cur.version,
            rows,
            totals,
        }
    }

    /// The frame as one JSON object (one line of `kvpool top --json`).
    pub(crate) fn to_json(&self, time_ms: u64) -> Value {
        let nodes: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                let mut v = use_json(r.now.as_ref());
                v["id"] = json!(r.id);
                v["tcp"] = json!(r.tcp);
                v["state"] = json!(r.state);
                v["error"] = json!(r.error);
                add_moved_json(&mut v, r.moved.as_ref(), r.moved.map(|m| m.rates()));
                v
            })
            .collect();
        let t = &self.totals;
        let mut totals = use_json(Some(&t.now));
        totals["nodes"] = json!(t.nodes);
        totals["up"] = json!(t.up);
        let any = self.rows.iter().any(|r| r.moved.is_some());
        add_moved_json(&mut totals, any.then_some(&t.moved), any.then_some(t.rates));
        json!({
            "time_ms": time_ms,
            "view_version": self.version,
            "nodes": nodes,
            "totals": totals,
        })
    }
}

impl Row {
    fn new(before: Option<&NodeSample>, n: &NodeSample) -> Row {
        let (state, error, now) = match &n.answer {
            Ok(a) => (n.info.state.name(), None, Some(Use::of(a))),
            // A node restarting in place is away, and says so; any other that does not answer
            // is down as far as this view goes.
            Err(e) if n.info.state == NodeState::Restarting => {
                ("restarting", Some(e.clone()), None)
            }
            Err(e) => ("down", Some(e.clone()), None),
        };
        let moved = match (before.map(|b| (&b.answer, b.at)), &n.answer) {
            (Some((Ok(a), at)), Ok(b)) => {
                Moved::between(a, b, n.at.duration_since(at).as_secs_f64())
            }
            _ => None,
        };
        Row {
            id: n.info.id,
            tcp: n.info.tcp.clone(),
            state,
            error,
            now,
            moved,
        }
    }
}

impl Use {
    fn of(a: &Answer) -> Use {
        Use {
            used: a.stats.used_bytes(),
            capacity: a.stats.capacity(),
            objects: a.stats.objects,
            disk: a.disk.as_ref().map(|d| [d.bytes, d.capacity, d.objects]),
        }
    }

    fn add(&mut self, o: &Use) {
        self.used += o.used;
        self.capacity += o.capacity;
        self.objects += o.objects;
        if let Some(d) = o.disk {
            let s = self.disk.get_or_insert([0; 3]);
            for (s, d) in s.iter_mut().zip(d) {
                *s += d;
            }
        }
    }
}

impl Moved {
    /// The counts between answers `a` and `b`, `seconds` apart: None when a counter went
    /// back (the node restarted between them) or no time passed.
    fn between(a: &Answer, b: &Answer, seconds: f64) -> Option<Moved> {
        let (s, t) = (&a.stats, &b.stats);
        let traffic = match (&a.traffic, &b.traffic) {
            (Some(x), Some(y)) => Some(Traffic::between(x, y)?),
            _ => None,
        };
        (seconds > 0.0).then_some(())?;
        Some(Moved {
            seconds,
            hits: t.hits.checked_sub(s.hits)?,
            misses: t.misses.checked_sub(s.misses)?,
            evictions: t.evictions.checked_sub(s.evictions)?,
            traffic,
        })
    }

    /// Hits over lookups (None without lookups).
    pub(crate) fn hit_rate(&self) -> Option<f64> {
        let lookups = self.hits + self.misses;
        (lookups > 0).then(|| self.hits as f64 / lookups as f64)
    }

    /// The counts over the interval, per second.
    pub(crate) fn rates(&self) -> Rates {
        let per_s = |n: u64| n as f64 / self.seconds;
        let t = self.traffic.unwrap_or_default();
        Rates {
            evictions: per_s(self.evictions),
            ops_in: per_s(t.ops_in),
            ops_out: per_s(t.ops_out),
            bytes_in: per_s(t.bytes_in),
            bytes_out: per_s(t.bytes_out),
            refusals: per_s(t.refusals),
        }
    }

    fn add(&mut self, o: &Moved) {
        self.seconds = self.seconds.max(o.seconds);
        self.hits += o.hits;
        self.misses += o.misses;
        self.evictions += o.evictions;
        if let Some(t) = o.traffic {
            let s = self.traffic.get_or_insert_with(Traffic::default);
            s.ops_in += t.ops_in;
            s.ops_out += t.ops_out;
            s.bytes_in += t.bytes_in;
            s.bytes_out += t.bytes_out;
            s.refusals += t.refusals;
        }
    }
}

impl Traffic {
    fn between(a: &NodeTraffic, b: &NodeTraffic) -> Option<Traffic> {
        Some(Traffic {
            ops_in: b.ops(&OPS_IN).checked_sub(a.ops(&OPS_IN))?,
            ops_out: b.ops(&OPS_OUT).checked_sub(a.ops(&OPS_OUT))?,
            bytes_in: b.bytes_in.checked_sub(a.bytes_in)?,
            bytes_out: b.bytes_out.checked_sub(a.bytes_out)?,
            refusals: b.refused().checked_sub(a.refused())?,
        })
    }
}

impl Rates {
    fn add(&mut self, o: &Rates) {
        self.evictions += o.evictions;
        self.ops_in += o.ops_in;
        self.ops_out += o.ops_out;
        self.bytes_in += o.bytes_in;
        self.bytes_out += o.bytes_out;
        self.refusals += o.refusals;
    }
}

/// A node's use as JSON fields (nulls when it did not answer).
fn use_json(u: Option<&Use>) -> Value {
    json!({
        "used_bytes": u.map(|u| u.used),
        "capacity": u.map(|u| u.capacity),
        "objects": u.map(|u| u.objects),
        "disk": u.and_then(|u| u.disk).map(|[bytes, capacity, objects]| json!({
            "bytes": bytes,
            "capacity": capacity,
            "objects": objects,
        })),
    })
}

/// Adds `interval_s`, `hit_rate`, `counts` and `per_second` to `v` (nulls without counts;
/// the traffic fields null from a node without `Traffic`).
fn add_moved_json(v: &mut Value, m: Option<&Moved>, r: Option<Rates>) {
    v["interval_s"] = json!(m.map(|m| m.seconds));
    v["hit_rate"] = json!(m.and_then(Moved::hit_rate));
    v["counts"] = match m {
        None => Value::Null,
        Some(m) => {
            let t = m.traffic;
            json!({
                "hits": m.hits,
                "misses": m.misses,
                "evictions": m.evictions,
                "ops_in": t.map(|t| t.ops_in),
                "ops_out": t.map(|t| t.ops_out),
                "bytes_in": t.map(|t| t.bytes_in),
                "bytes_out": t.map(|t| t.bytes_out),
                "refusals": t.map(|t| t.refusals),
            })
        }
    };
    v["per_second"] = match (m, r) {
        (Some(m), Some(r)) => {
            let known = m.traffic.is_some();
            let t = |x: f64| known.then_some(x);
            json!({
                "evictions": r.evictions,
                "ops_in": t(r.ops_in),
                "ops_out": t(r.ops_out),
                "bytes_in": t(r.bytes_in),
                "bytes_out": t(r.bytes_out),
                "refusals": t(r.refusals),
            })
        }
        _ => Value::Null,
    };
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kvpool::placement::NodeInfo;
    use kvpool::pool::PoolStats;
    use kvpool::protocol::{NodeTraffic, OpCount};

    use super::*;

    fn answer(hits: u64, misses: u64, puts: u64, bytes_in: u64) -> Answer {
        Answer {
            stats: PoolStats {
                node: 0,
                segments: vec![],
                namespaces: vec![],
                objects: puts,
                pending: 0,
                hits,
                misses,
                evictions: 0,
                commits: puts,
                reaped: 0,
            },
            traffic: Some(NodeTraffic {
                operations: vec![OpCount {
                    op: "put".into(),
                    ok: puts,
                    error: 0,
                }],
                bytes_in,
                ..NodeTraffic::default()
            }),
            disk: None,
        }
    }

    fn sample(at: Instant, nodes: Vec<(u32, Result<Answer, String>)>) -> Sample {
        Sample {
            version: 1,
            nodes: nodes
                .into_iter()
                .map(|(id, answer)| NodeSample {
                    info: NodeInfo::serving(id, 1),
                    at,
                    answer,
                })
                .collect(),
        }
    }

    #[test]
    fn counts_rates_and_totals_between_two_polls() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(2);
        let prev = sample(
            t0,
            vec![(0, Ok(answer(1, 1, 10, 100))), (1, Ok(answer(0, 0, 0, 0)))],
        );
        let cur = sample(
            t1,
            vec![(0, Ok(answer(7, 3, 30, 500))), (1, Ok(answer(2, 0, 4, 40)))],
        );
        let f = Frame::new(&prev, &cur);
        let m = f.rows[0].moved.unwrap();
        assert_eq!((m.hits, m.misses), (6, 2));
        assert_eq!(m.hit_rate(), Some(0.75));
        let t = m.traffic.unwrap();
        assert_eq!((t.ops_in, t.bytes_in), (20, 400));
        assert_eq!(m.rates().ops_in, 10.0);
        assert_eq!(f.totals.up, 2);
        let tt = f.totals.moved.traffic.unwrap();
        assert_eq!((tt.ops_in, tt.bytes_in), (24, 440));
        assert_eq!(f.totals.rates.ops_in, 12.0);
        assert_eq!(f.totals.moved.hit_rate(), Some(0.8));
        assert_eq!(f.totals.now.objects, 34);
    }

    #[test]
    fn a_node_that_restarted_or_did_not_answer_has_no_counts() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let prev = sample(
            t0,
            vec![(0, Ok(answer(9, 0, 9, 9))), (1, Ok(answer(0, 0, 0, 0)))],
        );
        let cur = sample(
            t1,
            vec![(0, Ok(answer(1, 0, 1, 1))), (1, Err("refused".into()))],
        );
        let f = Frame::new(&prev, &cur);
        assert!(f.rows[0].moved.is_none(), "its counters went back");
        assert!(f.rows[0].now.is_some());
        assert_eq!(f.rows[1].state, "down");
        assert!(f.rows[1].now.is_none() && f.rows[1].moved.is_none());
        assert_eq!((f.totals.nodes, f.totals.up), (2, 1));
        let j = f.to_json(0);
        assert!(j["totals"]["counts"].is_null(), "{j}");
        assert_eq!(j["nodes"][1]["error"], "refused");

        let mut away = sample(
            t1,
            vec![(0, Ok(answer(1, 0, 1, 1))), (1, Err("restarting".into()))],
        );
        away.nodes[1].info.state = NodeState::Restarting;
        let f = Frame::new(&prev, &away);
        assert_eq!(f.rows[1].state, "restarting", "away, not down");
        assert_eq!((f.totals.nodes, f.totals.up), (2, 1));
    }
}
