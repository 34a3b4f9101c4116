/*
 * pf_uring.c — the SSD tier's mechanism: batched O_DIRECT reads and writes
 * of whole records between the pinned pool and cache files, on io_uring.
 *
 * Shape: the caller (JS, one thread) hands over a batch; pf_io_submit
 * copies and validates it, queues it and wakes the reaper through an
 * eventfd (one write per batch). One reaper thread per uring is the ring's
 * only issuer: it prepares as many SQEs as there is credit for (at most
 * `depth` ops in the kernel), submits and waits in one io_uring_submit_and_wait,
 * refills the SQ as ops complete, and posts a PF_DONE_IO per op and a
 * PF_DONE_IO_BATCH per batch to the shared completion ring, so a batch larger
 * than the ring flows through without the caller coming back. Being the only
 * issuer means the SQ needs no lock, and with IORING_SETUP_COOP_TASKRUN a
 * completion's task work runs on the reaper when it enters the kernel anyway
 * instead of interrupting other threads (on this 2-core VM that measured
 * ahead of both a caller-submits design and plain task work). The mutex only
 * guards the pending list and counters.
 *
 * Records: an op may start with a 4 KiB header page from a staging arena the
 * library owns, followed by pool extents: one readv/writev moves header and
 * payload together, so a record is written by a single op (a torn record is
 * detectable by its checksums) and the payload is never bounced.
 *
 * Alignment: O_DIRECT needs file offsets, lengths and buffer addresses
 * aligned (statx DIOALIGN tells the exact numbers; the device's logical block
 * size otherwise). The check is done per op at submit; an op that does not
 * qualify goes through a second, buffered descriptor of the same file, which
 * is always correct (the kernel keeps the page cache coherent with direct
 * I/O) and only slower. The caller never sees EINVAL for alignment.
 *
 * Registration: files are registered (fixed files skip the fdget per op),
 * and the pool (in 1 GiB pieces, the kernel's per-buffer limit) plus the
 * header arena are registered buffers, used by single-range ops
 * (READ_FIXED/WRITE_FIXED) to skip page pinning per op. Vectored ops cannot
 * use fixed buffers on the kernels we target, so records use readv/writev.
 * Both registrations are best-effort: a kernel that refuses keeps working
 * without them, and pf_uring_info says which applied.
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#define URING_MAX_DEPTH 4096u
#define URING_MAX_HDR_PAGES 65536u
/* The kernel refuses a registered buffer larger than 1 GiB. */
#define POOL_BUF_CHUNK (1ull << 30)
/* Fixed-file slots: two per open file (direct + buffered descriptor). */
#define URING_FILE_SLOTS 256u
/* One op moves at most this much: keeps lengths within the kernel's
 * MAX_RW_COUNT and one op's latency bounded. */
#define IO_MAX_OP_BYTES (1ull << 30)
/* iovecs per op: IOV_MAX. */
#define IO_MAX_IOV 1024u
/* Alignment assumed when neither statx nor sysfs can tell. */
#define DEFAULT_DIO_ALIGN 4096u
/* Back-off after a submit the kernel refused (EAGAIN/EBUSY). */
#define RESUBMIT_BACKOFF_US 1000
/* user_data of the reaper's eventfd read (new batch, close). */
#define WAKE_USER_DATA 0ull

typedef struct pf_uring pf_uring;

typedef struct pf_file {
  pf_uring *u;
  uint32_t handle;
  int fd;       /* O_DIRECT descriptor when direct, else the buffered one */
  int fd_buf;   /* buffered descriptor (alignment fallback) */
  int direct;
  int rdonly;
  int slot;     /* fixed-file slot of fd (fd_buf at slot + 1), -1 if none */
  uint32_t off_align, mem_align;
  atomic_int inflight;
  char path[512];
} pf_file;

struct io_batch;

typedef struct io_op {
  struct io_batch *batch;
  pf_file *file;
  uint32_t index;
  uint32_t op, flags;
  uint32_t buffered; /* alignment fallback */
  uint32_t has_hdr;  /* iov[0] is a header page */
  uint64_t file_off;
  uint64_t expect;   /* bytes the op must move */
  struct iovec *iov; /* into batch->iov */
  uint32_t niov;
  int fixed_buf;     /* registered buffer index, -1 if vectored/plain */
} io_op;

typedef struct io_batch {
  pf_uring *u;
  uint64_t tag;
  uint32_t n_ops;
  uint32_t next_op;  /* first op not yet given to the kernel */
  atomic_uint remaining;
  atomic_int first_status;
  atomic_uint failed;
  atomic_ullong bytes;
  struct io_batch *next;
  io_op *ops;
  struct iovec *iov;
} io_batch;

struct pf_uring {
  uint32_t handle;
  struct io_uring ring;
  pf_pool *pool;
  pf_ring *cring;
  uint32_t depth;
  uint32_t hdr_pages;
  uint8_t *hdr;
  int bufs_registered;
  int files_registered;
  uint8_t slot_used[URING_FILE_SLOTS];
  pthread_mutex_t mu;
  io_batch *pend_head, *pend_tail;
  uint32_t inflight;      /* ops handed to the kernel, not yet reaped */
  int efd;                /* eventfd: pf_io_submit / close wake the reaper */
  uint64_t efd_value;     /* where the reaper's armed eventfd read lands */
  int closing;
  atomic_int holds;       /* calls between their lookup and return (uring_hold) */
  pthread_t reaper;
  uint64_t n_submitted, n_fallback;
  atomic_ullong n_completed;
  pf_file *files[URING_FILE_SLOTS];
};

/* ---- helpers ----------------------------------------------------------- */
static int is_pow2(uint32_t v) { return v && !(v & (v - 1)); }

static uint32_t sysfs_logical_block_size(dev_t dev) {
  char path[128];
  const char *fmts[] = {"/sys/dev/block/%u:%u/queue/logical_block_size",
                        "/sys/dev/block/%u:%u/../queue/logical_block_size"};
  for (int i = 0; i < 2; i++) {
    snprintf(path, sizeof path, fmts[i], major(dev), minor(dev));
    FILE *f = fopen(path, "r");
    if (!f) continue;
    unsigned v = 0;
    int ok = fscanf(f, "%u", &v) == 1;
    fclose(f);
    if (ok && is_pow2(v)) return v;
  }
  return 0;
}

/* Fills the file's O_DIRECT alignment: statx DIOALIGN (exact, Linux 6.1+),
 * else the block device's logical block size, else a safe 4 KiB. */
static void query_alignment(pf_file *f) {
  struct statx sx;
  f->off_align = f->mem_align = 0;
  if (statx(f->fd, "", AT_EMPTY_PATH, STATX_DIOALIGN | STATX_BASIC_STATS, &sx) == 0) {
    if ((sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align) {
      f->off_align = sx.stx_dio_offset_align;
      f->mem_align = sx.stx_dio_mem_align ? sx.stx_dio_mem_align : sx.stx_dio_offset_align;
      return;
    }
    uint32_t lbs = sysfs_logical_block_size(makedev(sx.stx_dev_major, sx.stx_dev_minor));
    if (lbs) {
      f->off_align = f->mem_align = lbs;
      return;
    }
  }
  f->off_align = f->mem_align = DEFAULT_DIO_ALIGN;
}

/* ---- open / close ------------------------------------------------------ */
/* Looks `uring` up and holds it under pf_objects_mu, for the calls on the JS
 * thread that use it past the lookup (submit, file open, info) while a
 * pf_uring_close runs off that thread: close retires the handle under the
 * same mutex and then waits for the holds to end before it frees anything,
 * so such a call either fails the lookup or finishes on a live uring (which
 * refuses new work once `closing`). Every hold ends with uring_unhold. */
static pf_uring *uring_hold(uint32_t uring, const char *fn) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_uring *u = pf_handle_get(uring, PF_K_URING, fn);
  if (u) atomic_fetch_add(&u->holds, 1);
  pthread_mutex_unlock(&pf_objects_mu);
  return u;
}

static int32_t uring_unhold(pf_uring *u, int32_t rc) {
  atomic_fetch_sub(&u->holds, 1);
  return rc;
}

static void *reaper_main(void *arg);
static unsigned uring_fill(pf_uring *u);

static int32_t uring_open(pf_pool *p, pf_ring *cr, uint32_t depth, uint32_t hdr_pages,
                          uint32_t *out_uring);

int32_t pf_uring_open(uint32_t pool, uint32_t ring, uint32_t depth, uint32_t hdr_pages,
                      uint32_t *out_uring) {
  if (!out_uring) return pf_fail(PF_EINVAL, "pf_uring_open: out_uring is NULL");
  if (!is_pow2(depth) || depth > URING_MAX_DEPTH)
    return pf_fail(PF_EINVAL, "pf_uring_open: depth %u must be a power of two in [1, %u]",
                   depth, URING_MAX_DEPTH);
  if (hdr_pages > URING_MAX_HDR_PAGES)
    return pf_fail(PF_EINVAL, "pf_uring_open: hdr_pages %u exceeds %u", hdr_pages,
                   URING_MAX_HDR_PAGES);
  /* The uring reads and writes the pool and posts to the ring for as long as
   * it is open: it holds both (as a transfer endpoint does), so destroying
   * either fails with PF_EBUSY until pf_uring_close instead of leaving it
   * with freed memory and a pool the kernel still has registered. */
  pthread_mutex_lock(&pf_objects_mu);
  pf_pool *p = pf_handle_get(pool, PF_K_POOL, "pf_uring_open(pool)");
  pf_ring *cr = p ? pf_handle_get(ring, PF_K_RING, "pf_uring_open(ring)") : NULL;
  if (!p || !cr) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  atomic_fetch_add(&p->inflight, 1);
  pf_ring_acquire(cr);
  pthread_mutex_unlock(&pf_objects_mu);
  int32_t rc = uring_open(p, cr, depth, hdr_pages, out_uring);
  if (rc < 0) {
    atomic_fetch_sub(&p->inflight, 1);
    pf_ring_release(cr);
  }
  return rc;
}

static int32_t uring_open(pf_pool *p, pf_ring *cr, uint32_t depth, uint32_t hdr_pages,
                          uint32_t *out_uring) {
  pf_uring *u = calloc(1, sizeof *u);
  if (!u) return pf_fail(PF_ENOMEM, "pf_uring_open: out of memory");
  u->pool = p;
  u->cring = cr;
  u->depth = depth;
  u->hdr_pages = hdr_pages;
  if (hdr_pages) {
    if (posix_memalign((void **)&u->hdr, PF_IO_HDR_BYTES, (size_t)hdr_pages * PF_IO_HDR_BYTES)) {
      free(u);
      return pf_fail(PF_ENOMEM, "pf_uring_open: cannot allocate %u header pages", hdr_pages);
    }
    memset(u->hdr, 0, (size_t)hdr_pages * PF_IO_HDR_BYTES);
  }
  /* CQ twice the SQ: completions of a full SQ never overflow even while the
   * reaper is posting the previous round. */
  struct io_uring_params params;
  memset(&params, 0, sizeof params);
  /* COOP_TASKRUN: completions run as task work when the reaper enters the
   * kernel anyway, instead of interrupting whichever thread submitted. */
  params.flags = IORING_SETUP_CQSIZE | IORING_SETUP_COOP_TASKRUN;
  params.cq_entries = depth * 2;
  int rc = io_uring_queue_init_params(depth, &u->ring, &params);
  if (rc == -EINVAL) { /* kernel older than 5.19 */
    memset(&params, 0, sizeof params);
    params.flags = IORING_SETUP_CQSIZE;
    params.cq_entries = depth * 2;
    rc = io_uring_queue_init_params(depth, &u->ring, &params);
  }
  if (rc < 0) {
    free(u->hdr);
    free(u);
    return pf_fail(PF_EIO, "pf_uring_open: io_uring_queue_init(depth %u): %s", depth,
                   strerror(-rc));
  }
  /* Fixed buffers: [0] header arena, [1..] pool in 1 GiB pieces. */
  uint64_t chunks = (p->bytes + POOL_BUF_CHUNK - 1) / POOL_BUF_CHUNK;
  struct iovec *iov = calloc(chunks + 1, sizeof *iov);
  if (iov) {
    iov[0].iov_base = u->hdr ? (void *)u->hdr : (void *)p->host;
    iov[0].iov_len = u->hdr ? (size_t)hdr_pages * PF_IO_HDR_BYTES : PF_IO_HDR_BYTES;
    for (uint64_t i = 0; i < chunks; i++) {
      uint64_t off = i * POOL_BUF_CHUNK;
      iov[i + 1].iov_base = p->host + off;
      iov[i + 1].iov_len = p->bytes - off < POOL_BUF_CHUNK ? p->bytes - off : POOL_BUF_CHUNK;
    }
    u->bufs_registered = io_uring_register_buffers(&u->ring, iov, (unsigned)chunks + 1) == 0;
    free(iov);
  }
  u->files_registered = io_uring_register_files_sparse(&u->ring, URING_FILE_SLOTS) == 0;
  u->efd = eventfd(0, EFD_CLOEXEC);
  if (u->efd < 0) {
    int e = errno;
    io_uring_queue_exit(&u->ring);
    free(u->hdr);
    free(u);
    return pf_fail(PF_EIO, "pf_uring_open: eventfd: %s", strerror(e));
  }
  pthread_mutex_init(&u->mu, NULL);
  uint32_t h = pf_handle_new(PF_K_URING, u);
  if (!h) {
    close(u->efd);
    io_uring_queue_exit(&u->ring);
    free(u->hdr);
    free(u);
    return PF_ENOMEM;
  }
  u->handle = h;
  if ((rc = pthread_create(&u->reaper, NULL, reaper_main, u)) != 0) {
    pf_handle_free(h);
    close(u->efd);
    io_uring_queue_exit(&u->ring);
    free(u->hdr);
    free(u);
    return pf_fail(PF_ENOMEM, "pf_uring_open: cannot start reaper thread: %s", strerror(rc));
  }
  *out_uring = h;
  return PF_OK;
}

void *pf_uring_hdr_ptr(uint32_t uring) {
  pf_uring *u = pf_handle_get(uring, PF_K_URING, "pf_uring_hdr_ptr");
  return u ? u->hdr : NULL;
}

_Static_assert(sizeof(pf_uring_stats) == 48, "pf_uring_stats layout");
_Static_assert(offsetof(pf_uring_stats, submitted) == 16, "pf_uring_stats layout");

int32_t pf_uring_info(uint32_t uring, pf_uring_stats *out) {
  pf_uring *u = uring_hold(uring, "pf_uring_info");
  if (!u) return PF_EHANDLE;
  if (!out) return uring_unhold(u, pf_fail(PF_EINVAL, "pf_uring_info: out is NULL"));
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&u->mu);
  out->depth = u->depth;
  out->hdr_pages = u->hdr_pages;
  out->fixed_buffers = u->bufs_registered ? 1 : 0;
  out->fixed_files = u->files_registered ? 1 : 0;
  out->submitted = u->n_submitted;
  out->completed = atomic_load(&u->n_completed);
  out->align_fallbacks = u->n_fallback;
  out->inflight = u->inflight;
  pthread_mutex_unlock(&u->mu);
  return uring_unhold(u, PF_OK);
}

static void file_release(pf_file *f) {
  pf_uring *u = f->u;
  if (f->slot >= 0) {
    int fds[2] = {-1, -1};
    io_uring_register_files_update(&u->ring, (unsigned)f->slot, fds, 2);
    u->slot_used[f->slot] = u->slot_used[f->slot + 1] = 0;
  }
  for (uint32_t i = 0; i < URING_FILE_SLOTS; i++)
    if (u->files[i] == f) u->files[i] = NULL;
  if (f->fd != f->fd_buf) close(f->fd);
  close(f->fd_buf);
  pf_handle_free(f->handle);
  free(f);
}

static int32_t uring_close(uint32_t uring) {
  pf_uring *u = uring_hold(uring, "pf_uring_close");
  if (!u) return PF_EHANDLE;
  if (pthread_equal(pthread_self(), u->reaper))
    return uring_unhold(u, pf_fail(PF_EBUSY, "pf_uring_close: called from the reaper thread"));
  pthread_mutex_lock(&u->mu);
  if (u->closing) {
    pthread_mutex_unlock(&u->mu);
    return uring_unhold(u, pf_fail(PF_ESHUTDOWN, "pf_uring_close: uring %u is already closing",
                                   uring));
  }
  u->closing = 1;
  pthread_mutex_unlock(&u->mu);
  uring_unhold(u, PF_OK);
  eventfd_write(u->efd, 1); /* wake the reaper even when nothing is in flight */
  pthread_join(u->reaper, NULL);
  /* The uring's and its files' handles retire together: a call looks either
   * up and holds the uring under the same mutex, or finds neither. */
  pthread_mutex_lock(&pf_objects_mu);
  pf_handle_free(uring);
  pthread_mutex_lock(&u->mu);
  for (uint32_t i = 0; i < URING_FILE_SLOTS; i++)
    if (u->files[i]) pf_handle_free(u->files[i]->handle);
  pthread_mutex_unlock(&u->mu);
  pthread_mutex_unlock(&pf_objects_mu);
  /* A call that looked them up before may still run (a submit racing this
   * close sees `closing` and refuses; a file close finishes; a file sync
   * ends its fdatasync): wait it out before the uring and files are freed. */
  while (atomic_load(&u->holds)) usleep(50);
  for (uint32_t i = 0; i < URING_FILE_SLOTS; i++)
    if (u->files[i]) file_release(u->files[i]);
  io_uring_queue_exit(&u->ring);
  close(u->efd);
  pthread_mutex_destroy(&u->mu);
  atomic_fetch_sub(&u->pool->inflight, 1); /* taken in pf_uring_open */
  pf_ring_release(u->cring);
  free(u->hdr);
  free(u);
  return PF_OK;
}

/* ---- files ------------------------------------------------------------- */
static int32_t file_open_held(pf_uring *u, const char *path, uint32_t flags,
                              uint32_t *out_file);

int32_t pf_file_open(uint32_t uring, const char *path, uint32_t flags, uint32_t *out_file) {
  pf_uring *u = uring_hold(uring, "pf_file_open");
  if (!u) return PF_EHANDLE;
  return uring_unhold(u, file_open_held(u, path, flags, out_file));
}

static int32_t file_open_held(pf_uring *u, const char *path, uint32_t flags,
                              uint32_t *out_file) {
  if (!path || !out_file) return pf_fail(PF_EINVAL, "pf_file_open: path or out_file is NULL");
  if (strlen(path) >= sizeof(((pf_file *)0)->path))
    return pf_fail(PF_EINVAL, "pf_file_open: path longer than %zu bytes",
                   sizeof(((pf_file *)0)->path) - 1);
  if (flags & ~(uint32_t)(PF_FILE_DIRECT | PF_FILE_CREATE | PF_FILE_RDONLY))
    return pf_fail(PF_EINVAL, "pf_file_open(%s): unknown flags 0x%x", path, flags);
  if ((flags & PF_FILE_RDONLY) && (flags & PF_FILE_CREATE))
    return pf_fail(PF_EINVAL, "pf_file_open(%s): CREATE with RDONLY", path);
  int base = (flags & PF_FILE_RDONLY) ? O_RDONLY : O_RDWR;
  base |= O_CLOEXEC;
  int fd_buf = open(path, base | ((flags & PF_FILE_CREATE) ? O_CREAT : 0), 0644);
  if (fd_buf < 0)
    return pf_fail(PF_EIO, "open %s: %s (errno %d)", path, strerror(errno), errno);
  struct stat st;
  if (fstat(fd_buf, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    close(fd_buf);
    return pf_fail(PF_EINVAL, "open %s: not a regular file or block device", path);
  }
  pf_file *f = calloc(1, sizeof *f);
  if (!f) {
    close(fd_buf);
    return pf_fail(PF_ENOMEM, "pf_file_open: out of memory");
  }
  f->u = u;
  f->fd = f->fd_buf = fd_buf;
  f->rdonly = (flags & PF_FILE_RDONLY) != 0;
  f->slot = -1;
  snprintf(f->path, sizeof f->path, "%s", path);
  if (flags & PF_FILE_DIRECT) {
    int fd = open(path, base | O_DIRECT);
    if (fd >= 0) {
      f->fd = fd;
      f->direct = 1;
    } else if (errno != EINVAL) {
      int e = errno;
      close(fd_buf);
      free(f);
      return pf_fail(PF_EIO, "open %s with O_DIRECT: %s (errno %d)", path, strerror(e), e);
    } /* EINVAL: the filesystem has no O_DIRECT (older tmpfs): buffered. */
  }
  query_alignment(f);

  pthread_mutex_lock(&u->mu);
  if (u->closing) {
    pthread_mutex_unlock(&u->mu);
    if (f->fd != f->fd_buf) close(f->fd);
    close(fd_buf);
    free(f);
    return pf_fail(PF_ESHUTDOWN, "pf_file_open(%s): uring is closing", path);
  }
  uint32_t free_idx = URING_FILE_SLOTS;
  for (uint32_t i = 0; i < URING_FILE_SLOTS; i++)
    if (!u->files[i]) { free_idx = i; break; }
  if (free_idx == URING_FILE_SLOTS) {
    pthread_mutex_unlock(&u->mu);
    if (f->fd != f->fd_buf) close(f->fd);
    close(fd_buf);
    free(f);
    return pf_fail(PF_ENOMEM, "pf_file_open(%s): %u files already open on this uring", path,
                   URING_FILE_SLOTS);
  }
  if (u->files_registered) {
    for (uint32_t s = 0; s + 1 < URING_FILE_SLOTS; s += 2) {
      if (!u->slot_used[s]) {
        int fds[2] = {f->fd, f->fd_buf};
        if (io_uring_register_files_update(&u->ring, s, fds, 2) == 2) {
          u->slot_used[s] = u->slot_used[s + 1] = 1;
          f->slot = (int)s;
        }
        break;
      }
    }
  }
  uint32_t h = pf_handle_new(PF_K_FILE, f);
  if (!h) {
    if (f->slot >= 0) {
      int fds[2] = {-1, -1};
      io_uring_register_files_update(&u->ring, (unsigned)f->slot, fds, 2);
      u->slot_used[f->slot] = u->slot_used[f->slot + 1] = 0;
    }
    pthread_mutex_unlock(&u->mu);
    if (f->fd != f->fd_buf) close(f->fd);
    close(fd_buf);
    free(f);
    return PF_ENOMEM;
  }
  f->handle = h;
  u->files[free_idx] = f;
  pthread_mutex_unlock(&u->mu);
  *out_file = h;
  return PF_OK;
}

_Static_assert(sizeof(pf_file_props) == 24, "pf_file_props layout");
_Static_assert(offsetof(pf_file_props, direct) == 16, "pf_file_props layout");

int32_t pf_file_info(uint32_t file, pf_file_props *out) {
  pf_file *f = pf_handle_get(file, PF_K_FILE, "pf_file_info");
  if (!f) return PF_EHANDLE;
  if (!out) return pf_fail(PF_EINVAL, "pf_file_info: out is NULL");
  struct stat st;
  if (fstat(f->fd_buf, &st) != 0)
    return pf_fail(PF_EIO, "fstat %s: %s", f->path, strerror(errno));
  memset(out, 0, sizeof *out);
  out->bytes = (uint64_t)st.st_size;
  out->offset_align = (uint32_t)f->off_align;
  out->mem_align = (uint32_t)f->mem_align;
  out->direct = f->direct ? 1u : 0u;
  return PF_OK;
}

int32_t pf_file_size(uint32_t file, uint64_t *out_bytes) {
  pf_file_props props;
  if (!out_bytes) return pf_fail(PF_EINVAL, "pf_file_size: out_bytes is NULL");
  int32_t rc = pf_file_info(file, &props);
  if (rc == PF_OK) *out_bytes = props.bytes;
  return rc;
}

int32_t pf_file_truncate(uint32_t file, uint64_t bytes) {
  pf_file *f = pf_handle_get(file, PF_K_FILE, "pf_file_truncate");
  if (!f) return PF_EHANDLE;
  if (ftruncate(f->fd_buf, (off_t)bytes) != 0)
    return pf_fail(PF_EIO, "ftruncate %s to %llu bytes: %s (errno %d)", f->path,
                   (unsigned long long)bytes, strerror(errno), errno);
  return PF_OK;
}

int32_t pf_file_allocate(uint32_t file, uint64_t bytes) {
  pf_file *f = pf_handle_get(file, PF_K_FILE, "pf_file_allocate");
  if (!f) return PF_EHANDLE;
  if (bytes == 0) return PF_OK;
  if (fallocate(f->fd_buf, 0, 0, (off_t)bytes) != 0) {
    int e = errno;
    if (e == EOPNOTSUPP)
      return pf_fail(PF_EUNSUPPORTED, "fallocate %s: not supported by this filesystem", f->path);
    return pf_fail(PF_EIO, "fallocate %s to %llu bytes: %s (errno %d)", f->path,
                   (unsigned long long)bytes, strerror(e), e);
  }
  return PF_OK;
}

/* Looks `file` up and holds it (its `inflight`, which pf_file_close refuses
 * while set) and its uring (which pf_uring_close waits out) under
 * pf_objects_mu: pf_file_sync runs off the JS thread, where a close of the
 * file or of its uring may run meanwhile. Ends with file_unhold. */
static pf_file *file_hold(uint32_t file, const char *fn) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_file *f = pf_handle_get(file, PF_K_FILE, fn);
  if (f) {
    atomic_fetch_add(&f->inflight, 1);
    atomic_fetch_add(&f->u->holds, 1);
  }
  pthread_mutex_unlock(&pf_objects_mu);
  return f;
}

int32_t pf_uring_close(uint32_t uring, char *err, uint32_t err_cap) {
  return pf_error_out(uring_close(uring), err, err_cap);
}

static int32_t file_unhold(pf_file *f, int32_t rc) {
  pf_uring *u = f->u; /* f may go once its inflight drops; u stays while held */
  atomic_fetch_sub(&f->inflight, 1);
  return uring_unhold(u, rc);
}

static int32_t file_sync(uint32_t file) {
  pf_file *f = file_hold(file, "pf_file_sync");
  if (!f) return PF_EHANDLE;
  if (fdatasync(f->fd_buf) != 0)
    return file_unhold(f, pf_fail(PF_EIO, "fdatasync %s: %s (errno %d)", f->path,
                                  strerror(errno), errno));
  return file_unhold(f, PF_OK);
}

int32_t pf_file_sync(uint32_t file, char *err, uint32_t err_cap) {
  return pf_error_out(file_sync(file), err, err_cap);
}

int32_t pf_file_drop_cache(uint32_t file) {
  pf_file *f = pf_handle_get(file, PF_K_FILE, "pf_file_drop_cache");
  if (!f) return PF_EHANDLE;
  int rc = posix_fadvise(f->fd_buf, 0, 0, POSIX_FADV_DONTNEED);
  if (rc != 0)
    return pf_fail(PF_EIO, "posix_fadvise(DONTNEED) %s: %s", f->path, strerror(rc));
  return PF_OK;
}

int32_t pf_file_close(uint32_t file) {
  /* Checked and retired under pf_objects_mu, the uring held meanwhile: a
   * pf_file_sync either holds the file first (EBUSY here) or no longer finds
   * it, and a pf_uring_close waits for this release before its own. */
  pthread_mutex_lock(&pf_objects_mu);
  pf_file *f = pf_handle_get(file, PF_K_FILE, "pf_file_close");
  if (!f) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  int busy = atomic_load(&f->inflight);
  if (busy > 0) {
    pthread_mutex_unlock(&pf_objects_mu);
    return pf_fail(PF_EBUSY, "pf_file_close(%s): %d ops in flight", f->path, busy);
  }
  pf_uring *u = f->u;
  atomic_fetch_add(&u->holds, 1);
  pf_handle_free(f->handle);
  pthread_mutex_unlock(&pf_objects_mu);
  pthread_mutex_lock(&u->mu);
  file_release(f);
  pthread_mutex_unlock(&u->mu);
  return uring_unhold(u, PF_OK);
}

_Static_assert(sizeof(pf_fs_usage) == 24, "pf_fs_usage layout");

int32_t pf_fs_space(const char *path, pf_fs_usage *out) {
  if (!path || !out) return pf_fail(PF_EINVAL, "pf_fs_space: path or out is NULL");
  struct statvfs sv;
  if (statvfs(path, &sv) != 0)
    return pf_fail(PF_EIO, "statvfs %s: %s (errno %d)", path, strerror(errno), errno);
  out->total_bytes = (uint64_t)sv.f_blocks * sv.f_frsize;
  out->available_bytes = (uint64_t)sv.f_bavail * sv.f_frsize;
  out->block_bytes = (uint64_t)sv.f_bsize;
  return PF_OK;
}

int32_t pf_errno_text(int32_t err, char *buf, uint32_t cap) {
  char tmp[256];
  return pf_text_out(strerror_r(err, tmp, sizeof tmp), buf, cap);
}

/* ---- batches ----------------------------------------------------------- */
/* Parses and bounds-checks a descriptor; shared by submit and crc32c. */
static int32_t parse_batch(const char *who, pf_pool *p, const void *desc, uint64_t desc_bytes,
                           const pf_io_batch_header **hdr, const pf_io_desc **ops,
                           const pf_io_ext **exts) {
  if (!desc || desc_bytes < sizeof(pf_io_batch_header))
    return pf_fail(PF_EINVAL, "%s: descriptor of %llu bytes is shorter than its header", who,
                   (unsigned long long)desc_bytes);
  /* The ops and extents hold u64 fields: read in place, they need 8-byte
   * alignment (a misaligned read is undefined behaviour). */
  if ((uintptr_t)desc & 7u)
    return pf_fail(PF_EINVAL, "%s: descriptor at %p is not 8-byte aligned", who, desc);
  const pf_io_batch_header *h = desc;
  if (h->reserved)
    return pf_fail(PF_EINVAL, "%s: header.reserved is 0x%llx (must be 0)", who,
                   (unsigned long long)h->reserved);
  uint64_t need = sizeof *h + (uint64_t)h->num_ops * sizeof(pf_io_desc) +
                  (uint64_t)h->num_exts * sizeof(pf_io_ext);
  if (h->num_ops == 0) return pf_fail(PF_EINVAL, "%s: batch has no ops", who);
  if (desc_bytes < need)
    return pf_fail(PF_EINVAL, "%s: descriptor of %llu bytes, %u ops and %u extents need %llu",
                   who, (unsigned long long)desc_bytes, h->num_ops, h->num_exts,
                   (unsigned long long)need);
  const pf_io_desc *o = (const pf_io_desc *)(h + 1);
  const pf_io_ext *x = (const pf_io_ext *)(o + h->num_ops);
  for (uint32_t e = 0; e < h->num_exts; e++) {
    if (x[e].bytes == 0 || x[e].pool_off > p->bytes || x[e].bytes > p->bytes - x[e].pool_off)
      return pf_fail(PF_ERANGE, "%s: extent %u [%llu, +%llu) is empty or outside the pool (%llu "
                     "bytes)", who, e, (unsigned long long)x[e].pool_off,
                     (unsigned long long)x[e].bytes, (unsigned long long)p->bytes);
  }
  for (uint32_t i = 0; i < h->num_ops; i++) {
    if ((uint64_t)o[i].first_ext + o[i].num_ext > h->num_exts)
      return pf_fail(PF_ERANGE, "%s: op %u extents [%u, +%u) beyond the %u in the batch", who, i,
                     o[i].first_ext, o[i].num_ext, h->num_exts);
    if (o[i].num_ext + 1 > IO_MAX_IOV)
      return pf_fail(PF_EINVAL, "%s: op %u has %u extents (max %u)", who, i, o[i].num_ext,
                     IO_MAX_IOV - 1);
  }
  *hdr = h;
  *ops = o;
  *exts = x;
  return PF_OK;
}

static int aligned(uint64_t v, uint32_t a) { return a == 0 || (v % a) == 0; }

static int32_t io_submit_held(pf_uring *u, uint32_t uring, const void *desc,
                              uint64_t desc_bytes, uint64_t tag);

int32_t pf_io_submit(uint32_t uring, const void *desc, uint64_t desc_bytes, uint64_t tag) {
  pf_uring *u = uring_hold(uring, "pf_io_submit");
  if (!u) return PF_EHANDLE;
  return uring_unhold(u, io_submit_held(u, uring, desc, desc_bytes, tag));
}

static int32_t io_submit_held(pf_uring *u, uint32_t uring, const void *desc,
                              uint64_t desc_bytes, uint64_t tag) {
  const pf_io_batch_header *h;
  const pf_io_desc *o;
  const pf_io_ext *x;
  int32_t rc = parse_batch("pf_io_submit", u->pool, desc, desc_bytes, &h, &o, &x);
  if (rc) return rc;
  if (pf_ring_is_shutdown(u->cring))
    return pf_fail(PF_ESHUTDOWN, "pf_io_submit: completion ring is shut down");

  /* Resolve and check every op before anything is queued. */
  pf_file **files = calloc(h->num_ops, sizeof *files);
  if (!files) return pf_fail(PF_ENOMEM, "pf_io_submit: out of memory");
  uint64_t total_iov = 0;
  for (uint32_t i = 0; i < h->num_ops; i++) {
    const pf_io_desc *d = &o[i];
    pf_file *f = pf_handle_get(d->file, PF_K_FILE, "pf_io_submit(file)");
    if (!f || f->u != u) {
      free(files);
      return f ? pf_fail(PF_EHANDLE, "pf_io_submit: op %u file %u belongs to another uring", i,
                         d->file)
               : PF_EHANDLE;
    }
    if (d->op != PF_IO_READ && d->op != PF_IO_WRITE) {
      free(files);
      return pf_fail(PF_EINVAL, "pf_io_submit: op %u kind %u is neither READ nor WRITE", i,
                     d->op);
    }
    if (d->flags & ~(uint32_t)PF_IO_CRC) {
      free(files);
      return pf_fail(PF_EINVAL, "pf_io_submit: op %u unknown flags 0x%x", i, d->flags);
    }
    if (d->op == PF_IO_WRITE && f->rdonly) {
      free(files);
      return pf_fail(PF_EINVAL, "pf_io_submit: op %u writes to %s, opened read-only", i,
                     f->path);
    }
    if (d->hdr_page > u->hdr_pages) {
      free(files);
      return pf_fail(PF_ERANGE, "pf_io_submit: op %u header page %u beyond the %u staged", i,
                     d->hdr_page - 1, u->hdr_pages);
    }
    if (d->hdr_page == 0 && d->num_ext == 0) {
      free(files);
      return pf_fail(PF_EINVAL, "pf_io_submit: op %u moves nothing (no header, no extents)", i);
    }
    uint64_t bytes = d->hdr_page ? PF_IO_HDR_BYTES : 0;
    for (uint32_t e = 0; e < d->num_ext; e++) bytes += x[d->first_ext + e].bytes;
    if (bytes > IO_MAX_OP_BYTES) {
      free(files);
      return pf_fail(PF_EINVAL, "pf_io_submit: op %u moves %llu bytes (max %llu per op)", i,
                     (unsigned long long)bytes, (unsigned long long)IO_MAX_OP_BYTES);
    }
    /* The kernel takes file offsets as a signed loff_t: an op reaching past
     * 2^63 would be accepted here and only fail in the kernel (EINVAL). */
    if (d->file_off > (uint64_t)INT64_MAX - bytes) {
      free(files);
      return pf_fail(PF_ERANGE, "pf_io_submit: op %u file_off %llu + %llu bytes passes the "
                     "largest file offset (2^63 - 1) of %s", i,
                     (unsigned long long)d->file_off, (unsigned long long)bytes, f->path);
    }
    files[i] = f;
    total_iov += (d->hdr_page ? 1 : 0) + d->num_ext;
  }

  io_batch *b = calloc(1, sizeof *b);
  io_op *ops = calloc(h->num_ops, sizeof *ops);
  struct iovec *iov = calloc(total_iov ? total_iov : 1, sizeof *iov);
  if (!b || !ops || !iov) {
    free(b);
    free(ops);
    free(iov);
    free(files);
    return pf_fail(PF_ENOMEM, "pf_io_submit: out of memory for %u ops", h->num_ops);
  }
  b->u = u;
  b->tag = tag;
  b->n_ops = h->num_ops;
  b->ops = ops;
  b->iov = iov;
  atomic_init(&b->remaining, h->num_ops);
  atomic_init(&b->first_status, PF_OK);
  uint64_t vi = 0;
  uint64_t fallbacks = 0;
  for (uint32_t i = 0; i < h->num_ops; i++) {
    const pf_io_desc *d = &o[i];
    pf_file *f = files[i];
    io_op *op = &ops[i];
    op->batch = b;
    op->file = f;
    op->index = i;
    op->op = d->op;
    op->flags = d->flags;
    op->file_off = d->file_off;
    op->iov = &iov[vi];
    op->fixed_buf = -1;
    int ok = f->direct && aligned(d->file_off, f->off_align);
    if (d->hdr_page) {
      iov[vi].iov_base = u->hdr + (size_t)(d->hdr_page - 1) * PF_IO_HDR_BYTES;
      iov[vi].iov_len = PF_IO_HDR_BYTES;
      ok = ok && aligned(PF_IO_HDR_BYTES, f->off_align) &&
           aligned((uintptr_t)iov[vi].iov_base, f->mem_align);
      op->expect += PF_IO_HDR_BYTES;
      op->has_hdr = 1;
      vi++;
    }
    for (uint32_t e = 0; e < d->num_ext; e++) {
      const pf_io_ext *ex = &x[d->first_ext + e];
      iov[vi].iov_base = u->pool->host + ex->pool_off;
      iov[vi].iov_len = ex->bytes;
      ok = ok && aligned(ex->bytes, f->off_align) &&
           aligned((uintptr_t)iov[vi].iov_base, f->mem_align);
      op->expect += ex->bytes;
      vi++;
    }
    op->niov = (uint32_t)(&iov[vi] - op->iov);
    op->buffered = !ok;
    if (op->buffered && f->direct) fallbacks++;
    if (u->bufs_registered && op->niov == 1) {
      if (d->hdr_page) {
        op->fixed_buf = 0;
      } else {
        uint64_t off = x[d->first_ext].pool_off, n = x[d->first_ext].bytes;
        if (off / POOL_BUF_CHUNK == (off + n - 1) / POOL_BUF_CHUNK)
          op->fixed_buf = 1 + (int)(off / POOL_BUF_CHUNK);
      }
    }
    atomic_fetch_add(&f->inflight, 1);
  }
  free(files);
  pf_ring_acquire(u->cring);
  atomic_fetch_add(&u->pool->inflight, 1);

  pthread_mutex_lock(&u->mu);
  if (u->closing) {
    pthread_mutex_unlock(&u->mu);
    for (uint32_t i = 0; i < b->n_ops; i++) atomic_fetch_sub(&ops[i].file->inflight, 1);
    pf_ring_release(u->cring);
    atomic_fetch_sub(&u->pool->inflight, 1);
    free(iov);
    free(ops);
    free(b);
    return pf_fail(PF_ESHUTDOWN, "pf_io_submit: uring %u is closing", uring);
  }
  u->n_fallback += fallbacks;
  if (u->pend_tail) u->pend_tail->next = b;
  else u->pend_head = b;
  u->pend_tail = b;
  pthread_mutex_unlock(&u->mu);
  /* The reaper is the ring's only issuer: it submits, waits and refills.
   * Completion task work therefore always runs on the thread that is in the
   * kernel waiting for it (the ring runs with COOP_TASKRUN, so nothing
   * interrupts other threads), and no lock is needed around the SQ. */
  eventfd_write(u->efd, 1);
  return PF_OK;
}

static void prep_op(pf_uring *u, struct io_uring_sqe *sqe, io_op *op) {
  pf_file *f = op->file;
  int fd = op->buffered ? f->fd_buf : f->fd;
  int fixed_file = 0;
  if (f->slot >= 0) {
    fd = f->slot + (op->buffered ? 1 : 0);
    fixed_file = 1;
  }
  if (op->fixed_buf >= 0) {
    if (op->op == PF_IO_READ)
      io_uring_prep_read_fixed(sqe, fd, op->iov[0].iov_base, (unsigned)op->iov[0].iov_len,
                               op->file_off, op->fixed_buf);
    else
      io_uring_prep_write_fixed(sqe, fd, op->iov[0].iov_base, (unsigned)op->iov[0].iov_len,
                                op->file_off, op->fixed_buf);
  } else if (op->op == PF_IO_READ) {
    io_uring_prep_readv(sqe, fd, op->iov, op->niov, op->file_off);
  } else {
    io_uring_prep_writev(sqe, fd, op->iov, op->niov, op->file_off);
  }
  if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, op);
  (void)u;
}

/* Moves waiting ops into the SQ while credit lasts (the caller submits).
 * Called by the reaper with u->mu held. */
static unsigned uring_fill(pf_uring *u) {
  unsigned prepared = 0;
  while (u->pend_head && u->inflight < u->depth) {
    io_batch *b = u->pend_head;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
    if (!sqe) break;
    prep_op(u, sqe, &b->ops[b->next_op]);
    b->next_op++;
    u->inflight++;
    prepared++;
    if (b->next_op == b->n_ops) {
      u->pend_head = b->next;
      if (!u->pend_head) u->pend_tail = NULL;
      b->next = NULL;
    }
  }
  u->n_submitted += prepared;
  return prepared;
}

/* Arms a read of the wake eventfd; its completion means "look at the queue". */
static int arm_wake(pf_uring *u) {
  struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
  if (!sqe) return 0; /* SQ full of data ops: arm on the next round */
  io_uring_prep_read(sqe, u->efd, &u->efd_value, sizeof u->efd_value, 0);
  io_uring_sqe_set_data64(sqe, WAKE_USER_DATA);
  return 1;
}

/* ---- reaper ------------------------------------------------------------ */
typedef struct reaped {
  io_op *op;
  int32_t res;
} reaped;

static void finish_op(pf_uring *u, io_op *op, int32_t res) {
  io_batch *b = op->batch;
  pf_completion c;
  memset(&c, 0, sizeof c);
  c.tag = b->tag;
  c.kind = PF_DONE_IO;
  c.index = op->index;
  if (res < 0 || (uint64_t)res != op->expect) {
    int err = res < 0 ? -res : (op->op == PF_IO_WRITE ? ENOSPC : ENODATA);
    c.status = PF_EIO;
    c.aux = (uint32_t)err;
    c.value = res < 0 ? 0 : (uint64_t)res;
    int expected = PF_OK;
    atomic_compare_exchange_strong(&b->first_status, &expected, PF_EIO);
    atomic_fetch_add(&b->failed, 1);
  } else {
    c.status = PF_OK;
    c.value = (uint64_t)res;
    if ((op->flags & PF_IO_CRC) && op->op == PF_IO_READ) {
      uint32_t crc = 0;
      for (uint32_t i = op->has_hdr; i < op->niov; i++)
        crc = pf_crc32c(crc, op->iov[i].iov_base, op->iov[i].iov_len);
      c.aux = crc;
    }
    atomic_fetch_add(&b->bytes, (uint64_t)res);
  }
  pf_ring_post(u->cring, &c);
  atomic_fetch_sub(&op->file->inflight, 1);
  atomic_fetch_add(&u->n_completed, 1);
  if (atomic_fetch_sub(&b->remaining, 1) == 1) {
    pf_completion d;
    memset(&d, 0, sizeof d);
    d.tag = b->tag;
    d.kind = PF_DONE_IO_BATCH;
    d.index = b->n_ops;
    d.status = atomic_load(&b->first_status);
    d.aux = atomic_load(&b->failed);
    d.value = atomic_load(&b->bytes);
    pf_ring_post(u->cring, &d);
    atomic_fetch_sub(&u->pool->inflight, 1);
    pf_ring_release(u->cring);
    free(b->iov);
    free(b->ops);
    free(b);
  }
}

static void *reaper_main(void *arg) {
  pf_uring *u = arg;
  pthread_setname_np(pthread_self(), "pf-uring-reap"); /* top, perf, /proc: whose CPU */
  reaped *done = calloc(u->depth * 2, sizeof *done);
  int armed = 0;
  for (;;) {
    pthread_mutex_lock(&u->mu);
    uring_fill(u);
    int exit_now = u->closing && u->inflight == 0 && !u->pend_head;
    pthread_mutex_unlock(&u->mu);
    if (exit_now) break;
    if (!armed) armed = arm_wake(u);
    /* One syscall submits what was prepared and waits for a completion. */
    int rc = io_uring_submit_and_wait(&u->ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -ETIME) {
      /* EAGAIN/EBUSY: the kernel is short of resources; the SQEs stay queued
       * and are submitted on the next round. Anything else should not happen
       * on a healthy ring. Either way: do not spin hot. */
      usleep(RESUBMIT_BACKOFF_US);
    }
    struct io_uring_cqe *cqe;
    unsigned n = 0, head, ops = 0;
    io_uring_for_each_cqe(&u->ring, head, cqe) {
      if (n == u->depth * 2) break;
      void *data = io_uring_cqe_get_data(cqe);
      if (data) {
        done[ops].op = data;
        done[ops].res = cqe->res;
        ops++;
      } else {
        armed = 0; /* the eventfd read completed: re-arm next round */
      }
      n++;
    }
    io_uring_cq_advance(&u->ring, n);
    if (ops) {
      pthread_mutex_lock(&u->mu);
      u->inflight -= ops;
      /* Refill before posting: the device gets new work first. */
      if (uring_fill(u)) io_uring_submit(&u->ring);
      pthread_mutex_unlock(&u->mu);
    }
    for (unsigned i = 0; i < ops; i++) finish_op(u, done[i].op, done[i].res);
  }
  free(done);
  return NULL;
}

/* ---- integrity --------------------------------------------------------- */
int32_t pf_pool_crc32c(uint32_t pool, const void *desc, uint64_t desc_bytes,
                       uint32_t *out_crcs) {
  pf_pool *p = pf_pool_hold(pool, "pf_pool_crc32c"); /* runs off the JS thread */
  if (!p) return PF_EHANDLE;
  const pf_io_batch_header *h;
  const pf_io_desc *o;
  const pf_io_ext *x;
  int32_t rc = out_crcs ? parse_batch("pf_pool_crc32c", p, desc, desc_bytes, &h, &o, &x)
                        : pf_fail(PF_EINVAL, "pf_pool_crc32c: out_crcs is NULL");
  if (rc) {
    pf_pool_unhold(p);
    return rc;
  }
  for (uint32_t i = 0; i < h->num_ops; i++) {
    uint32_t crc = 0;
    for (uint32_t e = 0; e < o[i].num_ext; e++) {
      const pf_io_ext *ex = &x[o[i].first_ext + e];
      crc = pf_crc32c(crc, p->host + ex->pool_off, ex->bytes);
    }
    out_crcs[i] = crc;
  }
  pf_pool_unhold(p);
  return PF_OK;
}
