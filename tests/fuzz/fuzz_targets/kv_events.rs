//! The KV-event decoder and the index on arbitrary payloads: never a panic; whatever decodes
//! applies to the index without breaking its invariants.
#![no_main]
use kvgate_routing::events::decode_batch;
use kvgate_routing::index::{IndexConfig, KvIndex};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = decode_batch(data) {
        let mut index = KvIndex::new(4, IndexConfig { max_blocks_per_pod: 64, ..IndexConfig::default() });
        let pod = kvgate_routing::pod_set::PodId(0);
        index.apply(pod, &batch);
        index.apply(pod, &batch);
        assert!(index.pod_blocks(pod) <= 64);
        assert!(index.distinct_blocks() <= index.entries());
    }
});
