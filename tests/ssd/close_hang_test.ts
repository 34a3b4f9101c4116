/**
 * A filesystem that hangs when the running SSD tier closes its files, as a
 * real mount: a FUSE filesystem (tests/ssd/_fuse_hang.ts) that holds a FLUSH,
 * the request every close(2) sends there and waits for (a network mount's
 * flush is the same). Before, the tier's close waited on it without a
 * deadline (`pf_uring_close` closing the io files, then the lock files'
 * close), so the server's stop never ended. Now the close gives up at
 * `closeTimeoutMs`, naming the call, the path and the deadline (logged at
 * error level); what is stuck is left to process exit (an engine not closed
 * keeps the pinned pool and the completion ring), and once the call returns
 * the close finishes by itself: no crash, no double close, nothing left open.
 */
import assert from "node:assert/strict";
import { SsdTier, type SsdTierOptions } from "../../lib/ssd/tier.ts";
import { Logger } from "../../lib/log.ts";
import { startServer } from "../../lib/server/server.ts";
import { inProcessSsdConfig } from "./_server.ts";
import { type Harness, harness, within } from "./_harness.ts";
import { assertNothingLeft, canFuse, hangingMount, openFds, until } from "./_fuse_hang.ts";

const MiB = 1 << 20;
const DEADLINE_MS = 300;
/** How long the FUSE server holds the FLUSH by itself (a test without the fix fails first). */
const GUARD_MS = 6_000;

/** A tier on `mnt` with short deadlines. */
function openOn(h: Harness, mnt: string): Promise<SsdTier> {
  return h.openTier({
    paths: [mnt],
    capacityBytes: 8 * MiB,
    segmentBytes: MiB,
    ioStallMs: DEADLINE_MS,
    closeTimeoutMs: DEADLINE_MS,
  });
}

/**
 * The lock file's handle on the mount: the open locks the cache file before
 * it opens the file for io, so the lock's open is the file's first (handle 1;
 * the io engine's are 2 and, with O_DIRECT, 3). Its close's FLUSH is picked
 * by that handle, not by its place among the FLUSHes: the io engine's closes
 * run on another thread and may come before or after it.
 */
const LOCK_FH = 1;

/**
 * Closes a tier on a mount that holds the first FLUSH (of handle `fh`, when
 * > 0); checks the give-up names `op` and the file, what {@link SsdTier.stillOpen} says meanwhile
 * (`engineHeld`), and that once the FLUSH is answered everything closes.
 */
async function hungClose(fh: number, op: string, engineHeld: boolean) {
  const h = await harness();
  const mnt = `${h.dir}/mnt`;
  await Deno.mkdir(mnt);
  const m = await hangingMount(mnt, "FLUSH", 1, GUARD_MS, fh);
  const file = `${mnt}/pegaflow-ssd.cache`;
  try {
    const fds = openFds(mnt);
    const tier = await openOn(h, mnt);
    const t0 = performance.now();
    await within(tier.close(), 2_000, "the tier's close on a filesystem whose FLUSH hangs");
    const waited = performance.now() - t0;
    await within(m.held, 100, "the filesystem holding a FLUSH");
    assert.ok(waited >= DEADLINE_MS - 5 && waited < DEADLINE_MS + 1_000, `gave up after ${waited}`);
    const said = `SSD close gave up: ${op} of ${file} did not return within ${DEADLINE_MS} ms`;
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes(said) && l.includes(`"path":"${file}"`) &&
        l.includes(`"op":"${op}"`) && l.includes(`"deadline_ms":${DEADLINE_MS}`)
      ),
      h.logs.join("\n"),
    );
    // While the io files' close hangs the engine still holds the pool and the ring.
    assert.equal(tier.stillOpen()?.includes(said) ?? false, engineHeld, String(tier.stillOpen()));
    assert.equal(tier.stats().capacityBytes, 7 * MiB, "stats after the give-up");
    await within(tier.close(), 100, "a second close");
    const logged = h.logs.length;
    await m.release();
    await within(tier.engineClosed, 3_000, "the engine and lock closing once the FLUSH returned");
    assert.equal(tier.stillOpen(), undefined);
    const after = h.logs.slice(logged);
    assert.ok(
      after.some((l) => l.includes("SSD close finished") && l.includes('"returned_after_ms":')),
      after.join("\n"),
    );
    assert.ok(!after.some((l) => l.includes('"level":"error"')), after.join("\n"));
    await assertNothingLeft(mnt, fds, file);
  } finally {
    await m.close();
    await h.close();
  }
}

Deno.test({
  name:
    "a tier whose io files' close hangs (FUSE FLUSH in pf_uring_close): close gives up at closeTimeoutMs naming the call, the path and the deadline; the engine stays held until the call returns, then everything closes",
  ignore: !canFuse,
  fn: () => hungClose(0, "close for io (pf_uring_close)", true),
});

Deno.test({
  name:
    "a tier whose lock file's close hangs (FUSE FLUSH): close gives up at closeTimeoutMs naming the lock file's close and the path; the engine is closed, the lock goes once the call returns",
  ignore: !canFuse,
  fn: () => hungClose(LOCK_FH, "close of the lock file", false),
});

Deno.test({
  name:
    "a server whose SSD cache file's close hangs at stop: the stop ends, the SSD close logged with the call, path and deadline, the pool and ring left to process exit; nothing breaks once the call returns",
  ignore: !canFuse,
  async fn() {
    const dir = await Deno.makeTempDir({ prefix: "pf-close-hang-" });
    const m = await hangingMount(dir, "FLUSH", 1, GUARD_MS);
    let tier: SsdTier | undefined;
    const open = SsdTier.open;
    SsdTier.open = (o: SsdTierOptions) =>
      open({ ...o, ioStallMs: DEADLINE_MS, closeTimeoutMs: DEADLINE_MS }).then((t) => (tier = t));
    const logs: string[] = [];
    const log = new Logger("debug", {}, (line) => logs.push(line));
    try {
      const server = await within(
        startServer(inProcessSsdConfig(dir), log),
        3_000,
        "the server's start",
      );
      assert.ok(tier, "the server opened the SSD tier");
      const file = `${dir}/pegaflow-ssd.cache`;
      await within(server.close(), 3_000, "the server's stop on a filesystem whose FLUSH hangs");
      const said =
        `close for io (pf_uring_close) of ${file} did not return within ${DEADLINE_MS} ms`;
      assert.ok(
        logs.some((l) =>
          l.includes('"level":"error"') && l.includes("SSD close gave up") && l.includes(said) &&
          l.includes(`"deadline_ms":${DEADLINE_MS}`)
        ),
        logs.join("\n"),
      );
      assert.ok(
        logs.some((l) =>
          l.includes('"level":"error"') && l.includes("left to process exit") && l.includes(said)
        ),
        logs.join("\n"),
      );
      // The stuck call is a close, not io: the server's own words say only that the tier is open.
      const left = logs.find((l) => l.includes("completion ring left to process exit")) ?? "";
      assert.ok(!left.includes("io in the kernel"), left);
      assert.ok(left.includes("the SSD tier has not finished closing"), left);
      assert.ok(tier.stillOpen(), "the engine was not taken for closed");
      await m.release();
      await within(tier.engineClosed, 3_000, "the engine closing once the FLUSH returned");
      assert.equal(tier.stillOpen(), undefined);
      await until(() => logs.some((l) => l.includes("SSD close finished")), 1_000, "the log");
    } finally {
      SsdTier.open = open;
      await m.close();
      await Deno.remove(dir, { recursive: true }).catch(() => {});
    }
  },
});

Deno.test({
  name:
    "a tier whose fdatasync hangs at close (FUSE FSYNC held): close gives up at closeTimeoutMs naming fdatasync, the path and the deadline; everything closes once the call returns",
  ignore: !canFuse,
  async fn() {
    const h = await harness();
    const mnt = `${h.dir}/mnt`;
    await Deno.mkdir(mnt);
    const m = await hangingMount(mnt, "FSYNC", 1, GUARD_MS);
    const file = `${mnt}/pegaflow-ssd.cache`;
    try {
      const tier = await openOn(h, mnt);
      const t0 = performance.now();
      await within(tier.close(), 2_000, "the tier's close on a filesystem whose FSYNC hangs");
      const waited = performance.now() - t0;
      await within(m.held, 100, "the filesystem holding an FSYNC");
      assert.ok(
        waited >= DEADLINE_MS - 5 && waited < DEADLINE_MS + 1_000,
        `gave up after ${waited}`,
      );
      const said = `fdatasync of ${file} did not return within ${DEADLINE_MS} ms`;
      assert.ok(
        h.logs.some((l) =>
          l.includes('"level":"error"') && l.includes("SSD close gave up") && l.includes(said) &&
          !l.includes("no io op in the kernel") && l.includes(`"path":"${file}"`) &&
          l.includes('"op":"fdatasync"') && l.includes(`"deadline_ms":${DEADLINE_MS}`)
        ),
        h.logs.join("\n"),
      );
      assert.ok(tier.stillOpen()?.includes(`fdatasync of ${file}`), String(tier.stillOpen()));
      await m.release();
      await within(tier.engineClosed, 3_000, "the engine and lock closing once the FSYNC returned");
      assert.equal(tier.stillOpen(), undefined);
      await until(() => h.logs.some((l) => l.includes("SSD close finished")), 1_000, "the log");
    } finally {
      await m.close();
      await h.close();
    }
  },
});
