"""Writes tests/fixtures/vllm/vllm-0.33.0-lora-kv-events.json: KV events of an engine serving a
LoRA adapter, as vLLM 0.33.0's own code publishes them.

The events are vLLM's msgspec structs (vllm/distributed/kv_events.py from the wheel, cached by
tests/tools/setup.sh), with the fields vLLM's engine sets: the block pool's BlockStored
(vllm/v1/core/block_pool.py: `lora_id` the adapter's id, `lora_name` its name, `extra_keys`
one untagged entry per block — the adapter's name, as vllm/v1/core/kv_cache_utils.py's
`to_event_extra_keys` turns its ("lora", name, path) hash key — and `group_idx` its KV-cache
group), annotated by the KV cache manager (vllm/v1/core/kv_cache_manager.py `take_events`:
`kv_cache_spec_kind` "full_attention", no sliding window). One batch stores an adapter's
blocks beside the base model's blocks of the same tokens; the next evicts one of each.

    python vllm_lora_fixture.py --kv-events ~/.cache/kvgate/vllm/0.33.0/kv_events.py OUT.json
"""

from vllm_kv_events import fixture_main

ADAPTER_A, ADAPTER_B = 9020408081234567890, 14123456789012345678
BASE_A, BASE_B = 1234605616436508552, 17357102489901502592


def batches(kv):
    def stored(hashes, lora):
        return kv.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                              block_size=4, lora_id=1 if lora else None, medium="GPU", lora_name=lora,
                              extra_keys=[(lora,), (lora,)] if lora else None, group_idx=0,
                              kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None)
    return [
        kv.KVEventBatch(ts=1700000000.5, events=[stored([ADAPTER_A, ADAPTER_B], "sql"), stored([BASE_A, BASE_B], None)]),
        kv.KVEventBatch(ts=1700000001.5, events=[kv.BlockRemoved(block_hashes=[ADAPTER_B, BASE_B], medium="GPU")]),
    ]


if __name__ == "__main__":
    fixture_main(__doc__, batches, "events as the engine builds them for a LoRA adapter (tests/tools/vllm_lora_fixture.py)")
