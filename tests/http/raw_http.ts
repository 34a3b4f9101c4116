/**
 * A raw HTTP/1.1 client over a TCP socket, for what `fetch` cannot send: a
 * body far larger than the server accepts, streamed while the answer is
 * awaited, and broken chunked encodings. Shared by the server's and the
 * router's body-limit tests; also reads a process's peak memory.
 *
 * @module
 */

const enc = new TextEncoder();
const dec = new TextDecoder();
/** Longest a test waits for an answer: a server that never answers fails the test, not hangs it. */
const ANSWER_TIMEOUT_MS = 30_000;

/** A parsed HTTP answer. */
export interface RawAnswer {
  status: number;
  headers: Record<string, string>;
  body: string;
}

/** Errors a writer meets when the server stopped reading and closed the connection. */
function isHangup(e: unknown): boolean {
  return e instanceof Deno.errors.BrokenPipe || e instanceof Deno.errors.ConnectionReset ||
    e instanceof Deno.errors.BadResource || e instanceof Deno.errors.NotConnected;
}

/** Reads one HTTP answer (status line, headers, body by Content-Length or to EOF); null on EOF first. */
async function readAnswer(conn: Deno.Conn): Promise<RawAnswer | null> {
  let buf = new Uint8Array(0);
  const chunk = new Uint8Array(64 * 1024);
  let headEnd = -1;
  let head: { status: number; headers: Record<string, string> } | undefined;
  for (;;) {
    let n: number | null;
    try {
      n = await conn.read(chunk);
    } catch (e) {
      if (!isHangup(e)) throw e;
      n = null;
    }
    if (n !== null) {
      const next = new Uint8Array(buf.length + n);
      next.set(buf);
      next.set(chunk.subarray(0, n), buf.length);
      buf = next;
    }
    if (!head) {
      headEnd = dec.decode(buf).indexOf("\r\n\r\n");
      if (headEnd >= 0) {
        const lines = dec.decode(buf.subarray(0, headEnd)).split("\r\n");
        const headers: Record<string, string> = {};
        for (const l of lines.slice(1)) {
          const i = l.indexOf(":");
          headers[l.slice(0, i).trim().toLowerCase()] = l.slice(i + 1).trim();
        }
        head = { status: Number(lines[0].split(" ")[1]), headers };
      }
    }
    if (head) {
      const body = buf.subarray(headEnd + 4);
      const len = head.headers["content-length"];
      if (len !== undefined && body.length >= Number(len)) {
        return { ...head, body: dec.decode(body.subarray(0, Number(len))) };
      }
      if (n === null) return { ...head, body: dec.decode(body) };
    }
    if (n === null) return null;
  }
}

/** What {@link streamUpload} saw. */
export interface UploadResult {
  /** The server's answer (null: it closed the connection without one). */
  answer: RawAnswer | null;
  /** Body bytes written before the server answered or hung up. */
  sentBytes: number;
}

/**
 * POSTs a body of `totalBytes` (JSON-ish filler) to `path` in `chunkBytes`
 * writes, chunked or with a Content-Length, while reading the answer: writing
 * stops as soon as the answer arrives or the server hangs up.
 *
 * @example
 * ```ts
 * const r = await streamUpload({ port, path: "/instances/cleanup", totalBytes: 64 << 20, chunked: true });
 * r.answer?.status; // 413
 * ```
 */
export async function streamUpload(opts: {
  port: number;
  path: string;
  totalBytes: number;
  chunkBytes?: number;
  chunked: boolean;
}): Promise<UploadResult> {
  const chunkBytes = opts.chunkBytes ?? 64 * 1024;
  const conn = await Deno.connect({ hostname: "127.0.0.1", port: opts.port });
  const framing = opts.chunked
    ? "transfer-encoding: chunked"
    : `content-length: ${opts.totalBytes}`;
  let answered = false;
  let timer: ReturnType<typeof setTimeout> | undefined;
  const answer = Promise.race([
    readAnswer(conn),
    new Promise<never>((_, rej) =>
      timer = setTimeout(
        () => rej(new Error(`no answer from ${opts.path} within ${ANSWER_TIMEOUT_MS} ms`)),
        ANSWER_TIMEOUT_MS,
      )
    ),
  ]).finally(() => {
    answered = true;
    clearTimeout(timer);
  });
  let sentBytes = 0;
  try {
    await conn.write(enc.encode(
      `POST ${opts.path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n` +
        `${framing}\r\n\r\n`,
    ));
    const filler = new Uint8Array(chunkBytes).fill(0x20); // spaces: valid JSON whitespace
    const chunkHead = enc.encode(`${chunkBytes.toString(16)}\r\n`);
    const crlf = enc.encode("\r\n");
    while (!answered && sentBytes < opts.totalBytes) {
      if (opts.chunked) await conn.write(chunkHead);
      let off = 0;
      while (off < filler.length) off += await conn.write(filler.subarray(off));
      if (opts.chunked) await conn.write(crlf);
      sentBytes += chunkBytes;
    }
    if (!answered && opts.chunked) await conn.write(enc.encode("0\r\n\r\n"));
  } catch (e) {
    // The server refusing the upload closes the connection under the writer.
    if (!isHangup(e)) throw e;
  }
  try {
    return { answer: await answer, sentBytes };
  } finally {
    conn.close();
  }
}

/**
 * Sends a request in parts, pausing `pauseMs` between them (so the server has
 * started reading the body before a later part arrives), and reads the
 * answer (null: the connection closed without one).
 *
 * @example
 * ```ts
 * const a = await sendInParts(port, ["POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", "zz\r\n"]);
 * ```
 */
export async function sendInParts(
  port: number,
  parts: string[],
  pauseMs: number,
): Promise<RawAnswer | null> {
  const conn = await Deno.connect({ hostname: "127.0.0.1", port });
  try {
    for (const [i, p] of parts.entries()) {
      if (i > 0) await new Promise((r) => setTimeout(r, pauseMs));
      await conn.write(enc.encode(p));
    }
    let timer: ReturnType<typeof setTimeout> | undefined;
    return await Promise.race([
      readAnswer(conn),
      new Promise<never>((_, rej) =>
        timer = setTimeout(
          () => rej(new Error(`no answer within ${ANSWER_TIMEOUT_MS} ms`)),
          ANSWER_TIMEOUT_MS,
        )
      ),
    ]).finally(() => clearTimeout(timer));
  } finally {
    conn.close();
  }
}

/**
 * A request whose chunked body breaks after a valid first chunk (a chunk-size
 * line that is not hex), answered by the server. The break is sent after a
 * pause so the server's handler is already reading the body (a break that
 * arrives before the handler runs makes the HTTP layer drop the connection
 * without calling it); the pause doubles on each of a few tries if the
 * connection closed without an answer.
 *
 * @example
 * ```ts
 * const a = await brokenChunkedRequest(port, "/v1/completions");
 * a.status; // 400
 * ```
 */
export async function brokenChunkedRequest(port: number, path: string): Promise<RawAnswer> {
  const head = `POST ${path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n` +
    `transfer-encoding: chunked\r\n\r\n2\r\n{"\r\n`;
  for (let pauseMs = 100; pauseMs <= 1600; pauseMs *= 2) {
    const a = await sendInParts(port, [head, "zz-not-hex\r\n"], pauseMs);
    if (a !== null) return a;
  }
  throw new Error(`${path}: the connection closed without an answer on every try`);
}

/** Peak resident memory (VmHWM) of process `pid`, in bytes. */
export function peakRssBytes(pid: number): number {
  const m = /VmHWM:\s+(\d+)\s+kB/.exec(Deno.readTextFileSync(`/proc/${pid}/status`));
  if (!m) throw new Error(`/proc/${pid}/status has no VmHWM`);
  return Number(m[1]) * 1024;
}
