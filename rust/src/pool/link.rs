//! `Link`: an entry's two neighbours in an intrusive doubly linked list over ids, kept side by
//! side so that one cache line holds both (the free queue's block links, the hash map's
//! key-list links).

/// No neighbour: an end of a list, or an entry linked nowhere.
pub const NO_LINK: u32 = u32::MAX;

/// The neighbours of one entry.
#[derive(Clone, Copy, Debug)]
pub struct Link {
    pub prev: u32,
    pub next: u32,
}

impl Link {
    /// Linked nowhere.
    pub const NONE: Link = Link { prev: NO_LINK, next: NO_LINK };
}
