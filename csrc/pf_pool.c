/*
 * pf_pool.c — host memory for the pinned pool, and small POSIX shm mappings.
 *
 * The pool is one anonymous mapping. Huge pages (MAP_HUGETLB) cut TLB misses
 * for a pool of tens of GiB and make cuMemHostRegister faster, but only work
 * when the administrator reserved them, so their absence is a clear error
 * rather than a silent fallback. Faulting tens of GiB in on one thread takes
 * seconds, so pre-touch splits the mapping across threads. The backends add
 * page-locking on top (host: mlock; cuda: cuMemHostRegister).
 *
 * pf_shm_* maps named shared-memory objects for control words shared with
 * other processes (load progress, small state blocks).
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Default pre-touch threads when the caller passes 0; more rarely helps
 * because page faults serialise on the mm lock. */
#define PF_TOUCH_THREADS_DEFAULT 8u
#define PF_TOUCH_THREADS_MAX 64u

typedef struct {
  void (*fn)(uint32_t, void *);
  void *arg;
  uint32_t i;
} par_task;

static void *par_main(void *x) {
  par_task *t = x;
  t->fn(t->i, t->arg);
  return NULL;
}

void pf_parallel(uint32_t n, void (*fn)(uint32_t i, void *arg), void *arg) {
  if (n <= 1) {
    fn(0, arg);
    return;
  }
  pthread_t th[PF_TOUCH_THREADS_MAX];
  par_task t[PF_TOUCH_THREADS_MAX];
  if (n > PF_TOUCH_THREADS_MAX) n = PF_TOUCH_THREADS_MAX;
  uint32_t started = 0;
  for (uint32_t i = 1; i < n; i++) {
    t[i] = (par_task){fn, arg, i};
    if (pthread_create(&th[i], NULL, par_main, &t[i]) != 0) break;
    started = i;
  }
  fn(0, arg);
  /* If a thread failed to start, run its share (and later ones) here. */
  for (uint32_t i = started + 1; i < n; i++) fn(i, arg);
  for (uint32_t i = 1; i <= started; i++) pthread_join(th[i], NULL);
}

/* Pre-touch threads add to the caller's progress counter once per this many
 * bytes: often enough for a once-a-second log line, rare enough that the
 * shared cache line costs nothing next to the page faults. */
#define PF_TOUCH_PROGRESS_BYTES (64ull << 20)

typedef struct {
  uint8_t *base;
  uint64_t bytes;
  uint64_t page;
  uint32_t n;
  _Atomic uint64_t *progress; /* NULL: nobody watches */
} touch_job;

static void touch_slice(uint32_t i, void *arg) {
  touch_job *j = arg;
  uint64_t pages = j->bytes / j->page;
  uint64_t per = (pages + j->n - 1) / j->n;
  uint64_t lo = (uint64_t)i * per, hi = lo + per;
  if (hi > pages) hi = pages;
  uint64_t step = PF_TOUCH_PROGRESS_BYTES / j->page;
  if (step == 0) step = 1;
  for (uint64_t k = lo; k < hi;) {
    uint64_t end = hi - k > step ? k + step : hi;
    uint64_t first = k;
    for (; k < end; k++) ((volatile uint8_t *)j->base)[k * j->page] = 0;
    if (j->progress)
      atomic_fetch_add_explicit(j->progress, (end - first) * j->page,
                                memory_order_relaxed);
  }
}

void pf_pool_phase(pf_pool *p, uint32_t phase) {
  if (p->progress)
    atomic_store_explicit((_Atomic uint32_t *)&p->progress->phase, phase,
                          memory_order_relaxed);
}

static uint64_t huge_page_size(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  if (!f) return 2u << 20;
  char line[256];
  unsigned long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Hugepagesize: %lu kB", &kb) == 1) break;
  fclose(f);
  return kb ? (uint64_t)kb << 10 : (2u << 20);
}

static long read_long(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  long v = -1;
  if (fscanf(f, "%ld", &v) != 1) v = -1;
  fclose(f);
  return v;
}

/* mbind(2) without libnuma: the policy constant and a node mask wide
 * enough for any machine we expect (the kernel checks the bits above its own
 * MAX_NUMNODES are clear). */
#define PF_MPOL_BIND 2
#define PF_NUMA_NODES_MAX 1024

/* Binds each part of a split pool to its node (pf_pool_create_split). Runs
 * before pre-touch, so every page is faulted in on its part's node. */
static int32_t bind_parts(pf_pool *p, uint64_t page, const char *who) {
  uint64_t off = 0;
  for (uint32_t i = 0; i < p->nparts; i++) {
    const pf_pool_part *part = &p->parts[i];
    int last = i + 1 == p->nparts;
    if (!last && part->bytes % page)
      return pf_fail(PF_EINVAL, "%s: part %u is %llu bytes, not a multiple of "
                     "the %llu-byte page the pool is mapped with", who, i,
                     (unsigned long long)part->bytes, (unsigned long long)page);
    uint64_t len = last ? p->mapped_bytes - off : part->bytes;
    if (part->node >= 0) {
      if (part->node >= PF_NUMA_NODES_MAX)
        return pf_fail(PF_EINVAL, "%s: part %u: node %d; expected < %d", who,
                       i, part->node, PF_NUMA_NODES_MAX);
      unsigned long mask[PF_NUMA_NODES_MAX / (8 * sizeof(unsigned long))] = {0};
      mask[part->node / (8 * sizeof(unsigned long))] |=
          1ul << (part->node % (8 * sizeof(unsigned long)));
      if (syscall(SYS_mbind, p->host + off, len, PF_MPOL_BIND, mask,
                  (unsigned long)PF_NUMA_NODES_MAX + 1, 0u) != 0)
        return pf_fail(errno == EINVAL ? PF_EINVAL : PF_EIO,
                       "%s: part %u (bytes [%llu, %llu)): mbind to NUMA node "
                       "%d failed: %s (is the node online? see "
                       "/sys/devices/system/node/online)", who, i,
                       (unsigned long long)off, (unsigned long long)(off + len),
                       part->node, strerror(errno));
    }
    off += len;
  }
  return PF_OK;
}

int32_t pf_hostmem_alloc(pf_pool *p, const char *who) {
  uint64_t t0 = pf_now_ns();
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  p->applied = 0;
  p->huge_page_bytes = 0;
  if (p->flags & PF_POOL_HUGEPAGES) {
    page = huge_page_size();
    flags |= MAP_HUGETLB;
  }
  if (p->bytes > UINT64_MAX - page)
    return pf_fail(PF_EINVAL, "%s: %llu bytes is too large", who,
                   (unsigned long long)p->bytes);
  uint64_t len = (p->bytes + page - 1) / page * page;
  void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (m == MAP_FAILED) {
    int err = errno;
    if (p->flags & PF_POOL_HUGEPAGES) {
      long total = read_long("/proc/sys/vm/nr_hugepages");
      return pf_fail(PF_ENOMEM,
                     "%s: mmap(MAP_HUGETLB) of %llu bytes failed (%s): %llu "
                     "huge pages of %llu KiB are needed, /proc/sys/vm/"
                     "nr_hugepages is %ld; reserve more (e.g. echo %llu > "
                     "/proc/sys/vm/nr_hugepages) or drop the huge-pages option",
                     who, (unsigned long long)p->bytes, strerror(err),
                     (unsigned long long)(len / page),
                     (unsigned long long)(page >> 10), total,
                     (unsigned long long)(len / page));
    }
    return pf_fail(PF_ENOMEM, "%s: mmap of %llu bytes failed: %s", who,
                   (unsigned long long)p->bytes, strerror(err));
  }
  if (p->flags & PF_POOL_HUGEPAGES) {
    p->applied |= PF_POOL_HUGEPAGES;
    p->huge_page_bytes = page;
  } else {
    /* Transparent huge pages where the kernel offers them (a hint; "never"
     * ignores it): 2 MiB pages fault in 512x fewer times at pre-touch and
     * cut TLB misses of every pass over the pool. */
    (void)madvise(m, len, MADV_HUGEPAGE);
  }
  p->host = m;
  p->mapped_bytes = len;
  int32_t rc = bind_parts(p, page, who);
  if (rc < 0) {
    pf_hostmem_free(p);
    return rc;
  }
  if (p->flags & PF_POOL_PRETOUCH) {
    uint32_t n = p->touch_threads ? p->touch_threads : PF_TOUCH_THREADS_DEFAULT;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus > 0 && n > (uint32_t)cpus) n = (uint32_t)cpus;
    if (n > PF_TOUCH_THREADS_MAX) n = PF_TOUCH_THREADS_MAX;
    if ((uint64_t)n > len / page) n = (uint32_t)(len / page);
    touch_job j = {m, len, page, n ? n : 1,
                   p->progress ? (_Atomic uint64_t *)&p->progress->touched_bytes
                               : NULL};
    pf_pool_phase(p, PF_POOL_PHASE_TOUCH);
    pf_parallel(j.n, touch_slice, &j);
    p->applied |= PF_POOL_PRETOUCH;
  }
  p->alloc_ns = pf_now_ns() - t0;
  return PF_OK;
}

void pf_hostmem_free(pf_pool *p) {
  if (p->host) munmap(p->host, p->mapped_bytes);
  p->host = NULL;
}

/* ---- shm --------------------------------------------------------------- */
/* Checks a POSIX shm name: "/" then 1..NAME_MAX-1 portable characters. */
int32_t pf_shm_name_check(const char *fn, const char *name, size_t cap) {
  size_t n = strnlen(name, cap);
  if (n == cap)
    return pf_fail(PF_EINVAL, "%s: shm name is not NUL-terminated within %zu "
                   "bytes", fn, cap);
  if (n < 2 || name[0] != '/')
    return pf_fail(PF_EINVAL, "%s: shm name \"%.*s\" must start with '/' and "
                   "have at least one more character", fn, (int)n, name);
  for (size_t i = 1; i < n; i++) {
    char c = name[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
          (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.'))
      return pf_fail(PF_EINVAL, "%s: shm name \"%.*s\" has character 0x%02x "
                     "at %zu (allowed: letters, digits, - _ .)", fn, (int)n,
                     name, (unsigned char)c, i);
  }
  return PF_OK;
}

int32_t pf_shm_open(const char *name, uint64_t bytes, uint32_t flags,
                    uint32_t *out_shm) {
  if (!name || !out_shm)
    return pf_fail(PF_EINVAL, "pf_shm_open: name/out_shm is NULL");
  int32_t rc = pf_shm_name_check("pf_shm_open", name, PF_HANDLE_BYTES);
  if (rc < 0) return rc;
  if (bytes == 0) return pf_fail(PF_EINVAL, "pf_shm_open: bytes is 0");
  if (flags & ~(uint32_t)(PF_SHM_CREATE | PF_SHM_UNLINK))
    return pf_fail(PF_EINVAL, "pf_shm_open: unknown flag bits 0x%x", flags);
  /* A peer's object can shrink under us: accesses go through the guard. */
  rc = pf_guard_init();
  if (rc < 0) return rc;
  int oflag = O_RDWR | ((flags & PF_SHM_CREATE) ? O_CREAT | O_EXCL : 0);
  int fd = shm_open(name, oflag, 0600);
  if (fd < 0)
    return pf_fail(errno == ENOENT ? PF_EINVAL : PF_EIO,
                   "pf_shm_open: shm_open(\"%s\"%s): %s", name,
                   (flags & PF_SHM_CREATE) ? ", create" : "", strerror(errno));
  struct stat st;
  if (flags & PF_SHM_CREATE) {
    if (ftruncate(fd, (off_t)bytes) != 0 || fstat(fd, &st) != 0) {
      int err = errno;
      close(fd);
      shm_unlink(name);
      return pf_fail(PF_EIO, "pf_shm_open: ftruncate(\"%s\", %llu): %s", name,
                     (unsigned long long)bytes, strerror(err));
    }
  } else if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < bytes) {
    close(fd);
    return pf_fail(PF_ERANGE, "pf_shm_open: \"%s\" is %lld bytes; expected "
                   "at least %llu", name, (long long)st.st_size,
                   (unsigned long long)bytes);
  }
  void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (m == MAP_FAILED) {
    if (flags & PF_SHM_CREATE) shm_unlink(name);
    return pf_fail(PF_ENOMEM, "pf_shm_open: mmap(\"%s\", %llu): %s", name,
                   (unsigned long long)bytes, strerror(err));
  }
  pf_shm *s = calloc(1, sizeof *s);
  if (!s) {
    munmap(m, bytes);
    if (flags & PF_SHM_CREATE) shm_unlink(name);
    return pf_fail(PF_ENOMEM, "pf_shm_open: out of memory");
  }
  snprintf(s->name, sizeof s->name, "%s", name);
  s->ptr = m;
  s->bytes = bytes;
  s->unlink_on_close = (flags & PF_SHM_UNLINK) != 0;
  s->dev = st.st_dev;
  s->ino = st.st_ino;
  uint32_t h = pf_handle_new(PF_K_SHM, s);
  if (!h) {
    munmap(m, bytes);
    if (flags & PF_SHM_CREATE) shm_unlink(name);
    free(s);
    return PF_ENOMEM;
  }
  s->handle = h;
  *out_shm = h;
  return PF_OK;
}

int32_t pf_shm_same(uint32_t shm) {
  pf_shm *s = pf_handle_get(shm, PF_K_SHM, "pf_shm_same");
  if (!s) return PF_EHANDLE;
  /* shm_open's directory on Linux (glibc and musl alike). */
  char path[sizeof "/dev/shm" + PF_HANDLE_BYTES];
  snprintf(path, sizeof path, "/dev/shm%s", s->name);
  struct stat st;
  if (stat(path, &st) != 0) return 0; /* unlinked (or unreadable): not the same */
  return st.st_dev == s->dev && st.st_ino == s->ino &&
         (uint64_t)st.st_size >= s->bytes;
}

void *pf_shm_ptr(uint32_t shm) {
  pf_shm *s = pf_handle_get(shm, PF_K_SHM, "pf_shm_ptr");
  return s ? s->ptr : NULL;
}

typedef struct {
  uint8_t *shm;
  uint8_t *buf;
  uint64_t bytes;
  int write;
} shm_io;

/* Whole u32 words when aligned (a peer polls them), else plain bytes. */
static void shm_io_run(void *arg) {
  shm_io *io = arg;
  if (((uintptr_t)io->shm & 3u) == 0 && (io->bytes & 3u) == 0) {
    for (uint64_t i = 0; i < io->bytes; i += 4) {
      _Atomic uint32_t *w = (_Atomic uint32_t *)(io->shm + i);
      uint32_t v;
      if (io->write) {
        memcpy(&v, io->buf + i, 4);
        atomic_store_explicit(w, v, memory_order_release);
      } else {
        v = atomic_load_explicit(w, memory_order_acquire);
        memcpy(io->buf + i, &v, 4);
      }
    }
  } else if (io->write) {
    memcpy(io->shm, io->buf, io->bytes);
  } else {
    memcpy(io->buf, io->shm, io->bytes);
  }
}

static int32_t shm_rw(const char *fn, uint32_t shm, uint64_t offset,
                      void *buf, uint64_t bytes, int write) {
  pf_shm *s = pf_handle_get(shm, PF_K_SHM, fn);
  if (!s) return PF_EHANDLE;
  if (!buf && bytes) return pf_fail(PF_EINVAL, "%s: buffer is NULL", fn);
  if (offset > s->bytes || bytes > s->bytes - offset)
    return pf_fail(PF_ERANGE, "%s: shm %u (\"%s\"): offset %llu + bytes %llu "
                   "exceeds its %llu mapped bytes", fn, shm, s->name,
                   (unsigned long long)offset, (unsigned long long)bytes,
                   (unsigned long long)s->bytes);
  if (bytes == 0) return PF_OK;
  shm_io io = {s->ptr + offset, buf, bytes, write};
  uint64_t fault = 0;
  int32_t rc = pf_guard_run(s->ptr, s->bytes, shm_io_run, &io, &fault);
  if (rc < 0)
    return pf_fail(rc, "%s: shm %u (\"%s\", %llu bytes mapped) faulted at "
                   "offset %llu: the object was shrunk after it was opened",
                   fn, shm, s->name, (unsigned long long)s->bytes,
                   (unsigned long long)fault);
  return PF_OK;
}

int32_t pf_shm_read(uint32_t shm, uint64_t offset, void *dst, uint64_t bytes) {
  return shm_rw("pf_shm_read", shm, offset, dst, bytes, 0);
}

int32_t pf_shm_write(uint32_t shm, uint64_t offset, const void *src,
                     uint64_t bytes) {
  return shm_rw("pf_shm_write", shm, offset, (void *)src, bytes, 1);
}

int32_t pf_shm_close(uint32_t shm) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_shm *s = pf_handle_get(shm, PF_K_SHM, "pf_shm_close");
  if (!s) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  int n = atomic_load(&s->inflight);
  if (n > 0) {
    pthread_mutex_unlock(&pf_objects_mu);
    return pf_fail(PF_EBUSY, "pf_shm_close: shm %u (\"%s\") receives progress "
                   "from %d batches in flight", shm, s->name, n);
  }
  pf_handle_free(shm);
  pthread_mutex_unlock(&pf_objects_mu);
  munmap(s->ptr, s->bytes);
  if (s->unlink_on_close) shm_unlink(s->name);
  free(s);
  return PF_OK;
}
