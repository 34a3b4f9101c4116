import { deepStrictEqual as assertEquals, strictEqual, throws } from "node:assert/strict";
import { LeaseError } from "../../lib/storage/errors.ts";
import { LeaseTable } from "../../lib/storage/lease.ts";
import { LEASE_ID_BYTES } from "../../lib/limits.ts";

function clock() {
  const c = { now: 1_000, tick: (ms: number) => void (c.now += ms) };
  return c;
}

function leaseError(reason: string) {
  return (e: unknown) =>
    e instanceof LeaseError && e.reason === reason && e.code === "FAILED_PRECONDITION";
}

Deno.test("a lease has a 16-byte random id and is consumed once per rank, world-size times", () => {
  const c = clock();
  const t = new LeaseTable<string>({ clock: () => c.now });
  const l = t.create("eng", "ns", ["a", "b"], 2);
  strictEqual(l.idBytes.length, LEASE_ID_BYTES);
  strictEqual(l.id.length, 2 * LEASE_ID_BYTES);
  strictEqual(l.expiresAt, 1_000 + 600_000); // default TTL 600 s
  strictEqual(t.consume(l.idBytes, "eng", 1).last, false);
  throws(() => t.consume(l.id, "eng", 1), leaseError("rank-already-consumed"));
  throws(() => t.consume(l.id, "eng", 2), leaseError("rank-out-of-range"));
  strictEqual(t.consume(l.id, "eng", 0).last, true);
  strictEqual(t.size, 0);
  throws(() => t.consume(l.id, "eng", 0), leaseError("unknown-or-expired"));
});

Deno.test("a lease is bound to its instance", () => {
  const t = new LeaseTable<string>();
  const l = t.create("eng-a", "ns", ["a"], 1);
  throws(
    () => t.consume(l.id, "eng-b", 0),
    (e: unknown) =>
      e instanceof LeaseError && e.reason === "wrong-instance" && e.fields.instance === "eng-b" &&
      e.fields.expected === "eng-a",
  );
  strictEqual(t.consume(l.id, "eng-a", 0).last, true);
});

Deno.test("an expired lease is unknown; expire() hands back exactly the expired ones", () => {
  const c = clock();
  const t = new LeaseTable<string>({ clock: () => c.now, ttlMs: 100 });
  const a = t.create("e", "ns", ["a"], 1);
  c.tick(60);
  const b = t.create("e", "ns", ["b"], 1);
  c.tick(40); // a expires now, b in 60 ms
  throws(() => t.consume(a.id, "e", 0), leaseError("unknown-or-expired"));
  assertEquals(t.expire().map((l) => l.id), [a.id]);
  strictEqual(t.size, 1);
  c.tick(60);
  assertEquals(t.expire().map((l) => l.id), [b.id]);
});

Deno.test("release and dropInstance remove leases; unknown and malformed ids are refused", () => {
  const t = new LeaseTable<string>();
  const a = t.create("x", "ns", ["a"], 1);
  const b = t.create("y", "ns", ["b"], 1);
  const c = t.create("x", "ns", ["c"], 1);
  strictEqual(t.release(b.idBytes).id, b.id);
  throws(() => t.release(b.id), leaseError("unknown-or-expired"));
  assertEquals(t.dropInstance("x").map((l) => l.id).sort(), [a.id, c.id].sort());
  strictEqual(t.size, 0);
  throws(() => t.release(new Uint8Array(3)), leaseError("unknown-or-expired"));
  throws(() => t.release("not-hex"), leaseError("unknown-or-expired"));
});

Deno.test("a failing validate callback leaves the rank's consume unspent", () => {
  const t = new LeaseTable<string>();
  const l = t.create("e", "ns", ["a"], 1);
  throws(() =>
    t.consume(l.id, "e", 0, () => {
      throw new Error("bad layers");
    }), /bad layers/);
  strictEqual(t.consume(l.id, "e", 0).last, true);
});
