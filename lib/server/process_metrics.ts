/**
 * The server process's own figures in Prometheus' standard names (resident
 * memory, open descriptors, CPU seconds) and the V8 heap in use: what an
 * operator watches for a leak or a runaway thread. Each is read when
 * /metrics is scraped (`/proc/self`, `Deno.memoryUsage()`); nothing runs
 * between scrapes. Linux only, as the server is.
 *
 * @module
 */
import { Counter, type Registry } from "prom-client";
import { scrapeGauge } from "../metrics.ts";

/** Linux's USER_HZ: the unit of the CPU times in /proc/self/stat. */
const CLOCK_TICKS_PER_S = 100;

/**
 * User plus system CPU seconds from a `/proc/PID/stat` or `/proc/PID/task/TID/stat` text: the
 * fields after the command name (which may hold spaces); utime is field 14, stime 15.
 */
export function statCpuSeconds(stat: string): number {
  const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  return (Number(f[11]) + Number(f[12])) / CLOCK_TICKS_PER_S;
}

/** Open file descriptors of this process (NaN where /proc is not readable). */
function openFds(): number {
  try {
    let n = 0;
    for (const _ of Deno.readDirSync("/proc/self/fd")) n++;
    return n - 1; // the listing's own descriptor
  } catch {
    return NaN;
  }
}

/** User plus system CPU seconds of this process (NaN where /proc is not readable). */
function cpuSeconds(): number {
  try {
    return statCpuSeconds(Deno.readTextFileSync("/proc/self/stat"));
  } catch {
    return NaN;
  }
}

/**
 * Registers `process_resident_memory_bytes`, `process_open_fds`,
 * `process_cpu_seconds_total` and `pegaflow_js_heap_used_bytes` on `r`.
 *
 * @example
 * ```ts
 * const r = new Registry();
 * registerProcessMetrics(r);
 * ```
 */
export function registerProcessMetrics(r: Registry): void {
  scrapeGauge(
    r,
    "process_resident_memory_bytes",
    "resident memory of the server process, bytes (the pinned pool included once touched)",
    () => Deno.memoryUsage().rss,
  );
  scrapeGauge(r, "process_open_fds", "open file descriptors of the server process", openFds);
  scrapeGauge(
    r,
    "pegaflow_js_heap_used_bytes",
    "V8 heap in use by the server's JS thread, bytes",
    () => Deno.memoryUsage().heapUsed,
  );
  let counted = 0;
  new Counter({
    name: "process_cpu_seconds_total",
    help: "user and system CPU time of the server process, seconds",
    registers: [r],
    collect() {
      const now = cpuSeconds();
      if (now > counted) {
        this.inc(now - counted);
        counted = now;
      }
    },
  });
}
