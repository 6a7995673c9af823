//! Global addresses: how any client names a byte range on any node, and proves it may touch it.
//!
//! A [`GlobalAddr`] names a node and the incarnation of its daemon, one of its segments, an
//! offset and a length, the generation of the object that lives there, and a memory key. The key
//! is a keyed hash (SipHash-2-4 under a secret that never leaves the node) over all the other
//! fields, so an address can't be forged or widened: changing the offset, the length, the
//! generation or the incarnation invalidates it. Every one-sided access checks the incarnation,
//! the key, the bounds and the generation (through the block's version word, see
//! [`crate::seqlock`]).
//!
//! The incarnation is a random nonzero number a daemon draws at start. A daemon restarted on the
//! same data directory reuses node, segment numbers and offsets, so without it an address of the
//! dead daemon and one of the new daemon could name the same place; with it, every address and
//! every same-host mapping says which life of the node it belongs to, and one of another life is
//! refused ([`crate::AddrFault::WrongIncarnation`]).

use std::fmt;
use std::hash::Hasher;

use rkyv::{Archive, Deserialize, Serialize};
use siphasher::sip::SipHasher24;

/// A node of the cluster. Every global address names the node that owns the memory.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Archive, Serialize, Deserialize,
)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node{}", self.0)
    }
}

/// The address of an object's bytes in some node's memory, with the key that opens it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Archive, Serialize, Deserialize)]
pub struct GlobalAddr {
    /// Node whose memory holds the bytes.
    pub node: NodeId,
    /// Incarnation of the node's daemon that issued the address (random, nonzero, drawn at
    /// start): an address of an earlier or later run of the node is refused.
    pub incarnation: u64,
    /// Segment of that node.
    pub segment: u32,
    /// Byte offset of the object inside the segment's data area.
    pub offset: u64,
    /// Length of the object in bytes.
    pub len: u64,
    /// Generation of the object; never reused within a node's lifetime.
    pub generation: u64,
    /// Memory key: a MAC over the other fields under the node's secret.
    pub key: u64,
}

impl GlobalAddr {
    /// Bytes of [`GlobalAddr::to_bytes`].
    pub const BYTES: usize = 48;

    /// The address as bytes (little-endian fields in declaration order), to hand to another
    /// process: the one-sided handoff's consumer gives its reserved address to the producer.
    /// Nothing is trusted from it: the node checks the memory key on every access.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        let fields: [&[u8]; 7] = [
            &self.node.0.to_le_bytes(),
            &self.incarnation.to_le_bytes(),
            &self.segment.to_le_bytes(),
            &self.offset.to_le_bytes(),
            &self.len.to_le_bytes(),
            &self.generation.to_le_bytes(),
            &self.key.to_le_bytes(),
        ];
        let mut at = 0;
        for f in fields {
            out[at..at + f.len()].copy_from_slice(f);
            at += f.len();
        }
        out
    }

    /// The address [`GlobalAddr::to_bytes`] wrote; None for bytes of another length.
    pub fn from_bytes(b: &[u8]) -> Option<GlobalAddr> {
        if b.len() != Self::BYTES {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(GlobalAddr {
            node: NodeId(u32_at(0)),
            incarnation: u64_at(4),
            segment: u32_at(12),
            offset: u64_at(16),
            len: u64_at(24),
            generation: u64_at(32),
            key: u64_at(40),
        })
    }

    /// Checks that `[offset, offset + len)` (relative to the object) lies inside the object and
    /// returns the absolute segment offset of its start.
    pub fn sub_range(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| self.offset + offset)
    }
}

/// The secret under which a node signs the addresses it hands out.
#[derive(Clone)]
pub struct MacKey {
    k0: u64,
    k1: u64,
}

impl fmt::Debug for MacKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MacKey(..)")
    }
}

impl MacKey {
    /// A key from 16 random bytes (the daemon reads them from the OS at start-up).
    pub fn new(secret: [u8; 16]) -> Self {
        let (a, b) = secret.split_at(8);
        MacKey {
            k0: u64::from_le_bytes(a.try_into().expect("8 bytes")),
            k1: u64::from_le_bytes(b.try_into().expect("8 bytes")),
        }
    }

    /// The memory key for an address: SipHash-2-4 over every other field.
    pub fn sign(&self, node: NodeId, place: Place) -> u64 {
        let Place {
            incarnation,
            segment,
            offset,
            len,
            generation,
        } = place;
        let mut h = SipHasher24::new_with_keys(self.k0, self.k1);
        h.write_u32(node.0);
        h.write_u64(incarnation);
        h.write_u32(segment);
        h.write_u64(offset);
        h.write_u64(len);
        h.write_u64(generation);
        h.finish()
    }

    /// Builds a signed address.
    pub fn address(&self, node: NodeId, place: Place) -> GlobalAddr {
        GlobalAddr {
            node,
            incarnation: place.incarnation,
            segment: place.segment,
            offset: place.offset,
            len: place.len,
            generation: place.generation,
            key: self.sign(node, place),
        }
    }

    /// True when the address's key matches its fields.
    pub fn verify(&self, addr: &GlobalAddr) -> bool {
        // Not constant-time: the key is 64 bits and every wrong guess costs a round trip.
        self.sign(addr.node, Place::of(addr)) == addr.key
    }

    /// A nonzero number derived from the secret, for a daemon's incarnation: as random as the
    /// secret (which is drawn at every start) and, SipHash being a PRF, telling nothing about it.
    pub fn incarnation(&self) -> u64 {
        let mut h = SipHasher24::new_with_keys(self.k0, self.k1);
        h.write(b"kvpool incarnation");
        h.finish().max(1)
    }
}

/// Everything an address names inside its node, as signed by [`MacKey::sign`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// Incarnation of the node's daemon.
    pub incarnation: u64,
    /// Segment.
    pub segment: u32,
    /// Byte offset in the segment's data area.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Generation of the object.
    pub generation: u64,
}

impl Place {
    /// The place an address names.
    pub fn of(addr: &GlobalAddr) -> Place {
        Place {
            incarnation: addr.incarnation,
            segment: addr.segment,
            offset: addr.offset,
            len: addr.len,
            generation: addr.generation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_through_bytes() {
        let mac = MacKey::new(*b"0123456789abcdef");
        let a = mac.address(NodeId(u32::MAX - 3), place(5, 2, 4096, 100, 7));
        let b = a.to_bytes();
        assert_eq!(GlobalAddr::from_bytes(&b), Some(a));
        assert!(mac.verify(&GlobalAddr::from_bytes(&b).unwrap()));
        assert_eq!(GlobalAddr::from_bytes(&b[1..]), None);
        assert_eq!(GlobalAddr::from_bytes(&[b.as_slice(), &[0]].concat()), None);
    }

    #[test]
    fn any_changed_field_breaks_the_key() {
        let mac = MacKey::new(*b"0123456789abcdef");
        let a = mac.address(NodeId(1), place(5, 2, 4096, 100, 7));
        assert!(mac.verify(&a));
        for bad in [
            GlobalAddr {
                incarnation: 6,
                ..a
            },
            GlobalAddr {
                node: NodeId(2),
                ..a
            },
            GlobalAddr { segment: 3, ..a },
            GlobalAddr {
                offset: 4096 + 512,
                ..a
            },
            GlobalAddr { len: 101, ..a },
            GlobalAddr { generation: 8, ..a },
            GlobalAddr {
                key: a.key ^ 1,
                ..a
            },
        ] {
            assert!(!mac.verify(&bad), "{bad:?}");
        }
        let other = MacKey::new(*b"fedcba9876543210");
        assert!(!other.verify(&a));
    }

    #[test]
    fn incarnation_is_nonzero_and_differs_per_secret() {
        let a = MacKey::new([1; 16]).incarnation();
        let b = MacKey::new([2; 16]).incarnation();
        assert!(a != 0 && b != 0 && a != b);
    }

    fn place(incarnation: u64, segment: u32, offset: u64, len: u64, generation: u64) -> Place {
        Place {
            incarnation,
            segment,
            offset,
            len,
            generation,
        }
    }

    #[test]
    fn sub_range_checks_bounds_without_overflow() {
        let mac = MacKey::new([7; 16]);
        let a = mac.address(NodeId(0), place(1, 0, 1000, 100, 1));
        assert_eq!(a.sub_range(0, 100), Some(1000));
        assert_eq!(a.sub_range(50, 50), Some(1050));
        assert_eq!(a.sub_range(50, 51), None);
        assert_eq!(a.sub_range(u64::MAX, 2), None);
    }
}
