//! `kvpool._native.Client`: one `kvpool_client::blocking::Client` shared by every Python thread,
//! each call run with the GIL released.
//!
//! Two kinds of call live here. The Mooncake-compatible ones (`get_into`, `put_from`,
//! `batch_get_into`, `batch_put_from`, `register_buffer`, ...) take raw addresses, accept only
//! ranges inside buffers registered with `register_buffer`, and return Mooncake's status codes.
//! The underscored ones are the engine of the Pythonic layer in `kvpool/__init__.py`, which
//! turns buffer-protocol objects into addresses while it holds their buffer exported (so they
//! can be neither freed nor resized meanwhile); they raise `kvpool` exceptions.
//!
//! This file is the class's Python surface; the batch calls on registered memory do their work
//! in `batch.rs` and `scatter.rs`, and arguments are checked by `args.rs` and `memory.rs`.

use std::sync::RwLock;
use std::time::Duration;

use kvpool_client::{blocking, ClientConfig, Prefix, SameHost};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::args::{check_key, checked_key, checked_keys, key_of, keys_of, reserved, seconds};
use crate::errors::{code, item_exception, Failure, InvalidArgumentError};
use crate::fetch::get_many;
use crate::memory::{overlaps, slice_mut, slice_ref, Range};
use crate::registry::Registry;
use crate::subscription::Subscription;

/// A kvpool client. Thread-safe: share one per process.
#[pyclass(name = "Client", module = "kvpool._native", subclass, frozen)]
pub(crate) struct NativeClient {
    /// None once closed.
    inner: RwLock<Option<blocking::Client>>,
    registry: Registry,
    endpoint: String,
}

#[pymethods]
impl NativeClient {
    /// Connects to the node at `endpoint` (`tcp://host:port`, `tls://host:port`,
    /// `quic://host:port`, `fabric://host:port`, `unix:///path` or `host:port`) in `namespace` (default `"default"`) with `token`.
    /// Every call must finish within `timeout` seconds. `same_host=False` turns the same-host
    /// path off (every byte through the endpoint's transport, as from another host).
    /// `priority` (`"background"`, `"low"`, `"normal"`, `"high"`) is this client's share of the
    /// nodes' bulk transfers; with `deadline` (seconds) every call carries a deadline, and a
    /// node refuses at once a bulk transfer it can't finish in time (`TimeoutError`).
    #[new]
    #[pyo3(signature = (endpoint, namespace=None, token=None, timeout=10.0, same_host=true, priority="normal", deadline=None, local_index=65_536, ca=None))]
    #[expect(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn new(
        py: Python<'_>,
        endpoint: String,
        namespace: Option<String>,
        token: Option<String>,
        timeout: f64,
        same_host: bool,
        priority: &str,
        deadline: Option<f64>,
        local_index: usize,
        ca: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        if !(timeout.is_finite() && timeout > 0.0 && timeout < 1e9) {
            return Err(Failure::BadArgument(format!(
                "timeout must be a positive number of seconds, not {timeout}"
            ))
            .into());
        }
        let priority = kvpool_client::Priority::parse(priority).ok_or_else(|| {
            Failure::BadArgument(format!(
                "priority must be background, low, normal or high, not {priority:?}"
            ))
        })?;
        if let Some(d) = deadline.filter(|d| !(d.is_finite() && *d > 0.0 && *d < 1e9)) {
            return Err(Failure::BadArgument(format!(
                "deadline must be a positive number of seconds, not {d}"
            ))
            .into());
        }
        let mut cfg = ClientConfig {
            timeout: Duration::from_secs_f64(timeout),
            client_name: "kvpool-python".into(),
            same_host: if same_host {
                SameHost::Auto
            } else {
                SameHost::Off
            },
            priority,
            deadline: deadline.map(Duration::from_secs_f64),
            local_index,
            ca,
            ..ClientConfig::default()
        };
        if let Some(ns) = namespace {
            cfg.namespace = ns;
        }
        if let Some(t) = token {
            cfg.token = t;
        }
        let client = py
            .detach(|| blocking::Client::connect(&endpoint, cfg))
            .map_err(Failure::from)?;
        Ok(NativeClient {
            inner: RwLock::new(Some(client)),
            registry: Registry::default(),
            endpoint,
        })
    }

    /// The endpoint the client was given.
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    /// True when the same-host path is in use: the node runs on this host and its memory is
    /// mapped into this process, so gets and puts are one copy with no socket per value.
    fn is_local(&self) -> PyResult<bool> {
        Ok(self.client()?.is_local())
    }

    /// How many times a node could not be reached and a request's keys on it were answered as
    /// misses (lookups, gets and prefix matches do that rather than raise). Compare it before
    /// and after a call to tell an unreachable node from a miss.
    fn unreachable_events(&self) -> PyResult<u64> {
        Ok(self.client()?.unreachable_events())
    }

    /// Closes the client: its connections are dropped and its registrations forgotten. Calls
    /// after it fail (`ClosedError`, or status -600). Closing twice is harmless.
    fn _close(&self, py: Python<'_>) {
        let old = self.inner.write().unwrap_or_else(|e| e.into_inner()).take();
        self.registry.clear();
        // Dropping the last handle shuts the client's runtime down: not under the GIL.
        py.detach(move || drop(old));
    }

    /// The statistics of the node the client connected to, per tier: the DRAM pool's
    /// (`objects`, `hits`, `misses`, `evictions`, `segments`, `namespaces`, ...) and, under
    /// `disk`, the disk tier's (None when the node has none): objects and bytes on disk, disk
    /// hits and misses, demotions, promotions, queue drops, bytes read and written, errors.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.client().map_err(Failure::into_py)?;
        let both = py.detach(|| Ok::<_, kvpool_client::ClientError>((c.stats()?, c.disk_stats()?)));
        let (pool, disk) = both.map_err(|e| Failure::Client(e).into_py())?;
        let mut out = serde_json::to_value(&pool).map_err(to_py)?;
        out["disk"] = serde_json::to_value(&disk).map_err(to_py)?;
        py.import("json")?.call_method1("loads", (out.to_string(),))
    }

    /// 0 when the node answers, 1 when the client is closed, 2 when the node can't be
    /// reached within the timeout (Mooncake's convention).
    fn health_check(&self, py: Python<'_>) -> i64 {
        let Ok(c) = self.client() else {
            return 1;
        };
        match py.detach(|| c.stats()) {
            Ok(_) => 0,
            Err(_) => 2,
        }
    }

    // ----- Mooncake-compatible calls on registered memory (status codes) -----

    /// Registers `size` bytes at `buffer_ptr` for `get_into`/`put_from` and their batch
    /// forms. The memory must stay valid until `unregister_buffer` or `close`. Returns 0, or
    /// -600 for a null pointer or a zero size.
    fn register_buffer(&self, buffer_ptr: usize, size: usize) -> i64 {
        if self.client().is_err() {
            return code::INVALID_PARAMS;
        }
        if self.registry.register(buffer_ptr, size) {
            code::OK
        } else {
            code::INVALID_PARAMS
        }
    }

    /// Drops the registration that starts at `buffer_ptr`. Returns 0, or -600 when there is
    /// none.
    fn unregister_buffer(&self, buffer_ptr: usize) -> i64 {
        if self.registry.unregister(buffer_ptr) {
            code::OK
        } else {
            code::INVALID_PARAMS
        }
    }

    /// Copies the value of `key` into the registered memory at `buffer_ptr` (`size` bytes).
    /// Returns the value's length, or a negative status: -704 not found, -10 buffer smaller
    /// than the value, -600 pointer not inside a registered buffer (or client closed), -400
    /// bad key, -900 node unreachable.
    fn get_into(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer_ptr: usize,
        size: usize,
    ) -> PyResult<i64> {
        let key = key_of(key)?;
        let run = || -> Result<i64, Failure> {
            check_key(&key)?;
            let c = self.client()?;
            self.check_registered(buffer_ptr, size)?;
            // SAFETY: the range lies inside a registration, whose owner promised the memory is
            // valid and writable while it is registered (register_buffer's contract).
            let dst = unsafe { slice_mut(buffer_ptr, size) };
            match py.detach(|| c.get_into(&key, dst))? {
                Some(n) => Ok(n as i64),
                None => Err(Failure::NotFound),
            }
        };
        Ok(run().unwrap_or_else(|f| f.code()))
    }

    /// Stores `size` bytes of registered memory at `buffer_ptr` under `key`. Returns 0 or a
    /// negative status (-600 pointer not registered, -400 bad key, -200 no room, -900
    /// unreachable). `config` (Mooncake's ReplicateConfig) is accepted and ignored: the
    /// namespace decides replication.
    #[pyo3(signature = (key, buffer_ptr, size, config=None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer_ptr: usize,
        size: usize,
        config: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i64> {
        let _ = config;
        let key = key_of(key)?;
        let run = || -> Result<i64, Failure> {
            check_key(&key)?;
            let c = self.client()?;
            self.check_registered(buffer_ptr, size)?;
            // SAFETY: inside a registration (see get_into); only read.
            let src = unsafe { slice_ref(buffer_ptr, size) };
            py.detach(|| c.put(&key, src))?;
            Ok(code::OK)
        };
        Ok(run().unwrap_or_else(|f| f.code()))
    }

    /// `get_into` for many keys, one round trip per node. Returns one entry per key: the
    /// value's length or a negative status.
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<i64>> {
        let keys = keys_of(&keys)?;
        Ok(self.get_into_batch(py, &keys, buffer_ptrs, sizes))
    }

    /// The length of `key`'s value, or a negative status: -704 not found, -400 bad key, -600
    /// client closed, -900 node unreachable (Mooncake's `get_size`).
    fn get_size(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<i64> {
        Ok(self.size_of(py, &key_of(key)?))
    }

    /// Mooncake's `get_into_ranges`: for buffer `i`, key `j` and fragment `k`, copies
    /// `all_sizes[i][j][k]` bytes at `all_src_offsets[i][j][k]` of `all_keys[i][j]`'s value
    /// into registered memory at `buffer_ptrs[i] + all_dst_offsets[i][j][k]`. Returns the same
    /// nesting: per fragment the bytes copied or a negative status (-704 key missing, -600 a
    /// range outside the value or outside a registered buffer, or lists whose lengths differ;
    /// -400 bad key). Each distinct key's whole value is fetched once and verified against its
    /// checksum before any of its fragments is copied.
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        buffer_ptrs: Vec<usize>,
        all_keys: Vec<Vec<Bound<'_, PyAny>>>,
        all_dst_offsets: Vec<Vec<Vec<usize>>>,
        all_src_offsets: Vec<Vec<Vec<usize>>>,
        all_sizes: Vec<Vec<Vec<usize>>>,
    ) -> PyResult<Vec<Vec<Vec<i64>>>> {
        let keys = all_keys
            .iter()
            .map(|ks| keys_of(ks))
            .collect::<PyResult<Vec<_>>>()?;
        let plan = crate::ranges::RangePlan {
            buffer_ptrs,
            keys,
            dst_offsets: all_dst_offsets,
            src_offsets: all_src_offsets,
            sizes: all_sizes,
        };
        Ok(self.get_ranges(py, &plan))
    }

    /// `batch_get_into` with each value scattered over several registered buffers:
    /// `pieces[i]` is a list of `(pointer, length)` that `keys[i]`'s value fills in order (the
    /// lengths summing to the value's). Returns one entry per key: the value's length, or a
    /// negative status (-704 a miss, -600 a piece not registered, overlapping, or lengths that
    /// are not the value's). On the same host each value is copied from the node's memory
    /// straight into its pieces, checked against its checksum in the same pass (one lookup
    /// round trip per node, no staging copy); otherwise the values are fetched in one batch,
    /// each received from the socket straight into its pieces.
    fn batch_get_scatter(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        pieces: Vec<Vec<(usize, usize)>>,
    ) -> PyResult<Vec<i64>> {
        let keys = keys_of(&keys)?;
        Ok(self.get_scatter_batch(py, &keys, &pieces))
    }

    /// `put_from` for many keys, one round trip per node. Returns one status per key (0
    /// stored, negative otherwise).
    #[pyo3(signature = (keys, buffer_ptrs, sizes, config=None))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<i64>> {
        let _ = config;
        let keys = keys_of(&keys)?;
        Ok(self.put_from_batch(py, &keys, &buffer_ptrs, &sizes))
    }

    // ----- the engine of the Pythonic layer (exceptions) -----

    /// Stores `data` (bytes) under `key`.
    fn _write_bytes(&self, py: Python<'_>, key: &Bound<'_, PyAny>, data: &[u8]) -> PyResult<()> {
        let key = checked_key(key)?;
        let c = self.client()?;
        py.detach(|| c.put(&key, data)).map_err(Failure::from)?;
        Ok(())
    }

    /// Stores `length` bytes at `address` under `key`. Private: the caller (kvpool/__init__.py)
    /// holds the buffer at `address` exported for the duration of the call.
    fn _write_unchecked(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        address: usize,
        length: usize,
    ) -> PyResult<()> {
        let key = checked_key(key)?;
        let c = self.client()?;
        // SAFETY: `address` is the start of an exported buffer of at least `length` bytes,
        // kept alive and unresizable by the caller's export for the whole call.
        let src = unsafe { slice_ref(address, length) };
        py.detach(|| c.put(&key, src)).map_err(Failure::from)?;
        Ok(())
    }

    /// The value of `key` as bytes, or None on a miss.
    fn _read(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyBytes>>> {
        let key = checked_key(key)?;
        let c = self.client()?;
        let v = py.detach(|| c.get(&key)).map_err(Failure::from)?;
        Ok(v.map(|v| PyBytes::new(py, &v).unbind()))
    }

    /// Copies the value of `key` into the `length` writable bytes at `address`; its length, or
    /// None on a miss. Private: see `_write_unchecked`.
    fn _read_into_unchecked(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        address: usize,
        length: usize,
    ) -> PyResult<Option<usize>> {
        let key = checked_key(key)?;
        let c = self.client()?;
        // SAFETY: `address` is the start of a writable exported buffer of at least `length`
        // bytes, held by the caller for the whole call.
        let dst = unsafe { slice_mut(address, length) };
        Ok(py.detach(|| c.get_into(&key, dst)).map_err(Failure::from)?)
    }

    /// `_read_into_unchecked` for many keys (one round trip per node). Private: the caller
    /// holds every buffer exported.
    fn _read_many_into_unchecked(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> PyResult<Vec<Option<usize>>> {
        let keys = checked_keys(&keys)?;
        if keys.len() != addresses.len() || keys.len() != lengths.len() {
            return Err(Failure::BadArgument("one buffer per key".into()).into());
        }
        let c = self.client()?;
        let ranges: Vec<Range> = addresses.into_iter().zip(lengths).collect();
        if overlaps(&ranges).iter().any(|o| *o) {
            return Err(Failure::BadArgument("two of the buffers overlap".into()).into());
        }
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        // SAFETY: each range is a writable exported buffer held by the caller; none overlap.
        let got = unsafe { get_many(py, &c, &refs, &ranges) }?;
        got.into_iter()
            .map(|g| g.map_err(PyErr::from))
            .collect::<PyResult<Vec<_>>>()
    }

    /// Stores many buffers (one round trip per node). Private: the caller holds every buffer
    /// exported. Raises the first item's failure.
    fn _write_many_unchecked(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> PyResult<()> {
        let keys = checked_keys(&keys)?;
        if keys.len() != addresses.len() || keys.len() != lengths.len() {
            return Err(Failure::BadArgument("one buffer per key".into()).into());
        }
        let c = self.client()?;
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(addresses.iter().zip(&lengths))
            // SAFETY: each range is an exported buffer held by the caller; only read.
            .map(|(k, (&a, &n))| (&k[..], unsafe { slice_ref(a, n) }))
            .collect();
        let codes = py
            .detach(|| c.batch_put_from(&items))
            .map_err(Failure::from)?;
        match codes
            .into_iter()
            .find(|c| *c != kvpool_client::ErrorCode::Ok)
        {
            Some(c) => Err(item_exception(c)),
            None => Ok(()),
        }
    }

    /// True when `key` is present.
    fn exists(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = checked_key(key)?;
        let c = self.client()?;
        Ok(py.detach(|| c.exists(&key)).map_err(Failure::from)?)
    }

    /// Per key, whether it is present: one round trip per node.
    fn _presence(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<bool>> {
        let keys = checked_keys(&keys)?;
        let c = self.client()?;
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        // Previous owners are consulted while the view is changing, as reads do.
        Ok(py.detach(|| c.present(&refs)).map_err(Failure::from)?)
    }

    /// One-sided handoff: reserves `length` bytes for `key` on its owner (invisible until
    /// committed); returns the address as bytes, for the producer.
    fn _reserve<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'_, PyAny>,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let key = checked_key(key)?;
        let c = self.client()?;
        let addr = py
            .detach(|| c.block_on(c.async_client().alloc(&key, length)))
            .map_err(Failure::from)?;
        Ok(PyBytes::new(py, &addr.to_bytes()))
    }

    /// Writes `len` bytes at `ptr` at `offset` of a reserved address. Private: the caller
    /// (`kvpool.Client.write_reserved`) holds the buffer exported for the call.
    fn _write_reserved_unchecked(
        &self,
        py: Python<'_>,
        address: &[u8],
        offset: u64,
        ptr: usize,
        len: usize,
    ) -> PyResult<()> {
        let addr = reserved(address)?;
        if len > 0 && (ptr == 0 || len > isize::MAX as usize || ptr.checked_add(len).is_none()) {
            return Err(InvalidArgumentError::new_err("bad buffer"));
        }
        let c = self.client()?;
        // SAFETY: the caller holds `ptr..ptr+len` exported (readable, not freed or resized)
        // for the call (this private method's contract); checked not null and not wrapping.
        let src = unsafe { slice_ref(ptr, len) };
        py.detach(|| c.block_on(c.async_client().write(&addr, offset, src)))
            .map_err(Failure::from)?;
        Ok(())
    }

    /// Makes a reserved address's bytes the value of its key, after the node checks they hash
    /// to `checksum` (xxh3-64, `kvpool.checksum`); every waiter is woken.
    fn _commit_reserved(&self, py: Python<'_>, address: &[u8], checksum: u64) -> PyResult<()> {
        let addr = reserved(address)?;
        let c = self.client()?;
        py.detach(|| c.block_on(c.async_client().commit(&addr, checksum)))
            .map_err(Failure::from)?;
        Ok(())
    }

    /// Gives a reserved address back without committing it.
    fn _abort_reserved(&self, py: Python<'_>, address: &[u8]) -> PyResult<()> {
        let addr = reserved(address)?;
        let c = self.client()?;
        py.detach(|| c.block_on(c.async_client().abort(&addr)))
            .map_err(Failure::from)?;
        Ok(())
    }

    /// Handoff: waits until every key is written, or failed by its producer, for at most
    /// `timeout` seconds; returns (missing keys, [(failed key, reason)]).
    #[expect(
        clippy::type_complexity,
        reason = "the Python return value, as documented"
    )]
    fn wait(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        timeout: f64,
    ) -> PyResult<(Vec<Vec<u8>>, Vec<(Vec<u8>, String)>)> {
        let keys = checked_keys(&keys)?;
        let timeout = seconds("timeout", timeout)?;
        let c = self.client()?;
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let got = py
            .detach(|| c.block_on(c.async_client().wait(&refs, timeout)))
            .map_err(Failure::from)?;
        Ok((got.missing, got.failed))
    }

    /// [`wait`] for a handoff's blocks that also reads each into its registered buffer
    /// (`buffer_ptrs[i]`, `sizes[i]` bytes) the moment it is written, while the producer writes
    /// the rest. Returns (per key the bytes read, or None when not read; the keys missing at
    /// the deadline; [(failed key, reason)]). Buffers must be registered and must not overlap.
    #[expect(
        clippy::type_complexity,
        reason = "the Python return value, as documented"
    )]
    fn wait_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        timeout: f64,
    ) -> PyResult<(Vec<Option<usize>>, Vec<Vec<u8>>, Vec<(Vec<u8>, String)>)> {
        let keys = checked_keys(&keys)?;
        let timeout = seconds("timeout", timeout)?;
        if keys.len() != buffer_ptrs.len() || keys.len() != sizes.len() {
            return Err(InvalidArgumentError::new_err(
                "keys, buffer_ptrs and sizes must have the same length",
            ));
        }
        let ranges: Vec<Range> = buffer_ptrs.into_iter().zip(sizes).collect();
        if ranges.iter().any(|&(p, n)| !self.registry.covers(p, n))
            || overlaps(&ranges).contains(&true)
        {
            return Err(InvalidArgumentError::new_err(
                "every buffer must lie inside a registered one, and no two may overlap",
            ));
        }
        let c = self.client()?;
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let mut dsts: Vec<&mut [u8]> = ranges
            .iter()
            // SAFETY: each range lies inside a registration (checked above: the caller keeps
            // registered memory alive and writable until it unregisters it) and no two overlap,
            // so these are disjoint writable slices for the duration of the call.
            .map(|&(a, n)| unsafe { slice_mut(a, n) })
            .collect();
        let (outcome, got) = py
            .detach(|| c.block_on(c.async_client().wait_get_into(&refs, &mut dsts, timeout)))
            .map_err(Failure::from)?;
        Ok((got, outcome.missing, outcome.failed))
    }

    /// Handoff lease on `keys`, written yet or not: every copy of each is removed `ttl` seconds
    /// from now unless renewed (call again) or ended (`ttl` 0). Returns how many are present.
    fn expire(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>, ttl: f64) -> PyResult<u64> {
        let keys = checked_keys(&keys)?;
        let ttl = seconds("ttl", ttl)?;
        let c = self.client()?;
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        Ok(py
            .detach(|| c.block_on(c.async_client().expire(&refs, ttl)))
            .map_err(Failure::from)?)
    }

    /// Handoff: a producer gives up on `keys`; every waiter hears `reason` at once. Returns
    /// how many tombstones were posted.
    fn fail(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>, reason: &str) -> PyResult<u64> {
        let keys = checked_keys(&keys)?;
        let c = self.client()?;
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        Ok(py
            .detach(|| c.block_on(c.async_client().fail(&refs, reason)))
            .map_err(Failure::from)?)
    }

    /// Handoff: aborts a request on both sides in one call: each key's objects are removed
    /// (pinned too), its pending reservations and writes released (their commits fail), its
    /// lease dropped, and every waiter hears `reason` (at most 1 KiB) at once. Returns how many
    /// objects and reservations were freed.
    fn cancel(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>, reason: &str) -> PyResult<u64> {
        let keys = checked_keys(&keys)?;
        let c = self.client()?;
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        Ok(py
            .detach(|| c.block_on(c.async_client().cancel(&refs, reason)))
            .map_err(Failure::from)?)
    }

    /// Handoff: events for every key of the namespace under `prefix`, from the nodes serving
    /// now (see `Subscription.next`).
    fn subscribe(&self, py: Python<'_>, prefix: &Bound<'_, PyAny>) -> PyResult<Subscription> {
        let prefix = key_of(prefix)?;
        if prefix.len() > 256 {
            return Err(InvalidArgumentError::new_err(
                "a prefix is at most 256 bytes",
            ));
        }
        let c = self.client()?;
        let sub = py
            .detach(|| c.block_on(c.async_client().subscribe(&prefix)))
            .map_err(Failure::from)?;
        Ok(Subscription::new(sub, c))
    }

    /// KV events for routers: batches of the keys of the namespace under `prefix` stored in
    /// or removed from a tier of every node serving now (see `KvEvents.next`).
    #[pyo3(signature = (prefix = None))]
    fn events(
        &self,
        py: Python<'_>,
        prefix: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<crate::kv_events::KvEvents> {
        let prefix = prefix.map(key_of).transpose()?.unwrap_or_default();
        if prefix.len() > 256 {
            return Err(InvalidArgumentError::new_err(
                "a prefix is at most 256 bytes",
            ));
        }
        let c = self.client()?;
        let sub = py.detach(|| c.kv_events(&prefix)).map_err(Failure::from)?;
        Ok(crate::kv_events::KvEvents::new(sub, c))
    }

    /// Removes `key`; True when an object was removed.
    fn delete(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = checked_key(key)?;
        let c = self.client()?;
        Ok(py.detach(|| c.remove(&key)).map_err(Failure::from)?)
    }

    /// Removes every object of this client's namespace on every node (pinned ones too);
    /// returns how many were removed.
    fn clear(&self, py: Python<'_>) -> PyResult<u64> {
        let c = self.client()?;
        Ok(py.detach(|| c.remove_all()).map_err(Failure::from)?)
    }

    /// How many leading keys of `keys` the pool holds (the prefix that can be loaded): one
    /// round trip per node owning any of them, never one per key.
    fn match_prefix(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<usize> {
        let keys = checked_keys(&keys)?;
        let c = self.client()?;
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        Ok(py
            .detach(|| c.match_prefix(Prefix::Keys(&refs)))
            .map_err(Failure::from)?)
    }
}

impl NativeClient {
    /// The client for a batch call of `keys` keys with `ptrs` pointers and `sizes` sizes, or
    /// the status every key gets: `INVALID_PARAMS` for lists of different lengths, the
    /// closed client's code.
    pub(crate) fn batch_client(
        &self,
        keys: usize,
        ptrs: usize,
        sizes: usize,
    ) -> Result<blocking::Client, Vec<i64>> {
        if keys != ptrs || keys != sizes {
            return Err(vec![code::INVALID_PARAMS; keys]);
        }
        self.client().map_err(|f| vec![f.code(); keys])
    }

    /// The status of one item of a pointer batch before it is sent: `INVALID_KEY`,
    /// `INVALID_PARAMS` (its range is not inside a registration) or `OK`.
    pub(crate) fn item_status(&self, key: &[u8], ptr: usize, len: usize) -> i64 {
        if check_key(key).is_err() {
            code::INVALID_KEY
        } else if !self.registry.covers(ptr, len) {
            code::INVALID_PARAMS
        } else {
            code::OK
        }
    }

    /// A handle on the client (shared connections), or `Closed`.
    pub(crate) fn client(&self) -> Result<blocking::Client, Failure> {
        self.inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or(Failure::Closed)
    }

    pub(crate) fn check_registered(&self, ptr: usize, len: usize) -> Result<(), Failure> {
        if ptr == 0 {
            return Err(Failure::BadArgument("null pointer".into()));
        }
        if !self.registry.covers(ptr, len) {
            return Err(Failure::BadArgument(format!(
                "{len} bytes at {ptr:#x} are not inside a buffer registered with register_buffer"
            )));
        }
        Ok(())
    }
}

/// A statistics snapshot that could not be turned into JSON.
fn to_py(e: serde_json::Error) -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(format!("statistics: {e}"))
}
