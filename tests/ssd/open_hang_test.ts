/**
 * A filesystem that hangs while the SSD tier opens (a dead network mount, a
 * hung disk), as a real mount: a FUSE filesystem (tests/ssd/_fuse_hang.ts)
 * that holds one kind of request, so the tier's syscall blocks in the kernel
 * and does not return. Before, the open made these calls on the server's
 * only JS thread (Deno.statSync/openSync, FFI calls on that thread): it
 * froze there for good and never said why. Now `open()` must give up at its
 * deadline (`ioStallMs`) with an `SsdOpenHungError` (an `SsdOpenError`, so
 * the server serves from RAM) naming the call, the path and the deadline,
 * logged; once the call returns, nothing of the open goes on and nothing it
 * opened is left open (this process's fd count is back where it was), and
 * the cache file's lock is free again.
 */
import assert from "node:assert/strict";
import {
  SsdOpenError,
  SsdOpenHungError,
  SsdTier,
  type SsdTierOptions,
} from "../../lib/ssd/tier.ts";
import { Logger } from "../../lib/log.ts";
import { startServer } from "../../lib/server/server.ts";
import { inProcessSsdConfig } from "./_server.ts";
import { harness, within } from "./_harness.ts";
import {
  assertNothingLeft,
  canFuse,
  type FuseOp,
  hangingMount,
  openFds,
  until,
} from "./_fuse_hang.ts";

const MiB = 1 << 20;
const DEADLINE_MS = 300;

interface Case {
  /** The FUSE request held, and which one of its kind. */
  hold: FuseOp;
  nth: number;
  /** The call the error must name. */
  op: string;
  /** Whether the io engine was open when the call hung (the pool stays held till it returns). */
  engine: boolean;
  /** Whether the hung call opens a file (closed when it returns late). */
  opens: boolean;
}

/**
 * Opens a tier on a FUSE mount that holds `c.hold`, and checks the give-up,
 * the error, the log, and that after the release nothing leaked.
 */
async function hungOpen(c: Case): Promise<void> {
  const h = await harness();
  const mnt = `${h.dir}/mnt`;
  await Deno.mkdir(mnt);
  const m = await hangingMount(mnt, c.hold, c.nth, 4_000);
  const file = `${mnt}/pegaflow-ssd.cache`;
  try {
    const fds = openFds(mnt);
    const t0 = performance.now();
    const opened = h.openTier({
      paths: [mnt],
      capacityBytes: 8 * MiB,
      segmentBytes: MiB,
      ioStallMs: DEADLINE_MS,
    });
    const err = await within(opened.catch((e) => e), 3_000, "open on a hung filesystem");
    const waited = performance.now() - t0;
    await within(m.held, 100, `the filesystem holding a ${c.hold}`);
    assert.ok(err instanceof SsdOpenHungError, String(err));
    assert.ok(err instanceof SsdOpenError, "the server serves from RAM");
    assert.ok(
      waited >= DEADLINE_MS - 5 && waited < DEADLINE_MS + 1_500,
      `gave up after ${waited} ms`,
    );
    const said = `${c.op} of ${file} did not return within ${DEADLINE_MS} ms`;
    assert.ok(err.message.includes(said), err.message);
    assert.equal(err.path, file);
    assert.equal(err.op, c.op);
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes(said) && l.includes(`"path":"${file}"`) &&
        l.includes(`"deadline_ms":${DEADLINE_MS}`)
      ),
      h.logs.join("\n"),
    );
    assert.equal(!!err.stillOpen(), c.engine, "the engine is held while the call hangs");
    // The call returns: what the open held closes, and the open does not go on.
    const logged = h.logs.length;
    await m.release();
    await within(err.engineClosed, 3_000, "the abandoned open's files closing");
    assert.equal(err.stillOpen(), undefined);
    await assertNothingLeft(mnt, fds, file);
    const after = h.logs.slice(logged);
    const late = c.opens ? "returned; what it opened is closed" : "returned after its deadline";
    assert.ok(after.some((l) => l.includes(late)), after.join("\n"));
    assert.ok(!after.some((l) => l.includes("rebuilding the SSD index")), after.join("\n"));
  } finally {
    await m.close();
    await h.close();
  }
}

Deno.test({
  name:
    "a cache file whose open hangs (the lock's open, a dead mount): open gives up at its deadline naming the open, the path and the deadline; the late file is closed",
  ignore: !canFuse,
  fn: () => hungOpen({ hold: "CREATE", nth: 1, op: "open", engine: false, opens: true }),
});

Deno.test({
  name:
    "a cache file whose open for io hangs (pf_file_open): open gives up at its deadline; the engine closes the late file once it returns",
  ignore: !canFuse,
  fn: () => hungOpen({ hold: "OPEN", nth: 1, op: "open for io", engine: true, opens: true }),
});

Deno.test({
  name:
    "a filesystem whose statvfs hangs (the free-space check): open gives up at its deadline naming statvfs and the path",
  ignore: !canFuse,
  fn: () => hungOpen({ hold: "STATFS", nth: 1, op: "statvfs", engine: true, opens: false }),
});

Deno.test({
  name:
    "a cache file whose ftruncate hangs (sizing it): open gives up at its deadline naming ftruncate and the path",
  ignore: !canFuse,
  fn: () =>
    hungOpen({ hold: "SETATTR", nth: 1, op: "ftruncate to 0 bytes", engine: true, opens: false }),
});

/** The longest this thread went without running a 10 ms timer while `p` ran (a frozen JS thread). */
async function longestStall<T>(p: Promise<T>): Promise<{ value: T; stallMs: number }> {
  let last = performance.now(), stallMs = 0;
  const tick = setInterval(() => {
    const now = performance.now();
    stallMs = Math.max(stallMs, now - last);
    last = now;
  }, 10);
  try {
    const value = await p;
    stallMs = Math.max(stallMs, performance.now() - last);
    return { value, stallMs };
  } finally {
    clearInterval(tick);
  }
}

Deno.test({
  name:
    "a filesystem whose close hangs (FUSE FLUSH, sent on every close there): no call of the open closes a file on the JS thread, which never stops, and the tier opens and closes once the close returns",
  ignore: !canFuse,
  async fn() {
    const h = await harness();
    const mnt = `${h.dir}/mnt`;
    await Deno.mkdir(mnt);
    const m = await hangingMount(mnt, "FLUSH", 1, 4_000);
    const file = `${mnt}/pegaflow-ssd.cache`;
    try {
      const fds = openFds(mnt);
      // Before, each of Deno's calls on the lock's open file (tryLock, stat, truncate) dup'ed
      // its fd and closed the dup on this thread: held there until the FLUSH was answered
      // (4 s), the open then gave up naming the flock, which had returned at once.
      const opened = h.openTier({
        paths: [mnt],
        capacityBytes: 8 * MiB,
        segmentBytes: MiB,
        ioStallMs: DEADLINE_MS,
      }).catch((e) => e);
      const { value: tier, stallMs } = await longestStall(opened);
      assert.ok(stallMs < 1_500, `the JS thread stood still for ${Math.round(stallMs)} ms`);
      assert.ok(tier instanceof SsdTier, String(tier));
      // Its close waits for the held FLUSH off this thread (the engine's and the lock's closes).
      const closing = longestStall(tier.close());
      await within(m.held, 2_000, "the filesystem holding a FLUSH");
      await new Promise((r) => setTimeout(r, 100));
      await m.release();
      const closed = await within(closing, 3_000, "the tier's close");
      assert.ok(closed.stallMs < 1_500, `stood still ${Math.round(closed.stallMs)} ms at close`);
      await assertNothingLeft(mnt, fds, file);
    } finally {
      await m.close();
      await h.close();
    }
  },
});

Deno.test({
  name:
    "a server whose SSD cache path hangs starts without the SSD tier, saying why, and stops cleanly once the call returned",
  ignore: !canFuse,
  async fn() {
    const dir = await Deno.makeTempDir({ prefix: "pf-open-hang-" });
    const m = await hangingMount(dir, "OPEN", 1, 4_000);
    // The server's tier, with a short deadline (the default is 30 s).
    const open = SsdTier.open;
    SsdTier.open = (o: SsdTierOptions) => open({ ...o, ioStallMs: DEADLINE_MS });
    const logs: string[] = [];
    const log = new Logger("debug", {}, (line) => logs.push(line));
    try {
      const server = await within(
        startServer(inProcessSsdConfig(dir), log),
        3_000,
        "the server's start",
      );
      const file = `${dir}/pegaflow-ssd.cache`;
      assert.ok(
        logs.some((l) =>
          l.includes('"level":"error"') && l.includes("SSD tier disabled") &&
          l.includes(`open for io of ${file} did not return within ${DEADLINE_MS} ms`)
        ),
        logs.join("\n"),
      );
      assert.ok(!logs.some((l) => l.includes("SSD tier ready")), logs.join("\n"));
      await m.release();
      await until(() => logs.some((l) => l.includes("SSD open abandoned")), 3_000, "the release");
      await within(server.close(), 5_000, "the server's stop");
      assert.ok(!logs.some((l) => l.includes("left to process exit")), logs.join("\n"));
    } finally {
      SsdTier.open = open;
      await m.close();
      await Deno.remove(dir, { recursive: true }).catch(() => {});
    }
  },
});
