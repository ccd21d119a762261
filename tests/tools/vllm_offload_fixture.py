"""Writes tests/fixtures/vllm/vllm-0.33.0-offload-kv-events.json: KV events of an engine whose
KV connector offloads to host memory, as vLLM 0.33.0's own code publishes them.

The events are vLLM's msgspec structs (vllm/distributed/kv_events.py from the wheel, cached by
tests/tools/setup.sh), published by its unmodified ZmqEventPublisher and received here on a
SUB socket. Their fields are the ones vLLM's OffloadingConnector sets
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py): by default a
placeholder per offloaded block (its hash, medium "CPU", no tokens, block size 0, group 0);
with `self_describing_kv_events` a full BlockStored with medium "CPU"; evictions as
BlockRemoved with medium "CPU" and group 0. One batch mixes them with GPU events, as the
scheduler publishes connector events in the same batch as the KV cache manager's.

    python vllm_offload_fixture.py --kv-events ~/.cache/kvgate/vllm/0.33.0/kv_events.py OUT.json
"""

from vllm_kv_events import fixture_main

A, B, C = 1234605616436508552, 17357102489901502592, 42


def batches(kv):
    gpu = kv.BlockStored(block_hashes=[A, B], parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                         block_size=4, lora_id=None, medium="GPU", lora_name=None)
    placeholders = [kv.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], lora_id=None,
                                   block_size=0, medium="CPU", lora_name=None, group_idx=0,
                                   kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None,
                                   locality=None, ownership=None) for h in (A, B)]
    described = kv.BlockStored(block_hashes=[C], parent_block_hash=B, token_ids=[9, 10, 11, 12], block_size=4,
                               lora_id=None, medium="CPU", lora_name=None, extra_keys=None, group_idx=0,
                               kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None, locality=None,
                               ownership=None)
    gpu_removed = kv.BlockRemoved(block_hashes=[B, A], medium="GPU")
    cpu_removed = kv.BlockRemoved(block_hashes=[C], medium="CPU", group_idx=0, locality=None, ownership=None)
    return [
        kv.KVEventBatch(ts=1700000000.5, events=[gpu, *placeholders]),
        kv.KVEventBatch(ts=1700000001.5, events=[described, gpu_removed]),
        kv.KVEventBatch(ts=1700000002.5, events=[cpu_removed]),
    ]


if __name__ == "__main__":
    fixture_main(__doc__, batches, "events as the OffloadingConnector builds them (tests/tools/vllm_offload_fixture.py)")
