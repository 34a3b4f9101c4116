/**
 * The quiet-batch progress check both backends run (tests/native/quiet_batch_test.ts on the
 * host, tests/gpu/quiet_cuda_test.ts on cuda): a quiet batch with progress words still stores
 * its groups done, one by one, and then its final status, over stale values.
 */
import assert from "node:assert/strict";
import {
  type CopyBatch,
  type CopyEngine,
  type ProgressTarget,
  SharedMemory,
} from "../../ffi/mod.ts";

/**
 * Submits `batch(progress)` quiet, `progress` pointing at words 2 and 3 of a fresh shared
 * memory that hold stale values, and checks that they read `groups` done and status ok.
 */
export async function assertQuietProgress(
  ce: CopyEngine,
  name: string,
  groups: number,
  batch: (progress: ProgressTarget) => CopyBatch,
): Promise<void> {
  const shm = SharedMemory.open(`/pegaflow-${name}-${Deno.pid}`, 64, {
    create: true,
    unlink: true,
  });
  try {
    const words = new Uint32Array(shm.view().buffer, 0, 16);
    words[2] = 777; // stale values the batch must overwrite
    words[3] = 777;
    const r = await ce.submitQuiet(batch({ shm, offset: 8 }));
    assert.equal(r.status, 0, r.error ?? "");
    assert.equal(words[2], groups, "groups done");
    assert.equal(words[3], 1, "final status: ok");
  } finally {
    shm.close();
  }
}
