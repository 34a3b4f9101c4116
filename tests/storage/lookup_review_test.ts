// Review of queryPrefix's counters: a query refused as malformed is not a query.
import { ok as assert, strictEqual, throws } from "node:assert/strict";
import { h, makeStore, NS, save } from "./helpers.ts";

Deno.test("a query refused for a malformed hash or a bad world size counts no query, hit or miss", () => {
  const { store } = makeStore(8);
  save(store, [h(1)]);
  const before = store.stats();
  throws(() => store.query(NS, [h(1), "not-hex"], "e1"), (e: Error) => /hash/i.test(e.message));
  throws(() => store.query(NS, [h(1)], "e1", 0), (e: Error) => /world size/.test(e.message));
  const after = store.stats();
  strictEqual(after.queries, before.queries, "a refused query was counted");
  strictEqual(after.hits, before.hits);
  strictEqual(after.misses, before.misses);
  // An accepted query still counts.
  const q = store.query(NS, [h(1)], "e1");
  strictEqual(q.hits, 1);
  assert(q.lease);
  strictEqual(store.stats().queries, before.queries + 1);
});
