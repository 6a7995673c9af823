//! Buffers registered with `register_buffer(ptr, size)`: the only memory the pointer-based
//! calls (`get_into`, `put_from`, `batch_*`) read or write. A pointer range is accepted only
//! when it lies inside one registration, so a null, stray or too-long pointer is refused with a
//! status code instead of being dereferenced.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Registrations: start address → length in bytes.
#[derive(Default)]
pub(crate) struct Registry {
    regs: Mutex<BTreeMap<usize, usize>>,
}

impl Registry {
    /// Registers `[ptr, ptr + size)`. False for a null pointer, a zero size or a range that
    /// wraps the address space or exceeds `isize::MAX` bytes. Registering a start again
    /// replaces its length.
    pub(crate) fn register(&self, ptr: usize, size: usize) -> bool {
        if ptr == 0 || size == 0 || size > isize::MAX as usize || ptr.checked_add(size).is_none() {
            return false;
        }
        self.lock().insert(ptr, size);
        true
    }

    /// Drops the registration that starts at `ptr`; false when there is none.
    pub(crate) fn unregister(&self, ptr: usize) -> bool {
        self.lock().remove(&ptr).is_some()
    }

    /// True when `[ptr, ptr + len)` lies inside one registration (a zero `len` at a registered
    /// address included).
    pub(crate) fn covers(&self, ptr: usize, len: usize) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        if ptr == 0 {
            return false;
        }
        self.lock()
            .range(..=ptr)
            .rev()
            .any(|(&start, &size)| end <= start + size)
    }

    /// Forgets every registration (the client is closed).
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        // The map is consistent after any panic (one insert or remove), so a poisoned lock is
        // still usable.
        self.regs.lock().unwrap_or_else(|e| e.into_inner())
    }
}
