//! Pod identities, sets of pods (which pods are eligible for a request), and per-pod state
//! by id.

use smallvec::SmallVec;

/// A pod, as the [`Router`](crate::router::Router) that allocated the id knows it: ids are
/// dense, from 0, and kept for good (a pod that leaves and comes back keeps its id).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(pub u32);

impl PodId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A set of pods as a bitset: 64 pods per word, two words inline (no heap up to 128 pods).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodSet {
    words: SmallVec<[u64; 2]>,
}

impl PodSet {
    pub fn insert(&mut self, pod: PodId) {
        let w = pod.index() / 64;
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << (pod.index() % 64);
    }

    pub fn contains(&self, pod: PodId) -> bool {
        self.word(pod.index() / 64) & (1 << (pod.index() % 64)) != 0
    }

    /// Bits of pods `64·i .. 64·i + 63`.
    pub fn word(&self, i: usize) -> u64 {
        self.words.get(i).copied().unwrap_or(0)
    }

    /// One more than its highest member's id (0 when empty).
    pub fn id_bound(&self) -> usize {
        let last = self.words.iter().rposition(|w| *w != 0);
        last.map_or(0, |i| i * 64 + 64 - self.words[i].leading_zeros() as usize)
    }
}

/// A component's state of each pod, by id: grown on first use, so that no table has to be
/// kept in step with another, and a pod is registered in one place only (the router).
#[derive(Clone, Debug, Default)]
pub struct PodMap<T> {
    items: Vec<T>,
}

impl<T: Default> PodMap<T> {
    /// The pod's state, if it has any yet.
    pub fn get(&self, pod: PodId) -> Option<&T> {
        self.items.get(pod.index())
    }

    /// The pod's state, made (default) on first use.
    pub fn get_mut(&mut self, pod: PodId) -> &mut T {
        if pod.index() >= self.items.len() {
            self.items.resize_with(pod.index() + 1, T::default);
        }
        &mut self.items[pod.index()]
    }

    /// Every pod's state, with its id.
    pub fn iter(&self) -> impl Iterator<Item = (PodId, &T)> {
        self.items.iter().enumerate().map(|(i, t)| (PodId(i as u32), t))
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.items.iter_mut()
    }

    /// Pods with state (a bound on their ids).
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl FromIterator<PodId> for PodSet {
    fn from_iter<T: IntoIterator<Item = PodId>>(iter: T) -> Self {
        let mut set = PodSet::default();
        iter.into_iter().for_each(|pod| set.insert(pod));
        set
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_across_words() {
        let a: PodSet = [0, 5, 63, 64, 200].into_iter().map(PodId).collect();
        for p in [0, 5, 63, 64, 200] {
            assert!(a.contains(PodId(p)));
        }
        assert!(!a.contains(PodId(1)) && !a.contains(PodId(201)) && !a.contains(PodId(9999)));
        assert_eq!(a.word(0), 1 | 1 << 5 | 1 << 63);
        assert_eq!(a.word(1), 1);
        assert_eq!(a.word(3), 1 << 8);
        assert_eq!(a.word(7), 0);
        assert_eq!((a.id_bound(), PodSet::default().id_bound()), (201, 0));
    }

    #[test]
    fn pod_maps_grow_on_first_use() {
        let mut m: PodMap<u32> = PodMap::default();
        assert_eq!(m.get(PodId(3)), None);
        *m.get_mut(PodId(3)) += 5;
        assert_eq!((m.get(PodId(3)), m.get(PodId(1)), m.len()), (Some(&5), Some(&0), 4));
        assert_eq!(m.iter().map(|(p, v)| (p.0, *v)).last(), Some((3, 5)));
    }
}
