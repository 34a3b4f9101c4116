/**
 * The index flags: parsed with their PEGAFLOW_* variables, bad values refused
 * with the flag named, defaults for node id and advertise address derived
 * from the bound gRPC address; `--index-redis-tls-ca` read at flag time.
 */

import assert from "node:assert/strict";
import { parseServeArgs } from "../../lib/server/config.ts";
import { nodeIdentity } from "../../lib/index/flags.ts";
import { RedisBlockIndex } from "../../lib/index/block_index.ts";
import { IndexInputError } from "../../lib/index/errors.ts";
import { makeTestCertificates } from "./_redis.ts";

function refused(argv: string[], flag: string, why: RegExp) {
  const r = parseServeArgs(argv);
  assert.equal(r.kind, "exit", `${argv.join(" ")} was accepted`);
  if (r.kind !== "exit") return;
  assert.equal(r.code, 2);
  assert.ok(r.output.includes(flag), `"${r.output}" does not name ${flag}`);
  assert.match(r.output, why);
}

Deno.test("no --index-redis means no index; the flags parse when given", () => {
  const none = parseServeArgs([]);
  assert.equal(none.kind, "config");
  if (none.kind === "config") assert.equal(none.config.index.redisUrl, undefined);
  const r = parseServeArgs([
    "--index-redis",
    "redis://10.0.0.5:6379/2",
    "--node-id",
    "gpu-7",
    "--advertise-addr",
    "10.0.0.7:50055",
    "--index-timeout-ms",
    "50",
  ]);
  assert.equal(r.kind, "config");
  if (r.kind !== "config") return;
  assert.deepEqual(r.config.index, {
    redisUrl: "redis://10.0.0.5:6379/2",
    redisCluster: false,
    nodeId: "gpu-7",
    advertiseAddr: "10.0.0.7:50055",
    timeoutMs: 50,
    nodeTtlMs: 15_000,
  });
});

Deno.test("bad index flag values are refused with the flag named", () => {
  refused(["--index-redis", "10.0.0.5:6379"], "--index-redis", /not a redis:\/\/ URL/);
  refused(["--index-redis", "http://h:6379"], "--index-redis", /expected redis:\/\//);
  refused(["--index-redis", "redis://h:6379/abc"], "--index-redis", /database number/);
  refused(["--node-id", "has space"], "--node-id", /without spaces/);
  refused(["--advertise-addr", "nohost"], "--advertise-addr", /not host:port/);
  refused(["--advertise-addr", "0.0.0.0:50055"], "--advertise-addr", /wildcard/);
  refused(["--index-timeout-ms", "0"], "--index-timeout-ms", /integer in 1\.\.2147483647, got "0"/);
  refused(["--index-node-ttl-ms", "10"], "--index-node-ttl-ms", /integer in 100\.\.2147483647/);
});

Deno.test("index flags are read from PEGAFLOW_* environment variables", () => {
  const keys = ["PEGAFLOW_INDEX_REDIS", "PEGAFLOW_NODE_ID", "PEGAFLOW_ADVERTISE_ADDR"];
  try {
    Deno.env.set("PEGAFLOW_INDEX_REDIS", "redis://127.0.0.1:6380");
    Deno.env.set("PEGAFLOW_NODE_ID", "n1");
    Deno.env.set("PEGAFLOW_ADVERTISE_ADDR", "n1.local:1");
    const r = parseServeArgs([]);
    assert.equal(r.kind, "config");
    if (r.kind !== "config") return;
    assert.equal(r.config.index.redisUrl, "redis://127.0.0.1:6380");
    assert.equal(r.config.index.nodeId, "n1");
    assert.equal(r.config.index.advertiseAddr, "n1.local:1");
    Deno.env.set("PEGAFLOW_INDEX_REDIS", "nope");
    refused([], "PEGAFLOW_INDEX_REDIS", /not a redis:\/\/ URL/);
  } finally {
    for (const k of keys) Deno.env.delete(k);
  }
});

Deno.test("node id and advertise address default from the bound gRPC address", () => {
  const base = {
    redisUrl: "redis://h:1",
    redisCluster: false,
    nodeId: undefined,
    advertiseAddr: undefined,
    timeoutMs: 1,
    nodeTtlMs: 100,
  };
  assert.deepEqual(nodeIdentity(base, "0.0.0.0:50055", "gpu7"), {
    nodeId: "gpu7:50055",
    advertiseAddr: "gpu7:50055",
  });
  assert.deepEqual(nodeIdentity(base, "10.1.2.3:41000", "gpu7"), {
    nodeId: "gpu7:41000",
    advertiseAddr: "10.1.2.3:41000",
  });
  assert.deepEqual(
    nodeIdentity({ ...base, nodeId: "x", advertiseAddr: "y:1" }, "0.0.0.0:1", "gpu7"),
    { nodeId: "x", advertiseAddr: "y:1" },
  );
});

Deno.test("--index-redis none, or an empty PEGAFLOW_INDEX_REDIS, means no index (as its help says)", () => {
  const redis = (argv: string[]) => {
    const r = parseServeArgs(argv);
    assert.equal(r.kind, "config", r.kind === "exit" ? r.output : "");
    return r.kind === "config" ? r.config.index.redisUrl : "unparsed";
  };
  assert.equal(redis(["--index-redis", "none"]), undefined);
  assert.equal(redis(["--index-redis", "NONE"]), undefined);
  try {
    Deno.env.set("PEGAFLOW_INDEX_REDIS", "");
    assert.equal(redis([]), undefined);
  } finally {
    Deno.env.delete("PEGAFLOW_INDEX_REDIS");
  }
  assert.equal(redis(["--index-redis", " redis://h:6379 "]), "redis://h:6379");
});

Deno.test("--index-redis-cluster takes comma-separated seed nodes; a list without it is refused", () => {
  const seeds = "redis://127.0.0.1:7000,redis://127.0.0.2:7001";
  const r = parseServeArgs(["--index-redis", seeds, "--index-redis-cluster"]);
  assert.equal(r.kind, "config", r.kind === "exit" ? r.output : "");
  if (r.kind !== "config") return;
  assert.equal(r.config.index.redisUrl, seeds);
  assert.equal(r.config.index.redisCluster, true);
  // One seed is a cluster too; a password may hold a `,` in one URL.
  const one = parseServeArgs(["--index-redis", "redis://:a,b@h:7000", "--index-redis-cluster"]);
  assert.equal(one.kind, "config", one.kind === "exit" ? one.output : "");
  refused(["--index-redis", seeds], "--index-redis-cluster", /lists 2 Redis nodes/);
  refused(["--index-redis-cluster"], "--index-redis", /needs --index-redis/);
  refused(
    ["--index-redis", "redis://h:1,h2:2"],
    "--index-redis",
    /"h2:2" has scheme "h2:"; expected redis:\/\//,
  );
  refused(["--index-redis", "redis://h:1,,redis://h:2"], "--index-redis", /empty entry/);
  refused(
    ["--index-redis", "redis://h:1/2,redis://h:2", "--index-redis-cluster"],
    "--index-redis",
    /seed redis:\/\/h:1\/2 names database 2; a Redis Cluster has only database 0/,
  );
  refused(
    ["--index-redis", "redis://:a@h:1,redis://:b@h:2", "--index-redis-cluster"],
    "--index-redis",
    /seed redis:\/\/h:2 differs from redis:\/\/h:1 in scheme or credentials/,
  );
  try {
    Deno.env.set("PEGAFLOW_INDEX_REDIS", seeds);
    Deno.env.set("PEGAFLOW_INDEX_REDIS_CLUSTER", "1");
    const e = parseServeArgs([]);
    assert.equal(e.kind === "config" && e.config.index.redisCluster, true);
  } finally {
    Deno.env.delete("PEGAFLOW_INDEX_REDIS");
    Deno.env.delete("PEGAFLOW_INDEX_REDIS_CLUSTER");
  }
});

Deno.test("a password that does not percent-decode is refused at flag time, naming --index-redis, not echoed", () => {
  const why = /redis:\/\/127\.0\.0\.1:\d+(\/1)?: the user name or password is not percent-encoded/;
  for (
    const argv of [
      ["--index-redis", "redis://:s3cret%zz@127.0.0.1:6379"],
      ["--index-redis", "redis://us%zzer:s3cret@127.0.0.1:6379/1"],
      [
        "--index-redis",
        "redis://:s3cret%zz@127.0.0.1:7000,redis://:s3cret%zz@127.0.0.1:7001",
        "--index-redis-cluster",
      ],
    ]
  ) {
    refused(argv, "--index-redis", why);
    const r = parseServeArgs(argv);
    assert.ok(r.kind === "exit" && !/s3cret|%zz/.test(r.output), `echoed: ${JSON.stringify(r)}`);
  }
  // Encoded right, it is taken: %25 is a literal %, %40 an @.
  const ok = parseServeArgs(["--index-redis", "redis://:p%25w%40d@127.0.0.1:6379"]);
  assert.equal(ok.kind, "config", ok.kind === "exit" ? ok.output : "");
  // The index itself refuses it too, as bad input rather than ioredis's URIError.
  for (const cluster of [false, true]) {
    assert.throws(
      () =>
        new RedisBlockIndex({
          url: "redis://:s3cret%zz@127.0.0.1:6379",
          cluster,
          nodeId: "n",
          advertiseAddr: "n:1",
          listSealed: () => [],
        }),
      (e) => e instanceof IndexInputError && !/s3cret/.test(e.message),
    );
  }
});

Deno.test("--index-redis-tls-ca reads a PEM CA at flag time; a bad file, or no rediss:// Redis, is refused naming the flag and the path", async () => {
  const certs = await makeTestCertificates();
  const dir = await Deno.makeTempDir({ prefix: "pf-flags-ca-" });
  const esc = (p: string) => p.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  try {
    const pem = await Deno.readTextFile(certs.caFile);
    const tls = ["--index-redis", "rediss://10.0.0.5:6380", "--index-redis-tls-ca", certs.caFile];
    const ok = parseServeArgs(tls);
    assert.equal(ok.kind, "config", ok.kind === "exit" ? ok.output : "");
    assert.equal(ok.kind === "config" && ok.config.index.tlsCa, pem);
    const seeds = "rediss://10.0.0.5:7000,rediss://10.0.0.6:7000";
    const cluster = parseServeArgs(
      ["--index-redis", seeds, "--index-redis-cluster", "--index-redis-tls-ca", certs.caFile],
    );
    assert.equal(cluster.kind === "config" && cluster.config.index.tlsCa, pem);
    const plain = parseServeArgs(["--index-redis", "rediss://10.0.0.5:6380"]);
    assert.ok(plain.kind === "config" && !("tlsCa" in plain.config.index), "no CA: the system's");

    const missing = `${dir}/missing.pem`;
    refused(
      ["--index-redis-tls-ca", missing],
      "--index-redis-tls-ca",
      new RegExp(`cannot read CA file "${esc(missing)}"`),
    );
    refused(
      ["--index-redis-tls-ca", dir],
      "--index-redis-tls-ca",
      new RegExp(`cannot read CA file "${esc(dir)}"`),
    );
    const empty = `${dir}/not-pem.txt`;
    await Deno.writeTextFile(empty, "not a certificate\n");
    refused(
      [...tls.slice(0, 3), empty],
      "--index-redis-tls-ca",
      new RegExp(`"${esc(empty)}" holds no PEM certificate`),
    );
    const garbled = `${dir}/garbled.pem`;
    await Deno.writeTextFile(
      garbled,
      pem + "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    );
    refused(
      [...tls.slice(0, 3), garbled],
      "--index-redis-tls-ca",
      new RegExp(`"${esc(garbled)}": certificate 2 of 2 does not parse`),
    );
    const caPath = new RegExp(`--index-redis-tls-ca "${esc(certs.caFile)}"`);
    refused(["--index-redis-tls-ca", certs.caFile], "--index-redis", caPath);
    refused(
      ["--index-redis-tls-ca", certs.caFile],
      "--index-redis-tls-ca",
      /needs --index-redis with a rediss:\/\/ URL/,
    );
    refused(
      ["--index-redis", "redis://10.0.0.5:6379", "--index-redis-tls-ca", certs.caFile],
      "--index-redis-tls-ca",
      /is not rediss:\/\//,
    );
    refused(
      ["--index-redis", "redis://10.0.0.5:6379", "--index-redis-tls-ca", certs.caFile],
      "redis://10.0.0.5:6379",
      caPath,
    );
    refused(
      [
        "--index-redis",
        seeds.replaceAll("rediss", "redis"),
        "--index-redis-cluster",
        "--index-redis-tls-ca",
        certs.caFile,
      ],
      "--index-redis-tls-ca",
      /is not rediss:\/\//,
    );
    // A cluster's seeds share their scheme: a mixed list is refused before the CA is looked at.
    refused(
      [
        "--index-redis",
        "rediss://h:1,redis://h:2",
        "--index-redis-cluster",
        "--index-redis-tls-ca",
        certs.caFile,
      ],
      "--index-redis",
      /differs from rediss:\/\/h:1 in scheme/,
    );
    try {
      Deno.env.set("PEGAFLOW_INDEX_REDIS", "rediss://10.0.0.5:6380");
      Deno.env.set("PEGAFLOW_INDEX_REDIS_TLS_CA", certs.caFile);
      const env = parseServeArgs([]);
      assert.equal(env.kind === "config" && env.config.index.tlsCa, pem);
      Deno.env.set("PEGAFLOW_INDEX_REDIS_TLS_CA", missing);
      refused(
        [],
        "PEGAFLOW_INDEX_REDIS_TLS_CA",
        new RegExp(`cannot read CA file "${esc(missing)}"`),
      );
    } finally {
      Deno.env.delete("PEGAFLOW_INDEX_REDIS");
      Deno.env.delete("PEGAFLOW_INDEX_REDIS_TLS_CA");
    }
  } finally {
    await Deno.remove(dir, { recursive: true });
    await certs.remove();
  }
});

Deno.test("an empty PEGAFLOW_INDEX_REDIS_TLS_CA means no CA (the system's trust store), as an empty PEGAFLOW_INDEX_REDIS means no index", () => {
  try {
    Deno.env.set("PEGAFLOW_INDEX_REDIS_TLS_CA", "");
    const none = parseServeArgs([]);
    assert.equal(none.kind, "config", none.kind === "exit" ? none.output : "");
    const tls = parseServeArgs(["--index-redis", "rediss://10.0.0.5:6380"]);
    assert.equal(tls.kind, "config", tls.kind === "exit" ? tls.output : "");
    assert.ok(tls.kind === "config" && !("tlsCa" in tls.config.index), "no CA: the system's");
  } finally {
    Deno.env.delete("PEGAFLOW_INDEX_REDIS_TLS_CA");
  }
});

Deno.test("--index-redis-tls-ca naming a FIFO is refused at once, naming the path, instead of blocking the start", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-flags-ca-" });
  try {
    const fifo = `${dir}/ca.pem`;
    const made = await new Deno.Command("mkfifo", { args: [fifo] }).output();
    assert.ok(made.success, new TextDecoder().decode(made.stderr));
    // Its own process: a read of a FIFO nobody writes blocks the thread that reads it.
    const config = new URL("../../lib/server/config.ts", import.meta.url).href;
    const code = `import { parseServeArgs } from "${config}";
      const r = parseServeArgs(["--index-redis", "rediss://10.0.0.5:6380", "--index-redis-tls-ca", ${
      JSON.stringify(fifo)
    }]);
      console.log(JSON.stringify(r.kind === "exit" ? r.output : "accepted"));`;
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["eval", code],
      stdout: "piped",
      stderr: "piped",
      signal: AbortSignal.timeout(30_000), // killed if the read blocks
    }).output();
    const text = new TextDecoder().decode(out.stdout);
    assert.ok(out.success, `blocked or failed: ${text}${new TextDecoder().decode(out.stderr)}`);
    const output = JSON.parse(text) as string;
    assert.ok(output.includes("--index-redis-tls-ca"), output);
    assert.ok(output.includes(`CA file "${fifo}"`), output);
    assert.match(output, /not a regular file/);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
