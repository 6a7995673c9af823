//! The verdict: whether the daemon's gauges stayed flat after the warm-up.

use std::sync::atomic::Ordering::Relaxed;

use serde_json::json;

use super::sample::{mib, Observed, Sample};

/// Flatness thresholds (stated in the report).
const RSS_FRACTION: f64 = 0.02;
const RSS_SLACK: f64 = 16.0 * 1048576.0;
const FD_RANGE: f64 = 16.0;
const FD_DRIFT: f64 = 8.0;
const PENDING_DRIFT_FRACTION: f64 = 0.25;

/// A gauge over the judged samples: its spread, its least-squares slope, and the verdict.
pub(super) struct Judged {
    pub(super) name: &'static str,
    pub(super) min: f64,
    pub(super) max: f64,
    mean: f64,
    /// Per minute.
    pub(super) slope: f64,
    /// Slope times the judged window.
    drift: f64,
    /// None: only the drift is judged.
    range_limit: Option<f64>,
    drift_limit: f64,
    pub(super) flat: bool,
    pub(super) rule: String,
}

fn judge(
    name: &'static str,
    points: &[(f64, f64)],
    range_limit: Option<f64>,
    drift_limit: f64,
    rule: String,
) -> Judged {
    let n = points.len() as f64;
    let mean_t = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_t).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_t) * (p.1 - mean)).sum();
    let slope_s = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let window = points.last().map_or(0.0, |p| p.0) - points.first().map_or(0.0, |p| p.0);
    let min = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let max = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let drift = slope_s * window;
    Judged {
        name,
        min,
        max,
        mean,
        slope: slope_s * 60.0,
        drift,
        range_limit,
        drift_limit,
        flat: range_limit.is_none_or(|l| max - min <= l) && drift.abs() <= drift_limit,
        rule,
    }
}

impl Judged {
    pub(super) fn json(&self) -> serde_json::Value {
        json!({
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "range": self.max - self.min,
            "slope_per_min": self.slope,
            "drift": self.drift,
            "range_limit": self.range_limit,
            "drift_limit": self.drift_limit,
            "flat": self.flat,
            "rule": self.rule,
        })
    }
}

/// The verdicts over the samples from the warm-up on.
pub(super) struct Verdicts {
    /// Samples before this many seconds are not judged.
    pub(super) warmup: f64,
    pub(super) rss: Judged,
    pub(super) rss_anon: Judged,
    pub(super) fds: Judged,
    pub(super) pending: Judged,
    /// The pending allocations fell to at most one per client once the load stopped.
    pub(super) drained: bool,
    pub(super) wrong: u64,
    pub(super) met: bool,
}

impl Verdicts {
    pub(super) fn of(o: &Observed<'_>) -> Verdicts {
        let args = o.args;
        let warmup = (args.warmup as f64).min(o.duration.as_secs_f64() / 2.0);
        let judged: Vec<&Sample> = o.samples.iter().filter(|s| s.t_s >= warmup - 0.5).collect();
        let pts = |f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
            judged.iter().map(|s| (s.t_s, f(s))).collect()
        };
        let rss_limit = RSS_FRACTION * args.memory as f64 + RSS_SLACK;
        let rss = judge(
            "RSS",
            &pts(&|s| s.rss as f64),
            Some(rss_limit),
            rss_limit,
            format!(
                "max-min and slope x window each <= 2% of the pool + 16 MiB ({})",
                mib(rss_limit)
            ),
        );
        let rss_anon = judge(
            "RssAnon",
            &pts(&|s| s.rss_anon as f64),
            Some(rss_limit),
            rss_limit,
            "as RSS (the heap alone; informative)".into(),
        );
        let fds = judge(
            "open fds",
            &pts(&|s| s.fds as f64),
            Some(FD_RANGE),
            FD_DRIFT,
            format!("max-min <= {FD_RANGE}, |slope x window| <= {FD_DRIFT}"),
        );
        let pend_pts = pts(&|s| s.pending);
        let pend_mean = pend_pts.iter().map(|p| p.1).sum::<f64>() / pend_pts.len() as f64;
        let pend_drift = PENDING_DRIFT_FRACTION * pend_mean + args.clients as f64;
        let mut pending = judge(
            "pending allocations",
            &pend_pts,
            None,
            pend_drift,
            format!(
                "|slope x window| <= 25% of the mean + clients ({pend_drift:.0}), and <= clients ({}) \
                 once the load stops, within pending_timeout_ms + 10 s",
                args.clients
            ),
        );
        let drained = o.after.pending <= args.clients as f64;
        pending.flat &= drained;
        let wrong = o.stats.wrong.load(Relaxed);
        let met = [&rss, &fds, &pending].iter().all(|j| j.flat) && wrong == 0;
        Verdicts {
            warmup,
            rss,
            rss_anon,
            fds,
            pending,
            drained,
            wrong,
            met,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steady_gauge_is_flat_and_a_growing_one_is_not() {
        let steady: Vec<(f64, f64)> = (0..10).map(|i| (i as f64 * 10.0, 100.0)).collect();
        assert!(judge("x", &steady, Some(1.0), 1.0, String::new()).flat);
        let growing: Vec<(f64, f64)> = (0..10).map(|i| (i as f64 * 10.0, i as f64)).collect();
        let j = judge("x", &growing, Some(100.0), 1.0, String::new());
        assert!(!j.flat);
        assert!((j.slope - 6.0).abs() < 1e-9);
    }
}
