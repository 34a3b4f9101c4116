/**
 * Exporter and importer in two real processes (host backend: shm files):
 * a child `deno run` allocates and fills KV regions and prints their
 * handles; this process imports them, gathers, scatters into the child's
 * second set of regions, and checks every byte. Once the child frees its
 * regions, the handles no longer import.
 */
import assert from "node:assert/strict";
import { loadLibrary } from "../../ffi/mod.ts";
import { crossProcessRoundTrip } from "./cross_process.ts";

loadLibrary();

Deno.test("regions exported by another process round-trip byte-exact (kv_split)", async () => {
  await crossProcessRoundTrip({
    backend: "host",
    kind: "kv_split",
    numBlocks: 32,
    numLayers: 3,
    segBytes: 4096,
  }, 8 << 20);
});

Deno.test("regions exported by another process round-trip byte-exact (cross_layer)", async () => {
  await crossProcessRoundTrip({
    backend: "host",
    kind: "cross_layer",
    numBlocks: 24,
    numLayers: 4,
    segBytes: 2048,
    numSegsCross: 1,
  }, 8 << 20);
});

Deno.test("an exporter that dies on an uncaught error leaves no shm file behind", async () => {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", decodeURIComponent(new URL("./crash_child.ts", import.meta.url).pathname)],
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.notEqual(out.code, 0, "the child should have failed");
  const name = new TextDecoder().decode(out.stdout).trim();
  assert.match(name, /^\/pegaflow-\d+-\d+$/);
  let exists = true;
  try {
    Deno.statSync(`/dev/shm${name}`);
  } catch (e) {
    if (!(e instanceof Deno.errors.NotFound)) throw e;
    exists = false;
  }
  assert.equal(exists, false, `/dev/shm${name} was left behind`);
});
