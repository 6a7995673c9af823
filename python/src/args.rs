//! Arguments as Python passes them, checked: keys (`str` or `bytes`, 1 to
//! [`kvpool::MAX_KEY_LEN`] bytes), durations in seconds, and addresses `_reserve` returned.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::errors::{Failure, InvalidArgumentError};

/// The bytes of a key: a `str` (its UTF-8) or `bytes`.
pub(crate) fn key_of(ob: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = ob.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(s) = ob.cast::<PyString>() {
        return Ok(s.to_cow()?.into_owned().into_bytes());
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "a key is str or bytes, not {}",
        ob.get_type().name()?
    )))
}

pub(crate) fn keys_of(obs: &[Bound<'_, PyAny>]) -> PyResult<Vec<Vec<u8>>> {
    obs.iter().map(key_of).collect()
}

pub(crate) fn check_key(key: &[u8]) -> Result<(), Failure> {
    if key.is_empty() || key.len() > kvpool::MAX_KEY_LEN {
        return Err(Failure::BadKey(key.len()));
    }
    Ok(())
}

pub(crate) fn checked_key(ob: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let k = key_of(ob)?;
    check_key(&k)?;
    Ok(k)
}

pub(crate) fn checked_keys(obs: &[Bound<'_, PyAny>]) -> PyResult<Vec<Vec<u8>>> {
    obs.iter().map(checked_key).collect()
}

/// `v` seconds as a duration (at most 1e9 s), or an `InvalidArgumentError` naming `what`
/// when `v` is negative or not finite.
pub(crate) fn seconds(what: &str, v: f64) -> PyResult<Duration> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(InvalidArgumentError::new_err(format!(
            "{what} must be a finite number of seconds, at least 0"
        )));
    }
    Ok(Duration::from_secs_f64(v.min(1e9)))
}

/// An address `_reserve` returned.
pub(crate) fn reserved(address: &[u8]) -> PyResult<kvpool::GlobalAddr> {
    kvpool::GlobalAddr::from_bytes(address)
        .ok_or_else(|| InvalidArgumentError::new_err("not an address from reserve()"))
}
