//! The probe of the join and drain: 4 KiB gets of the probe's keys, back to back, every byte
//! checked, on the runtime until stopped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use kvpool_client::Client;

use super::data::Data;
use super::{PROBE_KEYS, PROBE_SIZE};
use crate::perf::driver::Measured;

/// What one probe loop saw.
pub(super) struct ProbeOut {
    pub(super) m: Measured,
    /// Gets that found nothing (a pinned object must always be found).
    pub(super) misses: u64,
    /// Gets that failed, and the first error's text.
    pub(super) errors: u64,
    pub(super) first_error: Option<String>,
    /// Distinct probe keys that missed, and the last miss, from the probe's start.
    pub(super) missed_keys: std::collections::BTreeSet<usize>,
    pub(super) last_miss: Option<Duration>,
}

impl ProbeOut {
    /// Where the misses were, for the notes.
    pub(super) fn misses_text(&self) -> String {
        match self.last_miss {
            None => "none".into(),
            Some(t) => format!(
                "{} on {} of the {PROBE_KEYS} keys, the last {:.2} s after the probe's start",
                self.misses,
                self.missed_keys.len(),
                t.as_secs_f64()
            ),
        }
    }
}

/// The probe, running on the runtime until stopped.
pub(super) struct Probe {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<anyhow::Result<ProbeOut>>,
}

impl Probe {
    /// Starts the loop: gets of the probe's keys in turn, back to back, one at a time.
    pub(super) fn start(rt: &tokio::runtime::Runtime, client: &Client, data: &Arc<Data>) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let (c, d, s) = (client.clone(), data.clone(), stop.clone());
        let task = rt.spawn(async move {
            let mut out = ProbeOut {
                m: Measured::empty(),
                misses: 0,
                errors: 0,
                first_error: None,
                missed_keys: Default::default(),
                last_miss: None,
            };
            let began = Instant::now();
            let mut buf = vec![0u8; PROBE_SIZE as usize];
            let mut i = 0usize;
            while !s.load(Ordering::Acquire) {
                let k = i % PROBE_KEYS;
                i += 1;
                let t = Instant::now();
                let got = c.get_into(&d.probe_keys[k], &mut buf).await;
                let ns = t.elapsed().as_nanos().max(1) as u64;
                match got {
                    Ok(Some(n)) => {
                        ensure!(
                            n == buf.len() && buf == d.probe_values[k],
                            "probe: {} returned {n} bytes that are not the value stored",
                            String::from_utf8_lossy(&d.probe_keys[k])
                        );
                        out.m.ops += 1;
                        out.m.bytes += n as u64;
                        out.m.hist.saturating_record(ns);
                    }
                    Ok(None) => {
                        out.misses += 1;
                        out.missed_keys.insert(k);
                        out.last_miss = Some(began.elapsed());
                    }
                    Err(e) => {
                        out.errors += 1;
                        out.first_error.get_or_insert_with(|| e.to_string());
                    }
                }
            }
            out.m.secs = began.elapsed().as_secs_f64();
            Ok(out)
        });
        Probe { stop, task }
    }

    pub(super) fn finish(self, rt: &tokio::runtime::Runtime) -> anyhow::Result<ProbeOut> {
        self.stop.store(true, Ordering::Release);
        rt.block_on(self.task).context("the probe task")?
    }
}
