/**
 * Flag values the parsers used to let through although the server cannot run
 * with them are refused at parse time (exit 2), naming the flag: timer
 * periods past what a timer can wait (they fired every millisecond), a lease
 * TTL past the uint32 its answer carries (every QueryPrefetch failed with
 * INTERNAL and left its lease pinned), a device id past int32, SSD flags the
 * tier refused only after the pool existed or silently left out (a share
 * that holds no segment, a segment not in whole pages, more batches in
 * flight than header pages, counts past 2^53), and `--nics` entries the
 * transfer layer refused only after the pool was allocated.
 */
import assert from "node:assert/strict";
import {
  MAX_DEVICE_ID,
  MAX_LEASE_TTL_MS,
  parseServeArgs,
  type ServeConfig,
} from "../../lib/server/config.ts";
import { MAX_TIMER_MS } from "../../lib/timer_limit.ts";
import { runServerToEnd } from "./harness.ts";

function config(argv: string[]): ServeConfig {
  const r = parseServeArgs(argv);
  assert.equal(r.kind, "config", `${argv.join(" ")}: ${r.kind === "exit" ? r.output : ""}`);
  return (r as { config: ServeConfig }).config;
}

function refusedAtParse(argv: string[], flag: string, why: RegExp): void {
  const r = parseServeArgs(argv);
  assert.equal(r.kind, "exit", `${argv.join(" ")} was accepted`);
  if (r.kind !== "exit") return;
  assert.equal(r.code, 2);
  assert.ok(r.output.includes(flag), `"${r.output}" does not name ${flag}`);
  assert.match(r.output, why);
}

Deno.test("index timer flags stay within what a timer can wait", () => {
  for (const flag of ["--index-timeout-ms", "--index-node-ttl-ms"]) {
    refusedAtParse([flag, String(MAX_TIMER_MS + 1)], flag, /integer in \d+\.\.2147483647/);
    refusedAtParse([flag, "99999999999999999999"], flag, /integer in \d+\.\.2147483647/);
  }
  const c = config([
    "--index-timeout-ms",
    String(MAX_TIMER_MS),
    "--index-node-ttl-ms",
    String(MAX_TIMER_MS),
  ]);
  assert.deepEqual([c.index.timeoutMs, c.index.nodeTtlMs], [MAX_TIMER_MS, MAX_TIMER_MS]);
});

Deno.test("--nics refuses entries the transfer layer cannot open, naming the flag", () => {
  refusedAtParse(["--nics", "mlx5_0,,mlx5_1"], "--nics", /entry "" of "mlx5_0,,mlx5_1"/);
  refusedAtParse(["--nics", "mlx5_0:0"], "--nics", /entry "mlx5_0:0"/);
  refusedAtParse(["--nics", "mlx5_0:256"], "--nics", /port 1\.\.255/);
  refusedAtParse(["--nics", "mlx5 0"], "--nics", /entry "mlx5 0"/);
  refusedAtParse(["--nics", "x".repeat(64)], "--nics", /under 64 characters/);
  const seventeen = Array.from({ length: 17 }, (_, i) => `mlx5_${i}`).join(",");
  refusedAtParse(["--nics", seventeen], "--nics", /17 devices/);
  assert.deepEqual(config(["--nics", "mlx5_0, mlx5_1:2"]).peer.nics, ["mlx5_0", "mlx5_1:2"]);
  assert.deepEqual(config(["--nics", ""]).peer.nics, [], "empty: every device, as without it");
  try {
    Deno.env.set("PEGAFLOW_NICS", "mlx5_0,");
    refusedAtParse([], "PEGAFLOW_NICS", /entry ""/);
  } finally {
    Deno.env.delete("PEGAFLOW_NICS");
  }
});

Deno.test("values the server cannot run with are refused at parse time, naming the flags", () => {
  const cases: [string[], string, RegExp][] = [
    [
      ["--lease-ttl-ms", String(MAX_LEASE_TTL_MS + 1)],
      "--lease-ttl-ms",
      /integer in 1\.\.4294967295/,
    ],
    [["--lease-ttl-ms", "99999999999999999999"], "--lease-ttl-ms", /integer in 1\.\.4294967295/],
    [
      ["--pool-progress-ms", String(MAX_TIMER_MS + 1)],
      "--pool-progress-ms",
      /integer in 1\.\.2147483647/,
    ],
    [["--devices", `0,${MAX_DEVICE_ID + 1}`], "--devices", /device 2147483648 is above/],
    [
      [
        "--ssd-cache-path",
        "/tmp/a",
        "--ssd-cache-capacity",
        "128mb",
        "--ssd-segment-size",
        "128mb",
      ],
      "--ssd-segment-size",
      /capacity 134217728 over 1 --ssd-cache-path gives each 134217728 bytes, less than one/,
    ],
    [
      ["--ssd-cache-path", "/tmp/a,/tmp/b", "--ssd-cache-capacity", "128mb"],
      "--ssd-cache-capacity",
      /over 2 --ssd-cache-path gives each 67108864 bytes/,
    ],
    [["--ssd-segment-size", "8193"], "--ssd-segment-size", /multiple of 4096 bytes, got 8193/],
    [
      ["--ssd-write-inflight", "1000", "--ssd-prefetch-inflight", "25"],
      "--ssd-prefetch-inflight",
      /1000 \+ .* 25 is more than the 1024 batches/,
    ],
    [
      ["--ssd-write-queue-depth", "99999999999999999999"],
      "--ssd-write-queue-depth",
      /integer in 1\.\.9007199254740991/,
    ],
  ];
  for (const [argv, flag, why] of cases) refusedAtParse(argv, flag, why);
  // The largest usable values parse.
  for (
    const argv of [
      ["--lease-ttl-ms", String(MAX_LEASE_TTL_MS)],
      ["--pool-progress-ms", String(MAX_TIMER_MS)],
      ["--devices", `0,${MAX_DEVICE_ID}`],
      ["--ssd-cache-path", "/tmp/a", "--ssd-cache-capacity", "128mb", "--ssd-segment-size", "64mb"],
      ["--ssd-cache-path", "/tmp/a,/tmp/a", "--ssd-cache-capacity", "128mb"],
      ["--ssd-write-inflight", "1000", "--ssd-prefetch-inflight", "24"],
      // Small segments make a small capacity usable: the floor follows --ssd-segment-size.
      ["--ssd-cache-path", "/tmp/a", "--ssd-segment-size", "8kb", "--ssd-cache-capacity", "64mb"],
      ["--ssd-cache-path", "/tmp/a", "--ssd-segment-size", "8kb", "--ssd-cache-capacity", "12kb"],
    ]
  ) config(argv);
});

Deno.test("main.ts exits 2 naming the flag, announcing nothing, for a lease TTL or device id it cannot use", async () => {
  const cases: [string[], RegExp][] = [
    [
      ["--lease-ttl-ms", String(MAX_LEASE_TTL_MS + 1)],
      /--lease-ttl-ms must be an integer in 1\.\.4294967295/,
    ],
    [["--devices", String(MAX_DEVICE_ID + 1)], /--devices.*device 2147483648 is above/],
    [["--ssd-segment-size", "8193"], /--ssd-segment-size must be a multiple of 4096/],
  ];
  for (const [flags, why] of cases) {
    const r = await runServerToEnd(flags);
    assert.equal(r.code, 2, `${flags.join(" ")}: ${r.stderr}`);
    assert.match(r.stderr, why);
    assert.equal(r.stdout, "", "nothing was started, so nothing was announced");
  }
});
