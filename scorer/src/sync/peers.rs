//! What a replica knows of the others, without I/O: batches, snapshot parts, reconnections
//! and ticks in; what to do about them out (ask a replica for its snapshot, clear or apply a
//! replica's bookings, drop a silent one, say this replica has joined the fleet). The
//! receiving task carries it over NATS and does what it says.

use super::wire::Batch;
use ahash::AHashMap;
use kvgate_routing::load::Origin;
use std::time::{Duration, Instant};

/// A snapshot asked for and not received is asked for again after this long.
pub const SNAPSHOT_RETRY: Duration = Duration::from_secs(1);

/// How the peers are tracked (`sync:`'s timings).
#[derive(Clone, Copy, Debug)]
pub struct PeerTimings {
    /// Every replica publishes at least this often.
    pub heartbeat: Duration,
    /// A replica silent this long has left.
    pub replica_timeout: Duration,
    /// This replica routes on the fleet's bookings after this long, whatever it heard.
    pub join_wait: Duration,
}

/// Another replica, as heard.
struct Peer {
    origin: Origin,
    last_heard: Instant,
    /// The batch number expected next.
    next_seq: u64,
    /// Its snapshot has been applied since we last lost track of it.
    synced: bool,
    /// When we last asked for its snapshot (while not synced).
    asked_at: Option<Instant>,
}

impl Peer {
    /// Whether to ask for its snapshot at `now`: we have lost track of it and not asked lately.
    fn due(&self, now: Instant) -> bool {
        !self.synced && self.asked_at.is_none_or(|t| now.duration_since(t) >= SNAPSHOT_RETRY)
    }
}

/// The other replicas this one hears.
pub struct Peers {
    me: String,
    timings: PeerTimings,
    started: Instant,
    peers: AHashMap<String, Peer>,
    next_origin: u32,
    joined: bool,
}

/// What a batch on the bookings subject means.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Heard {
    /// Whose bookings its updates are (`None`: our own batch, echoed).
    pub origin: Option<Origin>,
    /// The first batch heard from this replica.
    pub new_replica: bool,
    /// Batches were lost: the number expected and the one that came.
    pub gap: Option<(u64, u64)>,
    /// Ask this replica for its snapshot.
    pub ask: bool,
}

/// What a part of a snapshot means.
#[derive(Debug, PartialEq, Eq)]
pub struct SnapshotStep {
    pub origin: Origin,
    /// The first part: every booking of the replica so far is replaced.
    pub clear_first: bool,
    /// The last part: the replica is in sync again.
    pub complete: bool,
}

/// What time passing means.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Tick {
    /// Replicas silent past the timeout, gone: their bookings are dropped.
    pub gone: Vec<(String, Origin)>,
    /// Replicas to ask for a snapshot (again).
    pub ask: Vec<String>,
    /// This replica has joined the fleet's bookings now (it routes on them from here on).
    pub joined: bool,
}

impl Peers {
    pub fn new(me: &str, timings: PeerTimings, started: Instant) -> Self {
        Peers { me: me.to_string(), timings, started, peers: AHashMap::new(), next_origin: 1, joined: false }
    }

    /// A batch on the bookings subject, at `now`.
    pub fn batch(&mut self, batch: &Batch, now: Instant) -> Heard {
        if batch.replica == self.me {
            return Heard::default();
        }
        let mut heard = Heard::default();
        let next_origin = &mut self.next_origin;
        let peer = self.peers.entry(batch.replica.clone()).or_insert_with(|| {
            heard.new_replica = true;
            let origin = Origin(*next_origin);
            *next_origin += 1;
            Peer { origin, last_heard: now, next_seq: 0, synced: false, asked_at: None }
        });
        peer.last_heard = now;
        if peer.synced && peer.next_seq != batch.seq {
            heard.gap = Some((peer.next_seq, batch.seq));
            peer.synced = false;
            peer.asked_at = None;
        }
        if peer.due(now) {
            peer.asked_at = Some(now);
            heard.ask = true;
        }
        peer.next_seq = batch.seq + 1;
        heard.origin = Some(peer.origin);
        heard
    }

    /// A part of a snapshot we asked for, at `now`; `None` if it is no snapshot part or
    /// comes from a replica we do not know (gone since we asked).
    pub fn snapshot_part(&mut self, batch: &Batch, now: Instant) -> Option<SnapshotStep> {
        let part = batch.snapshot.as_ref()?;
        let peer = self.peers.get_mut(&batch.replica)?;
        peer.last_heard = now;
        if part.last {
            peer.synced = true;
            // The snapshot accounts for every batch up to its number.
            peer.next_seq = batch.seq + 1;
        }
        Some(SnapshotStep { origin: peer.origin, clear_first: part.part == 0, complete: part.last })
    }

    /// Connected to the bus (again), at `now`: whatever came while we were away is lost, so
    /// every known replica is asked for its state anew. Returns whom to ask.
    pub fn reconnected(&mut self, now: Instant) -> Vec<String> {
        self.peers
            .iter_mut()
            .map(|(name, peer)| {
                peer.synced = false;
                peer.asked_at = Some(now);
                name.clone()
            })
            .collect()
    }

    /// Time passed (every half heartbeat): silent replicas dropped, snapshots asked again,
    /// and whether this replica has now joined.
    pub fn tick(&mut self, now: Instant) -> Tick {
        let timeout = self.timings.replica_timeout;
        let gone: Vec<(String, Origin)> = self
            .peers
            .extract_if(|_, p| now.duration_since(p.last_heard) >= timeout)
            .map(|(name, p)| (name, p.origin))
            .collect();
        let mut ask = Vec::new();
        for (name, peer) in self.peers.iter_mut().filter(|(_, p)| p.due(now)) {
            peer.asked_at = Some(now);
            ask.push(name.clone());
        }
        let mut joined = false;
        if !self.joined {
            // Ready once a heartbeat had time to name every replica and each one's snapshot
            // is in — or after `join_wait` whatever happened.
            let waited = now.duration_since(self.started);
            let heard_all = waited >= self.timings.heartbeat * 3 / 2 && self.peers.values().all(|p| p.synced);
            if heard_all || waited >= self.timings.join_wait {
                self.joined = true;
                joined = true;
            }
        }
        Tick { gone, ask, joined }
    }

    /// Replicas heard and not gone.
    pub fn count(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::wire::SnapshotPart;

    const MS: Duration = Duration::from_millis(1);

    fn timings() -> PeerTimings {
        PeerTimings { heartbeat: 100 * MS, replica_timeout: 5000 * MS, join_wait: 3000 * MS }
    }

    fn batch(replica: &str, seq: u64) -> Batch {
        Batch { replica: replica.into(), seq, ..Batch::default() }
    }

    fn part(replica: &str, seq: u64, part: u32, last: bool) -> Batch {
        Batch { snapshot: Some(SnapshotPart { part, last }), ..batch(replica, seq) }
    }

    #[test]
    fn a_new_replica_is_asked_for_its_snapshot_once_and_followed_from_it() {
        let t0 = Instant::now();
        let mut peers = Peers::new("a", timings(), t0);
        assert_eq!(peers.batch(&batch("a", 1), t0), Heard::default(), "our own batch, echoed");
        let first = peers.batch(&batch("b", 7), t0);
        assert_eq!(first, Heard { origin: Some(Origin(1)), new_replica: true, gap: None, ask: true });
        // Its batches apply meanwhile; it is not asked again before the retry.
        let second = peers.batch(&batch("b", 8), t0 + 100 * MS);
        assert_eq!(second, Heard { origin: Some(Origin(1)), ..Heard::default() });
        assert!(peers.tick(t0 + 500 * MS).ask.is_empty());
        // The snapshot, in two parts, accounts for batches up to 8.
        let step = peers.snapshot_part(&part("b", 8, 0, false), t0 + 600 * MS).unwrap();
        assert_eq!(step, SnapshotStep { origin: Origin(1), clear_first: true, complete: false });
        let step = peers.snapshot_part(&part("b", 8, 1, true), t0 + 610 * MS).unwrap();
        assert_eq!(step, SnapshotStep { origin: Origin(1), clear_first: false, complete: true });
        // In sync: the next batch follows on, and nobody is asked at the retry.
        assert_eq!(peers.batch(&batch("b", 9), t0 + 700 * MS).gap, None);
        assert!(peers.tick(t0 + 1700 * MS).ask.is_empty());
        // Another replica gets another origin.
        assert_eq!(peers.batch(&batch("c", 1), t0 + 800 * MS).origin, Some(Origin(2)));
        assert_eq!(peers.count(), 2);
        assert!(peers.snapshot_part(&batch("b", 9), t0).is_none(), "not a snapshot part");
        assert!(peers.snapshot_part(&part("z", 1, 0, true), t0).is_none(), "a replica we do not know");
    }

    #[test]
    fn an_unanswered_snapshot_request_is_repeated() {
        let t0 = Instant::now();
        let mut peers = Peers::new("a", timings(), t0);
        assert!(peers.batch(&batch("b", 1), t0).ask);
        assert!(peers.tick(t0 + 999 * MS).ask.is_empty());
        assert_eq!(peers.tick(t0 + 1000 * MS).ask, vec!["b".to_string()]);
        assert!(!peers.batch(&batch("b", 2), t0 + 1100 * MS).ask, "asked 100 ms ago");
    }

    #[test]
    fn lost_batches_put_a_replica_out_of_sync_until_its_snapshot() {
        let t0 = Instant::now();
        let mut peers = Peers::new("a", timings(), t0);
        peers.batch(&batch("b", 1), t0);
        peers.snapshot_part(&part("b", 1, 0, true), t0);
        assert_eq!(peers.batch(&batch("b", 2), t0).gap, None);
        let skipped = peers.batch(&batch("b", 5), t0 + 10 * MS);
        assert_eq!(skipped.gap, Some((3, 5)));
        assert!(skipped.ask, "asked at once");
        // Out of sync, later numbers are not gaps again.
        assert_eq!(peers.batch(&batch("b", 9), t0 + 20 * MS).gap, None);
        peers.snapshot_part(&part("b", 9, 0, true), t0 + 30 * MS);
        assert_eq!(peers.batch(&batch("b", 11), t0 + 40 * MS).gap, Some((10, 11)));
    }

    #[test]
    fn a_silent_replica_leaves_with_its_bookings() {
        let t0 = Instant::now();
        let mut peers = Peers::new("a", timings(), t0);
        peers.batch(&batch("b", 1), t0);
        peers.batch(&batch("c", 1), t0 + 2500 * MS);
        assert!(peers.tick(t0 + 4999 * MS).gone.is_empty());
        let tick = peers.tick(t0 + 5000 * MS);
        assert_eq!(tick.gone, vec![("b".to_string(), Origin(1))]);
        assert_eq!(peers.count(), 1);
        // Heard again, it is a new replica: asked for its snapshot, under a new origin.
        let back = peers.batch(&batch("b", 2), t0 + 5100 * MS);
        assert!(back.new_replica && back.ask);
        assert_eq!(back.origin, Some(Origin(3)));
    }

    #[test]
    fn after_a_bus_outage_every_replica_is_asked_again() {
        let t0 = Instant::now();
        let mut peers = Peers::new("a", timings(), t0);
        for name in ["b", "c"] {
            peers.batch(&batch(name, 1), t0);
            peers.snapshot_part(&part(name, 1, 0, true), t0);
        }
        let mut asked = peers.reconnected(t0 + 200 * MS);
        asked.sort();
        assert_eq!(asked, vec!["b".to_string(), "c".to_string()]);
        // Not synced until each snapshot comes; asked again at the retry if it does not.
        assert_eq!(peers.batch(&batch("b", 7), t0 + 300 * MS).gap, None, "out of sync: no gap counted");
        peers.snapshot_part(&part("b", 7, 0, true), t0 + 310 * MS);
        assert_eq!(peers.tick(t0 + 1200 * MS).ask, vec!["c".to_string()]);
    }

    #[test]
    fn this_replica_joins_once_it_has_heard_everyone_or_waited_long_enough() {
        let t0 = Instant::now();
        let mut alone = Peers::new("a", timings(), t0);
        assert!(!alone.tick(t0 + 100 * MS).joined, "a heartbeat and a half to hear the others");
        assert!(alone.tick(t0 + 150 * MS).joined, "nobody else: joined");
        assert!(!alone.tick(t0 + 200 * MS).joined, "said once");

        let mut waiting = Peers::new("a", timings(), t0);
        waiting.batch(&batch("b", 1), t0 + 10 * MS);
        assert!(!waiting.tick(t0 + 150 * MS).joined, "b's snapshot is not in");
        waiting.snapshot_part(&part("b", 1, 0, true), t0 + 160 * MS);
        assert!(waiting.tick(t0 + 200 * MS).joined);

        let mut stuck = Peers::new("a", timings(), t0);
        stuck.batch(&batch("b", 1), t0);
        for ms in (50..3000u32).step_by(50) {
            stuck.batch(&batch("b", 1 + u64::from(ms)), t0 + ms * MS);
            assert!(!stuck.tick(t0 + ms * MS).joined);
        }
        assert!(stuck.tick(t0 + 3000 * MS).joined, "join_wait: joined without b's snapshot");
    }
}
