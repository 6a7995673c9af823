//! `lru`: least recently used. The baseline every other policy is measured against.

use super::list::{Links, List};
use super::{Eviction, Handle, Insert};

/// Least recently used.
#[derive(Debug)]
pub struct Lru {
    links: Links,
    order: List,
}

impl Default for Lru {
    fn default() -> Self {
        Lru {
            links: Links::default(),
            order: List::new(0),
        }
    }
}

impl Eviction for Lru {
    fn insert(&mut self, h: Handle, _: Insert) {
        self.links.push_back(&mut self.order, h);
    }

    fn access(&mut self, h: Handle) {
        if self.links.list_of(h).is_some() {
            self.links.move_to_back(&mut self.order, h);
        }
    }

    fn remove(&mut self, h: Handle) {
        if self.links.list_of(h).is_some() {
            self.links.remove(&mut self.order, h);
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool) -> Option<Handle> {
        for _ in 0..super::SCAN.min(self.order.len()) {
            let h = self.order.front()?;
            if evictable(h) {
                self.links.remove(&mut self.order, h);
                return Some(h);
            }
            // Pinned, leased or being read: give it a new lease of life rather than meet it at
            // the cold end on every scan.
            self.links.move_to_back(&mut self.order, h);
        }
        None
    }

    fn len(&self) -> usize {
        self.order.len()
    }
}
