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

import argparse
import json
import time
import types

import msgspec
import zmq

from vllm_kv_events import load_vllm_kv_events

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-events", required=True)
    parser.add_argument("out")
    args = parser.parse_args()
    kv = load_vllm_kv_events(args.kv_events)
    # The publisher records its settings in a KVEventsConfig; the stand-in module's holds them.
    kv.KVEventsConfig = types.SimpleNamespace
    sub = zmq.Context.instance().socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{port}", topic="kv-events")
    # The slow joiner: a bound SUB forwards its subscription once it is polled.
    deadline = time.time() + 1.0
    while time.time() < deadline:
        sub.poll(50)
    sent = batches(kv)
    for batch in sent:
        publisher.publish(batch)
    messages = []
    decoder = msgspec.msgpack.Decoder()
    for _ in sent:
        if not sub.poll(10_000):
            raise SystemExit("no message from the publisher within 10 s")
        topic, seq, payload = sub.recv_multipart()
        messages.append({"topic_hex": topic.hex(), "seq": int.from_bytes(seq, "big"), "payload_hex": payload.hex(),
                         "payload_decoded_untyped": repr(decoder.decode(payload))})
    publisher.shutdown()
    out = {
        "produced_by": f"vLLM 0.33.0 vllm/distributed/kv_events.py ZmqEventPublisher (unmodified), msgspec "
                       f"{msgspec.__version__}, pyzmq {zmq.__version__}; events as the OffloadingConnector builds "
                       f"them (tests/tools/vllm_offload_fixture.py)",
        "frames": "each message is [topic, seq (8 bytes big-endian), payload (msgpack KVEventBatch)]",
        "messages": messages,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
