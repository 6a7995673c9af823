//! `batch_get_scatter`: each value scattered over several registered buffers. A batch is taken
//! in steps: the keys whose pieces may be written are admitted, located (one lookup round trip
//! per node), copied from the node's memory where it is mapped on this host, and fetched over
//! the socket where it is not.

use kvpool_client::{blocking, ClientError, Located};
use pyo3::prelude::*;

use crate::args::check_key;
use crate::client::NativeClient;
use crate::errors::{code, Failure};
use crate::fetch::get_scattered;
use crate::memory::{overlaps, slice_mut, Range};

/// A same-host scatter batch of at least this many bytes is copied on every core.
const SCATTER_PARALLEL_MIN: u64 = 8 << 20;

impl NativeClient {
    /// `batch_get_scatter`'s statuses: per key the value's length or a negative status.
    pub(crate) fn get_scatter_batch(
        &self,
        py: Python<'_>,
        keys: &[Vec<u8>],
        pieces: &[Vec<Range>],
    ) -> Vec<i64> {
        let n = keys.len();
        let c = match self.batch_client(n, pieces.len(), n) {
            Ok(c) => c,
            Err(codes) => return codes,
        };
        let mut out = vec![code::OK; n];
        let ok = self.admit_scattered(keys, pieces, &mut out);
        let sub_keys: Vec<&[u8]> = ok.iter().map(|&i| &keys[i][..]).collect();
        let located = match py.detach(|| c.lease(&sub_keys, 0)) {
            Ok(l) => l,
            Err(e) => {
                let status = Failure::from(e).code();
                ok.iter().for_each(|&i| out[i] = status);
                return out;
            }
        };
        let jobs: Vec<(usize, &Located)> = ok
            .iter()
            .zip(&located)
            .filter_map(|(&i, found)| match found {
                Some(loc) => Some((i, loc)),
                None => {
                    out[i] = code::OBJECT_NOT_FOUND;
                    None
                }
            })
            .collect();
        // SAFETY: every admitted key's pieces lie inside registrations (memory the caller keeps
        // valid and writable for the call) and overlap no other piece of any key.
        let copied = unsafe { copy_local(py, &c, pieces, &jobs) };
        let mut remote = Vec::new();
        for (i, status) in copied {
            match status {
                Some(st) => out[i] = st,
                None => remote.push(i),
            }
        }
        if !remote.is_empty() {
            // SAFETY: as above: the keys left to fetch were admitted.
            unsafe { fetch_remote(py, &c, keys, pieces, &remote, &mut out) };
        }
        out
    }

    /// The keys of a scatter batch that may be fetched: a valid key whose pieces lie inside
    /// registrations and overlap no other piece of any key. Every other key gets its status in
    /// `out`.
    fn admit_scattered(
        &self,
        keys: &[Vec<u8>],
        pieces: &[Vec<Range>],
        out: &mut [i64],
    ) -> Vec<usize> {
        let flat: Vec<Range> = pieces.iter().flatten().copied().collect();
        let overlapping = overlaps(&flat);
        let mut ok = Vec::with_capacity(keys.len());
        let mut at = 0;
        for (i, key) in keys.iter().enumerate() {
            let mine = at..at + pieces[i].len();
            at = mine.end;
            let bad_piece = pieces[i]
                .iter()
                .any(|&(p, len)| len > 0 && self.check_registered(p, len).is_err());
            out[i] = if let Err(f) = check_key(key) {
                f.code()
            } else if bad_piece || overlapping[mine].iter().any(|o| *o) {
                code::INVALID_PARAMS
            } else {
                ok.push(i);
                continue;
            };
        }
        ok
    }
}

/// Copies each located value from the node's memory straight into its key's pieces, checked
/// against its checksum in the same pass, on every core when the batch is large (as
/// `batch_get_into`'s): per key its status, or None when its node is not mapped here.
///
/// # Safety
/// The pieces of every key of `jobs` must be writable memory that stays valid for the call, and
/// overlap no other piece of any key.
unsafe fn copy_local(
    py: Python<'_>,
    c: &blocking::Client,
    pieces: &[Vec<Range>],
    jobs: &[(usize, &Located)],
) -> Vec<(usize, Option<i64>)> {
    let copy = |part: &[(usize, &Located)]| -> Vec<(usize, Option<i64>)> {
        part.iter()
            .map(|&(i, loc)| {
                // SAFETY: the function's contract; each key is handled by one thread only.
                let mut dsts = unsafe { piece_slices(&pieces[i]) };
                let status = c
                    .read_local_verified_scatter(loc, &mut dsts)
                    .map(|r| match r {
                        Ok(len) => len as i64,
                        Err(ClientError::BufferTooSmall { .. }) => code::INVALID_PARAMS,
                        Err(e) => Failure::from(e).code(),
                    });
                (i, status)
            })
            .collect()
    };
    let bytes: u64 = jobs.iter().map(|j| j.1.addr.len).sum();
    let threads = if bytes < SCATTER_PARALLEL_MIN {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(jobs.len())
            .max(1)
    };
    py.detach(|| {
        if threads == 1 {
            return copy(jobs);
        }
        std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .chunks(jobs.len().div_ceil(threads))
                .map(|part| (part, s.spawn(|| copy(part))))
                .collect();
            let mut all = Vec::new();
            for (part, h) in handles {
                // A copying thread that panicked: its keys failed (their pieces may be
                // half-written, as after any failed load).
                all.extend(h.join().unwrap_or_else(|_| {
                    part.iter()
                        .map(|&(i, _)| (i, Some(code::INTERNAL_ERROR)))
                        .collect()
                }));
            }
            all
        })
    })
}

/// Fetches the keys of `remote` (not mapped on this host, or the mapping off) in one batch,
/// each value received from the socket straight into its pieces and hashed as it arrives, and
/// sets their statuses in `out`: a value whose length is not its pieces' is -600.
///
/// # Safety
/// As [`copy_local`]'s, for the keys of `remote`.
unsafe fn fetch_remote(
    py: Python<'_>,
    c: &blocking::Client,
    keys: &[Vec<u8>],
    pieces: &[Vec<Range>],
    remote: &[usize],
    out: &mut [i64],
) {
    let rkeys: Vec<&[u8]> = remote.iter().map(|&i| &keys[i][..]).collect();
    let mut dsts: Vec<Vec<&mut [u8]>> = remote
        .iter()
        // SAFETY: the function's contract.
        .map(|&i| unsafe { piece_slices(&pieces[i]) })
        .collect();
    let want: Vec<usize> = remote
        .iter()
        .map(|&i| pieces[i].iter().map(|p| p.1).sum())
        .collect();
    match get_scattered(py, c, &rkeys, &mut dsts) {
        Ok(got) => {
            for ((&i, g), &want) in remote.iter().zip(got).zip(&want) {
                out[i] = match g {
                    Err(Failure::Client(ClientError::BufferTooSmall { .. })) => {
                        code::INVALID_PARAMS
                    }
                    Err(f) => f.code(),
                    Ok(Some(len)) if len == want => len as i64,
                    Ok(Some(_)) => code::INVALID_PARAMS,
                    Ok(None) => code::OBJECT_NOT_FOUND,
                };
            }
        }
        Err(f) => {
            let status = f.code();
            remote.iter().for_each(|&i| out[i] = status);
        }
    }
}

/// The writable slices of one key's pieces.
///
/// # Safety
/// Every piece must be writable memory that stays valid while the slices live and that nothing
/// else accesses meanwhile.
unsafe fn piece_slices<'a>(pieces: &[Range]) -> Vec<&'a mut [u8]> {
    pieces
        .iter()
        // SAFETY: the function's contract.
        .map(|&(p, len)| unsafe { slice_mut(p, len) })
        .collect()
}
