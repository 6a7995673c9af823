//! The caller's memory as the pointer-based calls see it: ranges given as (address, length),
//! checked for overlap, and turned into slices only where a registration or an exported buffer
//! vouches for them.

use pyo3::prelude::*;

use crate::errors::InvalidArgumentError;

/// A destination or source range: an address and a length.
pub(crate) type Range = (usize, usize);

/// For each range, whether it overlaps another one (empty ranges overlap nothing).
pub(crate) fn overlaps(ranges: &[Range]) -> Vec<bool> {
    let mut order: Vec<usize> = (0..ranges.len()).filter(|&i| ranges[i].1 > 0).collect();
    order.sort_unstable_by_key(|&i| ranges[i].0);
    let mut out = vec![false; ranges.len()];
    // The furthest end so far and the range that reaches it.
    let mut reach: Option<(usize, usize)> = None;
    for &i in &order {
        let (start, len) = ranges[i];
        let end = start.saturating_add(len);
        if let Some((far, j)) = reach {
            if start < far {
                out[i] = true;
                out[j] = true;
            }
            if end > far {
                reach = Some((end, i));
            }
        } else {
            reach = Some((end, i));
        }
    }
    out
}

/// xxh3-64 of `len` bytes at `ptr`. Private: the caller (`kvpool.checksum`) holds the buffer
/// exported for the call.
#[pyfunction]
pub(crate) fn _checksum_unchecked(py: Python<'_>, ptr: usize, len: usize) -> PyResult<u64> {
    if len > 0 && (ptr == 0 || len > isize::MAX as usize || ptr.checked_add(len).is_none()) {
        return Err(InvalidArgumentError::new_err("bad buffer"));
    }
    // SAFETY: the caller holds `ptr..ptr+len` exported for the call; checked above.
    let data = unsafe { slice_ref(ptr, len) };
    Ok(py.detach(|| kvpool::checksum(data)))
}

/// `len` writable bytes at `addr` (an empty slice for `len == 0`, whatever `addr`).
///
/// # Safety
/// For `len > 0`, `addr..addr + len` must be valid, writable memory that nothing else accesses
/// while the slice lives, and `len <= isize::MAX`.
pub(crate) unsafe fn slice_mut<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the function's contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

/// `len` readable bytes at `addr` (an empty slice for `len == 0`).
///
/// # Safety
/// For `len > 0`, `addr..addr + len` must be valid, readable memory for the slice's life, and
/// `len <= isize::MAX`.
pub(crate) unsafe fn slice_ref<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the function's contract.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}
