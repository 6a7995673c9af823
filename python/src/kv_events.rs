//! `kvpool._native.KvEvents`: KV events for cache-aware routers (`Client.events`), batches of
//! keys stored in and removed from each tier of each node, read with the GIL released.

use std::time::Duration;

use kvpool_client::blocking;
use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::args::seconds;
use crate::errors::Failure;

/// How long `__next__` waits between checks for a signal (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(200);

/// A subscription to KV events (`Client.events`): batches as the nodes publish them.
#[pyclass(name = "KvEvents", module = "kvpool._native", frozen)]
pub(crate) struct KvEvents {
    // Field order is drop order: the subscription before the client whose runtime it uses.
    sub: std::sync::Mutex<Option<blocking::KvEvents>>,
    _client: blocking::Client,
}

impl KvEvents {
    /// `sub`, read on `client`'s runtime.
    pub(crate) fn new(sub: blocking::KvEvents, client: blocking::Client) -> Self {
        KvEvents {
            sub: std::sync::Mutex::new(Some(sub)),
            _client: client,
        }
    }

    /// The next batch within `timeout` with the GIL released: None when none came (or the
    /// subscription is closed).
    fn batch(
        &self,
        py: Python<'_>,
        timeout: Duration,
    ) -> PyResult<Option<kvpool_client::KvEventBatch>> {
        let got = py.detach(|| {
            let mut guard = self.sub.lock().unwrap_or_else(|e| e.into_inner());
            guard.as_mut()?.next_within(timeout)
        });
        match got {
            None => Ok(None),
            Some(Ok(b)) => Ok(Some(b)),
            Some(Err(e)) => Err(Failure::from(e).into()),
        }
    }
}

/// A batch as Python sees it: `(node, seq, dropped, [(kind, tier, key), ...])`.
fn to_py<'py>(py: Python<'py>, b: &kvpool_client::KvEventBatch) -> PyResult<Bound<'py, PyTuple>> {
    let events = PyList::empty(py);
    for e in &b.events {
        let t = PyTuple::new(
            py,
            [
                PyString::new(py, e.kind.name()).into_any(),
                PyString::new(py, e.tier.name()).into_any(),
                PyBytes::new(py, &e.key).into_any(),
            ],
        )?;
        events.append(t)?;
    }
    (b.node, b.seq, b.dropped, events).into_pyobject(py)
}

#[pymethods]
impl KvEvents {
    /// The next batch, waiting at most `timeout` seconds: `(node, seq, dropped, events)`, each
    /// event `(kind, tier, key)` with kind "stored", "removed" or "cleared" and tier "dram" or
    /// "disk"; `dropped` > 0 is the lag marker (events were lost: resynchronise). None when
    /// nothing came in time or the subscription is closed.
    fn next<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let timeout = seconds("timeout", timeout)?;
        match self.batch(py, timeout)? {
            Some(b) => Ok(Some(to_py(py, &b)?)),
            None => Ok(None),
        }
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Waits for the next batch (Ctrl-C interrupts); stops once the subscription is closed.
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        loop {
            if self.sub.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
                return Err(PyStopIteration::new_err(()));
            }
            if let Some(b) = self.batch(py, SIGNAL_CHECK)? {
                return to_py(py, &b);
            }
            py.check_signals()?;
        }
    }

    /// Ends the subscription (as dropping it does).
    fn close(&self) {
        self.sub.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}
