//! `lru`: least recently used. The baseline every other policy is measured against.

use super::list::{Links, List};
use super::{Eviction, Handle, Insert};
use crate::paged::Paged;

/// Least recently used.
#[derive(Debug)]
pub struct Lru {
    pub(super) links: Links,
    pub(super) order: List,
    pub(super) stamp: Paged<u64>,
}

impl Default for Lru {
    fn default() -> Self {
        Lru {
            links: Links::default(),
            order: List::new(0),
            stamp: Paged::default(),
        }
    }
}

impl Lru {
    /// True when `h` is one of the objects held.
    pub(super) fn holds(&self, h: Handle) -> bool {
        self.links.list_of(h).is_some()
    }
}

impl Eviction for Lru {
    fn insert(&mut self, h: Handle, info: Insert) {
        super::set_stamp(&mut self.stamp, h, info.tick);
        self.links.push_back(&mut self.order, h);
    }

    fn access(&mut self, h: Handle, tick: u64) {
        if self.links.list_of(h).is_some() {
            self.stamp[h as usize] = tick;
            self.links.move_to_back(&mut self.order, h);
        }
    }

    fn remove(&mut self, h: Handle) {
        if self.links.list_of(h).is_some() {
            self.links.remove(&mut self.order, h);
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool, tick: u64) -> Option<Handle> {
        for _ in 0..super::SCAN.min(self.order.len()) {
            let h = self.order.front()?;
            if evictable(h) {
                self.links.remove(&mut self.order, h);
                return Some(h);
            }
            // Pinned, leased or being read: give it a new lease of life rather than meet it at
            // the cold end on every scan.
            self.stamp[h as usize] = tick;
            self.links.move_to_back(&mut self.order, h);
        }
        None
    }

    fn peek_stamp(&self) -> Option<u64> {
        self.order.front().map(|h| self.stamp[h as usize])
    }

    fn worth(&self, h: Handle) -> u64 {
        self.stamp.get(h as usize).copied().unwrap_or(0)
    }

    fn len(&self) -> usize {
        self.order.len()
    }
}
