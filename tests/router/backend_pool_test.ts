/** Backend selection: least inflight among healthy backends, ties shared, exclusions honoured. */

import assert from "node:assert/strict";
import fc from "fast-check";
import { BackendPool } from "../../lib/router/backend_pool.ts";

const URLS = ["http://a:1", "http://b:1", "http://c:1"];

Deno.test("the backend with the fewest inflight requests is picked", () => {
  const pool = new BackendPool("decode", URLS);
  const [a, b, c] = pool.backends;
  a.inflight = 3;
  b.inflight = 1;
  c.inflight = 2;
  for (let i = 0; i < 5; i++) assert.equal(pool.pick(), b);
});

Deno.test("idle backends take turns", () => {
  const pool = new BackendPool("prefill", URLS);
  const picked = Array.from({ length: 6 }, () => pool.pick()!.url);
  assert.deepEqual(picked, [...URLS, ...URLS]);
});

Deno.test("unhealthy and excluded backends are never picked; none left gives undefined", () => {
  const pool = new BackendPool("prefill", URLS);
  const [a, b, c] = pool.backends;
  pool.markDown(a, "test");
  for (let i = 0; i < 4; i++) assert.notEqual(pool.pick(), a);
  assert.equal(pool.pick(new Set([b])), c);
  pool.markDown(c, "test");
  assert.equal(pool.pick(new Set([b])), undefined);
  pool.markUp(a, "test");
  assert.equal(pool.pick(new Set([b])), a);
  assert.equal(pool.healthyCount(), 2);
});

Deno.test("health changes are reported once per transition", () => {
  const pool = new BackendPool("decode", URLS);
  const seen: string[] = [];
  pool.onHealthChange((b, up) => seen.push(`${b.url}:${up}`));
  const a = pool.backends[0];
  pool.markDown(a, "x");
  pool.markDown(a, "y");
  assert.equal(a.lastError, "y");
  pool.markUp(a, "ok");
  pool.markUp(a, "ok");
  assert.deepEqual(seen, ["http://a:1:false", "http://a:1:true"]);
  assert.equal(a.lastError, null);
});

Deno.test("release below zero is a bug and says which backend", () => {
  const pool = new BackendPool("decode", URLS);
  assert.throws(
    () => pool.release(pool.backends[1]),
    /inflight underflow on decode backend http:\/\/b:1/,
  );
});

Deno.test("property: pick returns a healthy, non-excluded backend with minimal inflight", () => {
  fc.assert(fc.property(
    fc.array(fc.record({ inflight: fc.nat(5), healthy: fc.boolean(), excluded: fc.boolean() }), {
      minLength: 1,
      maxLength: 8,
    }),
    fc.nat(10),
    (specs, rotations) => {
      const pool = new BackendPool("decode", specs.map((_, i) => `http://h${i}:1`));
      const exclude = new Set(pool.backends.filter((_, i) => specs[i].excluded));
      pool.backends.forEach((b, i) => {
        b.inflight = specs[i].inflight;
        b.healthy = specs[i].healthy;
      });
      for (let r = 0; r < rotations; r++) pool.pick();
      const eligible = pool.backends.filter((b) => b.healthy && !exclude.has(b));
      const got = pool.pick(exclude);
      if (eligible.length === 0) return got === undefined;
      const min = Math.min(...eligible.map((b) => b.inflight));
      return got !== undefined && eligible.includes(got) && got.inflight === min;
    },
  ));
});
