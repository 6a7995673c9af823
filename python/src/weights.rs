//! The native half of `kvpool.weights` (docs/WEIGHTS.md): publish, list, remove, load and slice
//! model weights through `kvpool_client::weights::Weights`, every call run with the GIL
//! released on the client's runtime.
//!
//! A published model's manifest is handed to Python as a [`Model`] (parsed once, shared by
//! every later call on it). Loads write into caller buffers given as (address, length): the
//! private `_load_into_unchecked` is called only by `kvpool/_weights_load.py`, which holds each
//! buffer exported (so it can be neither freed nor resized) for the whole call; the addresses
//! are still checked here (not null, no wrap, no overlap, exactly the tensor's length) so a
//! mistake there is an exception, never a stray write.

use std::path::PathBuf;
use std::sync::Arc;

use kvpool::weights::{chunk_key, Manifest};
use kvpool_client::blocking;
use kvpool_client::weights::{
    LoadReport, PublishOptions, Sources, Target, TensorViews, WeightStats, Weights, WeightsError,
};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use crate::client::NativeClient;
use crate::errors::{
    client_exception, BufferTooSmallError, Error, InvalidArgumentError, NotFoundError,
    PoolFullError,
};
use crate::memory::{overlaps, slice_mut};

/// A published model's manifest, parsed (`kvpool.weights.Manifest` wraps it).
#[pyclass(name = "WeightsModel", module = "kvpool._native", frozen)]
pub(crate) struct Model {
    m: Arc<Manifest>,
}

#[pymethods]
impl Model {
    /// Parses a manifest as stored in the pool (its JSON).
    #[staticmethod]
    fn from_json(json: &str) -> PyResult<Model> {
        let m = Manifest::from_json(json.as_bytes()).map_err(|e| into_py(e.into()))?;
        Ok(Model { m: Arc::new(m) })
    }

    /// The manifest's JSON, as stored in the pool.
    fn json(&self) -> String {
        String::from_utf8(self.m.to_json()).expect("serde_json writes UTF-8")
    }

    /// The model's name.
    #[getter]
    fn name(&self) -> &str {
        &self.m.name
    }

    /// The key of every chunk: (file index, tensor index, chunk index, key), file by file,
    /// tensor by tensor.
    fn chunk_keys<'py>(&self, py: Python<'py>) -> Vec<(usize, usize, usize, Bound<'py, PyBytes>)> {
        self.m
            .chunks()
            .map(|c| {
                let k = chunk_key(&self.m.name, &c);
                (c.file, c.tensor, c.chunk, PyBytes::new(py, &k))
            })
            .collect()
    }
}

/// The weights of `namespace` through `client`'s connections, and the blocking client that
/// runs their futures.
fn weights(client: &NativeClient, namespace: &str) -> PyResult<(blocking::Client, Weights)> {
    let c = client.client()?;
    let w = Weights::new(c.async_client(), namespace).map_err(client_exception)?;
    Ok((c, w))
}

/// Publishes model `name` from `paths` (safetensors files, a shard index, directories);
/// returns its manifest.
#[pyfunction]
#[pyo3(signature = (client, namespace, name, paths, chunk_size=None, replicas=None))]
pub(crate) fn _weights_publish(
    py: Python<'_>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    name: &str,
    paths: Vec<PathBuf>,
    chunk_size: Option<u64>,
    replicas: Option<u32>,
) -> PyResult<Model> {
    let (c, w) = weights(&client, namespace)?;
    let mut opts = PublishOptions {
        replicas,
        ..PublishOptions::default()
    };
    if let Some(cs) = chunk_size {
        opts.chunk_size = cs;
    }
    let m = py
        .detach(|| c.block_on(w.publish(name, &paths, &opts)))
        .map_err(into_py)?;
    Ok(Model { m: Arc::new(m) })
}

/// The manifest of model `name`, None when it is not published.
#[pyfunction]
pub(crate) fn _weights_manifest(
    py: Python<'_>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    name: &str,
) -> PyResult<Option<Model>> {
    let (c, w) = weights(&client, namespace)?;
    let m = py
        .detach(|| c.block_on(w.manifest(name)))
        .map_err(into_py)?;
    Ok(m.map(|m| Model { m: Arc::new(m) }))
}

/// The names of the published models, sorted.
#[pyfunction]
pub(crate) fn _weights_list(
    py: Python<'_>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
) -> PyResult<Vec<String>> {
    let (c, w) = weights(&client, namespace)?;
    py.detach(|| c.block_on(w.list())).map_err(into_py)
}

/// Removes model `name`; False when it was not published.
#[pyfunction]
pub(crate) fn _weights_remove(
    py: Python<'_>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    name: &str,
) -> PyResult<bool> {
    let (c, w) = weights(&client, namespace)?;
    py.detach(|| c.block_on(w.remove(name))).map_err(into_py)
}

/// Loads whole tensors into caller memory. `targets`: (file index, tensor index, address,
/// length) per tensor. Chunks in no copy are read from `source_dir` (files named as published)
/// or `source_files` when given, and put back. Returns the load's report.
///
/// Private: `kvpool/_weights_load.py` holds every buffer exported (alive, not resizable, writable)
/// for the whole call. The ranges are checked anyway: not null, no wrap, none overlapping,
/// each exactly its tensor's length.
#[pyfunction]
#[pyo3(signature = (client, namespace, model, targets, source_dir=None, source_files=None))]
pub(crate) fn _weights_load_into_unchecked<'py>(
    py: Python<'py>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    model: PyRef<'_, Model>,
    targets: Vec<(usize, usize, usize, usize)>,
    source_dir: Option<PathBuf>,
    source_files: Option<Vec<PathBuf>>,
) -> PyResult<Bound<'py, PyDict>> {
    let m = model.m.clone();
    let mut ranges = Vec::with_capacity(targets.len());
    for &(file, tensor, addr, len) in &targets {
        let t = m
            .files
            .get(file)
            .and_then(|f| f.tensors.get(tensor))
            .ok_or_else(|| {
                NotFoundError::new_err(format!("the model has no tensor #{file}.{tensor}"))
            })?;
        if len as u64 != t.len {
            return Err(BufferTooSmallError::new_err(format!(
                "buffer for {:?} is {len} bytes, the tensor {}",
                t.name, t.len
            )));
        }
        if len > 0 && (addr == 0 || len > isize::MAX as usize || addr.checked_add(len).is_none()) {
            return Err(InvalidArgumentError::new_err(format!(
                "bad buffer for {:?}: {len} bytes at {addr:#x}",
                t.name
            )));
        }
        ranges.push((addr, len));
    }
    if overlaps(&ranges).iter().any(|o| *o) {
        return Err(InvalidArgumentError::new_err("two of the buffers overlap"));
    }
    let sources = match (source_dir, source_files) {
        (Some(_), Some(_)) => {
            return Err(InvalidArgumentError::new_err(
                "give source_dir or source_files, not both",
            ))
        }
        (Some(d), None) => Some(Sources::dir(&d, &m)),
        (None, Some(f)) => Some(Sources::files(&f)),
        (None, None) => None,
    };
    let (c, w) = weights(&client, namespace)?;
    let mut tgts: Vec<Target<'_>> = targets
        .iter()
        .zip(&ranges)
        .map(|(&(file, tensor, _, _), &(addr, len))| Target {
            file,
            tensor,
            // SAFETY: `addr..addr + len` is a writable buffer the caller holds exported for
            // the whole call (this function's contract); it is not null, does not wrap, is at
            // most isize::MAX bytes and overlaps no other target (all checked above).
            dst: unsafe { slice_mut(addr, len) },
        })
        .collect();
    let report = py
        .detach(|| c.block_on(w.load_into(&m, &mut tgts, sources.as_ref())))
        .map_err(into_py)?;
    report_dict(py, &report)
}

/// Same-host zero-copy views of tensors (`kvpool.weights.load`'s arrays are read-only numpy
/// arrays over them): the pool's memory mapped read-only into this process, each tensor's
/// chunks held on their nodes, so the bytes neither move nor change while any array over them
/// lives. The holds end, and the mappings go, when the last reference to this object does.
#[pyclass(name = "WeightsViews", module = "kvpool._native", frozen)]
pub(crate) struct Views {
    // Field order is drop order: the views (and their holds' connections) go while the
    // client, whose runtime drives those connections, is still alive.
    views: TensorViews,
    _client: blocking::Client,
}

#[pymethods]
impl Views {
    /// Connections keeping the holds (one per node of this host asked).
    #[getter]
    fn connections(&self) -> usize {
        self.views.connections()
    }
}

/// Where a viewed tensor's bytes lie in this process: (address, length).
type Place = (usize, usize);

/// Views of tensors `targets` (file index, tensor index) of the model, where all their chunks
/// have a copy on this host: the owner of the views, and per target its (address, length) in
/// this process's memory, read-only and valid while the owner lives, or None when the tensor
/// must be copied instead (see `kvpool_client::weights::TensorViews`). `verify`: hash every
/// chunk against the manifest (otherwise only the nodes' recorded checksums are compared).
#[pyfunction]
pub(crate) fn _weights_view<'py>(
    py: Python<'py>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    model: PyRef<'_, Model>,
    targets: Vec<(usize, usize)>,
    verify: bool,
) -> PyResult<(Py<Views>, Vec<Option<Place>>)> {
    let m = model.m.clone();
    let (c, w) = weights(&client, namespace)?;
    let views = py
        .detach(|| c.block_on(w.view(&m, &targets, verify)))
        .map_err(into_py)?;
    let places = (0..views.len())
        .map(|i| views.get(i).map(|b| (b.as_ptr() as usize, b.len())))
        .collect();
    let owner = Py::new(py, Views { views, _client: c })?;
    Ok((owner, places))
}

/// Slice `rank` of `world` of tensor `tensor` along dimension `dim`, fetching only the chunks
/// it touches: (its bytes, its shape).
#[pyfunction]
#[expect(
    clippy::too_many_arguments,
    reason = "the slice's tensor, dimension, rank and world, by position"
)]
pub(crate) fn _weights_slice<'py>(
    py: Python<'py>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    model: PyRef<'_, Model>,
    tensor: &str,
    dim: usize,
    rank: u64,
    world: u64,
) -> PyResult<(Bound<'py, PyByteArray>, Vec<u64>)> {
    let m = model.m.clone();
    let (c, w) = weights(&client, namespace)?;
    let (bytes, shape) = py
        .detach(|| c.block_on(w.slice(&m, tensor, dim, rank, world)))
        .map_err(into_py)?;
    Ok((PyByteArray::new(py, &bytes), shape))
}

/// The bytes of companion file `index` of the manifest, checked against it.
#[pyfunction]
pub(crate) fn _weights_extra<'py>(
    py: Python<'py>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    model: PyRef<'_, Model>,
    index: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let m = model.m.clone();
    let (c, w) = weights(&client, namespace)?;
    let bytes = py
        .detach(|| c.block_on(w.extra(&m, index)))
        .map_err(into_py)?;
    Ok(PyBytes::new(py, &bytes))
}

/// Writes the model's files into `dir`, byte for byte as published; missing chunks are read
/// from `source_dir` when given. Returns the load's report.
#[pyfunction]
#[pyo3(signature = (client, namespace, model, dir, source_dir=None))]
pub(crate) fn _weights_write_files<'py>(
    py: Python<'py>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    model: PyRef<'_, Model>,
    dir: PathBuf,
    source_dir: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let m = model.m.clone();
    let sources = source_dir.map(|d| Sources::dir(&d, &m));
    let (c, w) = weights(&client, namespace)?;
    let report = py
        .detach(|| c.block_on(w.write_files(&m, &dir, sources.as_ref())))
        .map_err(into_py)?;
    report_dict(py, &report)
}

/// Where the model's chunks are now (`kvpool weights stats`).
#[pyfunction]
pub(crate) fn _weights_stats<'py>(
    py: Python<'py>,
    client: PyRef<'_, NativeClient>,
    namespace: &str,
    model: PyRef<'_, Model>,
) -> PyResult<Bound<'py, PyDict>> {
    let m = model.m.clone();
    let (c, w) = weights(&client, namespace)?;
    let s: WeightStats = py.detach(|| c.block_on(w.stats(&m))).map_err(into_py)?;
    let d = PyDict::new(py);
    d.set_item("tensor_bytes", s.tensor_bytes)?;
    d.set_item("tensors", s.tensors)?;
    d.set_item("chunks", s.chunks)?;
    d.set_item("replicas", s.replicas)?;
    d.set_item("nodes", s.nodes)?;
    d.set_item("under_replicated", s.under_replicated)?;
    d.set_item("missing", s.missing)?;
    d.set_item("namespace_hits", s.namespace_hits)?;
    Ok(d)
}

fn report_dict<'py>(py: Python<'py>, r: &LoadReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("chunks_from_pool", r.chunks_from_pool)?;
    d.set_item("bytes_from_pool", r.bytes_from_pool)?;
    d.set_item("chunks_from_files", r.chunks_from_files)?;
    d.set_item("bytes_from_files", r.bytes_from_files)?;
    d.set_item("chunks_from_replicas", r.chunks_from_replicas)?;
    Ok(d)
}

/// The exception for a weights call's failure: the `kvpool` class that names it, or the
/// built-in `OSError` subclass for a file that could not be read or written.
fn into_py(e: WeightsError) -> PyErr {
    let msg = e.to_string();
    match e {
        WeightsError::Client(c) => client_exception(c),
        WeightsError::Io { source, .. } => match source.kind() {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
            _ => PyOSError::new_err(msg),
        },
        WeightsError::NotFound(_) | WeightsError::NoTensor(_) | WeightsError::Missing { .. } => {
            NotFoundError::new_err(msg)
        }
        WeightsError::Format(_) | WeightsError::Replicas { .. } => {
            InvalidArgumentError::new_err(msg)
        }
        WeightsError::Buffer { .. } => BufferTooSmallError::new_err(msg),
        WeightsError::Store { code, .. } => match code {
            kvpool_client::ErrorCode::PoolFull | kvpool_client::ErrorCode::QuotaExceeded => {
                PoolFullError::new_err(msg)
            }
            _ => Error::new_err(msg),
        },
        WeightsError::SourceChanged { .. } => Error::new_err(msg),
    }
}

/// Adds the weights functions and class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_class::<Views>()?;
    m.add_function(wrap_pyfunction!(_weights_publish, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_list, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_remove, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_load_into_unchecked, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_slice, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_view, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_extra, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_write_files, m)?)?;
    m.add_function(wrap_pyfunction!(_weights_stats, m)?)?;
    Ok(())
}
