//! `kvpool._native.Subscription`: a handoff subscription, the keys under a prefix as they are
//! written or failed, read with the GIL released.

use kvpool_client::blocking;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString, PyTuple};

use crate::args::seconds;

/// A handoff subscription (`Client.subscribe`): the keys under a prefix as they are written or
/// failed.
#[pyclass(name = "Subscription", module = "kvpool._native", frozen)]
pub(crate) struct Subscription {
    // Field order is drop order: the subscription before the client whose runtime it uses.
    sub: std::sync::Mutex<Option<kvpool_client::Subscription>>,
    client: blocking::Client,
}

impl Subscription {
    /// `sub`, read on `client`'s runtime.
    pub(crate) fn new(sub: kvpool_client::Subscription, client: blocking::Client) -> Self {
        Subscription {
            sub: std::sync::Mutex::new(Some(sub)),
            client,
        }
    }
}

#[pymethods]
impl Subscription {
    /// The next event, waiting at most `timeout` seconds: `("written", key)`,
    /// `("failed", key, reason)`, `("lagged",)` (events were dropped: look the keys up again),
    /// or None when none came in time or the subscription is closed.
    fn next<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let timeout = seconds("timeout", timeout)?;
        let c = &self.client;
        let ev = py.detach(|| {
            let mut guard = self.sub.lock().unwrap_or_else(|e| e.into_inner());
            let sub = guard.as_mut()?;
            c.block_on(sub.recv_within(timeout))
        });
        let Some(ev) = ev else {
            return Ok(None);
        };
        let t = match ev {
            kvpool_client::KeyEvent::Written(k) => PyTuple::new(
                py,
                [
                    PyString::new(py, "written").into_any(),
                    PyBytes::new(py, &k).into_any(),
                ],
            )?,
            kvpool_client::KeyEvent::Failed(k, reason) => PyTuple::new(
                py,
                [
                    PyString::new(py, "failed").into_any(),
                    PyBytes::new(py, &k).into_any(),
                    PyString::new(py, &reason).into_any(),
                ],
            )?,
            kvpool_client::KeyEvent::Lagged => PyTuple::new(py, [PyString::new(py, "lagged")])?,
        };
        Ok(Some(t))
    }

    /// Ends the subscription (as dropping it does).
    fn close(&self) {
        self.sub.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}
