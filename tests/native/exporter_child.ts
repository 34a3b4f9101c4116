/**
 * Test helper process: acts as an inference engine that owns KV memory.
 * Allocates source and destination regions for a geometry on the given
 * backend, fills the source with (block, layer, seg)-derived content, prints
 * one JSON line {src: hex[], dst: hex[]} with the 64-byte handles, then
 * holds the memory until stdin closes, frees it and prints "closed".
 *
 * Usage: deno run -A exporter_child.ts '<json GeometryArgs>'
 */
import { Engine, loadLibrary } from "../../ffi/mod.ts";
import { allocRegions, fillRegions, type LayoutKind, makeGeometry } from "./kv_layout.ts";

/** What the parent asks the child to allocate. */
export interface ExporterArgs {
  backend: "host" | "cuda";
  device?: number;
  kind: LayoutKind;
  numBlocks: number;
  numLayers: number;
  segBytes: number;
  numSegsCross?: number;
}

function hex(b: Uint8Array): string {
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

if (import.meta.main) {
  loadLibrary();
  const args = JSON.parse(Deno.args[0]) as ExporterArgs;
  const engine = Engine.open({ backend: args.backend, device: args.device ?? 0 });
  const g = makeGeometry(
    args.kind,
    args.numBlocks,
    args.numLayers,
    args.segBytes,
    args.numSegsCross ?? 2,
  );
  const src = allocRegions(engine, g);
  const dst = allocRegions(engine, g);
  fillRegions(g, src);
  if (args.backend === "cuda") {
    // cuMemAlloc does not zero: the parent checks untouched bytes stay 0.
    for (const r of dst) r.write(0, new Uint8Array(r.bytes));
  }
  console.log(
    JSON.stringify({ src: src.map((r) => hex(r.handle)), dst: dst.map((r) => hex(r.handle)) }),
  );
  // Hold the memory until the parent closes our stdin.
  for await (const _ of Deno.stdin.readable) { /* drain */ }
  for (const r of [...src, ...dst]) r.close();
  engine.close();
  console.log("closed");
}
