/** A thread of the test process that holds a cache file's flock for `holdMs`, then closes it. */
/// <reference lib="deno.worker" />
self.onmessage = async (e: MessageEvent<{ path: string; holdMs: number }>) => {
  const f = Deno.openSync(e.data.path, { read: true, write: true });
  if (!f.tryLockSync(true)) {
    self.postMessage("busy");
    f.close();
    return;
  }
  self.postMessage("locked");
  await new Promise((r) => setTimeout(r, e.data.holdMs));
  f.close();
  self.postMessage("released");
  self.close();
};
