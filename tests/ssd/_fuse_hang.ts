/**
 * A real hung filesystem for the SSD open tests: a FUSE mount served by a
 * child process that answers every request except one chosen kind (e.g. the
 * first CREATE), which it holds until told to answer. The call waiting on it
 * blocks in the kernel exactly as one on a dead network mount or a hung disk
 * does (no fake in the tier's path: its syscall does not return). The child
 * answers a held request by itself after `guardMs`, so a test of code that
 * blocks its JS thread on it still ends (and fails) instead of hanging.
 *
 * Served: one directory (the mount root) holding at most the cache file, in
 * memory: LOOKUP, GETATTR, SETATTR (size), CREATE, OPEN, READ, WRITE, STATFS,
 * FLUSH, FSYNC, RELEASE; everything else answers ENOSYS. flock is the
 * kernel's own (no FUSE lock requests).
 *
 * Mounting needs CAP_SYS_ADMIN and /dev/fuse: where refused, the tests that
 * need it are skipped (`ignore: !canFuse`), never faked.
 *
 * Run as a child: `deno run -A _fuse_hang.ts <mountpoint> <OP> <nth> <guardMs> <fh> <pid>`;
 * it prints `mounted`, then `held <OP>` when it holds the request; a line
 * `release` on its stdin answers it; closing stdin unmounts and exits.
 */
import { lockCacheFile } from "../../lib/ssd/file_lock.ts";

/** FUSE opcodes this server knows (linux/fuse.h). */
const OP = {
  LOOKUP: 1,
  FORGET: 2,
  GETATTR: 3,
  SETATTR: 4,
  OPEN: 14,
  READ: 15,
  WRITE: 16,
  STATFS: 17,
  RELEASE: 18,
  FSYNC: 20,
  FLUSH: 25,
  INIT: 26,
  CREATE: 35,
  INTERRUPT: 36,
  DESTROY: 38,
  BATCH_FORGET: 42,
} as const;
export type FuseOp = keyof typeof OP;

const ENOENT = 2;
const ENOSYS = 38;
const FILE_NAME = "pegaflow-ssd.cache";
const ROOT = 1n;
const FILE = 2n;
const IN_HEADER = 40;
const OUT_HEADER = 16;
const FATTR_SIZE = 1 << 3;

/** The server side, in the child process. */
class HangFs {
  readonly #write: (buf: Uint8Array) => void;
  readonly #hold: { op: number; nth: number; fh: bigint; pid: number };
  readonly #onHold: () => void;
  #seen = 0;
  #held: Uint8Array | undefined;
  #data = new Uint8Array(0);
  #exists = false;
  /** The file handle the next OPEN or CREATE answers (1, 2, ...: one per open file description). */
  #nextFh = 1n;

  constructor(
    write: (buf: Uint8Array) => void,
    op: FuseOp,
    nth: number,
    fh: bigint,
    pid: number,
    onHold: () => void,
  ) {
    this.#write = write;
    this.#hold = { op: OP[op], nth, fh, pid };
    this.#onHold = onHold;
  }

  /** One request: answered now, held, or (FORGET) never answered. */
  take(req: Uint8Array): void {
    const v = new DataView(req.buffer, req.byteOffset, req.byteLength);
    const opcode = v.getUint32(4, true);
    // A request on a file handle (FLUSH, RELEASE, FSYNC, READ, WRITE) names it first in its body.
    const onFh = this.#hold.fh === 0n || (req.byteLength >= IN_HEADER + 8 &&
      v.getBigUint64(IN_HEADER, true) === this.#hold.fh);
    if (opcode === this.#hold.op && onFh && this.#fromTest(v) && ++this.#seen === this.#hold.nth) {
      this.#held = req.slice();
      console.log(`held ${Object.keys(OP).find((k) => OP[k as FuseOp] === opcode)}`);
      this.#onHold();
      return;
    }
    this.#answer(req);
  }

  /**
   * Whether a request comes from a thread of the test's process. A process
   * forked meanwhile (a child another test file spawns: `deno test
   * --parallel` runs them in the same process) closes its copies of every
   * descriptor at exec, and each of those closes sends this file a FLUSH of
   * its own, from the child's pid.
   */
  #fromTest(v: DataView): boolean {
    if (this.#hold.pid === 0) return true;
    try {
      Deno.statSync(`/proc/${this.#hold.pid}/task/${v.getUint32(32, true)}`);
      return true;
    } catch {
      return false;
    }
  }

  /** Answers the held request (a release, or the guard). */
  release(): void {
    const req = this.#held;
    this.#held = undefined;
    if (req) this.#answer(req);
  }

  #answer(req: Uint8Array): void {
    const v = new DataView(req.buffer, req.byteOffset, req.byteLength);
    const opcode = v.getUint32(4, true);
    const unique = v.getBigUint64(8, true);
    const node = v.getBigUint64(16, true);
    if (opcode === OP.FORGET || opcode === OP.BATCH_FORGET || opcode === OP.INTERRUPT) return;
    const body = req.subarray(IN_HEADER);
    const out = this.#reply(opcode, node, body);
    this.#send(unique, typeof out === "number" ? -out : 0, typeof out === "number" ? null : out);
  }

  /** The reply's body, or an errno. */
  #reply(opcode: number, node: bigint, body: Uint8Array): Uint8Array | number {
    const bv = new DataView(body.buffer, body.byteOffset, body.byteLength);
    switch (opcode) {
      case OP.INIT:
        return initOut(bv.getUint32(4, true));
      case OP.LOOKUP:
        return cName(body) === FILE_NAME && this.#exists ? this.#entry() : ENOENT;
      case OP.GETATTR:
        return node === ROOT || this.#exists ? attrOut(this.#attr(node)) : ENOENT;
      case OP.SETATTR:
        if (bv.getUint32(0, true) & FATTR_SIZE) this.#resize(Number(bv.getBigUint64(16, true)));
        return attrOut(this.#attr(node));
      case OP.CREATE:
        this.#exists = true;
        return concat(this.#entry(), openOut(this.#nextFh++));
      case OP.OPEN:
        return openOut(this.#nextFh++);
      case OP.READ:
        return this.#read(Number(bv.getBigUint64(8, true)), bv.getUint32(16, true));
      case OP.WRITE:
        return this.#writeAt(
          Number(bv.getBigUint64(8, true)),
          body.subarray(40, 40 + bv.getUint32(16, true)),
        );
      case OP.STATFS:
        return statfsOut();
      case OP.FLUSH:
      case OP.FSYNC:
      case OP.RELEASE:
      case OP.DESTROY:
        return new Uint8Array(0);
      default:
        return ENOSYS;
    }
  }

  #resize(size: number): void {
    const next = new Uint8Array(size);
    next.set(this.#data.subarray(0, Math.min(size, this.#data.length)));
    this.#data = next;
  }

  #read(offset: number, size: number): Uint8Array {
    return this.#data.slice(
      Math.min(offset, this.#data.length),
      Math.min(offset + size, this.#data.length),
    );
  }

  #writeAt(offset: number, bytes: Uint8Array): Uint8Array {
    if (offset + bytes.length > this.#data.length) this.#resize(offset + bytes.length);
    this.#data.set(bytes, offset);
    const out = new Uint8Array(8);
    new DataView(out.buffer).setUint32(0, bytes.length, true);
    return out;
  }

  #attr(node: bigint): Uint8Array {
    const a = new Uint8Array(88);
    const v = new DataView(a.buffer);
    const file = node === FILE;
    v.setBigUint64(0, node, true);
    v.setBigUint64(8, BigInt(file ? this.#data.length : 0), true);
    v.setBigUint64(16, BigInt(file ? Math.ceil(this.#data.length / 512) : 0), true);
    v.setUint32(60, file ? 0o100644 : 0o40755, true);
    v.setUint32(64, file ? 1 : 2, true);
    v.setUint32(80, 4096, true);
    return a;
  }

  #entry(): Uint8Array {
    const e = new Uint8Array(40);
    new DataView(e.buffer).setBigUint64(0, FILE, true);
    return concat(e, this.#attr(FILE));
  }

  #send(unique: bigint, error: number, body: Uint8Array | null): void {
    const out = new Uint8Array(OUT_HEADER + (body?.length ?? 0));
    const v = new DataView(out.buffer);
    v.setUint32(0, out.length, true);
    v.setInt32(4, error, true);
    v.setBigUint64(8, unique, true);
    if (body) out.set(body, OUT_HEADER);
    this.#write(out);
  }
}

function concat(a: Uint8Array, b: Uint8Array): Uint8Array {
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

function cName(body: Uint8Array): string {
  const end = body.indexOf(0);
  return new TextDecoder().decode(body.subarray(0, end < 0 ? body.length : end));
}

/** fuse_init_out of protocol 7.31 (the kernel speaks down to it), 128 KiB writes. */
function initOut(kernelMinor: number): Uint8Array {
  const o = new Uint8Array(64);
  const v = new DataView(o.buffer);
  v.setUint32(0, 7, true);
  v.setUint32(4, Math.min(kernelMinor, 31), true);
  v.setUint32(8, 128 * 1024, true);
  v.setUint16(16, 16, true);
  v.setUint16(18, 12, true);
  v.setUint32(20, 128 * 1024, true);
  v.setUint32(24, 1, true);
  return o;
}

function attrOut(attr: Uint8Array): Uint8Array {
  return concat(new Uint8Array(16), attr);
}

function openOut(fh: bigint): Uint8Array {
  const o = new Uint8Array(16);
  new DataView(o.buffer).setBigUint64(0, fh, true);
  return o;
}

/** 1 GiB free in 4 KiB blocks. */
function statfsOut(): Uint8Array {
  const o = new Uint8Array(80);
  const v = new DataView(o.buffer);
  for (const off of [0, 8, 16]) v.setBigUint64(off, 262144n, true);
  v.setUint32(40, 4096, true);
  v.setUint32(44, 255, true);
  v.setUint32(48, 4096, true);
  return o;
}

const libc = () =>
  Deno.dlopen("libc.so.6", {
    open: { parameters: ["buffer", "i32"], result: "i32" },
    mount: { parameters: ["buffer", "buffer", "buffer", "u64", "buffer"], result: "i32" },
    read: { parameters: ["i32", "buffer", "usize"], result: "isize", nonblocking: true },
    write: { parameters: ["i32", "buffer", "usize"], result: "isize" },
  }).symbols;

const cstr = (s: string) => new TextEncoder().encode(`${s}\0`);

/** Child: mounts, serves, holds; exits when stdin closes (the kernel then aborts the mount). */
async function child(
  mnt: string,
  op: FuseOp,
  nth: number,
  guardMs: number,
  fh: bigint,
  pid: number,
): Promise<void> {
  const c = libc();
  const fd = c.open(cstr("/dev/fuse"), 2 /* O_RDWR */);
  if (fd < 0) throw new Error("cannot open /dev/fuse");
  const opts = `fd=${fd},rootmode=40000,user_id=0,group_id=0`;
  const MS_NOSUID = 2n, MS_NODEV = 4n;
  if (c.mount(cstr("pf-hang"), cstr(mnt), cstr("fuse"), MS_NOSUID | MS_NODEV, cstr(opts)) !== 0) {
    throw new Error(`mount fuse on ${mnt} refused`);
  }
  let guard: ReturnType<typeof setTimeout> | undefined;
  const fs = new HangFs((b) => void c.write(fd, b, BigInt(b.length)), op, nth, fh, pid, () => {
    guard = setTimeout(() => (console.log("guard"), fs.release()), guardMs);
  });
  console.log("mounted");
  (async () => {
    for await (const line of Deno.stdin.readable.pipeThrough(new TextDecoderStream())) {
      if (line.includes("release")) fs.release();
    }
    clearTimeout(guard);
    Deno.exit(0); // the kernel aborts the connection: every later call fails with ENOTCONN
  })();
  const buf = new Uint8Array(256 * 1024 + 4096);
  for (;;) {
    const n = Number(await c.read(fd, buf, BigInt(buf.length)));
    if (n <= 0) Deno.exit(0); // unmounted
    fs.take(buf.subarray(0, n));
  }
}

if (import.meta.main) {
  const [mnt, op, nth, guard, fh, pid] = Deno.args;
  await child(mnt, op as FuseOp, Number(nth), Number(guard), BigInt(fh ?? 0), Number(pid ?? 0));
}

/** The parent's handle on a hanging mount. */
export interface HangMount {
  /** Resolves when the chosen request is held (a call now blocks in the kernel). */
  held: Promise<void>;
  /** Answers the held request: the blocked call returns. */
  release(): Promise<void>;
  /** Stops the server and unmounts. */
  close(): Promise<void>;
}

/**
 * Mounts a hanging FUSE filesystem at `mnt` (an empty directory) that holds
 * the `nth` request of kind `op` until {@link HangMount.release}, or until
 * `guardMs` passed. With `fh` (> 0), only requests on that file handle
 * count: the file's OPENs and CREATEs are answered handles 1, 2, ... in
 * order, so a FLUSH can be picked by the open whose close sends it, however
 * the closes of other descriptors interleave with it. Only requests of this
 * process's threads count (not those of a child forked meanwhile).
 */
export async function hangingMount(
  mnt: string,
  op: FuseOp,
  nth = 1,
  guardMs = 10_000,
  fh = 0,
): Promise<HangMount> {
  const proc = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "-A",
      new URL(import.meta.url).pathname,
      mnt,
      op,
      String(nth),
      String(guardMs),
      String(fh),
      String(Deno.pid),
    ],
    stdin: "piped",
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const lines = proc.stdout.pipeThrough(new TextDecoderStream()).getReader();
  const stdin = proc.stdin.getWriter();
  const seen: string[] = [];
  const waiters: { want: string; done: () => void }[] = [];
  let ended = false;
  const pump = (async () => {
    for (;;) {
      const r = await lines.read();
      if (r.done) break;
      seen.push(...r.value.split("\n").filter((l) => l));
      for (const w of waiters.splice(0)) {
        if (seen.some((l) => l.startsWith(w.want))) w.done();
        else waiters.push(w);
      }
    }
    ended = true;
    for (const w of waiters.splice(0)) w.done();
  })();
  const saw = (want: string) =>
    new Promise<void>((done, fail) => {
      const check = () =>
        seen.some((l) => l.startsWith(want))
          ? done()
          : fail(new Error(`the FUSE server on ${mnt} ended before "${want}": ${seen.join("; ")}`));
      if (seen.some((l) => l.startsWith(want)) || ended) check();
      else waiters.push({ want, done: check });
    });
  try {
    await saw("mounted");
  } catch (e) {
    await proc.status;
    throw e;
  }
  const held = saw(`held ${op}`);
  held.catch(() => {}); // a server closed before it held anything: only a waiter hears of it
  return {
    held,
    release: () => stdin.write(new TextEncoder().encode("release\n")),
    async close() {
      await stdin.close().catch(() => {});
      await proc.status;
      await pump;
      await new Deno.Command("umount", { args: ["-l", mnt], stderr: "null" }).output();
    },
  };
}

/**
 * This process's descriptors open on files under `dir` (the test's mount): what a test's
 * tier may leave open. Only those: `deno test --parallel` runs other test files in this
 * process, whose descriptors come and go meanwhile (a count of all of them read 40 against
 * a baseline of 43 once another file closed its own).
 */
export function openFds(dir: string): number {
  return [...Deno.readDirSync("/proc/self/fd")].filter((e) => {
    try {
      const to = Deno.readLinkSync(`/proc/self/fd/${e.name}`);
      return to === dir || to.startsWith(`${dir}/`);
    } catch {
      return false; // closed meanwhile (the read of the directory's own fd)
    }
  }).length;
}

/**
 * Nothing of a tier is left on `mnt`: its descriptors there back to `fds`
 * (within 2 s: a late call's close may still be on its way) and the cache
 * file `file` free to lock again.
 */
export async function assertNothingLeft(mnt: string, fds: number, file: string): Promise<void> {
  await until(
    () => openFds(mnt) === fds,
    2_000,
    `the descriptors on ${mnt} back to ${fds} (now ${openFds(mnt)})`,
  );
  const lock = await lockCacheFile(file, 0);
  await lock.close();
}

/** Waits until `cond` holds, polling every 10 ms; throws naming `what` after `ms`. */
export async function until(cond: () => boolean, ms: number, what: string): Promise<void> {
  const end = performance.now() + ms;
  while (!cond()) {
    if (performance.now() > end) throw new Error(`${what} did not happen within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

/** True when this process may mount a FUSE filesystem (root with /dev/fuse). */
export const canFuse = !import.meta.main && await (async () => {
  try {
    Deno.statSync("/dev/fuse");
  } catch {
    return false;
  }
  const d = await Deno.makeTempDir();
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    const m = await Promise.race([
      hangingMount(d, "STATFS", 1, 1_000),
      new Promise<undefined>((r) => (timer = setTimeout(() => r(undefined), 5_000))),
    ]);
    if (!m) return false;
    await m.close();
    return true;
  } catch {
    return false;
  } finally {
    clearTimeout(timer);
    await Deno.remove(d).catch(() => {});
  }
})();
