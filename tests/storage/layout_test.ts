import assert from "node:assert/strict";
import {
  blockLayoutIdentity,
  type LayoutDescription,
  layoutIdentity,
} from "../../lib/storage/layout.ts";
import { KvStore } from "../../lib/storage/store.ts";
import { InvalidArgumentError, LayoutMismatchError } from "../../lib/storage/errors.ts";
import { MAX_BLOCK_ITEMS } from "../../lib/limits.ts";

const names = (n: number) => Array.from({ length: n }, (_, i) => `model.layers.${i}.attn`);
const kv = (n: number, segBytes: number, numSegments = 2): LayoutDescription => ({
  tpSize: 1,
  ppSize: 1,
  collapseTp: false,
  layers: names(n).map((name) => ({ name, segBytes, numSegments })),
});

Deno.test("layouts of equal block size that cut the bytes differently have different fingerprints", () => {
  const base = kv(8, 32768);
  const variants: [string, LayoutDescription][] = [
    ["TP 2 at half the segment", { ...kv(8, 16384), tpSize: 2 }],
    ["16 layers × 1 segment", kv(16, 32768, 1)],
    ["segments re-cut to 16 KiB", kv(8, 16384, 4)],
    ["PP 2", { ...base, ppSize: 2 }],
    ["TP collapsed", { ...base, collapseTp: true }],
    ["other layer names", {
      ...base,
      layers: base.layers.map((l) => ({ ...l, name: l.name + "x" })),
    }],
    ["another slot order", { ...base, layers: [...base.layers].reverse() }],
  ];
  const seen = new Set([layoutIdentity(base).fingerprint]);
  for (const [what, d] of variants) {
    const fp = layoutIdentity(d).fingerprint;
    assert.match(fp, /^[0-9a-f]{32}$/);
    assert.ok(!seen.has(fp), `${what} collides`);
    seen.add(fp);
  }
  assert.equal(
    layoutIdentity(base).summary,
    "tp_size 1, pp_size 1, 8 layers × 2 segments × 32768 B",
  );
});

Deno.test("a layer name cannot forge another layer's line of the fingerprint text", () => {
  const two: LayoutDescription = {
    tpSize: 1,
    ppSize: 1,
    collapseTp: false,
    layers: [{ name: "a", segBytes: 1, numSegments: 1 }, {
      name: "b",
      segBytes: 1,
      numSegments: 1,
    }],
  };
  const forged: LayoutDescription = {
    ...two,
    layers: [{ name: 'a"\t1\t1\n1\t"b', segBytes: 1, numSegments: 1 }, two.layers[1]],
  };
  assert.notEqual(layoutIdentity(two).fingerprint, layoutIdentity(forged).fingerprint);
});

Deno.test("the fingerprint is the same in another process (it outlives restarts)", async () => {
  const d = kv(4, 32768);
  const code = `import { layoutIdentity } from "${
    new URL("../../lib/storage/layout.ts", import.meta.url).href
  }"; console.log(layoutIdentity(${JSON.stringify(d)}).fingerprint);`;
  const out = await new Deno.Command(Deno.execPath(), { args: ["eval", code], stdout: "piped" })
    .output();
  assert.equal(out.code, 0);
  assert.equal(new TextDecoder().decode(out.stdout).trim(), layoutIdentity(d).fingerprint);
});

Deno.test("a store namespace without an engine's identity gets one from its geometry", () => {
  const g = { layers: 4, tpSize: 2, collapseTp: false, segments: 2, segmentBytes: 16384 };
  const a = blockLayoutIdentity(g);
  assert.equal(a.fingerprint, blockLayoutIdentity({ ...g }).fingerprint);
  assert.notEqual(
    a.fingerprint,
    blockLayoutIdentity({ ...g, tpSize: 1, segmentBytes: 32768 }).fingerprint,
  );
  const own = layoutIdentity(kv(4, 16384));
  assert.equal(blockLayoutIdentity({ ...g, identity: own }), own);
});

Deno.test("the store refuses a second layout identity under one namespace, naming both", () => {
  const store = new KvStore({ capacityBytes: 1 << 20 });
  const g = { layers: 4, tpSize: 1, collapseTp: false, segments: 2, segmentBytes: 4096 };
  const a = layoutIdentity(kv(4, 4096));
  const b = layoutIdentity({ ...kv(4, 4096), layers: [...kv(4, 4096).layers].reverse() });
  store.defineNamespace("ns", { ...g, identity: a });
  store.defineNamespace("ns", { ...g, identity: a }); // idempotent
  assert.throws(
    () => store.defineNamespace("ns", { ...g, identity: b }),
    (e: unknown) =>
      e instanceof LayoutMismatchError && e.code === "FAILED_PRECONDITION" &&
      e.message.includes(a.fingerprint) && e.message.includes(b.fingerprint),
  );
  assert.equal(store.layoutOf("ns")!.identity!.fingerprint, a.fingerprint);
});

Deno.test("a layout whose block has more items than MAX_BLOCK_ITEMS is refused, naming the product", () => {
  const store = new KvStore({ capacityBytes: 1 << 20 });
  // Each field is within its own limit; the product sized a 33-million-entry slot table mid-save.
  const huge = { layers: 4096, tpSize: 1024, collapseTp: false, segments: 8, segmentBytes: 1 };
  assert.throws(
    () => store.defineNamespace("huge", huge),
    (e: unknown) =>
      e instanceof InvalidArgumentError && e.code === "INVALID_ARGUMENT" &&
      e.message.includes(`4096 layers × 1024 rank slots × 8 segments = ${4096 * 1024 * 8} items`),
  );
  assert.equal(store.layoutOf("huge"), undefined, "nothing defined");
  // At the limit it is defined; TP collapsed counts one rank slot.
  store.defineNamespace("edge", { ...huge, layers: MAX_BLOCK_ITEMS / (1024 * 8) });
  store.defineNamespace("mla", { ...huge, collapseTp: true, segments: 1 });
});
