//! Where a committed object is, as a lookup or a put of this client found it: what one-sided
//! reads take, and what the same-host index remembers.

use kvpool::protocol::LocatedWire;
use kvpool::GlobalAddr;

/// A committed object located for one-sided reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Located {
    /// Its address.
    pub addr: GlobalAddr,
    /// xxh3-64 of its bytes.
    pub checksum: u64,
}

impl From<LocatedWire> for Located {
    fn from(l: LocatedWire) -> Self {
        Located {
            addr: l.addr,
            checksum: l.checksum,
        }
    }
}
