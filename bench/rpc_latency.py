"""RPC latency probe with the engines' real client library (Python grpcio).

Times unary RPCs to a running PegaFlow server over TCP and over its --uds
socket, interleaved in batches so both see the same machine noise:
an empty Health, and (given --query-request) a QueryPrefetch whose lease is
released after each timed call (the Release is not timed). No generated code:
the generic ``channel.unary_unary`` with identity (de)serializers sends bytes
as they are; the request bytes of the QueryPrefetch come from a file written
by bench/rpc_latency.ts, which also starts the server and fills it.

Prints one JSON object on stdout: per RPC and transport, the samples' count
and percentiles in microseconds. Normally run by bench/rpc_latency.ts:

    python3 bench/rpc_latency.py --tcp 127.0.0.1:50055 --uds /tmp/x/grpc.sock \
        --n 5000 --warmup 500 [--query-request req.bin]
"""

import argparse
import json
import time

import grpc

# Samples per transport before switching to the other one.
BATCH = 500
# Every call has a deadline: a stuck server fails the probe instead of hanging it.
DEADLINE_S = 10.0


def percentiles(samples_us):
    s = sorted(samples_us)
    n = len(s)

    def at(p):
        return s[min(n - 1, int(p / 100.0 * n))]

    return {
        "n": n,
        "p50_us": at(50),
        "p90_us": at(90),
        "p99_us": at(99),
        "p999_us": at(99.9),
        "max_us": s[-1],
        "mean_us": sum(s) / n,
    }


def read_varint(buf, i):
    shift = 0
    value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def field(buf, wanted):
    """The bytes of length-delimited field `wanted` of a protobuf message, or None."""
    i = 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 2:
            length, i = read_varint(buf, i)
            if number == wanted:
                return buf[i:i + length]
            i += length
        elif wire == 0:
            _, i = read_varint(buf, i)
        elif wire == 5:
            i += 4
        elif wire == 1:
            i += 8
        else:
            raise ValueError("unexpected wire type %d" % wire)
    return None


def lease_of(query_response):
    # QueryPrefetchResponse.ready (2) -> QueryReady.lease_id (2)
    ready = field(query_response, 2)
    return field(ready, 2) if ready is not None else None


def probe(targets, n, warmup, query_request):
    channels = {name: grpc.insecure_channel(t) for name, t in targets.items()}
    identity = dict(request_serializer=lambda x: x, response_deserializer=lambda x: x)
    calls = {}
    for name, ch in channels.items():
        calls[name] = {
            "health": ch.unary_unary("/pegaflow.Engine/Health", **identity),
            "query": ch.unary_unary("/pegaflow.Engine/QueryPrefetch", **identity),
            "release": ch.unary_unary("/pegaflow.Engine/Release", **identity),
        }

    def one(name, rpc):
        c = calls[name]
        if rpc == "health":
            t0 = time.perf_counter_ns()
            c["health"](b"", timeout=DEADLINE_S)
            return (time.perf_counter_ns() - t0) / 1000.0
        t0 = time.perf_counter_ns()
        res = c["query"](query_request, timeout=DEADLINE_S)
        us = (time.perf_counter_ns() - t0) / 1000.0
        lease = lease_of(res)
        if not lease:
            raise RuntimeError("QueryPrefetch did not hit: %r" % res[:64])
        c["release"](b"\x0a" + bytes([len(lease)]) + lease, timeout=DEADLINE_S)
        return us

    rpcs = ["health"] + (["query"] if query_request is not None else [])
    out = {}
    for rpc in rpcs:
        for name in channels:
            for _ in range(warmup):
                one(name, rpc)
        samples = {name: [] for name in channels}
        while any(len(v) < n for v in samples.values()):
            for name in channels:
                k = min(BATCH, n - len(samples[name]))
                samples[name].extend(one(name, rpc) for _ in range(k))
        for name, v in samples.items():
            out["%s/%s" % (rpc, name)] = percentiles(v)
    for ch in channels.values():
        ch.close()
    return out


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="Prints its results as one JSON line on stdout; writes no file."
    )
    # Checked after parsing (not required=True), so that an unknown flag is what gets named.
    ap.add_argument("--tcp", help="host:port of the server's gRPC address (required)")
    ap.add_argument("--uds", help="the server's --uds socket path")
    ap.add_argument("--n", type=int, default=5000, help="timed calls per RPC and transport")
    ap.add_argument("--warmup", type=int, default=500, help="untimed calls first")
    ap.add_argument("--query-request", help="file holding an encoded QueryPrefetchRequest")
    a = ap.parse_args()
    if not a.tcp:
        ap.error("--tcp is required")
    targets = {"tcp": a.tcp}
    if a.uds:
        targets["uds"] = "unix:" + a.uds
    query = open(a.query_request, "rb").read() if a.query_request else None
    result = probe(targets, a.n, a.warmup, query)
    print(json.dumps({"client": "python-grpcio", "grpcio": grpc.__version__, "results": result}))


if __name__ == "__main__":
    main()
