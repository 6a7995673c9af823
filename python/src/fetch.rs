//! Values fetched into buffers the caller owns, for every call of the extension that reads into
//! memory it was given: one buffer per key or several, each key's own failure apart from the
//! batch's.

use kvpool_client::blocking;
use pyo3::prelude::*;

use crate::errors::Failure;
use crate::memory::{slice_mut, Range};

/// Per key its length, None for a miss, or its own failure.
pub(crate) type Got = Vec<Result<Option<usize>, Failure>>;

/// Fetches `keys[i]` into `ranges[i]` ([`get_scattered`] with one buffer per key).
///
/// # Safety
/// Every range must be writable memory that stays valid for the call, and no two may overlap.
pub(crate) unsafe fn get_many(
    py: Python<'_>,
    c: &blocking::Client,
    keys: &[&[u8]],
    ranges: &[Range],
) -> Result<Got, Failure> {
    let mut dsts: Vec<Vec<&mut [u8]>> = ranges
        .iter()
        // SAFETY: the caller's contract.
        .map(|&(a, n)| vec![unsafe { slice_mut(a, n) }])
        .collect();
    get_scattered(py, c, keys, &mut dsts)
}

/// Fetches `keys[i]` into `dsts[i]` (its buffers, filled in order): per key its length, None
/// for a miss, or its own failure; a failure of the whole batch (the node unreachable) is the
/// outer error. On a batch refused because one key's buffers are too small, each key is
/// fetched alone, so every other key still gets its value and the small one its own error.
pub(crate) fn get_scattered(
    py: Python<'_>,
    c: &blocking::Client,
    keys: &[&[u8]],
    dsts: &mut [Vec<&mut [u8]>],
) -> Result<Got, Failure> {
    match py.detach(|| c.batch_get_scatter(keys, dsts)) {
        Ok(got) => Ok(got.into_iter().map(Ok).collect()),
        Err(kvpool_client::ClientError::BufferTooSmall { .. }) => Ok(keys
            .iter()
            .zip(dsts.iter_mut())
            .map(|(k, d)| {
                py.detach(|| c.batch_get_scatter(&[k], std::slice::from_mut(d)))
                    .map(|mut g| g.pop().flatten())
                    .map_err(Failure::from)
            })
            .collect()),
        Err(e) => Err(e.into()),
    }
}
