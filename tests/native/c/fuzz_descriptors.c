/* Seeded fuzz of the library's batch entry points (pf_copy_submit,
 * pf_io_submit, pf_pool_crc32c, pf_pool_checksums, pf_xfer_submit) and of the
 * calls that take caller text or structs (pf_file_open, pf_region_import,
 * pf_xfer_peer_connect, pf_ring_wait / take_error), on the host backend, a
 * uring over a temp file and a TCP endpoint pair on loopback. Built with ASan
 * and UBSan (tests/native/fuzz_c_review_test.ts). Usage: SEED ITERS FILE.
 *
 * Two phases per entry point: random bytes of random lengths (with live and
 * dead handles planted), then valid descriptors with one field broken. The
 * checks: a malformed batch is refused with a negative PF_E* (never a crash,
 * UB or hang: SIGALRM ends the run naming the phase), a refused batch posts
 * no completion record and keeps no ring error, anything accepted ends with
 * its one final record; afterwards valid batches still move bytes exactly
 * and every object closes with 0 (LeakSanitizer checks the rest at exit).
 * Each case prints its name on failure, so a failure is its own repro. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "pegaflow.h"
#include "check.h"

#define POOL_BYTES (2u << 20)
#define REGION_BYTES (256u << 10)
#define HDR_PAGES 4u

static const char *phase = "setup";
static uint64_t rng;
static uint64_t rnd(void) { /* splitmix64: the same stream for a seed everywhere */
  uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static uint32_t below(uint32_t n) { return (uint32_t)(rnd() % n); }

static void on_alarm(int sig) {
  (void)sig;
  static const char m[] = "HANG: the alarm fired in phase ";
  (void)!write(2, m, sizeof m - 1);
  (void)!write(2, phase, strlen(phase));
  (void)!write(2, "\n", 1);
  _exit(3);
}

#define FAIL(...)                                                   \
  do {                                                              \
    fprintf(stderr, "FAIL [%s] line %d: ", phase, __LINE__);        \
    fprintf(stderr, __VA_ARGS__);                                   \
    fprintf(stderr, "\n");                                          \
    if (!keep_going) exit(4);                                       \
    failures++;                                                     \
  } while (0)
/* FUZZ_KEEP_GOING=1: report every failing case, exit 4 at the end. */
static int keep_going;
static unsigned failures;

/* ---- the objects under fuzz -------------------------------------------- */
static uint32_t eng, eng2, pool, pool_b, ring, ring_b, shm, uring, file, rofile;
static uint32_t reg[2], reg_other, dead_region, dead_file, dead_peer, dead_ring;
static uint32_t ep_a, ep_b, peer;
static uint8_t *poolp, *poolp_b;
static uint64_t next_tag = 1000;
static uint64_t imm_expected;
static uint64_t n_refused, n_accepted;

/* Handles worth planting: live ones of every kind and dead ones. */
static uint32_t some_handle(void) {
  uint32_t all[] = {eng, eng2, pool, pool_b, ring, ring_b, shm, uring, file, rofile, reg[0],
                    reg[1], reg_other, dead_region, dead_file, dead_peer, dead_ring, ep_a, ep_b,
                    peer, 0, 0xffffffffu, 1};
  return all[below(sizeof all / sizeof all[0])];
}
static uint32_t odd32(void) {
  static const uint32_t v[] = {0, 1, 2, 3, 7, 8, 16, 24, 4095, 4096, 0x7fffffffu, 0x80000000u,
                               0xfffffff0u, 0xfffffff8u, 0xffffffffu, 1u << 20, (1u << 20) + 1};
  switch (below(3)) {
  case 0: return v[below(sizeof v / sizeof v[0])];
  case 1: return some_handle();
  default: return (uint32_t)rnd();
  }
}
static uint64_t odd64(void) {
  static const uint64_t v[] = {0, 1, 4096, POOL_BYTES, POOL_BYTES - 1, POOL_BYTES + 1,
                               REGION_BYTES, 1ull << 32, (1ull << 32) - 1, (1ull << 63),
                               (1ull << 63) - 1, UINT64_MAX, UINT64_MAX - 4095, UINT64_MAX - 7};
  return below(2) ? v[below(sizeof v / sizeof v[0])] : rnd();
}

/* ---- the completion ring ------------------------------------------------ */
typedef struct consumer {
  uint32_t handle;
  uint8_t *mem;
  uint64_t seen;
} consumer;
static consumer ca, cb;

static _Atomic uint64_t *ring_word(consumer *c, int i) { return (_Atomic uint64_t *)(c->mem + 8 * i); }
static uint64_t ring_head(consumer *c) { return atomic_load(ring_word(c, 0)); }
static pf_completion ring_take(consumer *c) {
  uint32_t cap = *(uint32_t *)(c->mem + 16);
  pf_completion r;
  memcpy(&r, c->mem + PF_RING_HEADER_BYTES + (c->seen % cap) * sizeof r, sizeof r);
  c->seen++;
  atomic_store(ring_word(c, 1), c->seen);
  return r;
}

/* Reads ring A until the final record (kind `last`) of `tag`: every record
 * before it must carry `tag` (nothing else is in flight). */
static int32_t wait_final(uint64_t tag, uint32_t last, const char *what) {
  for (;;) {
    while (ca.seen < ring_head(&ca)) {
      pf_completion r = ring_take(&ca);
      if (r.tag != tag)
        FAIL("%s: record of tag %llu (kind %u, status %d) while waiting for tag %llu", what,
             (unsigned long long)r.tag, r.kind, r.status, (unsigned long long)tag);
      if (r.kind == last) return r.status;
    }
    int64_t h = pf_ring_wait(ca.handle, ca.seen, 5000);
    if (h == PF_ETIMEDOUT) FAIL("%s: no final record for tag %llu within 5 s", what,
                                (unsigned long long)tag);
    CHECK(h >= 0);
  }
}

/* A call's outcome: refused ones must have posted nothing and kept no ring
 * error; accepted ones are drained to their final record. must_refuse: the
 * case is malformed, so acceptance is itself a failure. */
static void outcome(int32_t rc, uint64_t tag, uint32_t last, int must_refuse, const char *what) {
  if (rc > 0) FAIL("%s: returned %d (expected 0 or a negative PF_E*)", what, rc);
  if (rc < 0) {
    n_refused++;
    if (rc < PF_ECANCELED) FAIL("%s: returned %d, not a PF_E* code", what, rc);
    char e[8];
    if (pf_last_error(e, sizeof e) <= 0 && rc != PF_EHANDLE)
      FAIL("%s: refused with %d and no error text", what, rc);
    if (ring_head(&ca) != ca.seen || ring_head(&cb) != cb.seen)
      FAIL("%s: refused (rc %d) but a completion record was posted", what, rc);
    if (last && pf_ring_take_error(ring, tag, NULL, 0) != 0)
      FAIL("%s: refused (rc %d) but the ring keeps an error for its tag", what, rc);
    return;
  }
  n_accepted++;
  if (must_refuse) {
    char e[256] = "";
    int32_t st = last ? wait_final(tag, last, what) : 0;
    if (st < 0) pf_ring_take_error(ring, tag, e, sizeof e);
    FAIL("%s: a malformed descriptor was accepted (rc 0; its batch ended %d)", what, st);
    return;
  }
  if (last) {
    int32_t st = wait_final(tag, last, what);
    char e[512] = "";
    if (st < 0) pf_ring_take_error(ring, tag, e, sizeof e);
    (void)st;
  }
}

/* ---- descriptors ------------------------------------------------------- */
typedef struct copy_desc {
  pf_batch_header h;
  pf_batch_group g[2];
  pf_batch_seg s[3];
} copy_desc;

static copy_desc valid_copy(void) {
  copy_desc d;
  memset(&d, 0, sizeof d);
  d.h = (pf_batch_header){.num_groups = 2, .num_segs = 3, .direction = below(2)};
  d.g[0] = (pf_batch_group){.region = reg[0], .layer = 5, .first_seg = 0, .num_segs = 2};
  d.g[1] = (pf_batch_group){.region = reg[1], .layer = 6, .first_seg = 2, .num_segs = 1};
  d.s[0] = (pf_batch_seg){.region_off = 0, .pool_off = 0, .bytes = 4096};
  d.s[1] = (pf_batch_seg){.region_off = 8192, .pool_off = 65536, .bytes = 100};
  d.s[2] = (pf_batch_seg){.region_off = REGION_BYTES - 512, .pool_off = POOL_BYTES - 512,
                          .bytes = 512};
  return d;
}

static const char *const copy_cases[] = {
    "num_groups 0", "num_groups +1", "num_groups huge", "num_segs +1", "num_segs -1",
    "num_segs huge", "direction 2", "path 5", "flags unknown bit", "segs_off not 8-aligned",
    "segs_off inside groups", "segs_off past the end", "group 0 num_segs 0", "first_seg skips",
    "group covers past num_segs", "region closed", "region is a pool handle",
    "region is a file handle", "region of another engine", "region 0", "seg bytes 0",
    "region_off past region", "region_off + bytes overflows", "pool_off past pool",
    "pool_off + bytes overflows", "bytes 2^64-1", "region_off near 2^32", "pool_off near 2^64",
    "progress shm is a ring", "progress_off unaligned", "progress_off past shm",
    "desc_bytes short", "desc misaligned", "engine is a pool handle", "ring closed",
    "pool of another engine's kind (ring handle)"};
#define N_COPY_CASES (sizeof copy_cases / sizeof copy_cases[0])

static void copy_mutated(uint32_t m) {
  copy_desc d = valid_copy();
  uint64_t len = sizeof d;
  uint32_t e = eng, p = pool, r = ring;
  int misalign = 0;
  switch (m) {
  case 0: d.h.num_groups = 0; break;
  case 1: d.h.num_groups = 3; break;
  case 2: d.h.num_groups = 0xffffffffu; break;
  case 3: d.h.num_segs = 4; break;
  case 4: d.h.num_segs = 2; break;
  case 5: d.h.num_segs = 0xfffffffeu; break;
  case 6: d.h.direction = 2 + below(1000); break;
  case 7: d.h.path = 5 + below(1000); break;
  case 8: d.h.flags = 4u << below(30); break;
  case 9: d.h.segs_off = 64 + 4; break;
  case 10: d.h.segs_off = 40; break;
  case 11: d.h.segs_off = 0xfffffff8u; break;
  case 12: d.g[0].num_segs = 0; break;
  case 13: d.g[1].first_seg = 3; break;
  case 14: d.g[1].num_segs = 2; break;
  case 15: d.g[below(2)].region = dead_region; break;
  case 16: d.g[below(2)].region = pool; break;
  case 17: d.g[below(2)].region = file; break;
  case 18: d.g[below(2)].region = reg_other; break;
  case 19: d.g[below(2)].region = 0; break;
  case 20: d.s[below(3)].bytes = 0; break;
  case 21: d.s[2].region_off = REGION_BYTES - 511; break;
  case 22: d.s[0].region_off = UINT64_MAX - 100; d.s[0].bytes = 4096; break;
  case 23: d.s[2].pool_off = POOL_BYTES - 511; break;
  case 24: d.s[1].pool_off = UINT64_MAX - 50; break;
  case 25: d.s[below(3)].bytes = UINT64_MAX; break;
  case 26: d.s[0].region_off = (1ull << 32) - 8; break;
  case 27: d.s[0].pool_off = UINT64_MAX - 4095; break;
  case 28: d.h.progress_shm = ring; break;
  case 29: d.h.progress_shm = shm; d.h.progress_off = 4; break;
  case 30: d.h.progress_shm = shm; d.h.progress_off = 4096 - 8 * below(1); break;
  case 31: len -= 1 + below(24); break;
  case 32: misalign = 1; break;
  case 33: e = pool; break;
  case 34: r = dead_ring; break;
  case 35: p = ring; break;
  }
  uint64_t tag = next_tag++;
  char what[96];
  snprintf(what, sizeof what, "pf_copy_submit mutation %u (%s)", m, copy_cases[m]);
  int32_t rc;
  if (misalign) {
    uint8_t *buf = malloc(sizeof d + 4);
    memcpy(buf + 4, &d, sizeof d);
    rc = pf_copy_submit(e, p, r, buf + 4, len, tag);
    free(buf);
  } else {
    uint8_t *buf = malloc(len); /* exactly len: ASan names any read past it */
    memcpy(buf, &d, len);
    rc = pf_copy_submit(e, p, r, buf, len, tag);
    free(buf);
  }
  outcome(rc, tag, PF_DONE_BATCH, 1, what);
}

typedef struct io_d {
  pf_io_batch_header h;
  pf_io_desc o[2];
  pf_io_ext x[3];
} io_d;

static io_d valid_io(void) {
  io_d d;
  memset(&d, 0, sizeof d);
  d.h = (pf_io_batch_header){.num_ops = 2, .num_exts = 3};
  d.o[0] = (pf_io_desc){.file = file, .op = PF_IO_WRITE, .hdr_page = 1, .file_off = 0,
                        .first_ext = 0, .num_ext = 2};
  d.o[1] = (pf_io_desc){.file = file, .op = PF_IO_READ, .flags = PF_IO_CRC, .file_off = 1 << 20,
                        .first_ext = 2, .num_ext = 1};
  d.x[0] = (pf_io_ext){.pool_off = 0, .bytes = 4096};
  d.x[1] = (pf_io_ext){.pool_off = 8192, .bytes = 8192};
  d.x[2] = (pf_io_ext){.pool_off = 1 << 20, .bytes = 4096};
  return d;
}

static const char *const io_cases[] = {
    "num_ops 0", "num_ops +1", "num_ops huge", "num_exts +1", "num_exts huge",
    "file closed", "file is a region handle", "file 0", "op kind 2", "flags unknown bit",
    "write to a read-only file", "hdr_page past the staged pages", "no header and no extents",
    "first_ext past num_exts", "first_ext + num_ext wraps", "num_ext huge", "ext bytes 0",
    "ext pool_off past pool", "ext pool_off + bytes overflows", "ext bytes 2^64-1",
    "op over 1 GiB", "file_off near 2^64", "file_off + bytes past 2^63", "reserved nonzero",
    "desc_bytes short", "desc misaligned", "desc NULL"};
#define N_IO_CASES (sizeof io_cases / sizeof io_cases[0])

/* Builds the mutated io descriptor into a fresh buffer of exactly *len bytes
 * (+4 and offset when misaligned); returns the pointer to pass. */
static uint8_t *io_mutated(uint32_t m, uint64_t *len, uint8_t **alloc) {
  io_d d = valid_io();
  *len = sizeof d;
  int misalign = 0;
  switch (m) {
  case 0: d.h.num_ops = 0; break;
  case 1: d.h.num_ops = 3; break;
  case 2: d.h.num_ops = 0xffffffffu; break;
  case 3: d.h.num_exts = 4; break;
  case 4: d.h.num_exts = 0xffffffffu; break;
  case 5: d.o[below(2)].file = dead_file; break;
  case 6: d.o[below(2)].file = reg[0]; break;
  case 7: d.o[below(2)].file = 0; break;
  case 8: d.o[below(2)].op = 2 + below(100); break;
  case 9: d.o[below(2)].flags = 2u << below(31); break;
  case 10: d.o[0].file = rofile; break;
  case 11: d.o[0].hdr_page = HDR_PAGES + 1 + below(100); break;
  case 12: d.o[1].num_ext = 0; break;
  case 13: d.o[1].first_ext = 3; break;
  case 14: d.o[1].first_ext = 0xffffffffu; break;
  case 15: d.o[1].num_ext = 0xffffffffu; break;
  case 16: d.x[below(3)].bytes = 0; break;
  case 17: d.x[2].pool_off = POOL_BYTES; break;
  case 18: d.x[1].pool_off = UINT64_MAX - 100; break;
  case 19: d.x[below(3)].bytes = UINT64_MAX; break;
  case 20: break; /* built below */
  case 21: d.o[below(2)].file_off = UINT64_MAX - 4095; break;
  case 22: d.o[0].file_off = (1ull << 63) - 4096; break;
  case 23: d.h.reserved = 1ull << below(64); break;
  case 24: *len -= 1 + below(16); break;
  case 25: misalign = 1; break;
  case 26: *alloc = NULL; return NULL;
  }
  if (m == 20) {
    /* 513 extents of the whole 2 MiB pool: one op of just over 1 GiB. */
    uint32_t n = 513;
    *len = sizeof(pf_io_batch_header) + sizeof(pf_io_desc) + n * sizeof(pf_io_ext);
    uint8_t *b = malloc(*len);
    pf_io_batch_header h = {.num_ops = 1, .num_exts = n};
    pf_io_desc o = {.file = file, .op = PF_IO_READ, .num_ext = n};
    memcpy(b, &h, sizeof h);
    memcpy(b + sizeof h, &o, sizeof o);
    for (uint32_t i = 0; i < n; i++) {
      pf_io_ext x = {.pool_off = 0, .bytes = POOL_BYTES};
      memcpy(b + sizeof h + sizeof o + i * sizeof x, &x, sizeof x);
    }
    *alloc = b;
    return b;
  }
  uint8_t *b = malloc(*len + (misalign ? 4 : 0));
  memcpy(b + (misalign ? 4 : 0), &d, *len);
  *alloc = b;
  return b + (misalign ? 4 : 0);
}

static void io_mutated_call(uint32_t m) {
  uint64_t len;
  uint8_t *alloc;
  uint8_t *b = io_mutated(m, &len, &alloc);
  uint64_t tag = next_tag++;
  char what[96];
  snprintf(what, sizeof what, "pf_io_submit mutation %u (%s)", m, io_cases[m]);
  int32_t rc = pf_io_submit(uring, b, len, tag);
  outcome(rc, tag, PF_DONE_IO_BATCH, 1, what);
  free(alloc);
  /* The same descriptor's CRC: the cases that break only submit-side rules
   * (files, kinds, flags, header pages, file offsets) are fine to checksum. */
  static const uint8_t crc_ok[N_IO_CASES] = {[5] = 1, [6] = 1, [7] = 1, [8] = 1, [9] = 1,
                                             [10] = 1, [11] = 1, [12] = 1, [21] = 1, [22] = 1};
  if (m == 20) return; /* a 1 GiB checksum: correct, and too slow under ASan */
  b = io_mutated(m, &len, &alloc);
  uint32_t crcs[4];
  snprintf(what, sizeof what, "pf_pool_crc32c mutation %u (%s)", m, io_cases[m]);
  rc = pf_pool_crc32c(pool, b, len, crcs);
  outcome(rc, 0, 0, !crc_ok[m] && m != 23, what);
  free(alloc);
}

typedef struct xfer_d {
  pf_xfer_header h;
  pf_xfer_seg s[3];
  uint64_t g[2];
} xfer_d;

static const char *const xfer_cases[] = {
    "op 3", "num_segs 0", "num_segs past the max", "num_segs +1", "num_groups +1",
    "groups on a write", "groups and out_crcs NULL", "timeout 0", "timeout past the max",
    "reserved nonzero", "imm on a read", "seg bytes 0", "local_off past pool",
    "local_off + bytes overflows", "remote_off past the remote pool",
    "remote_off + bytes overflows", "group 0 bytes", "groups sum short", "groups sum long",
    "group bytes 2^64-1", "desc_bytes short", "desc_bytes long", "desc misaligned",
    "peer closed", "peer is an endpoint handle", "desc NULL"};
#define N_XFER_CASES (sizeof xfer_cases / sizeof xfer_cases[0])

static xfer_d valid_xfer(void) {
  xfer_d d;
  memset(&d, 0, sizeof d);
  d.h = (pf_xfer_header){.op = PF_XFER_READ, .num_segs = 3, .timeout_ms = 5000,
                         .num_groups = 2};
  d.s[0] = (pf_xfer_seg){.remote_off = 0, .local_off = 0, .bytes = 4096};
  d.s[1] = (pf_xfer_seg){.remote_off = 4096, .local_off = 4096, .bytes = 4096};
  d.s[2] = (pf_xfer_seg){.remote_off = POOL_BYTES - 100, .local_off = 1 << 20, .bytes = 100};
  d.g[0] = 6000;
  d.g[1] = 8192 + 100 - 6000;
  return d;
}

static void xfer_mutated(uint32_t m) {
  xfer_d d = valid_xfer();
  uint64_t len = sizeof d;
  uint32_t pr = peer, crcs[4], *out = crcs;
  int misalign = 0, null_desc = 0;
  switch (m) {
  case 0: d.h.op = 3 + below(100); break;
  case 1: d.h.num_segs = 0; break;
  case 2: d.h.num_segs = PF_XFER_MAX_SEGS + 1; break;
  case 3: d.h.num_segs = 4; break;
  case 4: d.h.num_groups = 3; break;
  case 5: d.h.op = PF_XFER_WRITE; break;
  case 6: out = NULL; break;
  case 7: d.h.timeout_ms = 0; break;
  case 8: d.h.timeout_ms = 3600001 + below(1000); break;
  case 9: d.h.reserved = 1u << below(32); break;
  case 10: d.h.imm = 7; break;
  case 11: d.s[below(3)].bytes = 0; break;
  case 12: d.s[2].local_off = POOL_BYTES - 99; break;
  case 13: d.s[0].local_off = UINT64_MAX - 100; break;
  case 14: d.s[2].remote_off = POOL_BYTES - 99; break;
  case 15: d.s[1].remote_off = UINT64_MAX - 4095; break;
  case 16: d.g[below(2)] = 0; break;
  case 17: d.g[1] -= 1; break;
  case 18: d.g[1] += 1; break;
  case 19: d.g[0] = UINT64_MAX; break;
  case 20: len -= 1 + below(8); break;
  case 21: break; /* built below */
  case 22: misalign = 1; break;
  case 23: pr = dead_peer; break;
  case 24: pr = ep_a; break;
  case 25: null_desc = 1; break;
  }
  uint8_t *b = malloc(sizeof d + 8);
  memset(b, 0, sizeof d + 8);
  memcpy(b + (misalign ? 4 : 0), &d, len);
  if (m == 21) len += 8;
  uint64_t tag = next_tag++;
  char what[96];
  snprintf(what, sizeof what, "pf_xfer_submit mutation %u (%s)", m, xfer_cases[m]);
  int32_t rc = pf_xfer_submit(pr, null_desc ? NULL : b + (misalign ? 4 : 0), len, tag, out);
  outcome(rc, tag, PF_DONE_XFER, 1, what);
  free(b);
}

/* ---- random bytes ------------------------------------------------------- */
/* A buffer of exactly `len` random bytes with odd values and handles planted
 * at random 4-aligned places (caller frees). */
static uint8_t *random_bytes(uint64_t len) {
  uint8_t *b = malloc(len ? len : 1);
  for (uint64_t i = 0; i < len; i++) b[i] = (uint8_t)rnd();
  uint32_t plants = below(12);
  for (uint32_t k = 0; k < plants && len >= 8; k++) {
    uint64_t at = (rnd() % (len / 4)) * 4;
    if (below(2) && at + 8 <= len) {
      uint64_t v = odd64();
      memcpy(b + at, &v, 8);
    } else {
      uint32_t v = odd32();
      memcpy(b + at, &v, 4);
    }
  }
  return b;
}
static uint64_t random_len(void) {
  switch (below(4)) {
  case 0: return below(8);
  case 1: return 8 + below(64);
  case 2: return 16 + 8 * below(64);
  default: return below(4096);
  }
}

static void random_round(uint32_t i) {
  char what[96];
  uint64_t len = random_len(), tag = next_tag++;
  uint8_t *b = random_bytes(len);
  /* A plausible header now and then, so the parse goes past its first check. */
  if (len >= 32 && below(2)) {
    pf_batch_header h = {.num_groups = 1 + below(3), .num_segs = 1 + below(4),
                         .direction = below(2), .path = below(5)};
    memcpy(b, &h, sizeof h);
  }
  snprintf(what, sizeof what, "random pf_copy_submit %u (%llu bytes)", i, (unsigned long long)len);
  outcome(pf_copy_submit(eng, pool, ring, b, len, tag), tag, PF_DONE_BATCH, 0, what);
  free(b);

  len = random_len();
  tag = next_tag++;
  b = random_bytes(len);
  if (len >= 16 && below(2)) {
    pf_io_batch_header h = {.num_ops = 1 + below(3), .num_exts = below(5)};
    memcpy(b, &h, sizeof h);
  }
  snprintf(what, sizeof what, "random pf_io_submit %u (%llu bytes)", i, (unsigned long long)len);
  outcome(pf_io_submit(uring, b, len, tag), tag, PF_DONE_IO_BATCH, 0, what);
  uint32_t *crcs = malloc((len / sizeof(pf_io_desc) + 1) * sizeof *crcs);
  snprintf(what, sizeof what, "random pf_pool_crc32c %u (%llu bytes)", i,
           (unsigned long long)len);
  outcome(pf_pool_crc32c(pool, b, len, crcs), 0, 0, 0, what);
  free(crcs);
  free(b);

  len = random_len();
  tag = next_tag++;
  b = random_bytes(len);
  if (len >= 24 && below(2)) {
    uint32_t n = (uint32_t)((len - 24) / 24);
    pf_xfer_header h = {.op = below(3), .num_segs = n ? n : 1, .timeout_ms = 1 + below(5000)};
    memcpy(b, &h, sizeof h);
  }
  uint32_t ng = (uint32_t)(len / 8 + 1);
  crcs = malloc(ng * sizeof *crcs);
  snprintf(what, sizeof what, "random pf_xfer_submit %u (%llu bytes)", i, (unsigned long long)len);
  int32_t rc = pf_xfer_submit(peer, b, len, tag, below(4) ? crcs : NULL);
  if (rc == 0 && len >= 4 && *(uint32_t *)b == PF_XFER_WRITE_IMM) imm_expected++;
  outcome(rc, tag, PF_DONE_XFER, 0, what);
  free(crcs);
  free(b);

  /* pf_pool_checksums: extents, counts and their sum that may disagree. */
  uint32_t nx = below(6), nb = below(4);
  b = random_bytes(nx * sizeof(pf_io_ext));
  uint32_t *counts = malloc((nb ? nb : 1) * sizeof *counts), sum = 0;
  for (uint32_t k = 0; k < nb; k++) sum += counts[k] = below(3) ? below(nx + 1) : odd32();
  uint32_t *out = malloc((nb ? nb : 1) * sizeof *out);
  int must = sum != nx || (nb == 0 && nx != 0);
  snprintf(what, sizeof what, "random pf_pool_checksums %u (%u extents, %u blocks, sum %u)", i,
           nx, nb, sum);
  outcome(pf_pool_checksums(pool, b, nx, counts, nb, out), 0, 0, must, what);
  free(out);
  free(counts);
  free(b);
}

/* ---- text and struct arguments ------------------------------------------ */
static void text_args(const char *dir) {
  phase = "pf_file_open paths";
  char longp[5000];
  memset(longp, 'a', sizeof longp - 1);
  longp[0] = '/';
  longp[sizeof longp - 1] = 0;
  char missing[512];
  snprintf(missing, sizeof missing, "%s/no/such/dir/x", dir);
  struct { const char *p; uint32_t flags; } bad[] = {
      {NULL, 0}, {"", 0}, {longp, 0}, {dir, 0}, {"/dev/null", 0}, {missing, PF_FILE_CREATE},
      {missing, PF_FILE_RDONLY}, {dir, PF_FILE_CREATE | PF_FILE_RDONLY}, {dir, 8},
      {dir, 0xffffffffu}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint32_t f = 0;
    int32_t rc = pf_file_open(uring, bad[i].p, bad[i].flags, &f);
    char what[96];
    snprintf(what, sizeof what, "pf_file_open case %zu", i);
    if (rc >= 0) FAIL("%s: opened (handle %u)", what, f);
  }
  CHECK(pf_file_open(uring, dir, 0, NULL) < 0);
  CHECK(pf_file_open(dead_file, dir, 0, &(uint32_t){0}) == PF_EHANDLE);

  phase = "pf_region_import handles";
  uint8_t h[PF_HANDLE_BYTES], good[PF_HANDLE_BYTES];
  uint32_t r;
  CHECK(pf_region_alloc(eng, 4096, good, &r) == 0);
  for (uint32_t i = 0; i < 200; i++) {
    uint64_t bytes = 4096;
    switch (i % 8) {
    case 0: for (size_t k = 0; k < sizeof h; k++) h[k] = (uint8_t)rnd(); break;
    case 1: memcpy(h, good, sizeof h); h[strlen((char *)good) + 1 + below(8)] = (uint8_t)(1 + below(255)); break;
    case 2: memcpy(h, good, sizeof h); bytes = 4097 + below(1u << 20); break;
    case 3: memcpy(h, good, sizeof h); bytes = UINT64_MAX - below(2); break;
    case 4: memset(h, 'x', sizeof h); h[0] = '/'; break;
    case 5: memset(h, 0, sizeof h); memcpy(h, "/..", 3); break;
    case 6: memset(h, 0, sizeof h); memcpy(h, "/pf-no-such-region-xyz", 22); break;
    case 7: memcpy(h, good, sizeof h); h[1 + below(8)] = "/\\ \n*?"[below(6)]; break;
    }
    uint32_t out = 0;
    int32_t rc = pf_region_import(i % 16 == 15 ? pool : eng, h, bytes, &out);
    if (rc >= 0) FAIL("pf_region_import case %u (kind %u) accepted (region %u)", i, i % 8, out);
  }
  CHECK(pf_region_import(eng, good, 0, &r) < 0);
  uint32_t again;
  CHECK(pf_region_import(eng, good, 4096, &again) == 0); /* the good one still imports */
  CHECK(pf_region_close(again) == 0);
  CHECK(pf_region_close(r) == 0);

  phase = "pf_xfer_peer_connect addresses";
  uint32_t scratch;
  CHECK(pf_xfer_peer_create(ep_a, &scratch) == 0);
  char longhost[400];
  memset(longhost, '1', sizeof longhost - 1);
  longhost[sizeof longhost - 1] = 0;
  const char *addrs[] = {"", ":", "127.0.0.1", "127.0.0.1:", ":80", "127.0.0.1:0",
                         "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:80x", "[::1",
                         "[]:80", "[:80", "127.0.0.1:1", "999.1.1.1:80", longhost,
                         "127.0.0.1:99999999999999999999"};
  for (size_t i = 0; i < sizeof addrs / sizeof addrs[0]; i++) {
    int32_t rc = pf_xfer_peer_connect(scratch, (const uint8_t *)addrs[i],
                                      (uint32_t)strlen(addrs[i]), 300);
    if (rc >= 0) FAIL("pf_xfer_peer_connect(\"%.40s\") connected", addrs[i]);
  }
  uint8_t nonul[600];
  memset(nonul, '7', sizeof nonul);
  CHECK(pf_xfer_peer_connect(scratch, nonul, sizeof nonul, 300) < 0);
  CHECK(pf_xfer_peer_connect(scratch, nonul, 0, 300) < 0);
  CHECK(pf_xfer_peer_connect(scratch, NULL, 5, 300) < 0);
  CHECK(pf_xfer_peer_connect(scratch, (const uint8_t *)"127.0.0.1:1", 11, 0) < 0);
  CHECK(pf_xfer_peer_connect(scratch, (const uint8_t *)"127.0.0.1:1", 11, -5) < 0);
  CHECK(pf_xfer_peer_connect(dead_peer, (const uint8_t *)"127.0.0.1:1", 11, 100) == PF_EHANDLE);
  pf_xfer_peer_status st;
  CHECK(pf_xfer_peer_state(scratch, &st) == 0 && st.connected == 0 && st.inflight == 0);
  CHECK(pf_xfer_peer_close(scratch) == 0);

  phase = "ring waits";
  CHECK(pf_ring_wait(dead_ring, 0, 10) == PF_EHANDLE);
  CHECK(pf_ring_wait(ring, UINT64_MAX, 10) == PF_ETIMEDOUT);
  CHECK(pf_ring_wait(ring, ca.seen, 0) == PF_ETIMEDOUT);
  CHECK(pf_ring_take_error(ring, 12345, NULL, 0) == 0);
  CHECK(pf_ring_take_error(pool, 0, NULL, 0) == PF_EHANDLE);
}

/* ---- a server that accepts and stalls mid-hello -------------------------- */
typedef struct stall {
  int lfd, cfd;
  uint32_t send;
} stall;
static void *stall_main(void *arg) {
  stall *s = arg;
  s->cfd = accept(s->lfd, NULL, NULL);
  uint8_t junk[64] = {0x50, 0x46, 0x58, 0x31};
  if (s->cfd >= 0 && s->send) (void)!write(s->cfd, junk, s->send);
  return NULL; /* keeps the connection open, silent */
}
typedef struct connect_call {
  uint32_t peer;
  char addr[64];
  int32_t rc;
  atomic_int done;
} connect_call;
static void *connect_main(void *arg) {
  connect_call *c = arg;
  c->rc = pf_xfer_peer_connect(c->peer, (const uint8_t *)c->addr, (uint32_t)strlen(c->addr), 300);
  atomic_store(&c->done, 1);
  return NULL;
}
/* A listener that is not a PegaFlow endpoint: connects with a 300 ms
 * deadline must end in about that time, whatever it sends (nothing, a part
 * of a frame, a whole wrong frame). */
static void stalled_hellos(void) {
  static const uint32_t sends[] = {0, 1, 20, 64};
  for (size_t i = 0; i < sizeof sends / sizeof sends[0]; i++) {
    phase = "pf_xfer_peer_connect to a stalling listener";
    stall s = {.lfd = socket(AF_INET, SOCK_STREAM, 0), .cfd = -1, .send = sends[i]};
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    CHECK(s.lfd >= 0 && bind(s.lfd, (struct sockaddr *)&a, sizeof a) == 0 && listen(s.lfd, 8) == 0);
    CHECK(getsockname(s.lfd, (struct sockaddr *)&a, &al) == 0);
    pthread_t srv, cli;
    CHECK(pthread_create(&srv, NULL, stall_main, &s) == 0);
    connect_call c = {.rc = 99};
    CHECK(pf_xfer_peer_create(ep_a, &c.peer) == 0);
    snprintf(c.addr, sizeof c.addr, "127.0.0.1:%u", ntohs(a.sin_port));
    CHECK(pthread_create(&cli, NULL, connect_main, &c) == 0);
    for (int t = 0; t < 300 && !atomic_load(&c.done); t++) usleep(10000);
    if (!atomic_load(&c.done)) {
      keep_going = 0; /* the call still holds the peer: nothing can go on */
      FAIL("pf_xfer_peer_connect(timeout 300 ms) to a listener that sent %u bytes of its "
           "hello and stalled has not returned after 3 s", sends[i]);
    }
    pthread_join(cli, NULL);
    pthread_join(srv, NULL);
    if (c.rc >= 0) FAIL("connected to a listener that sent %u junk bytes", sends[i]);
    CHECK(pf_xfer_peer_close(c.peer) == 0);
    if (s.cfd >= 0) close(s.cfd);
    close(s.lfd);
  }
}

/* ---- valid batches after the fuzzing ------------------------------------ */
static void valid_after(void) {
  phase = "valid copy after fuzzing";
  uint8_t pat[REGION_BYTES], back[REGION_BYTES];
  for (size_t i = 0; i < sizeof pat; i++) pat[i] = (uint8_t)rnd();
  CHECK(pf_region_write(reg[0], 0, pat, sizeof pat) == 0);
  copy_desc d = valid_copy();
  d.h.num_groups = 1;
  d.h.num_segs = 1;
  d.h.segs_off = sizeof(pf_batch_header) + sizeof(pf_batch_group);
  d.g[0] = (pf_batch_group){.region = reg[0], .layer = 1, .first_seg = 0, .num_segs = 1};
  pf_batch_seg s0 = {.region_off = 0, .pool_off = 4096, .bytes = REGION_BYTES};
  memcpy((uint8_t *)&d + d.h.segs_off, &s0, sizeof s0);
  d.h.direction = PF_D2H;
  uint64_t tag = next_tag++;
  CHECK(pf_copy_submit(eng, pool, ring, &d, sizeof d, tag) == 0);
  CHECK(wait_final(tag, PF_DONE_BATCH, "valid D2H") == PF_OK);
  CHECK(memcmp(poolp + 4096, pat, sizeof pat) == 0);
  d.h.direction = PF_H2D;
  d.g[0].region = reg[1];
  tag = next_tag++;
  CHECK(pf_copy_submit(eng, pool, ring, &d, sizeof d, tag) == 0);
  CHECK(wait_final(tag, PF_DONE_BATCH, "valid H2D") == PF_OK);
  CHECK(pf_region_read(reg[1], 0, back, sizeof back) == 0);
  CHECK(memcmp(back, pat, sizeof pat) == 0);

  phase = "valid io after fuzzing";
  struct { pf_io_batch_header h; pf_io_desc o; pf_io_ext x; } w = {
      .h = {.num_ops = 1, .num_exts = 1},
      .o = {.file = file, .op = PF_IO_WRITE, .file_off = 1 << 20, .num_ext = 1},
      .x = {.pool_off = 4096, .bytes = REGION_BYTES}};
  tag = next_tag++;
  CHECK(pf_io_submit(uring, &w, sizeof w, tag) == 0);
  CHECK(wait_final(tag, PF_DONE_IO_BATCH, "valid write") == PF_OK);
  w.o.op = PF_IO_READ;
  w.o.flags = PF_IO_CRC;
  w.x.pool_off = 1 << 20;
  memset(poolp + (1 << 20), 0, REGION_BYTES);
  tag = next_tag++;
  CHECK(pf_io_submit(uring, &w, sizeof w, tag) == 0);
  CHECK(wait_final(tag, PF_DONE_IO_BATCH, "valid read") == PF_OK);
  CHECK(memcmp(poolp + (1 << 20), pat, sizeof pat) == 0);
  uint32_t crc;
  CHECK(pf_pool_crc32c(pool, &w, sizeof w, &crc) == 0 && crc == pf_crc32c(0, pat, sizeof pat));
  uint32_t one = 1;
  CHECK(pf_pool_checksums(pool, &w.x, 1, &one, 1, &crc) == 0 &&
        crc == pf_crc32c(0, pat, sizeof pat));

  phase = "valid transfer after fuzzing";
  struct { pf_xfer_header h; pf_xfer_seg s; uint64_t g[2]; } x = {
      .h = {.op = PF_XFER_WRITE_IMM, .num_segs = 1, .timeout_ms = 5000, .imm = 77},
      .s = {.remote_off = 8192, .local_off = 4096, .bytes = REGION_BYTES}};
  tag = next_tag++;
  CHECK(pf_xfer_submit(peer, &x, sizeof x.h + sizeof x.s, tag, NULL) == 0);
  imm_expected++;
  CHECK(wait_final(tag, PF_DONE_XFER, "valid write_imm") == PF_OK);
  CHECK(memcmp(poolp_b + 8192, pat, sizeof pat) == 0);
  x.h = (pf_xfer_header){.op = PF_XFER_READ, .num_segs = 1, .timeout_ms = 5000, .num_groups = 2};
  x.s = (pf_xfer_seg){.remote_off = 8192, .local_off = 1 << 20, .bytes = REGION_BYTES};
  x.g[0] = 1000;
  x.g[1] = REGION_BYTES - 1000;
  memset(poolp + (1 << 20), 0, REGION_BYTES);
  uint32_t crcs[2];
  tag = next_tag++;
  CHECK(pf_xfer_submit(peer, &x, sizeof x, tag, crcs) == 0);
  CHECK(wait_final(tag, PF_DONE_XFER, "valid read") == PF_OK);
  CHECK(memcmp(poolp + (1 << 20), pat, sizeof pat) == 0);
  CHECK(crcs[0] == pf_crc32c(0, pat, 1000) && crcs[1] == pf_crc32c(0, pat + 1000, REGION_BYTES - 1000));
  /* The target's IMM records: one per accepted WRITE_IMM, nothing else. */
  for (int t = 0; t < 500 && ring_head(&cb) - cb.seen < imm_expected; t++) usleep(10000);
  uint64_t imms = 0;
  while (cb.seen < ring_head(&cb)) {
    pf_completion r = ring_take(&cb);
    if (r.kind != PF_DONE_XFER_IMM) FAIL("target ring: a record of kind %u", r.kind);
    imms++;
  }
  if (imms != imm_expected)
    FAIL("target ring: %llu IMM records for %llu accepted write_imm batches",
         (unsigned long long)imms, (unsigned long long)imm_expected);
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: fuzz_descriptors SEED ITERS DIR\n");
    return 2;
  }
  rng = strtoull(argv[1], NULL, 0);
  keep_going = getenv("FUZZ_KEEP_GOING") != NULL;
  uint32_t iters = (uint32_t)strtoul(argv[2], NULL, 0);
  const char *dir = argv[3];
  signal(SIGALRM, on_alarm);
  alarm(60);

  uint8_t name[PF_HANDLE_BYTES];
  CHECK(pf_engine_open(PF_BACKEND_HOST, 0, 2, &eng) == 0);
  CHECK(pf_engine_open(PF_BACKEND_HOST, 1, 1, &eng2) == 0);
  CHECK(pf_pool_create(eng, POOL_BYTES, 0, 0, NULL, &pool) == 0);
  CHECK(pf_pool_create(eng, POOL_BYTES, 0, 0, NULL, &pool_b) == 0);
  poolp = pf_pool_ptr(pool);
  poolp_b = pf_pool_ptr(pool_b);
  CHECK(pf_ring_create(1024, &ring) == 0);
  CHECK(pf_ring_create(1024, &ring_b) == 0);
  CHECK(pf_ring_create(16, &dead_ring) == 0 && pf_ring_destroy(dead_ring) == 0);
  ca = (consumer){.handle = ring, .mem = pf_ring_ptr(ring)};
  cb = (consumer){.handle = ring_b, .mem = pf_ring_ptr(ring_b)};
  CHECK(pf_region_alloc(eng, REGION_BYTES, name, &reg[0]) == 0);
  CHECK(pf_region_alloc(eng, REGION_BYTES, name, &reg[1]) == 0);
  CHECK(pf_region_alloc(eng2, REGION_BYTES, name, &reg_other) == 0);
  CHECK(pf_region_alloc(eng, 4096, name, &dead_region) == 0 && pf_region_close(dead_region) == 0);
  char shm_name[64];
  snprintf(shm_name, sizeof shm_name, "/pf-fuzz-%d", (int)getpid());
  CHECK(pf_shm_open(shm_name, 4096, PF_SHM_CREATE | PF_SHM_UNLINK, &shm) == 0);

  char path[512], ropath[512];
  snprintf(path, sizeof path, "%s/fuzz.dat", dir);
  snprintf(ropath, sizeof ropath, "%s/fuzz.ro", dir);
  CHECK(pf_uring_open(pool, ring, 8, HDR_PAGES, &uring) == 0);
  CHECK(pf_file_open(uring, path, PF_FILE_CREATE | PF_FILE_DIRECT, &file) == 0);
  CHECK(pf_file_truncate(file, 4u << 20) == 0);
  CHECK(pf_file_open(uring, ropath, PF_FILE_CREATE, &rofile) == 0 && pf_file_close(rofile) == 0);
  CHECK(pf_file_open(uring, ropath, PF_FILE_RDONLY, &rofile) == 0);
  CHECK(pf_file_open(uring, path, 0, &dead_file) == 0 && pf_file_close(dead_file) == 0);

  pf_xfer_config cfg = {.transport = PF_XFER_TCP, .streams = 2, .imm_tag = 424242};
  snprintf(cfg.bind_addr, sizeof cfg.bind_addr, "127.0.0.1");
  CHECK(pf_xfer_open(pool, ring, &cfg, sizeof cfg, &ep_a) == 0);
  CHECK(pf_xfer_open(pool_b, ring_b, &cfg, sizeof cfg, &ep_b) == 0);
  pf_xfer_stats xs;
  CHECK(pf_xfer_info(ep_b, &xs) == 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", xs.listen_port);
  CHECK(pf_xfer_peer_create(ep_a, &peer) == 0);
  CHECK(pf_xfer_peer_connect(peer, (const uint8_t *)addr, (uint32_t)strlen(addr), 5000) == 0);
  CHECK(pf_xfer_peer_create(ep_a, &dead_peer) == 0 && pf_xfer_peer_close(dead_peer) == 0);

  for (uint32_t m = 0; m < N_COPY_CASES; m++) {
    phase = "pf_copy_submit mutations";
    copy_mutated(m);
  }
  for (uint32_t m = 0; m < N_IO_CASES; m++) {
    phase = "pf_io_submit mutations";
    io_mutated_call(m);
  }
  for (uint32_t m = 0; m < N_XFER_CASES; m++) {
    phase = "pf_xfer_submit mutations";
    xfer_mutated(m);
  }
  for (uint32_t i = 0; i < iters; i++) {
    phase = "mutations (random order)";
    switch (below(3)) {
    case 0: copy_mutated(below(N_COPY_CASES)); break;
    case 1: io_mutated_call(below(N_IO_CASES)); break;
    default: xfer_mutated(below(N_XFER_CASES)); break;
    }
    phase = "random bytes";
    random_round(i);
  }
  text_args(dir);
  stalled_hellos();
  valid_after();

  phase = "closing";
  pf_xfer_peer_status ps;
  CHECK(pf_xfer_peer_state(peer, &ps) == 0 && ps.inflight == 0 && ps.broken == 0);
  int32_t rcs[] = {pf_xfer_peer_close(peer), pf_xfer_close(ep_a), pf_xfer_close(ep_b),
                   pf_file_close(file), pf_file_close(rofile), pf_uring_close(uring, NULL, 0),
                   pf_region_close(reg[0]), pf_region_close(reg[1]), pf_region_close(reg_other),
                   pf_shm_close(shm), pf_pool_destroy(pool), pf_pool_destroy(pool_b),
                   pf_ring_destroy(ring), pf_ring_destroy(ring_b), pf_engine_close(eng),
                   pf_engine_close(eng2)};
  for (size_t i = 0; i < sizeof rcs / sizeof rcs[0]; i++)
    if (rcs[i] != 0) FAIL("close step %zu returned %d", i, rcs[i]);
  unlink(path);
  unlink(ropath);
  if (failures) return 4;
  printf("fuzz seed %s: %u rounds, %llu refused, %llu accepted; every object closed\n", argv[1],
         iters, (unsigned long long)n_refused, (unsigned long long)n_accepted);
  return 0;
}
