//! An intrusive doubly linked list of handles, stored in a paged vector indexed by handle: the
//! queue every policy here is built from. O(1) push, remove and pop; no allocation but growing
//! the vector to the largest handle seen.

use super::Handle;
use crate::paged::Paged;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Link {
    prev: u32,
    next: u32,
    /// Which list holds the handle (`u8::MAX`: none); lets several lists share one link table.
    list: u8,
}

/// Links for up to `u32::MAX - 1` handles, shared by a fixed set of lists.
#[derive(Debug, Default)]
pub(crate) struct Links {
    links: Paged<Link>,
}

/// One list's ends and length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct List {
    id: u8,
    head: u32,
    tail: u32,
    len: usize,
}

impl List {
    pub(crate) const fn new(id: u8) -> Self {
        List {
            id,
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The oldest handle (the one `pop_front` returns).
    pub(crate) fn front(&self) -> Option<Handle> {
        (self.head != NIL).then_some(self.head)
    }
}

impl Links {
    fn ensure(&mut self, h: Handle) {
        self.links.grow_to(
            h as usize + 1,
            Link {
                prev: NIL,
                next: NIL,
                list: u8::MAX,
            },
        );
    }

    /// The list holding `h`, if any.
    pub(crate) fn list_of(&self, h: Handle) -> Option<u8> {
        self.links
            .get(h as usize)
            .map(|l| l.list)
            .filter(|&l| l != u8::MAX)
    }

    /// Appends `h` (not in any list) at the back (newest end) of `list`.
    pub(crate) fn push_back(&mut self, list: &mut List, h: Handle) {
        self.ensure(h);
        debug_assert_eq!(
            self.links[h as usize].list,
            u8::MAX,
            "handle already listed"
        );
        self.links[h as usize] = Link {
            prev: list.tail,
            next: NIL,
            list: list.id,
        };
        if list.tail != NIL {
            self.links[list.tail as usize].next = h;
        } else {
            list.head = h;
        }
        list.tail = h;
        list.len += 1;
    }

    /// Unlinks `h` from `list` (which must hold it).
    pub(crate) fn remove(&mut self, list: &mut List, h: Handle) {
        let Link {
            prev,
            next,
            list: id,
        } = self.links[h as usize];
        debug_assert_eq!(id, list.id, "handle is in another list");
        if prev != NIL {
            self.links[prev as usize].next = next;
        } else {
            list.head = next;
        }
        if next != NIL {
            self.links[next as usize].prev = prev;
        } else {
            list.tail = prev;
        }
        self.links[h as usize] = Link {
            prev: NIL,
            next: NIL,
            list: u8::MAX,
        };
        list.len -= 1;
    }

    /// The handle after `h` (towards the newest end) in its list.
    pub(crate) fn next(&self, h: Handle) -> Option<Handle> {
        let n = self.links.get(h as usize)?.next;
        (n != NIL).then_some(n)
    }

    /// Moves `h` (in `list`) to its back.
    pub(crate) fn move_to_back(&mut self, list: &mut List, h: Handle) {
        self.remove(list, h);
        self.push_back(list, h);
    }
}
