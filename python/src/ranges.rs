//! Mooncake Store's size and ranged reads (`get_size`, `get_into_ranges`) on kvpool's whole
//! verified values: a range is cut from a value fetched and checked against its checksum, so a
//! range read never returns bytes the value's checksum did not cover.

use std::collections::HashMap;

use pyo3::prelude::*;

use crate::args::check_key;
use crate::client::NativeClient;
use crate::errors::{code, Failure};
use crate::fetch::get_scattered;
use crate::memory::slice_mut;

/// `get_into_ranges`'s plan for one destination buffer: its keys, and per key the fragments'
/// destination offsets, source offsets and sizes.
pub(crate) struct RangePlan {
    pub(crate) buffer_ptrs: Vec<usize>,
    pub(crate) keys: Vec<Vec<Vec<u8>>>,
    pub(crate) dst_offsets: Vec<Vec<Vec<usize>>>,
    pub(crate) src_offsets: Vec<Vec<Vec<usize>>>,
    pub(crate) sizes: Vec<Vec<Vec<usize>>>,
}

/// Each key's value length, None for a miss: one lookup round trip per node, no lease.
fn lengths(
    py: Python<'_>,
    c: &kvpool_client::blocking::Client,
    keys: &[&[u8]],
) -> Result<Vec<Option<usize>>, Failure> {
    let found = py.detach(|| c.lease(keys, 0))?;
    Ok(found
        .into_iter()
        .map(|l| l.map(|l| l.addr.len as usize))
        .collect())
}

/// Per buffer, per key, per fragment: the bytes read or a negative status.
pub(crate) type RangeResults = Vec<Vec<Vec<i64>>>;

impl RangePlan {
    /// Whether buffer `i`'s lists have one entry per key, and key `j`'s one per fragment.
    fn shaped(&self, i: usize, j: usize) -> bool {
        let n = self.sizes[i][j].len();
        self.dst_offsets[i][j].len() == n && self.src_offsets[i][j].len() == n
    }

    /// The results' shape, every entry `status`: as many fragments per key as it has sizes.
    fn filled(&self, status: i64) -> RangeResults {
        (0..self.keys.len())
            .map(|i| {
                (0..self.keys[i].len())
                    .map(|j| {
                        vec![status; self.sizes.get(i).and_then(|s| s.get(j)).map_or(0, Vec::len)]
                    })
                    .collect()
            })
            .collect()
    }

    /// Whether the top-level lists and each buffer's lists have matching lengths.
    fn top_shaped(&self) -> bool {
        let n = self.buffer_ptrs.len();
        [
            self.keys.len(),
            self.dst_offsets.len(),
            self.src_offsets.len(),
            self.sizes.len(),
        ]
        .iter()
        .all(|&l| l == n)
            && (0..n).all(|i| {
                let k = self.keys[i].len();
                [
                    self.dst_offsets[i].len(),
                    self.src_offsets[i].len(),
                    self.sizes[i].len(),
                ]
                .iter()
                .all(|&l| l == k)
            })
    }
}

impl NativeClient {
    /// `get_size`: the value's length, or a negative status (-704 not found, -400 bad key,
    /// -900 unreachable). A value on the node's disk tier is found (and brought up) too.
    pub(crate) fn size_of(&self, py: Python<'_>, key: &[u8]) -> i64 {
        let run = || -> Result<i64, Failure> {
            check_key(key)?;
            let c = self.client()?;
            match lengths(py, &c, &[key])?.into_iter().next().flatten() {
                Some(len) => Ok(len as i64),
                None => Err(Failure::NotFound),
            }
        };
        run().unwrap_or_else(|f| f.code())
    }

    /// `get_into_ranges`: each distinct key's value is fetched once (one round trip per node),
    /// verified, and its fragments copied into the registered destination buffers. A fragment
    /// whose key is missing is -704; one outside its value or outside a registered buffer, or
    /// of a key whose lists differ in length, is -600; a bad key is -400.
    pub(crate) fn get_ranges(&self, py: Python<'_>, plan: &RangePlan) -> RangeResults {
        if !plan.top_shaped() {
            return plan.filled(code::INVALID_PARAMS);
        }
        let c = match self.client() {
            Ok(c) => c,
            Err(f) => return plan.filled(f.code()),
        };
        let mut distinct: Vec<&[u8]> = Vec::new();
        let mut index: HashMap<&[u8], usize> = HashMap::new();
        for key in plan.keys.iter().flatten() {
            if check_key(key).is_ok() && !index.contains_key(&key[..]) {
                index.insert(key, distinct.len());
                distinct.push(key);
            }
        }
        let values = match self.fetch_whole(py, &c, &distinct) {
            Ok(v) => v,
            Err(f) => return plan.filled(f.code()),
        };
        let mut out = plan.filled(code::OK);
        for (i, keys) in plan.keys.iter().enumerate() {
            for (j, key) in keys.iter().enumerate() {
                let value = index.get(&key[..]).map(|&d| &values[d]);
                for k in 0..out[i][j].len() {
                    out[i][j][k] = self.copy_fragment(plan, (i, j, k), key, value);
                }
            }
        }
        out
    }

    /// The whole values of `keys`, verified: per key its bytes, or the status of its failure.
    fn fetch_whole(
        &self,
        py: Python<'_>,
        c: &kvpool_client::blocking::Client,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<Vec<u8>, i64>>, Failure> {
        let lens = lengths(py, c, keys)?;
        let mut bufs: Vec<Vec<u8>> = lens.iter().map(|l| vec![0; l.unwrap_or(0)]).collect();
        let found: Vec<usize> = (0..keys.len()).filter(|&i| lens[i].is_some()).collect();
        let sub: Vec<&[u8]> = found.iter().map(|&i| keys[i]).collect();
        let mut dsts: Vec<Vec<&mut [u8]>> = Vec::with_capacity(found.len());
        let mut by_index: Vec<Option<&mut Vec<u8>>> = bufs.iter_mut().map(Some).collect();
        for &i in &found {
            let b = by_index[i].take().expect("each key is fetched once");
            dsts.push(vec![&mut b[..]]);
        }
        let got = get_scattered(py, c, &sub, &mut dsts)?;
        drop(dsts);
        let mut out: Vec<Result<Vec<u8>, i64>> =
            lens.iter().map(|_| Err(code::OBJECT_NOT_FOUND)).collect();
        for (&i, g) in found.iter().zip(got) {
            out[i] = match g {
                Ok(Some(n)) => {
                    let mut v = std::mem::take(&mut bufs[i]);
                    v.truncate(n);
                    Ok(v)
                }
                Ok(None) => Err(code::OBJECT_NOT_FOUND),
                Err(f) => Err(f.code()),
            };
        }
        Ok(out)
    }

    /// Copies fragment `(i, j, k)` of `plan` out of `value` (key `key`'s), or its status.
    fn copy_fragment(
        &self,
        plan: &RangePlan,
        (i, j, k): (usize, usize, usize),
        key: &[u8],
        value: Option<&Result<Vec<u8>, i64>>,
    ) -> i64 {
        if check_key(key).is_err() {
            return code::INVALID_KEY;
        }
        if !plan.shaped(i, j) {
            return code::INVALID_PARAMS;
        }
        let value = match value {
            Some(Ok(v)) => v,
            Some(Err(status)) => return *status,
            None => return code::OBJECT_NOT_FOUND,
        };
        let (src, size) = (plan.src_offsets[i][j][k], plan.sizes[i][j][k]);
        let Some(bytes) = src.checked_add(size).and_then(|end| value.get(src..end)) else {
            return code::INVALID_PARAMS;
        };
        let Some(dst) = plan.buffer_ptrs[i].checked_add(plan.dst_offsets[i][j][k]) else {
            return code::INVALID_PARAMS;
        };
        if size > 0 && self.check_registered(dst, size).is_err() {
            return code::INVALID_PARAMS;
        }
        // SAFETY: `dst..dst + size` lies inside a registration (checked just above), whose
        // owner promised the memory is valid and writable while it is registered
        // (register_buffer's contract); `bytes` is this call's own buffer, so they are apart.
        unsafe { slice_mut(dst, size) }.copy_from_slice(bytes);
        size as i64
    }
}
