/**
 * Test helper: one exporter/importer round trip across two processes, used
 * by tests/native (host) and tests/gpu (cuda IPC).
 */
import assert from "node:assert/strict";
import { CopyEngine, type CopyPath, NativeError, type Region } from "../../ffi/mod.ts";
import type { ExporterArgs } from "./exporter_child.ts";
import { makeGeometry, pickBlocks, runRoundTrip } from "./kv_layout.ts";
import { mulberry32 as rng } from "../_seeded.ts";
import { spawnDeno, unhex } from "./process.ts";

/** Runs one two-process round trip for `args` on `backend`. */
export async function crossProcessRoundTrip(
  args: ExporterArgs,
  poolBytes: number,
  path?: CopyPath,
): Promise<void> {
  const child = spawnDeno(new URL("./exporter_child.ts", import.meta.url), [JSON.stringify(args)]);
  const ce = CopyEngine.open({ backend: args.backend, device: args.device ?? 0, poolBytes });
  const imported: Region[] = [];
  let handles: { src: string[]; dst: string[] } | undefined;
  try {
    const line = await child.line();
    assert.ok(line, "the exporter exited before printing its handles");
    handles = JSON.parse(line) as { src: string[]; dst: string[] };
    const g = makeGeometry(
      args.kind,
      args.numBlocks,
      args.numLayers,
      args.segBytes,
      args.numSegsCross ?? 2,
    );
    const src = handles.src.map((h, i) => ce.engine.importRegion(unhex(h), g.regionBytes[i]));
    imported.push(...src);
    const dst = handles.dst.map((h, i) => ce.engine.importRegion(unhex(h), g.regionBytes[i]));
    imported.push(...dst);
    assert.ok(src.every((r) => r.info().imported));
    const rand = rng(args.numBlocks * 7 + args.numLayers);
    const n = Math.max(1, Math.floor(args.numBlocks / 2));
    await runRoundTrip(
      ce,
      g,
      src,
      dst,
      pickBlocks(rand, args.numBlocks, n, false),
      pickBlocks(rand, args.numBlocks, n, false),
      { path },
    );
  } finally {
    for (const r of imported) r.close();
    await ce.close();
    await child.closeStdin();
    assert.equal(await child.line(), "closed");
    assert.equal(await child.line(), null);
    assert.equal((await child.proc.status).code, 0);
  }
  if (args.backend === "host" && handles) {
    // The exporter unlinked its shm names on close: importing now fails.
    const ce2 = CopyEngine.open({ backend: "host", poolBytes: 1 << 16 });
    try {
      assert.throws(
        () => ce2.engine.importRegion(unhex(handles!.src[0]), 64),
        (e: unknown) =>
          e instanceof NativeError && e.codeName === "PF_EHANDLE" &&
          /is the exporting process alive/.test(e.message),
      );
    } finally {
      await ce2.close();
    }
  }
}
