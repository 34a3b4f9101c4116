/**
 * Small real filesystems for the SSD sizing tests: a tmpfs of a given size.
 * Mounting needs root (CAP_SYS_ADMIN); where it is refused, the tests that
 * need it are skipped (`ignore: !canMount`), never faked.
 */

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
