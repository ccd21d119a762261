//! vLLM's KV-cache events, encoded byte for byte as vLLM's publisher encodes them.
//!
//! A batch is the msgpack array `[ts, [event, ...], data_parallel_rank]`. Events are tagged
//! by class name in one of two encodings:
//! - [`EventFormat::Array`] (vLLM ≤ 0.23): `["BlockStored", f1, f2, ...]`, every field
//!   written, trailing `nil`s included;
//! - [`EventFormat::Map`] (vLLM ≥ 0.24): `{"type": "BlockStored", ...}`, fields without a
//!   default always written, defaulted fields omitted when `nil`. msgspec writes a map16
//!   header for structs with more than 15 fields (BlockStored), a fixmap otherwise.
//!
//! Block hashes are msgpack integers (vLLM's default, the low 8 bytes of the digest,
//! up to `u64::MAX`) or 32-byte `bin` (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).

use crate::cache::{CacheChange, EngineBlockHash, KvGroup};

/// How events are laid out (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EventFormat {
    /// msgpack maps tagged by `type` (vLLM ≥ 0.24).
    Map,
    /// positional msgpack arrays (vLLM ≤ 0.23).
    Array,
}

/// How block hashes are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HashFormat {
    /// unsigned 64-bit integers (vLLM default; often above i64::MAX).
    U64,
    /// 32 raw digest bytes (msgpack bin).
    Bytes,
}

/// Encodes one batch of cache changes as vLLM's `KVEventBatch` payload.
pub struct EventEncoder {
    pub format: EventFormat,
    pub hashes: HashFormat,
    pub block_size: usize,
    pub data_parallel_rank: Option<u64>,
}

impl EventEncoder {
    /// The msgpack payload of one batch (the third ZMQ frame).
    pub fn encode_batch(&self, ts: f64, changes: &[CacheChange]) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(64 + changes.len() * 64));
        w.array_len(3);
        w.f64(ts);
        w.array_len(changes.len());
        for change in changes {
            match change {
                CacheChange::Stored { .. } => self.block_stored(&mut w, change),
                CacheChange::Removed { hash, group } => self.block_removed(&mut w, std::slice::from_ref(hash), *group),
                CacheChange::Offloaded { hash } => self.offload_placeholder(&mut w, hash),
                CacheChange::OffloadRemoved { hash } => self.offload_removed(&mut w, hash),
                CacheChange::Cleared => match self.format {
                    EventFormat::Map => {
                        w.map_len(1);
                        w.str("type");
                        w.str("AllBlocksCleared");
                    }
                    EventFormat::Array => {
                        w.array_len(1);
                        w.str("AllBlocksCleared");
                    }
                },
            }
        }
        match self.data_parallel_rank {
            Some(rank) => w.uint(rank),
            None => w.nil(),
        }
        w.0
    }

    fn hash(&self, w: &mut Writer, h: &EngineBlockHash) {
        match self.hashes {
            HashFormat::U64 => w.uint(h.as_u64()),
            HashFormat::Bytes => w.bin(&h.0),
        }
    }

    fn hashes(&self, w: &mut Writer, hs: &[EngineBlockHash]) {
        w.array_len(hs.len());
        for h in hs {
            self.hash(w, h);
        }
    }

    /// A [`CacheChange::Stored`] as vLLM's `BlockStored`.
    fn block_stored(&self, w: &mut Writer, stored: &CacheChange) {
        let CacheChange::Stored { hashes, parent, token_ids, keys, first_index, group } = stored else { return };
        let (parent, group) = (parent.as_ref(), *group);
        let extra: Vec<Vec<&str>> = (0..hashes.len()).map(|i| keys.for_block(first_index + i)).collect();
        let extra_keys = extra.iter().any(|k| !k.is_empty()).then_some(&extra);
        let field = |w: &mut Writer, name: &str| {
            if self.format == EventFormat::Map {
                w.str(name);
            }
        };
        // A hybrid model's group, annotated as vLLM's KV cache manager does: its index, kind
        // and window (the window omitted, as msgspec omits defaults, for full attention).
        let group_fields = group.map_or(0, |g| 2 + usize::from(g.sliding_window.is_some()));
        match self.format {
            // type + 7 fields without defaults + extra_keys when present + the group's.
            EventFormat::Map => w.map16_len(8 + usize::from(extra_keys.is_some()) + group_fields),
            // tag + the 11 fields of vLLM 0.23's BlockStored.
            EventFormat::Array => w.array_len(12),
        }
        if self.format == EventFormat::Map {
            w.str("type");
        }
        w.str("BlockStored");
        field(w, "block_hashes");
        self.hashes(w, hashes);
        field(w, "parent_block_hash");
        match parent {
            Some(p) => self.hash(w, p),
            None => w.nil(),
        }
        field(w, "token_ids");
        w.array_len(token_ids.len());
        for &t in token_ids {
            w.uint(u64::from(t));
        }
        field(w, "block_size");
        w.uint(self.block_size as u64);
        field(w, "lora_id");
        match keys.lora_id {
            Some(id) => w.uint(u64::from(id)),
            None => w.nil(),
        }
        field(w, "medium");
        w.str("GPU");
        field(w, "lora_name");
        match &keys.lora_name {
            Some(name) => w.str(name),
            None => w.nil(),
        }
        if self.format == EventFormat::Array || extra_keys.is_some() {
            field(w, "extra_keys");
            self.extra_keys(w, extra_keys);
        }
        match (group, self.format) {
            (Some(g), _) => {
                field(w, "group_idx");
                w.uint(u64::from(g.index));
                field(w, "kv_cache_spec_kind");
                w.str(if g.sliding_window.is_some() { "sliding_window" } else { "full_attention" });
                match g.sliding_window {
                    Some(window) => {
                        field(w, "kv_cache_spec_sliding_window");
                        w.uint(u64::from(window));
                    }
                    None if self.format == EventFormat::Array => w.nil(),
                    None => {}
                }
            }
            // group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window (0.23 writes them all).
            (None, EventFormat::Array) => (0..3).for_each(|_| w.nil()),
            (None, EventFormat::Map) => {}
        }
    }

    fn extra_keys(&self, w: &mut Writer, extra_keys: Option<&Vec<Vec<&str>>>) {
        match extra_keys {
            Some(per_block) => {
                w.array_len(per_block.len());
                for keys in per_block {
                    if keys.is_empty() {
                        w.nil();
                    } else {
                        w.array_len(keys.len());
                        keys.iter().for_each(|k| w.str(k));
                    }
                }
            }
            None => w.nil(),
        }
    }

    fn block_removed(&self, w: &mut Writer, hashes: &[EngineBlockHash], group: Option<KvGroup>) {
        match self.format {
            EventFormat::Map => {
                w.map_len(3 + usize::from(group.is_some()));
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                self.hashes(w, hashes);
                w.str("medium");
                w.str("GPU");
                if let Some(g) = group {
                    w.str("group_idx");
                    w.uint(u64::from(g.index));
                }
            }
            EventFormat::Array => {
                // tag, block_hashes, medium, group_idx (vLLM 0.23).
                w.array_len(4);
                w.str("BlockRemoved");
                self.hashes(w, hashes);
                w.str("GPU");
                match group {
                    Some(g) => w.uint(u64::from(g.index)),
                    None => w.nil(),
                }
            }
        }
    }

    /// vLLM's `OffloadingConnector` announcing a block copied to host memory, as it does
    /// unless `self_describing_kv_events` is set: the hash alone, no tokens, block size 0,
    /// medium CPU, KV-cache group 0.
    fn offload_placeholder(&self, w: &mut Writer, hash: &EngineBlockHash) {
        let field = |w: &mut Writer, name: &str| {
            if self.format == EventFormat::Map {
                w.str(name);
            }
        };
        match self.format {
            // type + the 7 fields without defaults + group_idx.
            EventFormat::Map => {
                w.map16_len(9);
                w.str("type");
            }
            EventFormat::Array => w.array_len(12),
        }
        w.str("BlockStored");
        field(w, "block_hashes");
        self.hashes(w, std::slice::from_ref(hash));
        field(w, "parent_block_hash");
        w.nil();
        field(w, "token_ids");
        w.array_len(0);
        field(w, "block_size");
        w.uint(0);
        field(w, "lora_id");
        w.nil();
        field(w, "medium");
        w.str("CPU");
        field(w, "lora_name");
        w.nil();
        if self.format == EventFormat::Array {
            w.nil(); // extra_keys
        }
        field(w, "group_idx");
        w.uint(0);
        if self.format == EventFormat::Array {
            w.nil(); // kv_cache_spec_kind
            w.nil(); // kv_cache_spec_sliding_window
        }
    }

    /// Host memory evicting an offloaded block: `BlockRemoved` with medium CPU, group 0.
    fn offload_removed(&self, w: &mut Writer, hash: &EngineBlockHash) {
        match self.format {
            EventFormat::Map => {
                w.map_len(4);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                self.hashes(w, std::slice::from_ref(hash));
                w.str("medium");
                w.str("CPU");
                w.str("group_idx");
                w.uint(0);
            }
            EventFormat::Array => {
                w.array_len(4);
                w.str("BlockRemoved");
                self.hashes(w, std::slice::from_ref(hash));
                w.str("CPU");
                w.uint(0);
            }
        }
    }
}

/// The few msgpack writers the events need, with msgpack's shortest encodings (as msgspec).
struct Writer(Vec<u8>);

impl Writer {
    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.0.push(v as u8),
            0x80..=0xff => self.0.extend([0xcc, v as u8]),
            0x100..=0xffff => {
                self.0.push(0xcd);
                self.0.extend((v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.0.push(0xce);
                self.0.extend((v as u32).to_be_bytes());
            }
            _ => {
                self.0.push(0xcf);
                self.0.extend(v.to_be_bytes());
            }
        }
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend(v.to_be_bytes());
    }

    fn str(&mut self, s: &str) {
        let n = s.len();
        match n {
            0..=31 => self.0.push(0xa0 | n as u8),
            32..=0xff => self.0.extend([0xd9, n as u8]),
            0x100..=0xffff => {
                self.0.push(0xda);
                self.0.extend((n as u16).to_be_bytes());
            }
            _ => {
                self.0.push(0xdb);
                self.0.extend((n as u32).to_be_bytes());
            }
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    fn bin(&mut self, b: &[u8]) {
        // Digests are 32 bytes: bin8 always suffices.
        self.0.extend([0xc4, b.len() as u8]);
        self.0.extend_from_slice(b);
    }

    fn array_len(&mut self, n: usize) {
        match n {
            0..=15 => self.0.push(0x90 | n as u8),
            16..=0xffff => {
                self.0.push(0xdc);
                self.0.extend((n as u16).to_be_bytes());
            }
            _ => {
                self.0.push(0xdd);
                self.0.extend((n as u32).to_be_bytes());
            }
        }
    }

    fn map_len(&mut self, n: usize) {
        debug_assert!(n <= 15);
        self.0.push(0x80 | n as u8);
    }

    fn map16_len(&mut self, n: usize) {
        self.0.push(0xde);
        self.0.extend((n as u16).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::HashKeys;

    fn hash_from_u64(v: u64) -> EngineBlockHash {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&v.to_be_bytes());
        EngineBlockHash(d)
    }

    fn fixture(name: &str, index: usize) -> Vec<u8> {
        kvgate_test_harness::vllm_fixture_payload(name, index)
    }

    /// The same events as the fixtures that vLLM's own publisher produced.
    fn fixture_batches() -> [(f64, Vec<CacheChange>); 2] {
        let (a, b) = (hash_from_u64(0x1122334455667788), hash_from_u64(0xf0e0d0c0b0a09080));
        [
            (
                1700000000.5,
                vec![CacheChange::Stored {
                    hashes: vec![a, b],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
                    keys: HashKeys::default(),
                    first_index: 0,
                    group: None,
                }],
            ),
            (1700000001.25, vec![CacheChange::Removed { hash: b, group: None }, CacheChange::Cleared]),
        ]
    }

    fn encoder(format: EventFormat) -> EventEncoder {
        EventEncoder { format, hashes: HashFormat::U64, block_size: 4, data_parallel_rank: Some(0) }
    }

    #[test]
    fn array_encoding_is_byte_identical_to_vllm_0_23() {
        for (i, (ts, changes)) in fixture_batches().iter().enumerate() {
            assert_eq!(
                encoder(EventFormat::Array).encode_batch(*ts, changes),
                fixture("vllm-0.23.0-kv-events.json", i)
            );
        }
    }

    #[test]
    fn map_encoding_is_byte_identical_to_vllm_0_33() {
        for (i, (ts, changes)) in fixture_batches().iter().enumerate() {
            assert_eq!(encoder(EventFormat::Map).encode_batch(*ts, changes), fixture("vllm-0.33.0-kv-events.json", i));
        }
    }

    #[test]
    fn offload_events_are_byte_identical_to_vllm_0_33s_connector() {
        let (a, b) = (hash_from_u64(0x1122334455667788), hash_from_u64(0xf0e0d0c0b0a09080));
        let [(ts, mut changes), _] = fixture_batches();
        changes.extend([CacheChange::Offloaded { hash: a }, CacheChange::Offloaded { hash: b }]);
        let fixture = |i| fixture("vllm-0.33.0-offload-kv-events.json", i);
        assert_eq!(encoder(EventFormat::Map).encode_batch(ts, &changes), fixture(0));
        let evicted = [CacheChange::OffloadRemoved { hash: hash_from_u64(42) }];
        assert_eq!(encoder(EventFormat::Map).encode_batch(1700000002.5, &evicted), fixture(2));
    }

    #[test]
    fn hybrid_model_events_are_byte_identical_to_vllm_0_33s_engine() {
        let blocks = [1234605616436508552, 17357102489901502592, 42, 9020408081234567890].map(hash_from_u64);
        let full = KvGroup { index: 0, sliding_window: None };
        let window = KvGroup { index: 1, sliding_window: Some(9) };
        let stored = |group| CacheChange::Stored {
            hashes: blocks.to_vec(),
            parent: None,
            token_ids: (1..=16).collect(),
            keys: HashKeys::default(),
            first_index: 0,
            group: Some(group),
        };
        let fixture = |i| fixture("vllm-0.33.0-hybrid-kv-events.json", i);
        let enc = encoder(EventFormat::Map);
        assert_eq!(enc.encode_batch(1700000000.5, &[stored(full), stored(window)]), fixture(0));
        let evicted = [CacheChange::Removed { hash: blocks[3], group: Some(window) }];
        assert_eq!(enc.encode_batch(1700000002.5, &evicted), fixture(2));
    }

    #[test]
    fn bytes_hashes_are_bin32() {
        let enc = EventEncoder { hashes: HashFormat::Bytes, ..encoder(EventFormat::Map) };
        let payload = enc.encode_batch(0.0, &[CacheChange::Removed { hash: EngineBlockHash([7; 32]), group: None }]);
        let mut expected = vec![0xc4, 32];
        expected.extend([7u8; 32]);
        assert!(payload.windows(34).any(|w| w == expected.as_slice()));
    }
}
