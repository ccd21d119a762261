"""Decode KV events with vLLM's own code: the msgspec structs of vllm/distributed/kv_events.py.

The file is taken unmodified from a vLLM release wheel (tests/tools/setup.sh caches it). It
imports a few vLLM modules that pull in torch; this script provides them as tiny stand-ins
holding exactly what kv_events.py uses (ExternalBlockHash is `bytes | int` in vLLM 0.23 and
0.33 alike). Decoding is strict: `msgspec.msgpack.Decoder(type=KVEventBatch)`, so a payload
vLLM's consumers could not read fails here too.

    python vllm_kv_events.py --kv-events PATH subscribe --endpoint tcp://127.0.0.1:5557 \
        --count 3 --timeout 10 [--bind] [--topic T]
    python vllm_kv_events.py --kv-events PATH replay --endpoint tcp://127.0.0.1:5558 --start 0

Prints one JSON object per line: {"ready": true} once subscribed, then one per message with
the topic, sequence number and the decoded batch (hashes as integers, or hex for bytes).
"""

import argparse
import importlib.util
import json
import logging
import sys
import time
import types

import msgspec
import zmq


def load_vllm_kv_events(path):
    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    for pkg in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"]:
        module(pkg, __path__=[])
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.config.kv_events", KVEventsConfig=type("KVEventsConfig", (), {}))
    module("vllm.utils.network_utils", get_ip=None, get_tcp_uri=None,
           is_valid_ipv6_address=None, split_zmq_path=None)
    module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def plain(value):
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def describe(kv, batch):
    events = []
    for event in batch.events:
        fields = {f: plain(getattr(event, f)) for f in event.__struct_fields__}
        fields["type"] = type(event).__name__
        events.append(fields)
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


def write_fixture(kv, batches, built_by, out_path):
    """Publishes `batches` (vLLM's own structs) with vLLM's unmodified ZmqEventPublisher,
    receives them on a SUB socket and writes the messages as a fixture file to `out_path`;
    `built_by` says who built the events, for the file's `produced_by`."""
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
    for batch in batches:
        publisher.publish(batch)
    messages = []
    decoder = msgspec.msgpack.Decoder()
    for _ in batches:
        if not sub.poll(10_000):
            raise SystemExit("no message from the publisher within 10 s")
        topic, seq, payload = sub.recv_multipart()
        messages.append({"topic_hex": topic.hex(), "seq": int.from_bytes(seq, "big"), "payload_hex": payload.hex(),
                         "payload_decoded_untyped": repr(decoder.decode(payload))})
    publisher.shutdown()
    out = {
        "produced_by": f"vLLM 0.33.0 vllm/distributed/kv_events.py ZmqEventPublisher (unmodified), msgspec "
                       f"{msgspec.__version__}, pyzmq {zmq.__version__}; {built_by}",
        "frames": "each message is [topic, seq (8 bytes big-endian), payload (msgpack KVEventBatch)]",
        "messages": messages,
    }
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def fixture_main(doc, batches, built_by):
    """The command line of a fixture script: `--kv-events PATH OUT`, `batches(kv)` built from
    vLLM's module, published and written as `write_fixture` does."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--kv-events", required=True)
    parser.add_argument("out")
    args = parser.parse_args()
    kv = load_vllm_kv_events(args.kv_events)
    write_fixture(kv, batches(kv), built_by, args.out)


def emit(obj):
    print(json.dumps(obj), flush=True)


def subscribe(kv, args):
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    (sock.bind if args.bind else sock.connect)(args.endpoint)
    time.sleep(0.5)  # let the subscription reach the publisher (slow joiner)
    emit({"ready": True})
    deadline = time.monotonic() + args.timeout
    received = 0
    while received < args.count:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000)):
            emit({"timeout": True, "received": received})
            return 1
        topic, seq, payload = sock.recv_multipart()
        batch = decoder.decode(payload)
        emit({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), **describe(kv, batch)})
        received += 1
    return 0


def replay(kv, args):
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(args.endpoint)
    sock.send_multipart([b"", args.start.to_bytes(8, "big")])
    deadline = time.monotonic() + args.timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000)):
            emit({"timeout": True})
            return 1
        frames = sock.recv_multipart()
        # vLLM <= 0.25: ["", seq, payload]; >= 0.26: ["", topic, seq, payload]
        if len(frames) == 3:
            _, seq, payload = frames
            topic = None
        elif len(frames) == 4:
            _, topic, seq, payload = frames
            topic = topic.decode()
        else:
            emit({"error": f"unexpected {len(frames)} frames"})
            return 1
        if seq == b"\xff" * 8:
            emit({"end": True, "frames": len(frames), "payload_len": len(payload)})
            return 0
        batch = decoder.decode(payload)
        emit({"frames": len(frames), "topic": topic, "seq": int.from_bytes(seq, "big"),
              **describe(kv, batch)})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-events", required=True, help="vLLM's kv_events.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("subscribe")
    s.add_argument("--endpoint", required=True)
    s.add_argument("--count", type=int, required=True)
    s.add_argument("--timeout", type=float, default=10.0)
    s.add_argument("--bind", action="store_true", help="bind the SUB socket (publisher connects)")
    s.add_argument("--topic", default="")
    r = sub.add_parser("replay")
    r.add_argument("--endpoint", required=True)
    r.add_argument("--start", type=int, default=0)
    r.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    kv = load_vllm_kv_events(args.kv_events)
    return subscribe(kv, args) if args.cmd == "subscribe" else replay(kv, args)


if __name__ == "__main__":
    sys.exit(main())
