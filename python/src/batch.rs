//! The Mooncake-compatible batch calls on registered memory (`batch_get_into`,
//! `batch_put_from`): each key checked on its own, the valid ones sent in one batch (one round
//! trip per node), and one status code per key.

use pyo3::prelude::*;

use crate::client::NativeClient;
use crate::errors::{code, item_code, Failure};
use crate::fetch::get_many;
use crate::memory::{overlaps, slice_ref, Range};

impl NativeClient {
    /// `batch_get_into`'s statuses: per key the value's length or a negative status.
    pub(crate) fn get_into_batch(
        &self,
        py: Python<'_>,
        keys: &[Vec<u8>],
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> Vec<i64> {
        let c = match self.batch_client(keys.len(), buffer_ptrs.len(), sizes.len()) {
            Ok(c) => c,
            Err(codes) => return codes,
        };
        let ranges: Vec<Range> = buffer_ptrs.into_iter().zip(sizes).collect();
        let mut out = vec![code::OK; keys.len()];
        let mut ok = Vec::with_capacity(keys.len());
        let overlapping = overlaps(&ranges);
        for (i, key) in keys.iter().enumerate() {
            let (p, n) = ranges[i];
            out[i] = match self.item_status(key, p, n) {
                code::OK if overlapping[i] => code::INVALID_PARAMS,
                code::OK => {
                    ok.push(i);
                    continue;
                }
                status => status,
            };
        }
        let sub_keys: Vec<&[u8]> = ok.iter().map(|&i| &keys[i][..]).collect();
        let sub_ranges: Vec<Range> = ok.iter().map(|&i| ranges[i]).collect();
        // SAFETY: every range lies inside a registration (checked above) and no two overlap.
        match unsafe { get_many(py, &c, &sub_keys, &sub_ranges) } {
            Ok(got) => {
                for (&i, g) in ok.iter().zip(got) {
                    out[i] = match g {
                        Ok(Some(n)) => n as i64,
                        Ok(None) => code::OBJECT_NOT_FOUND,
                        Err(f) => f.code(),
                    };
                }
            }
            Err(f) => ok.iter().for_each(|&i| out[i] = f.code()),
        }
        out
    }

    /// `batch_put_from`'s statuses: per key 0 when stored, negative otherwise.
    pub(crate) fn put_from_batch(
        &self,
        py: Python<'_>,
        keys: &[Vec<u8>],
        buffer_ptrs: &[usize],
        sizes: &[usize],
    ) -> Vec<i64> {
        let c = match self.batch_client(keys.len(), buffer_ptrs.len(), sizes.len()) {
            Ok(c) => c,
            Err(codes) => return codes,
        };
        let mut out = vec![code::OK; keys.len()];
        let mut items: Vec<(&[u8], &[u8])> = Vec::with_capacity(keys.len());
        let mut sent = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            let (p, n) = (buffer_ptrs[i], sizes[i]);
            out[i] = self.item_status(key, p, n);
            if out[i] == code::OK {
                // SAFETY: inside a registration (item_status checked it); only read.
                items.push((key, unsafe { slice_ref(p, n) }));
                sent.push(i);
            }
        }
        match py.detach(|| c.batch_put_from(&items)) {
            Ok(codes) => {
                for (&i, c) in sent.iter().zip(codes) {
                    out[i] = item_code(c);
                }
            }
            Err(e) => {
                let f = Failure::from(e).code();
                sent.iter().for_each(|&i| out[i] = f);
            }
        }
        out
    }
}
