/**
 * Where a benchmark's CPU goes, read from /proc (Linux): per process, its
 * total (`/proc/PID/stat`, which keeps the time of threads that have exited,
 * in clock ticks) and per live thread, grouped by thread name
 * (`/proc/PID/task/TID/schedstat`, ns on the CPU; each thread's delta taken by
 * its id, then summed by name, so a thread that exits between two samples
 * takes nothing away from its group). bench/peer_fetch.ts takes
 * a sample before and after each fetch and each raw blast, so a run says how
 * many ms of CPU each side's threads spent per transfer, on machines where
 * `perf` is not at hand.
 *
 * @module
 */

/** Nanoseconds per clock tick of /proc/PID/stat (USER_HZ is 100 on Linux). */
const TICK_NS = 1e9 / 100;

/** One live thread at a moment: its folded name and its ns on the CPU since it started. */
interface ThreadSample {
  name: string;
  ns: number;
}

/** One process's CPU at a moment: its total and its live threads. */
interface ProcSample {
  totalNs: number;
  /** `PID/TID` → the thread (name with digits and `/N` suffixes folded). */
  threads: Map<string, ThreadSample>;
}

/** CPU of some processes at a moment, by role (e.g. "A", "B", "kernel"). */
export type CpuSample = Map<string, ProcSample>;

/** `ksoftirqd/3` → `ksoftirqd`, `worker-12` → `worker`: one group per kind of thread. */
function foldName(comm: string): string {
  return comm.trim().replace(/[/:-]?\d+$/, "") || "?";
}

function readOr(path: string): string | undefined {
  try {
    return Deno.readTextFileSync(path);
  } catch {
    return undefined; // the process or thread has exited
  }
}

function sampleProc(pid: number): ProcSample | undefined {
  const stat = readOr(`/proc/${pid}/stat`);
  if (stat === undefined) return undefined;
  // Fields after the name, which is in parentheses and may hold spaces: utime is the 14th field.
  const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  const totalNs = (Number(f[11]) + Number(f[12])) * TICK_NS;
  const threads = new Map<string, ThreadSample>();
  let tids: Deno.DirEntry[] = [];
  try {
    tids = [...Deno.readDirSync(`/proc/${pid}/task`)];
  } catch { /* exited */ }
  for (const t of tids) {
    const ns = Number(readOr(`/proc/${pid}/task/${t.name}/schedstat`)?.split(" ")[0]);
    const comm = readOr(`/proc/${pid}/task/${t.name}/comm`);
    if (!Number.isFinite(ns) || comm === undefined) continue;
    threads.set(`${pid}/${t.name}`, { name: foldName(comm), ns });
  }
  return { totalNs, threads };
}

/** The pids of the kernel's softirq threads (`ksoftirqd/N`), where the network's deferred work runs. */
export function softirqPids(): number[] {
  const out: number[] = [];
  for (const e of Deno.readDirSync("/proc")) {
    if (!/^\d+$/.test(e.name)) continue;
    if (readOr(`/proc/${e.name}/comm`)?.startsWith("ksoftirqd/")) out.push(Number(e.name));
  }
  return out;
}

/**
 * A sample of `roles` (role → its pids; several pids of a role are summed).
 *
 * @example
 * ```ts
 * const roles = { A: [a.pid], B: [b.pid], kernel: softirqPids() };
 * const s0 = sampleCpu(roles);
 * await transfer();
 * console.log(cpuDeltaMs(s0, sampleCpu(roles))); // { "A total": 120.0, "A pf-tcp-serve": 98.1, ... }
 * ```
 */
export function sampleCpu(roles: Record<string, readonly number[]>): CpuSample {
  const out: CpuSample = new Map();
  for (const [role, pids] of Object.entries(roles)) {
    const sum: ProcSample = { totalNs: 0, threads: new Map() };
    for (const pid of pids) {
      const p = sampleProc(pid);
      if (!p) continue;
      sum.totalNs += p.totalNs;
      for (const [id, t] of p.threads) sum.threads.set(id, t);
    }
    out.set(role, sum);
  }
  return out;
}

/**
 * ms of CPU between two samples: `"<role> total"` per role (ticks: ±10 ms,
 * threads that exited included) and `"<role> <thread name>"` per thread
 * group, each thread's delta by its id (exact; a thread that exited in
 * between is left out, one that started in between counts from its start).
 */
export function cpuDeltaMs(before: CpuSample, after: CpuSample): Record<string, number> {
  const out: Record<string, number> = {};
  for (const [role, a] of after) {
    const b = before.get(role);
    if (!b) continue;
    out[`${role} total`] = (a.totalNs - b.totalNs) / 1e6;
    const byName = new Map<string, number>();
    for (const [id, t] of a.threads) {
      const was = b.threads.get(id)?.ns ?? 0;
      // Less than before: the id was reused by a thread started in between.
      const d = t.ns >= was ? t.ns - was : t.ns;
      byName.set(t.name, (byName.get(t.name) ?? 0) + d);
    }
    for (const [name, ns] of byName) if (ns >= 5e4) out[`${role} ${name}`] = ns / 1e6;
  }
  return out;
}
