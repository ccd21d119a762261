"""Writes tests/fixtures/vllm/vllm-0.33.0-hybrid-kv-events.json: KV events of a hybrid model's
engine (full attention beside sliding-window attention, as gpt-oss and Gemma 3 run), as vLLM
0.33.0's own code publishes them.

The events are vLLM's msgspec structs (vllm/distributed/kv_events.py from the wheel, cached by
tests/tools/setup.sh), with the fields vLLM's engine sets: the block pool stores a request's
full blocks once per KV-cache group (`group_idx`), and the KV cache manager annotates each store
with its group's kind and window (vllm/v1/core/kv_cache_manager.py `take_events`:
`kv_cache_spec_kind` "full_attention" or "sliding_window", `kv_cache_spec_sliding_window`).
The sliding-window group frees a request's blocks that fall out of its window, and the pool
evicts them first: removals name that group.

Batches: both groups store the same four blocks (window 9 tokens, block size 4); the
sliding-window group evicts blocks 0 and 1; then block 3.

    python vllm_hybrid_fixture.py --kv-events ~/.cache/kvgate/vllm/0.33.0/kv_events.py OUT.json
"""

from vllm_kv_events import fixture_main

BLOCKS = [1234605616436508552, 17357102489901502592, 42, 9020408081234567890]


def batches(kv):
    def stored(group, kind, window):
        return kv.BlockStored(block_hashes=BLOCKS, parent_block_hash=None, token_ids=list(range(1, 17)), block_size=4,
                              lora_id=None, medium="GPU", lora_name=None, extra_keys=None, group_idx=group,
                              kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)

    def removed(hashes):
        return kv.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=1)

    return [
        kv.KVEventBatch(ts=1700000000.5, events=[stored(0, "full_attention", None), stored(1, "sliding_window", 9)]),
        kv.KVEventBatch(ts=1700000001.5, events=[removed(BLOCKS[:2])]),
        kv.KVEventBatch(ts=1700000002.5, events=[removed(BLOCKS[3:])]),
    ]


if __name__ == "__main__":
    fixture_main(__doc__, batches, "events as the engine builds them for a hybrid model (tests/tools/vllm_hybrid_fixture.py)")
