//! # kvpool-python
//!
//! The native half of the `kvpool` Python package (`kvpool._native`), built by maturin as an
//! abi3 extension for CPython 3.9 and later. It wraps `kvpool_client::blocking::Client`, so a
//! Python process gets the same routing, reconnection and same-host mapping as a Rust one, and
//! every call that may block runs with the GIL released.
//!
//! Components: `client` (the `Client` class: Mooncake-compatible calls on registered memory,
//! and the engine of the Pythonic calls of `kvpool/__init__.py`) with its batch calls on
//! registered memory in `batch` and `scatter` (values scattered over several buffers),
//! `subscription` (handoff events), `args` (keys and durations as Python passes them),
//! `memory` (the caller's address ranges as slices), `registry` (the buffers registered for
//! pointer-based calls), `weights` (model weights: `kvpool/weights.py`'s engine), `errors`
//! (client errors as `kvpool` exceptions and Mooncake status codes), and `block_hashes`
//! (docs/HASHING.md's keys, by the core's code).

use kvpool::prefix::PrefixSeed;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

mod args;
mod batch;
mod client;
mod errors;
mod fetch;
mod kv_events;
mod memory;
mod ranges;
mod registry;
mod scatter;
mod subscription;
mod weights;

/// The keys of the full `block_tokens`-token blocks of `token_ids`, as docs/HASHING.md
/// specifies (16 bytes each; key `i` covers blocks 0 to `i`). The seed fields are the model,
/// KV layout and salt that make the same tokens' KV bytes differ.
#[pyfunction]
#[pyo3(signature = (
    token_ids, block_tokens=16, *, tenant="", model="", dtype="", tp_rank=0, tp_size=1,
    pp_stage=0, layer_start=0, layer_end=0, salt=None
))]
#[expect(
    clippy::too_many_arguments,
    reason = "docs/HASHING.md's seed fields, by keyword"
)]
fn block_hashes<'py>(
    py: Python<'py>,
    token_ids: Vec<u32>,
    block_tokens: u32,
    tenant: &str,
    model: &str,
    dtype: &str,
    tp_rank: u32,
    tp_size: u32,
    pp_stage: u32,
    layer_start: u32,
    layer_end: u32,
    salt: Option<&str>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if block_tokens == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "block_tokens must be at least 1",
        ));
    }
    let seed = PrefixSeed {
        tenant: tenant.into(),
        model: model.into(),
        dtype: dtype.into(),
        tp_rank,
        tp_size,
        pp_stage,
        layer_start,
        layer_end,
        block_tokens,
        salt: salt.map(str::to_string),
    };
    let keys = py.detach(|| seed.block_keys(&token_ids));
    Ok(keys.iter().map(|k| PyBytes::new(py, k)).collect())
}

/// The module `kvpool._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::NativeClient>()?;
    m.add_class::<subscription::Subscription>()?;
    m.add_class::<kv_events::KvEvents>()?;
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(memory::_checksum_unchecked, m)?)?;
    m.add("MAX_KEY_LEN", kvpool::MAX_KEY_LEN)?;
    weights::register(m)?;
    Ok(())
}
