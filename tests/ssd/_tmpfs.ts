/**
 * Small real filesystems for the SSD sizing tests: a tmpfs of a given size.
 * Mounting needs root (CAP_SYS_ADMIN); where it is refused, the tests that
 * need it are skipped (`ignore: !canMount`), never faked.
 */
import assert from "node:assert/strict";
import { type Harness, harness } from "./_harness.ts";

/** Mounts a tmpfs with `opts` (e.g. "size=8m") on `dir`; false when refused. */
export async function mountTmpfs(dir: string, opts: string): Promise<boolean> {
  const r = await new Deno.Command("mount", {
    args: ["-t", "tmpfs", "-o", opts, "tmpfs", dir],
    stderr: "null",
  })
    .output().catch(() => ({ code: 1 }));
  return r.code === 0;
}

/** Unmounts `dir`. */
export async function umount(dir: string): Promise<void> {
  await new Deno.Command("umount", { args: [dir] }).output();
}

/** True when this process may mount a tmpfs. */
export const canMount = await (async () => {
  const d = await Deno.makeTempDir();
  const ok = await mountTmpfs(d, "size=1m");
  if (ok) await umount(d);
  await Deno.remove(d);
  return ok;
})();

/**
 * Runs `fn` with a fresh harness and a tmpfs of `opts` mounted at `<harness dir>/<name>`;
 * unmounts it and closes the harness after, whatever `fn` did.
 */
export async function withTmpfs(
  name: string,
  opts: string,
  fn: (h: Harness, dir: string) => Promise<void>,
): Promise<void> {
  const h = await harness();
  const dir = `${h.dir}/${name}`;
  await Deno.mkdir(dir);
  assert.ok(await mountTmpfs(dir, opts), `a tmpfs (${opts}) mounted on ${dir}`);
  try {
    await fn(h, dir);
  } finally {
    await umount(dir);
    await h.close();
  }
}
