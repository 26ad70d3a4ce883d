//! The manager's request table: request id → per-request state, with each state in a stable
//! slot so that a batch can look a request up once and come back to it by slot.

use hashbrown::HashMap;

/// A map from request id to `T` whose values live in slots that keep their index until the
/// entry is removed (inserting other entries never moves them).
#[derive(Clone, Debug)]
pub struct RequestTable<T> {
    index: HashMap<String, u32>,
    slots: Vec<T>,
    /// The id of each slot's entry (empty for a vacant slot).
    names: Vec<String>,
    /// Slots of removed entries, reused first.
    vacant: Vec<u32>,
    /// The generation of each slot's entry: a number no other entry of this table ever had
    /// (0 for a vacant slot), so `(slot, generation)` names one entry for good.
    gens: Vec<u64>,
    next_gen: u64,
}

impl<T> Default for RequestTable<T> {
    fn default() -> Self {
        RequestTable {
            index: HashMap::new(),
            slots: Vec::new(),
            names: Vec::new(),
            vacant: Vec::new(),
            gens: Vec::new(),
            next_gen: 1,
        }
    }
}

impl<T: Default> RequestTable<T> {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The slot of `id`, if present.
    #[inline]
    pub fn slot(&self, id: &str) -> Option<u32> {
        self.index.get(id).copied()
    }

    /// The slot of `id` and its entry's generation, if present.
    #[inline]
    pub fn slot_gen(&self, id: &str) -> Option<(u32, u64)> {
        self.slot(id).map(|s| (s, self.gen_at(s)))
    }

    /// The generation of the entry in `slot` (0 if the slot is vacant or out of range).
    #[inline]
    pub fn gen_at(&self, slot: u32) -> u64 {
        self.gens.get(slot as usize).copied().unwrap_or(0)
    }

    #[inline]
    pub fn get(&self, id: &str) -> Option<&T> {
        self.slot(id).map(|s| &self.slots[s as usize])
    }

    #[inline]
    pub fn get_mut(&mut self, id: &str) -> Option<&mut T> {
        let s = self.slot(id)?;
        Some(&mut self.slots[s as usize])
    }

    /// The entry in `slot` (a slot returned by [`RequestTable::slot`] or
    /// [`RequestTable::insert`] whose entry has not been removed since).
    #[inline]
    pub fn at(&self, slot: u32) -> &T {
        &self.slots[slot as usize]
    }

    /// [`RequestTable::at`], mutably.
    #[inline]
    pub fn at_mut(&mut self, slot: u32) -> &mut T {
        &mut self.slots[slot as usize]
    }

    /// Insert `value` under `id` (which must not be present); returns its slot.
    pub fn insert(&mut self, id: &str, value: T) -> u32 {
        debug_assert!(!self.index.contains_key(id));
        let s = match self.vacant.pop() {
            Some(s) => {
                self.slots[s as usize] = value;
                s
            }
            None => {
                self.slots.push(value);
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(id.to_owned(), s);
        if self.gens.len() <= s as usize {
            self.gens.resize(s as usize + 1, 0);
        }
        if self.names.len() <= s as usize {
            self.names.resize(s as usize + 1, String::new());
        }
        id.clone_into(&mut self.names[s as usize]);
        self.gens[s as usize] = self.next_gen;
        self.next_gen += 1;
        s
    }

    /// Remove `id`, returning its value.
    pub fn remove(&mut self, id: &str) -> Option<T> {
        let s = self.index.remove(id)?;
        self.vacant.push(s);
        self.gens[s as usize] = 0;
        if let Some(n) = self.names.get_mut(s as usize) {
            n.clear();
        }
        Some(std::mem::take(&mut self.slots[s as usize]))
    }

    /// The id of the entry in `slot`, None for a vacant slot or one out of range.
    #[inline]
    pub fn id_at(&self, slot: u32) -> Option<&str> {
        if self.gen_at(slot) == 0 {
            return None;
        }
        self.names.get(slot as usize).map(String::as_str)
    }

    /// Start loading the generation of `slot` (see [`crate::prefetch`]).
    #[inline(always)]
    pub fn prefetch_gen(&self, slot: u32) {
        if let Some(g) = self.gens.get(slot as usize) {
            crate::prefetch::prefetch(g);
        }
    }

    /// The slots holding an entry, ascending.
    pub fn live_slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.gens.iter().enumerate().filter(|(_, &g)| g != 0).map(|(s, _)| s)
    }

    /// Every id present (any order).
    pub fn ids(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }

    /// Remove every entry.
    pub fn clear(&mut self) {
        self.index.clear();
        self.slots.clear();
        self.names.clear();
        self.vacant.clear();
        self.gens.clear(); // next_gen goes on: no later entry repeats an old generation
    }
}

#[cfg(test)]
mod tests {
    use super::RequestTable;

    #[test]
    fn slots_are_stable_and_reused() {
        let mut t: RequestTable<u64> = RequestTable::default();
        let a = t.insert("a", 1);
        let b = t.insert("b", 2);
        for i in 0..100 {
            t.insert(&format!("x{i}"), i);
        }
        assert_eq!((t.slot("a"), t.slot("b")), (Some(a), Some(b)));
        *t.at_mut(b) += 40;
        assert_eq!((t.get("b"), t.at(b)), (Some(&42), &42));
        assert_eq!(t.remove("a"), Some(1));
        assert_eq!(t.get("a"), None);
        assert_eq!((t.remove("a"), t.len()), (None, 101));
        assert_eq!(t.insert("c", 3), a); // the vacant slot is reused
        assert_eq!(t.get("c"), Some(&3));
        t.clear();
        assert!(t.is_empty() && t.get("b").is_none());
    }

    #[test]
    fn live_slots_are_the_occupied_ones() {
        let mut t: RequestTable<u64> = RequestTable::default();
        let slots: Vec<u32> = (0..5).map(|i| t.insert(&format!("r{i}"), i)).collect();
        t.remove("r1");
        t.remove("r3");
        assert_eq!(t.live_slots().collect::<Vec<_>>(), vec![slots[0] as usize, slots[2] as usize, slots[4] as usize]);
        let s = t.insert("new", 9); // a vacant slot is reused, and live again
        assert!(t.live_slots().any(|x| x == s as usize));
        t.clear();
        assert_eq!(t.live_slots().count(), 0);
    }

    #[test]
    fn generations_name_one_entry_for_good() {
        let mut t: RequestTable<u64> = RequestTable::default();
        let a = t.insert("a", 1);
        let (s, g) = t.slot_gen("a").unwrap();
        assert_eq!((s, t.gen_at(a)), (a, g));
        assert_ne!(g, 0);
        t.remove("a");
        assert_eq!(t.gen_at(a), 0);
        let b = t.insert("b", 2);
        assert_eq!(b, a); // the slot is reused, under a new generation
        assert!(t.gen_at(b) != g && t.gen_at(b) != 0);
        let gb = t.gen_at(b);
        t.clear();
        assert_eq!((t.gen_at(b), t.gen_at(99)), (0, 0));
        let c = t.insert("c", 3);
        assert_eq!(c, b);
        assert!(![0, g, gb].contains(&t.gen_at(c)));
    }
}
