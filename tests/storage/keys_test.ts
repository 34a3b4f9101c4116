import { notStrictEqual, strictEqual, throws } from "node:assert/strict";
import { blockKey, hashHex, namespaceOf, type NamespaceSpec } from "../../lib/storage/keys.ts";
import { InvalidArgumentError } from "../../lib/storage/errors.ts";

const LLAMA: NamespaceSpec = {
  model: "meta-llama/Llama-3.1-8B",
  dtype: "bfloat16",
  tpSize: 1,
  ppSize: 1,
  numKvHeads: 8,
  headSize: 128,
  numLayers: 32,
  cacheDtype: "auto",
  layout: "kv-split",
  blockTokens: 16,
};

Deno.test("the namespace is the same in another process (deterministic across restarts)", async () => {
  const here = namespaceOf(LLAMA);
  const url = new URL("../../lib/storage/keys.ts", import.meta.url).href;
  const code = `import { namespaceOf } from "${url}";
    // Keys in a different order must not matter.
    const spec = JSON.parse(Deno.args[0]);
    const shuffled = Object.fromEntries(Object.entries(spec).reverse());
    console.log(namespaceOf(shuffled));`;
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["eval", code, JSON.stringify(LLAMA)],
    stdout: "piped",
    stderr: "piped",
  }).output();
  strictEqual(new TextDecoder().decode(out.stderr).includes("error"), false);
  strictEqual(new TextDecoder().decode(out.stdout).trim(), here);
  strictEqual(here.length, 16);
  strictEqual(/^[0-9a-f]{16}$/.test(here), true);
});

Deno.test("every layout-changing field changes the namespace", () => {
  const base = namespaceOf(LLAMA);
  const variants: Partial<NamespaceSpec>[] = [
    { model: "meta-llama/Llama-3.1-70B" },
    { dtype: "float16" },
    { tpSize: 2 },
    { ppSize: 2 },
    { numKvHeads: 4 },
    { headSize: 64 },
    { numLayers: 80 },
    { cacheDtype: "fp8_e4m3" },
    { layout: "mla" },
    { blockTokens: 32 },
  ];
  const seen = new Set([base]);
  for (const v of variants) {
    const ns = namespaceOf({ ...LLAMA, ...v });
    notStrictEqual(ns, base, JSON.stringify(v));
    seen.add(ns);
  }
  strictEqual(seen.size, variants.length + 1);
});

Deno.test("a bad namespace spec names the field", () => {
  throws(
    () => namespaceOf({ ...LLAMA, tpSize: 0 }),
    (e: unknown) =>
      e instanceof InvalidArgumentError && /tpSize/.test(e.message) &&
      e.code === "INVALID_ARGUMENT",
  );
  throws(() => namespaceOf({ ...LLAMA, model: "" }), /model/);
  throws(() => namespaceOf({ ...LLAMA, layout: "paged" as never }), /layout/);
});

Deno.test("block keys are namespace:hex, bytes and hex agree, bad hashes are refused", () => {
  strictEqual(blockKey("abcd", new Uint8Array([0, 1, 0xfe, 0xff])), "abcd:0001feff");
  strictEqual(blockKey("abcd", "0001feff"), "abcd:0001feff");
  strictEqual(hashHex(new Uint8Array(32).fill(0xab)), "ab".repeat(32));
  throws(() => hashHex(new Uint8Array(0)), InvalidArgumentError);
  throws(() => hashHex(new Uint8Array(65)), InvalidArgumentError);
  throws(() => hashHex("XYZ"), InvalidArgumentError);
});
