//! Per-publisher sequence numbers: what a batch's number says about lost messages.
//!
//! vLLM numbers batches from 0 per publisher, +1 each. A subscriber that joins late sees a
//! first number above 0 (nothing lost that it could have had); a jump means lost batches
//! (replay them, or distrust the pod's index); a number going back to 0 means the engine
//! restarted with an empty cache; a repeated or older number is a duplicate to drop.

/// What to do with a batch, judged by its sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sequencing {
    /// The expected next batch (or the first one seen): apply it.
    InOrder,
    /// Batches `missing_from..seq` were lost; this one is `seq`.
    Gap { missing_from: u64, seq: u64 },
    /// The publisher started over at 0: the engine restarted, its cache is new.
    Restart,
    /// Already applied (duplicate or late): drop it.
    Stale,
}

/// Tracks one publisher's sequence.
#[derive(Clone, Debug, Default)]
pub struct SequenceTracker {
    next: Option<u64>,
    /// The batches seen last came from the replay buffer: live copies of them may still
    /// arrive (the subscription was up before the replay was read), and are stale — a 0
    /// among them too — until a batch past them arrives.
    replayed: bool,
}

impl SequenceTracker {
    /// Judges batch `seq` and, unless it is stale, advances past it.
    pub fn observe(&mut self, seq: u64) -> Sequencing {
        let verdict = match self.next {
            None => Sequencing::InOrder,
            Some(next) if seq == next => Sequencing::InOrder,
            Some(next) if seq > next => Sequencing::Gap { missing_from: next, seq },
            Some(_) if seq == 0 && !self.replayed => Sequencing::Restart,
            Some(_) => return Sequencing::Stale,
        };
        self.next = seq.checked_add(1);
        self.replayed = false;
        verdict
    }

    /// Batch `seq` was applied from the replay buffer (in order, as [`Self::observe`]
    /// judges): live copies of the replayed batches that arrive next are stale.
    pub fn replayed(&mut self, seq: u64) {
        self.observe(seq);
        self.replayed = true;
    }

    /// The sequence number expected next, if any batch was seen.
    pub fn expected(&self) -> Option<u64> {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judges_orders_gaps_restarts_and_duplicates() {
        let mut t = SequenceTracker::default();
        assert_eq!(t.observe(41), Sequencing::InOrder, "joined late: nothing to recover");
        assert_eq!(t.observe(42), Sequencing::InOrder);
        assert_eq!(t.observe(42), Sequencing::Stale);
        assert_eq!(t.observe(40), Sequencing::Stale);
        assert_eq!(t.observe(45), Sequencing::Gap { missing_from: 43, seq: 45 });
        assert_eq!(t.expected(), Some(46));
        assert_eq!(t.observe(0), Sequencing::Restart);
        assert_eq!(t.observe(1), Sequencing::InOrder);
        assert_eq!(t.observe(u64::MAX), Sequencing::Gap { missing_from: 2, seq: u64::MAX });
        assert_eq!(t.expected(), None);
    }

    #[test]
    fn live_copies_of_replayed_batches_are_stale_a_zero_among_them_too() {
        // Subscribed, then the replay buffer read: the engine's first batches came both ways.
        let mut t = SequenceTracker::default();
        t.replayed(0);
        t.replayed(1);
        assert_eq!(t.observe(0), Sequencing::Stale, "the live copy of batch 0, not a restart");
        assert_eq!(t.observe(1), Sequencing::Stale);
        assert_eq!(t.observe(2), Sequencing::InOrder);
        assert_eq!(t.observe(0), Sequencing::Restart, "past the replayed batches, 0 is a restart again");
    }
}
