//! Pod identities and sets of pods (which pods are eligible for a request).

use smallvec::SmallVec;

/// Index of a pod in the scorer's pod table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
}

impl FromIterator<PodId> for PodSet {
    fn from_iter<T: IntoIterator<Item = PodId>>(iter: T) -> Self {
        let mut set = PodSet::default();
        for pod in iter {
            set.insert(pod);
        }
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
    }
}
