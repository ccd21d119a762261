//! Decoding the KV-event batches engines publish.
//!
//! A batch is the msgpack array `[ts, [event, ...], data_parallel_rank?]`. Events come in two
//! encodings: positional arrays tagged by class name in the first element (vLLM ≤ 0.23;
//! trailing fields vary by version, extra ones are ignored) and maps tagged by `"type"`
//! (vLLM ≥ 0.24; defaulted fields may be absent, unknown keys are ignored). Block hashes are
//! unsigned or signed integers or byte strings ([`EngineHash`]). A batch decodes completely
//! or not at all, so garbage can never be half-applied; event kinds from newer engines that
//! kvgate does not know are kept as [`KvEvent::Unknown`] and skipped.

use crate::hash::EngineHash;
use crate::msgpack::{Int, MsgpackError, Reader};

/// One decoded batch (one engine step).
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch<'a> {
    pub ts: f64,
    pub events: Vec<KvEvent<'a>>,
    pub data_parallel_rank: Option<u64>,
}

/// A cache change on one engine.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent<'a> {
    /// Consecutive full blocks were cached: `token_ids` holds all their tokens.
    BlockStored(BlockStored<'a>),
    /// Cached blocks were evicted.
    BlockRemoved { block_hashes: Vec<EngineHash>, tier: Tier, group: u32 },
    /// The engine dropped its whole cache.
    AllBlocksCleared,
    /// An event type this version of kvgate does not know (newer engines); skipped.
    Unknown(&'a str),
}

/// Where a block lives. Blocks in the engine's own GPU cache make its prefill free; blocks
/// its KV connector offloaded to local host memory or storage (vLLM's `OffloadingConnector`,
/// LMCache) are loaded back instead of recomputed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// `medium` absent, nil or `"GPU"`.
    Gpu,
    /// `medium` `"CPU"`: offloaded to the pod's host memory.
    Cpu,
    /// `medium` `"STORAGE"`: offloaded to the pod's disk or object store.
    Storage,
    /// Another KV-cache group offloaded, a `REMOTE` locality (a tier shared by pods, not
    /// this pod's) or an unknown medium: not indexed.
    Other,
}

/// What kind of layers a KV-cache group serves (`kv_cache_spec_kind`): a hybrid model keeps
/// one group per kind, and a prefix is cached only as far as every group serves it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GroupKind {
    /// Full attention (MLA too): the whole prefix's blocks are needed.
    #[default]
    FullAttention,
    /// Sliding-window attention over this many tokens: only the blocks of the last window
    /// before the hit are needed.
    SlidingWindow(u32),
    /// Mamba state: one block, at the hit.
    Mamba,
    /// A kind kvgate does not model (chunked local attention, encoder-only, …).
    Other,
}

impl GroupKind {
    fn parse(kind: Option<&str>, sliding_window: Option<u64>) -> Self {
        match (kind, sliding_window) {
            (None | Some("full_attention" | "mla_attention"), _) => GroupKind::FullAttention,
            (Some("sliding_window" | "sliding_window_mla"), Some(w)) if w > 0 => {
                GroupKind::SlidingWindow(u32::try_from(w).unwrap_or(u32::MAX))
            }
            (Some("mamba"), _) => GroupKind::Mamba,
            _ => GroupKind::Other,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored<'a> {
    pub block_hashes: Vec<EngineHash>,
    pub parent_block_hash: Option<EngineHash>,
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    pub lora_name: Option<&'a str>,
    /// The string extra keys of the first block (vLLM: LoRA name, then the cache salt).
    pub first_block_extra: Vec<&'a str>,
    /// Some block carries extra keys kvgate cannot reproduce for requests (multimodal
    /// identifiers, prompt-embedding digests): such blocks never match a text request.
    pub opaque_extra_keys: bool,
    pub tier: Tier,
    /// The KV-cache group (`group_idx`; 0 when absent) and its kind.
    pub group: u32,
    pub group_kind: GroupKind,
}

impl BlockStored<'_> {
    /// An offload tier's announcement that names only the blocks' engine hashes (vLLM's
    /// `OffloadingConnector` unless `self_describing_kv_events`: no tokens, no parent, block
    /// size 0): the pod's index resolves them through the hashes it already knows.
    pub fn is_placeholder(&self) -> bool {
        self.token_ids.is_empty() && self.block_size == 0
    }
}

/// Why a batch was dropped.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("malformed msgpack: {0}")]
    Msgpack(#[from] MsgpackError),
    #[error("{0}")]
    Shape(String),
}

fn shape<T>(message: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError::Shape(message.into()))
}

/// Decodes one batch payload (the third ZMQ frame).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch<'_>, DecodeError> {
    let mut r = Reader::new(payload);
    let n = r.array_len()?;
    if n < 2 {
        return shape(format!("a batch is an array of at least 2 elements, got {n}"));
    }
    let ts = r.number()?;
    let events = r.array(decode_event)?;
    let data_parallel_rank = if n >= 3 { if r.try_nil()? { None } else { Some(r.uint()?) } } else { None };
    for _ in 3..n {
        r.skip()?;
    }
    if !r.is_empty() {
        return shape(format!("{} bytes after the batch", payload.len() - r.position()));
    }
    Ok(EventBatch { ts, events, data_parallel_rank })
}

fn decode_event<'a>(r: &mut Reader<'a>) -> Result<KvEvent<'a>, DecodeError> {
    if r.at_array() {
        decode_positional(r)
    } else if r.at_map() {
        decode_tagged_map(r)
    } else {
        shape(format!("an event must be an array or a map (byte {})", r.position()))
    }
}

/// Fields of any event, filled from either encoding.
#[derive(Default)]
struct Fields<'a> {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u64>,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    first_block_extra: Vec<&'a str>,
    opaque_extra_keys: bool,
    group_idx: Option<u64>,
    spec_kind: Option<&'a str>,
    sliding_window: Option<u64>,
    locality: Option<&'a str>,
}

#[derive(Clone, Copy, PartialEq)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    Locality,
    Ignored,
}

/// vLLM's field order, by event kind (new fields are only ever appended).
const STORED_ORDER: [Field; 12] = [
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::Ignored, // lora_id (deprecated)
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
    Field::SlidingWindow,
    Field::Locality,
];
const REMOVED_ORDER: [Field; 4] = [Field::BlockHashes, Field::Medium, Field::GroupIdx, Field::Locality];

fn field_by_name(name: &str) -> Field {
    match name {
        "block_hashes" => Field::BlockHashes,
        "parent_block_hash" => Field::Parent,
        "token_ids" => Field::TokenIds,
        "block_size" => Field::BlockSize,
        "medium" => Field::Medium,
        "lora_name" => Field::LoraName,
        "extra_keys" => Field::ExtraKeys,
        "group_idx" => Field::GroupIdx,
        "kv_cache_spec_kind" => Field::SpecKind,
        "kv_cache_spec_sliding_window" => Field::SlidingWindow,
        "locality" => Field::Locality,
        _ => Field::Ignored,
    }
}

fn decode_positional<'a>(r: &mut Reader<'a>) -> Result<KvEvent<'a>, DecodeError> {
    let n = r.array_len()?;
    if n == 0 {
        return shape("an event array needs its type tag");
    }
    let kind = r.str()?;
    let order: &[Field] = match kind {
        "BlockStored" => &STORED_ORDER,
        "BlockRemoved" => &REMOVED_ORDER,
        _ => &[],
    };
    let mut fields = Fields::default();
    for i in 0..n - 1 {
        match order.get(i) {
            Some(&field) => read_field(r, field, &mut fields)?,
            None => r.skip()?,
        }
    }
    finish(kind, fields)
}

fn decode_tagged_map<'a>(r: &mut Reader<'a>) -> Result<KvEvent<'a>, DecodeError> {
    let n = r.map_len()?;
    let mut kind = None;
    let mut fields = Fields::default();
    for _ in 0..n {
        let key = r.str()?;
        if key == "type" {
            kind = Some(r.str()?);
        } else {
            read_field(r, field_by_name(key), &mut fields)?;
        }
    }
    match kind {
        Some(kind) => finish(kind, fields),
        None => shape("an event map has no 'type'"),
    }
}

fn read_field<'a>(r: &mut Reader<'a>, field: Field, f: &mut Fields<'a>) -> Result<(), DecodeError> {
    match field {
        Field::BlockHashes => f.block_hashes = Some(r.array(read_hash)?),
        Field::Parent => f.parent_block_hash = if r.try_nil()? { None } else { Some(read_hash(r)?) },
        Field::TokenIds => {
            let token = |r: &mut Reader<'a>| {
                let at = r.position();
                u32::try_from(r.uint()?).map_err(|_| MsgpackError::Range(at))
            };
            f.token_ids = Some(r.array(token)?);
        }
        Field::BlockSize => f.block_size = if r.try_nil()? { None } else { Some(r.uint()?) },
        Field::Medium => f.medium = if r.try_nil()? { None } else { Some(r.str()?) },
        Field::LoraName => f.lora_name = if r.try_nil()? { None } else { Some(r.str()?) },
        Field::GroupIdx => f.group_idx = if r.try_nil()? { None } else { Some(r.uint()?) },
        Field::SpecKind => f.spec_kind = if r.try_nil()? { None } else { Some(r.str()?) },
        Field::SlidingWindow => f.sliding_window = if r.try_nil()? { None } else { Some(r.uint()?) },
        Field::Locality => f.locality = if r.try_nil()? { None } else { Some(r.str()?) },
        Field::ExtraKeys => read_extra_keys(r, f)?,
        Field::Ignored => r.skip()?,
    }
    Ok(())
}

/// `extra_keys`: nil, or one entry per block, each nil or an array of keys. String keys of
/// the first block seed the hash chain; any non-string key makes the event opaque.
fn read_extra_keys<'a>(r: &mut Reader<'a>, f: &mut Fields<'a>) -> Result<(), DecodeError> {
    if r.try_nil()? {
        return Ok(());
    }
    let blocks = r.array_len()?;
    for block in 0..blocks {
        if r.try_nil()? {
            continue;
        }
        let keys = r.array_len()?;
        for _ in 0..keys {
            if r.at_str() {
                let key = r.str()?;
                if block == 0 {
                    f.first_block_extra.push(key);
                }
            } else {
                f.opaque_extra_keys = true;
                r.skip()?;
            }
        }
    }
    Ok(())
}

fn read_hash(r: &mut Reader<'_>) -> Result<EngineHash, MsgpackError> {
    if matches!(r.peek()?, 0xc4..=0xc6) {
        return Ok(EngineHash::from_bytes(r.bin()?));
    }
    Ok(match r.int()? {
        Int::Unsigned(v) => EngineHash(v),
        Int::Negative(v) => EngineHash(v as u64),
    })
}

fn finish<'a>(kind: &'a str, f: Fields<'a>) -> Result<KvEvent<'a>, DecodeError> {
    let group = u32::try_from(f.group_idx.unwrap_or(0)).unwrap_or(u32::MAX);
    let tier = match (f.medium, group, f.locality) {
        (_, _, Some("REMOTE")) => Tier::Other,
        (None | Some("GPU"), _, _) => Tier::Gpu,
        // Offloaded blocks are indexed for the first group only.
        (_, 1.., _) => Tier::Other,
        (Some("CPU"), _, _) => Tier::Cpu,
        (Some("STORAGE"), _, _) => Tier::Storage,
        _ => Tier::Other,
    };
    match kind {
        "BlockStored" => {
            let (Some(block_hashes), Some(token_ids), Some(block_size)) = (f.block_hashes, f.token_ids, f.block_size)
            else {
                return shape("BlockStored needs block_hashes, token_ids and block_size");
            };
            let placeholder = block_size == 0 && token_ids.is_empty() && tier != Tier::Gpu;
            if !placeholder
                && (block_size == 0 || token_ids.len() as u64 != block_size.saturating_mul(block_hashes.len() as u64))
            {
                return shape(format!(
                    "BlockStored has {} tokens for {} blocks of {block_size}",
                    token_ids.len(),
                    block_hashes.len()
                ));
            }
            Ok(KvEvent::BlockStored(BlockStored {
                block_hashes,
                parent_block_hash: f.parent_block_hash,
                token_ids,
                block_size: block_size as usize,
                lora_name: f.lora_name,
                first_block_extra: f.first_block_extra,
                opaque_extra_keys: f.opaque_extra_keys,
                tier,
                group,
                group_kind: GroupKind::parse(f.spec_kind, f.sliding_window),
            }))
        }
        "BlockRemoved" => match f.block_hashes {
            Some(block_hashes) => Ok(KvEvent::BlockRemoved { block_hashes, tier, group }),
            None => shape("BlockRemoved needs block_hashes"),
        },
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Ok(KvEvent::Unknown(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str, index: usize) -> Vec<u8> {
        kvgate_test_harness::vllm_fixture_payload(name, index)
    }

    fn check_fixture(name: &str) {
        let first = fixture(name, 0);
        let batch = decode_batch(&first).unwrap();
        assert_eq!(batch.ts, 1700000000.5);
        assert_eq!(batch.data_parallel_rank, Some(0));
        let KvEvent::BlockStored(stored) = &batch.events[0] else { panic!("{batch:?}") };
        assert_eq!(stored.block_hashes, vec![EngineHash(0x1122334455667788), EngineHash(17357102489901502592)]);
        assert!(stored.block_hashes[1].0 > i64::MAX as u64);
        assert_eq!(stored.parent_block_hash, None);
        assert_eq!(stored.token_ids, vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(stored.block_size, 4);
        assert_eq!(stored.tier, Tier::Gpu);
        let second = fixture(name, 1);
        let batch = decode_batch(&second).unwrap();
        assert_eq!(
            batch.events,
            vec![
                KvEvent::BlockRemoved {
                    block_hashes: vec![EngineHash(17357102489901502592)],
                    tier: Tier::Gpu,
                    group: 0
                },
                KvEvent::AllBlocksCleared
            ]
        );
    }

    #[test]
    fn decodes_vllm_0_23_positional_arrays() {
        check_fixture("vllm-0.23.0-kv-events.json");
    }

    #[test]
    fn decodes_vllm_0_33_tagged_maps() {
        check_fixture("vllm-0.33.0-kv-events.json");
    }

    #[test]
    fn decodes_offload_tier_events_as_vllm_0_33_publishes_them() {
        // Batch 0: a GPU store, then the OffloadingConnector's placeholders (hash only,
        // medium CPU, block size 0) in the same batch.
        let first = fixture("vllm-0.33.0-offload-kv-events.json", 0);
        let batch = decode_batch(&first).unwrap();
        assert_eq!(batch.events.len(), 3, "placeholders do not spoil the batch");
        let KvEvent::BlockStored(gpu) = &batch.events[0] else { panic!("{batch:?}") };
        assert_eq!((gpu.tier, gpu.is_placeholder()), (Tier::Gpu, false));
        for (event, hash) in batch.events[1..].iter().zip([0x1122334455667788, 17357102489901502592]) {
            let KvEvent::BlockStored(cpu) = event else { panic!("{event:?}") };
            assert_eq!((cpu.tier, cpu.is_placeholder()), (Tier::Cpu, true));
            assert_eq!(cpu.block_hashes, vec![EngineHash(hash)]);
        }
        // Batch 1: a self-describing CPU store (tokens, parent), a GPU eviction.
        let second = fixture("vllm-0.33.0-offload-kv-events.json", 1);
        let batch = decode_batch(&second).unwrap();
        let KvEvent::BlockStored(described) = &batch.events[0] else { panic!("{batch:?}") };
        assert_eq!((described.tier, described.is_placeholder()), (Tier::Cpu, false));
        assert_eq!((described.token_ids.as_slice(), described.block_size), (&[9, 10, 11, 12][..], 4));
        assert_eq!(described.parent_block_hash, Some(EngineHash(17357102489901502592)));
        assert!(matches!(batch.events[1], KvEvent::BlockRemoved { tier: Tier::Gpu, .. }));
        // Batch 2: the CPU tier evicts.
        let third = fixture("vllm-0.33.0-offload-kv-events.json", 2);
        assert_eq!(
            decode_batch(&third).unwrap().events,
            vec![KvEvent::BlockRemoved { block_hashes: vec![EngineHash(42)], tier: Tier::Cpu, group: 0 }]
        );
    }

    #[test]
    fn tiers_by_medium_group_and_locality() {
        // {"type": "BlockRemoved", "block_hashes": [1], "medium": M, "group_idx": G, "locality": L}
        let removed = |medium: &str, group: u8, locality: Option<&str>| {
            let mut ev = vec![0x85];
            for s in ["type", "BlockRemoved", "block_hashes"] {
                fixstr(&mut ev, s);
            }
            ev.extend([0x91, 0x01]);
            for s in ["medium", medium, "group_idx"] {
                fixstr(&mut ev, s);
            }
            ev.push(group);
            fixstr(&mut ev, "locality");
            match locality {
                Some(l) => fixstr(&mut ev, l),
                None => ev.push(0xc0),
            }
            match &decode_batch(&batch_with(&ev)).unwrap().events[0] {
                KvEvent::BlockRemoved { tier, group, .. } => (*tier, *group),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(removed("GPU", 0, None), (Tier::Gpu, 0));
        assert_eq!(removed("CPU", 0, Some("LOCAL")), (Tier::Cpu, 0));
        assert_eq!(removed("STORAGE", 0, None), (Tier::Storage, 0));
        assert_eq!(removed("CPU", 0, Some("REMOTE")).0, Tier::Other, "a shared tier is not the pod's");
        assert_eq!(removed("GPU", 1, None), (Tier::Gpu, 1), "another KV-cache group of the GPU cache");
        assert_eq!(removed("CPU", 1, None).0, Tier::Other, "another group's offloaded blocks");
        assert_eq!(removed("NVME", 0, None).0, Tier::Other);
    }

    #[test]
    fn a_gpu_store_without_tokens_is_malformed() {
        // ["BlockStored", [1], nil, [], 0, nil, "GPU"]: only offload tiers send placeholders.
        let mut ev = vec![0x97, 0xab];
        ev.extend(b"BlockStored");
        ev.extend([0x91, 0x01, 0xc0, 0x90, 0x00, 0xc0, 0xa3]);
        ev.extend(b"GPU");
        assert!(decode_batch(&batch_with(&ev)).is_err());
    }

    /// Appends `s` as a msgpack fixstr (under 32 bytes).
    fn fixstr(ev: &mut Vec<u8>, s: &str) {
        assert!(s.len() < 32);
        ev.push(0xa0 | s.len() as u8);
        ev.extend(s.as_bytes());
    }

    /// Hand-built payload: `[ts, [event], nil]` with one event built by `event`.
    fn batch_with(event: &[u8]) -> Vec<u8> {
        let mut p = vec![0x93, 0xcb];
        p.extend(1.0f64.to_be_bytes());
        p.push(0x91);
        p.extend_from_slice(event);
        p.push(0xc0);
        p
    }

    #[test]
    fn signed_and_byte_hashes_are_accepted() {
        // SGLang: ["BlockRemoved", [-2, 5], nil] with signed int64 hashes.
        let mut ev = vec![0x93, 0xac];
        ev.extend(b"BlockRemoved");
        ev.extend([0x92, 0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0x05, 0xc0]);
        let payload = batch_with(&ev);
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(batch.data_parallel_rank, None);
        assert_eq!(
            batch.events[0],
            KvEvent::BlockRemoved {
                block_hashes: vec![EngineHash(u64::MAX - 1), EngineHash(5)],
                tier: Tier::Gpu,
                group: 0
            }
        );
        // {"type": "BlockRemoved", "block_hashes": [bin32], "medium": "CPU"}
        let mut ev = vec![0x83];
        for s in ["type", "BlockRemoved", "block_hashes"] {
            fixstr(&mut ev, s);
        }
        ev.extend([0x91, 0xc4, 32]);
        ev.extend([9u8; 32]);
        fixstr(&mut ev, "medium");
        fixstr(&mut ev, "CPU");
        let payload = batch_with(&ev);
        match &decode_batch(&payload).unwrap().events[0] {
            KvEvent::BlockRemoved { block_hashes, tier, .. } => {
                assert_eq!(block_hashes, &vec![EngineHash::from_bytes(&[9u8; 32])]);
                assert_eq!(*tier, Tier::Cpu);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_events_and_keys_are_skipped() {
        // {"type": "BlockMoved", "x": [1]} and a map event with an unknown key.
        let mut ev = vec![0x82, 0xa4];
        ev.extend(b"type");
        ev.push(0xaa);
        ev.extend(b"BlockMoved");
        ev.push(0xa1);
        ev.extend(b"x");
        ev.extend([0x91, 0x01]);
        let payload = batch_with(&ev);
        assert_eq!(decode_batch(&payload).unwrap().events, vec![KvEvent::Unknown("BlockMoved")]);
    }

    #[test]
    fn garbage_is_an_error() {
        let good = fixture("vllm-0.33.0-kv-events.json", 0);
        for cut in 0..good.len() {
            assert!(decode_batch(&good[..cut]).is_err(), "truncated at {cut}");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(decode_batch(&trailing).is_err());
        assert!(decode_batch(b"hello world").is_err());
        assert!(decode_batch(&[0x92, 0x00, 0x91, 0x07]).is_err(), "an event must be an array or map");
        // Token count that does not match the blocks.
        let mut ev = vec![0x95, 0xab];
        ev.extend(b"BlockStored");
        ev.extend([0x91, 0x01, 0xc0, 0x92, 0x01, 0x02, 0x04]);
        assert!(matches!(decode_batch(&batch_with(&ev)), Err(DecodeError::Shape(_))));
    }
}
