/**
 * The serve CLI: bad values are refused before start-up with the flag named,
 * env vars count like flags, --help lists defaults. Runs main.ts as a real
 * process (a refused start must not bind anything or allocate a pool).
 */
import assert from "node:assert/strict";
import {
  capPoolSize,
  parseServeArgs,
  parseSize,
  POOL_MEM_FRACTION,
} from "../../lib/server/config.ts";
import { allocationUnit, transferLockTtlMs } from "../../lib/server/server.ts";
import { MAX_PEER_LOCK_TTL_MS } from "../../lib/peer/locks.ts";
import { KvStore } from "../../lib/storage/store.ts";

const ROOT = new URL("../../", import.meta.url).pathname;

async function runMain(args: string[], env: Record<string, string> = {}) {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", "main.ts", ...args],
    cwd: ROOT,
    env,
    stdout: "piped",
    stderr: "piped",
  }).output();
  const d = new TextDecoder();
  return { code: out.code, stdout: d.decode(out.stdout), stderr: d.decode(out.stderr) };
}

Deno.test("sizes accept kb/mb/gb/tb and refuse garbage", () => {
  assert.equal(parseSize("30gb"), 30 * 1024 ** 3);
  assert.equal(parseSize("512MB"), 512 * 1024 ** 2);
  assert.equal(parseSize("1tb"), 1024 ** 4);
  assert.equal(parseSize("4096"), 4096);
  assert.equal(parseSize("1.5kb"), 1536);
  assert.throws(() => parseSize("12zb"), /unknown unit/);
  assert.throws(() => parseSize("-1gb"), /not a size/);
  assert.throws(() => parseSize("gb"), /not a size/);
});

Deno.test("every bad flag value is refused with the flag named", () => {
  const cases: [string[], string][] = [
    [["--pool-size", "lots"], "--pool-size"],
    [["--pool-size", "12"], "--pool-size"],
    [["--addr", "nohostport"], "--addr"],
    [["--addr", "127.0.0.1:70000"], "--addr"],
    [["--http-addr", "x"], "--http-addr"],
    [["--backend", "gpu"], "--backend"],
    [["--transfer-path", "fast"], "--transfer-path"],
    [["--log-level", "loud"], "--log-level"],
    [["--devices", "0,a"], "--devices"],
    [["--devices", "0,1,0"], "--devices"],
    [["--use-hugepages", "maybe"], "--use-hugepages"],
    [["--hint-value-size", "1"], "--hint-value-size"],
    [["--lease-ttl-ms", "soon"], "--lease-ttl-ms"],
    [["--no-such-flag"], "--no-such-flag"],
    [["--uds", ""], "--uds"],
    [["--uds", "/tmp/" + "x".repeat(110)], "--uds"],
  ];
  for (const [argv, flag] of cases) {
    const r = parseServeArgs(argv);
    assert.equal(r.kind, "exit", `${argv.join(" ")} should be refused`);
    if (r.kind === "exit") {
      assert.equal(r.code, 2);
      assert.ok(
        r.output.includes(flag),
        `message for ${argv.join(" ")} names ${flag}: ${r.output}`,
      );
    }
  }
});

Deno.test("flags parse into the config, with defaults", () => {
  const r = parseServeArgs([
    "--pool-size",
    "2gb",
    "--backend",
    "host",
    "--use-hugepages",
    "--devices",
    "0,1",
  ]);
  assert.equal(r.kind, "config");
  if (r.kind !== "config") return;
  assert.equal(r.config.poolSize, 2 * 1024 ** 3);
  assert.equal(r.config.poolSizeDefaulted, false);
  assert.equal(r.config.backend, "host");
  assert.equal(r.config.useHugepages, true);
  assert.deepEqual(r.config.devices, [0, 1]);
  assert.equal(r.config.addr, "127.0.0.1:50055");
  assert.equal(r.config.transferPath, "auto");
  assert.equal(r.config.uds, undefined, "no Unix socket unless asked for");
  const u = parseServeArgs(["--uds", "unix:/run/pegaflow/grpc.sock"]);
  assert.ok(u.kind === "config" && u.config.uds === "/run/pegaflow/grpc.sock");
  const d = parseServeArgs([]);
  assert.ok(
    d.kind === "config" && d.config.poolSizeDefaulted && d.config.poolSize === 30 * 1024 ** 3,
  );
  // No --devices: resolved at start-up (every visible GPU on cuda, 0 on host); NUMA split on.
  assert.ok(d.kind === "config" && d.config.devices === undefined && !d.config.disableNumaAffinity);
  const n = parseServeArgs(["--disable-numa-affinity"]);
  assert.ok(n.kind === "config" && n.config.disableNumaAffinity);
});

Deno.test("main.ts refuses a bad flag and a bad env var before start-up, exit 2", async () => {
  const a = await runMain(["--pool-size", "12zb", "--addr", "127.0.0.1:0"]);
  assert.equal(a.code, 2);
  assert.match(a.stderr, /--pool-size/);
  assert.equal(a.stdout, "", "nothing was started, so nothing was announced");
  const b = await runMain(["--addr", "127.0.0.1:0"], { PEGAFLOW_BACKEND: "tpu" });
  assert.equal(b.code, 2);
  assert.match(b.stderr, /--backend/);
  assert.match(b.stderr, /PEGAFLOW_BACKEND/);
});

Deno.test("--help lists every flag with its default and env var", async () => {
  const r = await runMain(["--help"]);
  assert.equal(r.code, 0);
  for (
    const s of [
      "--addr",
      "127.0.0.1:50055",
      "--http-addr",
      "--uds",
      "PEGAFLOW_UDS",
      "--devices",
      "--disable-numa-affinity",
      "--backend",
      "--pool-size",
      "30gb",
      "--hint-value-size",
      "--use-hugepages",
      "--enable-lfu-admission",
      "--transfer-path",
      "--log-level",
      "PEGAFLOW_POOL_SIZE",
    ]
  ) assert.ok(r.stdout.includes(s), `--help mentions ${s}`);
});

Deno.test("the pool size is capped to half of MemAvailable, and a small request is left alone", () => {
  const huge = capPoolSize(2 ** 50);
  assert.equal(huge.capped, true);
  assert.ok(huge.availBytes !== null && huge.bytes <= huge.availBytes * POOL_MEM_FRACTION);
  assert.equal(huge.bytes % (1 << 20), 0, "capped to whole MiB");
  const small = capPoolSize(64 << 20);
  assert.deepEqual([small.bytes, small.capped], [64 << 20, false]);
});

Deno.test("--hint-value-size picks the largest power-of-two unit dividing it, within 512 B..64 KiB", () => {
  assert.equal(allocationUnit(0), 4096, "no hint: 4 KiB");
  assert.equal(allocationUnit(32768), 32768, "Llama-3.1-8B K or V: one unit per segment");
  assert.equal(allocationUnit(36864), 4096, "36 KiB = 9 x 4 KiB");
  assert.equal(allocationUnit(1 << 20), 65536, "capped at 64 KiB");
  assert.equal(allocationUnit(1000), 512, "odd sizes fall back to the 512 B floor");
});

Deno.test("a short --lease-ttl-ms does not shorten transfer locks: a peer-locked block outlives it", () => {
  assert.equal(transferLockTtlMs(5_000), MAX_PEER_LOCK_TTL_MS);
  assert.equal(transferLockTtlMs(10 * MAX_PEER_LOCK_TTL_MS), 10 * MAX_PEER_LOCK_TTL_MS);
  // The store as the server builds it: a lock taken for a peer read is still held past the lease TTL.
  let now = 0;
  const store = new KvStore({
    capacityBytes: 1 << 20,
    leaseTtlMs: 5_000,
    transferLockTtlMs: transferLockTtlMs(5_000),
    clock: () => now,
  });
  store.defineNamespace("0123456789abcdef", {
    layers: 1,
    tpSize: 1,
    collapseTp: false,
    segments: 2,
    segmentBytes: 4096,
  });
  const hash = new Uint8Array([7, 7, 7]);
  const plan = store.beginSave({
    namespace: "0123456789abcdef",
    instance: "e",
    rank: 0,
    hashes: [hash],
  });
  assert.ok(plan.ok);
  if (!plan.ok) return;
  store.completeSave(plan.plan, true);
  const lock = store.lockForTransfer("0123456789abcdef", [hash], "peer:node-b");
  assert.ok(lock);
  now += 60_000; // past the lease TTL, inside the longest peer lock
  store.collect();
  assert.equal(store.evictAll(), 0, "the locked block stays");
  now += MAX_PEER_LOCK_TTL_MS;
  store.collect();
  assert.equal(store.evictAll(), 1, "an abandoned lock still expires");
});
