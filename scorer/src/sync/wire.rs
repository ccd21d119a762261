//! The sync's messages on the wire: prost [`Batch`]es of booking [`Update`]s, pods named by
//! the address the proxy routes to (pod ids are each process's own).

use crate::scorer::Pod;
use ahash::AHashMap;
use kvgate_routing::adapters::AdapterId;
use kvgate_routing::hash::SequenceHash;
use kvgate_routing::load::{Booking, BookingUpdate, Leg, Lifecycle};
use kvgate_routing::pod_set::PodId;
use prost::Message;
use std::net::SocketAddr;
use std::sync::Arc;

/// A NATS message carries at most this many bytes of updates (servers accept 1 MiB by
/// default); more go in several numbered batches.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// One message of the booking sync.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Batch {
    /// The sending replica's `replica_id`.
    #[prost(string, tag = "1")]
    pub replica: String,
    /// Number of the sender's batch on `<prefix>.bookings` (1, 2, …); on snapshot parts,
    /// the last number the snapshot accounts for.
    #[prost(uint64, tag = "2")]
    pub seq: u64,
    /// When it was sent (Unix seconds), for the lag metric.
    #[prost(double, tag = "3")]
    pub sent_at: f64,
    #[prost(message, repeated, tag = "4")]
    pub updates: Vec<Update>,
    /// Set on the parts of a snapshot: the first replaces every booking the sender had
    /// shared before.
    #[prost(message, optional, tag = "5")]
    pub snapshot: Option<SnapshotPart>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotPart {
    #[prost(uint32, tag = "1")]
    pub part: u32,
    #[prost(bool, tag = "2")]
    pub last: bool,
}

/// One booking change ([`BookingUpdate`]), the pod named by the address the proxy routes to.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Update {
    #[prost(string, tag = "1")]
    pub request: String,
    #[prost(bool, tag = "2")]
    pub prefill_leg: bool,
    #[prost(enumeration = "Kind", tag = "3")]
    pub kind: i32,
    /// `ip:port` (booked and moved).
    #[prost(string, tag = "4")]
    pub pod: String,
    #[prost(uint32, tag = "5")]
    pub prompt_tokens: u32,
    #[prost(uint32, tag = "6")]
    pub cached_tokens: u32,
    /// The prompt's block chain (booked).
    #[prost(fixed64, repeated, tag = "7")]
    pub chain: Vec<u64>,
    #[prost(uint32, optional, tag = "8")]
    pub max_output_tokens: Option<u32>,
    /// The LoRA adapter's [`AdapterId`] (booked).
    #[prost(fixed64, optional, tag = "9")]
    pub adapter: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Kind {
    Booked = 0,
    FirstToken = 1,
    Done = 2,
    Cancelled = 3,
    Moved = 4,
}

/// The wire form of an update (`pods`: the scorer's pod table, by id).
pub fn encode_update(update: &BookingUpdate, pods: &[Arc<Pod>]) -> Update {
    let address = |pod: PodId| pods.get(pod.index()).map(|p| p.address.clone()).unwrap_or_default();
    let leg = |leg: &Leg| *leg == Leg::Prefill;
    match update {
        BookingUpdate::Booked { request, leg: l, booking } => Update {
            request: request.to_string(),
            prefill_leg: leg(l),
            kind: Kind::Booked as i32,
            pod: address(booking.pod),
            prompt_tokens: booking.prompt_tokens,
            cached_tokens: booking.cached_tokens,
            chain: booking.chain.iter().map(|h| h.0).collect(),
            max_output_tokens: booking.max_output_tokens,
            adapter: booking.adapter.map(|a| a.0),
        },
        BookingUpdate::Reported { request, leg: l, event } => Update {
            request: request.to_string(),
            prefill_leg: leg(l),
            kind: match event {
                Lifecycle::FirstToken => Kind::FirstToken,
                Lifecycle::Done => Kind::Done,
                Lifecycle::Cancelled => Kind::Cancelled,
            } as i32,
            ..Update::default()
        },
        BookingUpdate::Moved { request, leg: l, pod, cached_tokens } => Update {
            request: request.to_string(),
            prefill_leg: leg(l),
            kind: Kind::Moved as i32,
            pod: address(*pod),
            cached_tokens: *cached_tokens,
            ..Update::default()
        },
    }
}

/// Why an update from another replica cannot be applied here.
#[derive(Debug, PartialEq, Eq)]
pub enum Unusable {
    /// It names a pod this replica does not route to (not discovered yet, or gone).
    UnknownPod,
    /// An unknown kind (a newer replica's).
    UnknownKind,
}

/// An update from the wire, its pod resolved by address (`pods`: this replica's).
pub fn decode_update(update: Update, pods: &AHashMap<SocketAddr, PodId>) -> Result<BookingUpdate, Unusable> {
    let pod = || update.pod.parse::<SocketAddr>().ok().and_then(|a| pods.get(&a).copied()).ok_or(Unusable::UnknownPod);
    let leg = if update.prefill_leg { Leg::Prefill } else { Leg::Serve };
    let request: Box<str> = update.request.as_str().into();
    let reported = |event| BookingUpdate::Reported { request: request.clone(), leg, event };
    Ok(match Kind::try_from(update.kind).map_err(|_| Unusable::UnknownKind)? {
        Kind::Booked => BookingUpdate::Booked {
            booking: Booking {
                pod: pod()?,
                prompt_tokens: update.prompt_tokens,
                cached_tokens: update.cached_tokens,
                chain: update.chain.into_iter().map(SequenceHash).collect(),
                max_output_tokens: update.max_output_tokens,
                adapter: update.adapter.map(AdapterId),
            },
            request,
            leg,
        },
        Kind::FirstToken => reported(Lifecycle::FirstToken),
        Kind::Done => reported(Lifecycle::Done),
        Kind::Cancelled => reported(Lifecycle::Cancelled),
        Kind::Moved => BookingUpdate::Moved { pod: pod()?, request, leg, cached_tokens: update.cached_tokens },
    })
}

/// Splits updates into messages of at most [`MAX_MESSAGE_BYTES`] (at least one update each).
pub fn split(updates: Vec<Update>) -> Vec<Vec<Update>> {
    let mut out: Vec<Vec<Update>> = Vec::new();
    let mut size = 0;
    for u in updates {
        let len = u.encoded_len() + 4;
        match out.last_mut() {
            Some(last) if size + len <= MAX_MESSAGE_BYTES => last.push(u),
            _ => {
                out.push(vec![u]);
                size = 0;
            }
        }
        size += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Role;
    use crate::scorer::Pod;

    #[test]
    fn updates_cross_the_wire_by_pod_address() {
        let pod = |id: u32, address: &str| {
            Arc::new(Pod {
                id: PodId(id),
                name: format!("pod-{id}"),
                address: address.into(),
                role: Role::Both,
                precise: true,
                scraped: true,
            })
        };
        // The sender knows the pods in one order, the receiver in another.
        let sender = vec![pod(0, "10.0.0.1:8000"), pod(1, "10.0.0.2:8000")];
        let receiver: AHashMap<SocketAddr, PodId> =
            [("10.0.0.2:8000".parse().unwrap(), PodId(0)), ("10.0.0.1:8000".parse().unwrap(), PodId(1))].into();
        let booked = BookingUpdate::Booked {
            request: "r1".into(),
            leg: Leg::Prefill,
            booking: Booking {
                pod: PodId(1),
                prompt_tokens: 40,
                cached_tokens: 16,
                chain: vec![SequenceHash(7), SequenceHash(u64::MAX)].into(),
                max_output_tokens: Some(0),
                adapter: Some(AdapterId::of("sql")),
            },
        };
        let moved = BookingUpdate::Moved { request: "r2".into(), leg: Leg::Serve, pod: PodId(0), cached_tokens: 3 };
        let done = BookingUpdate::Reported { request: "r1".into(), leg: Leg::Serve, event: Lifecycle::Cancelled };
        let batch = Batch {
            replica: "a".into(),
            seq: 9,
            sent_at: 1.5,
            updates: [&booked, &moved, &done].iter().map(|u| encode_update(u, &sender)).collect(),
            snapshot: None,
        };
        let back = Batch::decode(batch.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back, batch);
        let decoded: Vec<BookingUpdate> =
            back.updates.into_iter().map(|u| decode_update(u, &receiver).unwrap()).collect();
        let on = |pod| match &decoded[0] {
            BookingUpdate::Booked { booking, .. } => booking.pod == pod,
            _ => false,
        };
        assert!(on(PodId(0)), "10.0.0.2 is the receiver's pod 0");
        assert!(
            matches!(&decoded[0], BookingUpdate::Booked { booking, .. } if booking.adapter == Some(AdapterId::of("sql")))
        );
        assert_eq!(
            decoded[1],
            BookingUpdate::Moved { request: "r2".into(), leg: Leg::Serve, pod: PodId(1), cached_tokens: 3 }
        );
        assert_eq!(decoded[2], done);

        let elsewhere = Update { pod: "10.9.9.9:1".into(), ..encode_update(&booked, &sender) };
        assert_eq!(decode_update(elsewhere, &receiver), Err(Unusable::UnknownPod));
        assert_eq!(decode_update(Update { kind: 99, ..Update::default() }, &receiver), Err(Unusable::UnknownKind));
    }

    #[test]
    fn large_updates_are_split_under_the_message_limit() {
        let big = Update { chain: vec![1; 10_000], ..Update::default() }; // ≈ 80 kB each
        let parts = split(vec![big; 7]);
        assert!(parts.len() >= 3, "{}", parts.len());
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 7);
        for p in &parts {
            assert!(p.iter().map(|u| u.encoded_len()).sum::<usize>() <= MAX_MESSAGE_BYTES);
        }
        assert!(split(Vec::new()).is_empty());
    }
}
