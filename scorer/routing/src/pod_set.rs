//! A set of pods as a bitset: the value of the global block index. Two words inline cover
//! 128 pods without a heap allocation; larger fleets spill to the heap.

use smallvec::SmallVec;

/// Index of a pod in the scorer's pod table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(pub u32);

impl PodId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Which pods hold a block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodSet {
    words: SmallVec<[u64; 2]>,
}

impl PodSet {
    pub fn insert(&mut self, pod: PodId) {
        let (w, bit) = (pod.index() / 64, pod.index() % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << bit;
    }

    pub fn remove(&mut self, pod: PodId) {
        let (w, bit) = (pod.index() / 64, pod.index() % 64);
        if let Some(word) = self.words.get_mut(w) {
            *word &= !(1 << bit);
        }
        while self.words.last() == Some(&0) {
            self.words.pop();
        }
    }

    pub fn contains(&self, pod: PodId) -> bool {
        self.words.get(pod.index() / 64).is_some_and(|w| w & (1 << (pod.index() % 64)) != 0)
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The pods in `self` that are also in `other`, word by word into `out`.
    pub fn intersect_into(&self, other: &PodSet, out: &mut PodSet) {
        out.words.clear();
        out.words.extend(self.words.iter().zip(other.words.iter()).map(|(a, b)| a & b));
        while out.words.last() == Some(&0) {
            out.words.pop();
        }
    }

    /// Pods in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = PodId> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let bit = bits.trailing_zeros();
                bits &= bits - 1;
                Some(PodId(w as u32 * 64 + bit))
            })
        })
    }

    /// Heap bytes used beyond the inline words (0 for fleets up to 128 pods).
    pub fn heap_bytes(&self) -> usize {
        if self.words.spilled() { self.words.capacity() * 8 } else { 0 }
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
    fn insert_remove_and_intersect_across_words() {
        let a: PodSet = [0, 5, 63, 64, 200].into_iter().map(PodId).collect();
        let b: PodSet = [5, 64, 201].into_iter().map(PodId).collect();
        let mut both = PodSet::default();
        a.intersect_into(&b, &mut both);
        assert_eq!(both.iter().collect::<Vec<_>>(), vec![PodId(5), PodId(64)]);
        assert!(a.contains(PodId(200)) && !a.contains(PodId(201)) && !a.contains(PodId(9999)));
        let mut c = a.clone();
        for p in [0, 5, 63, 64, 200] {
            c.remove(PodId(p));
        }
        assert!(c.is_empty());
        assert_eq!(c, PodSet::default(), "trailing zero words are trimmed");
        assert!(a.heap_bytes() > 0, "pod 200 needs a fourth word");
        assert_eq!(b.iter().count(), 3);
    }
}
