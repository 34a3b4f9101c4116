/**
 * LoadStateMaps (lib/engine/load_state_maps.ts): an instance's load states
 * stay mapped between its loads, are reused only while their name still
 * names the same object, and are closed when the instance goes, when two
 * loads mapped one at once, and beyond the per-instance cap.
 */
import assert from "node:assert/strict";
import { KEPT_LOAD_STATES_PER_INSTANCE, LoadStateMaps } from "../../lib/engine/load_state_maps.ts";
import type { ShmPort } from "../../lib/engine/ports.ts";
import { Logger } from "../../lib/log.ts";

/** Fake mappings: `same` answers what the test set; every open and close is counted. */
function world() {
  const live = new Set<string>(["i1", "i2"]);
  const opened: string[] = [];
  const closed: string[] = [];
  const stale = new Set<string>();
  let handle = 0;
  const maps = new LoadStateMaps(
    (name) => {
      opened.push(name);
      const h = ++handle;
      const port: ShmPort = {
        handle: h,
        read: () => {},
        write: () => {},
        same: () => !stale.has(`${name}#${h}`),
        close: () => closed.push(`${name}#${h}`),
      };
      return port;
    },
    (i) => live.has(i),
    new Logger("error", {}, () => {}),
  );
  return { maps, live, opened, closed, stale };
}

Deno.test("a load state is mapped once for an instance's successive loads", () => {
  const w = world();
  const a = w.maps.acquire("i1", "/ls-a", 64);
  w.maps.release("i1", "/ls-a", 64, a);
  const b = w.maps.acquire("i1", "/ls-a", 64);
  assert.equal(b, a, "the kept mapping is reused");
  w.maps.release("i1", "/ls-a", 64, b);
  assert.deepEqual(w.opened, ["/ls-a"]);
  assert.deepEqual(w.closed, []);
  assert.equal(w.maps.size, 1);
});

Deno.test("a kept mapping whose name now names another object is closed and the name mapped anew", () => {
  const w = world();
  const a = w.maps.acquire("i1", "/ls-a", 64);
  w.maps.release("i1", "/ls-a", 64, a);
  w.stale.add(`/ls-a#${a.handle}`); // the engine unlinked it and made a new one under the name
  const b = w.maps.acquire("i1", "/ls-a", 64);
  assert.notEqual(b, a);
  assert.deepEqual(w.closed, [`/ls-a#${a.handle}`]);
  assert.deepEqual(w.opened, ["/ls-a", "/ls-a"]);
  // Another size than it was mapped with is a new mapping too.
  w.maps.release("i1", "/ls-a", 64, b);
  assert.notEqual(w.maps.acquire("i1", "/ls-a", 128), b);
  assert.deepEqual(w.closed, [`/ls-a#${a.handle}`, `/ls-a#${b.handle}`]);
});

Deno.test("instances keep their own mappings; forget closes one instance's", () => {
  const w = world();
  const a = w.maps.acquire("i1", "/ls-a", 64);
  const b = w.maps.acquire("i2", "/ls-a", 64); // another instance naming the same object: its own mapping
  assert.notEqual(a, b);
  w.maps.release("i1", "/ls-a", 64, a);
  w.maps.release("i2", "/ls-a", 64, b);
  w.maps.forget("i1");
  assert.deepEqual(w.closed, [`/ls-a#${a.handle}`]);
  assert.equal(w.maps.acquire("i2", "/ls-a", 64), b);
});

Deno.test("a load that ends after its instance went closes its mapping", () => {
  const w = world();
  const a = w.maps.acquire("i1", "/ls-a", 64);
  w.live.delete("i1");
  w.maps.release("i1", "/ls-a", 64, a);
  assert.deepEqual(w.closed, [`/ls-a#${a.handle}`]);
  assert.equal(w.maps.size, 0);
});

Deno.test("two loads mapping one state at once keep one mapping; the cap closes the oldest", () => {
  const w = world();
  const a = w.maps.acquire("i1", "/ls-a", 64);
  const b = w.maps.acquire("i1", "/ls-a", 64);
  assert.notEqual(a, b, "in use: the second load maps its own");
  w.maps.release("i1", "/ls-a", 64, a);
  w.maps.release("i1", "/ls-a", 64, b);
  assert.deepEqual(w.closed, [`/ls-a#${b.handle}`]);
  const ports = Array.from(
    { length: KEPT_LOAD_STATES_PER_INSTANCE },
    (_, i) => [`/ls-${i}`, w.maps.acquire("i1", `/ls-${i}`, 64)] as const,
  );
  for (const [name, p] of ports) w.maps.release("i1", name, 64, p);
  assert.equal(w.maps.size, KEPT_LOAD_STATES_PER_INSTANCE);
  assert.equal(w.closed.at(-1), `/ls-a#${a.handle}`, "the oldest kept mapping went first");
});
